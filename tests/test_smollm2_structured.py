"""Structured output with the real SmolLM2 (`--model smollm2`), through gRPC and the official `openai` client.

At temperature 1, with several seeds and n > 1 (forks), every JSON-schema output validates
with `jsonschema`, every regex output matches, every choice output is a choice: the
grammar's mask is what makes that so, since the raw model would wander. Greedy under a
constraint that never bites equals greedy without one, logprobs included (they are the
raw model's). A bad schema, regex or grammar is INVALID_ARGUMENT / 400 naming the
problem, and no block stays leased. The suite's one SmolLM2 stack (conftest) serves every test.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pydantic
import pytest

from harness.cache_helpers import no_block_leased
from pagedkv.model.v1 import model_pb2

SEEDS = (1, 2, 3)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "home": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
            "required": ["city", "zip"],
        },
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "home", "pets", "ok"],
}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-[0-2]\d"
CITIES = ["Paris", "London", "Berlin", "Rome"]
FRANCE = [model_pb2.ChatMessage(role="user", content="What is the capital of France?")]
PERSON_ASK = [model_pb2.ChatMessage(role="user", content="Describe a person as JSON.")]


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack.stub, smollm2_stack.cache, smollm2_stack.model


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack[2].http_url, api_key="unused", max_retries=0, timeout=300)


def generate(stub, structured, *, messages=PERSON_ASK, seed=None, n=1, temperature=1.0, max_new_tokens=96,
             **sampling) -> list[tuple[str, list[int], model_pb2.GenerateResponse]]:
    """(text, token ids, last message) of each of the n completions."""
    params = model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n,
                                      structured=structured, **sampling)
    if seed is not None:
        params.seed = seed
    texts, tokens, last = [""] * n, [[] for _ in range(n)], [None] * n
    for response in stub.Generate(model_pb2.GenerateRequest(messages=messages, sampling=params), timeout=1200):
        texts[response.index] += response.text
        tokens[response.index].extend(response.token_ids)
        last[response.index] = response
    return list(zip(texts, tokens, last))


def each_seed(call) -> list:
    """call(seed) for every seed at once: they share the engine's batches (and the test's time)."""
    with ThreadPoolExecutor(len(SEEDS)) as pool:
        return [output for outputs in pool.map(call, SEEDS) for output in outputs]


@pytest.mark.timeout(900)  # seconds on a quiet machine; minutes on a shared, loaded one
def test_json_schema_outputs_validate_at_temperature_one(stack):
    stub, cache, _ = stack
    structured = model_pb2.StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    for text, _, last in each_seed(lambda seed: generate(stub, structured, seed=seed, n=2)):
        assert last.finish_reason == model_pb2.FINISH_REASON_EOS, text
        jsonschema.validate(json.loads(text), PERSON)
    no_block_leased(cache)


@pytest.mark.timeout(900)
def test_regex_and_choice_outputs_match(stack):
    stub, cache, _ = stack
    when = [model_pb2.ChatMessage(role="user", content="When?")]
    dates = each_seed(lambda seed: generate(stub, model_pb2.StructuredOutputs(regex=DATE), seed=seed, n=2,
                                            messages=when))
    for text, _, last in dates:
        assert re.fullmatch(DATE, text) and last.finish_reason == model_pb2.FINISH_REASON_EOS, text
    cities = each_seed(lambda seed: generate(stub, model_pb2.StructuredOutputs(choice=CITIES), seed=seed, n=3,
                                             messages=FRANCE))
    assert all(text in CITIES for text, _, _ in cities), cities
    no_block_leased(cache)


def test_greedy_where_the_mask_never_bites_equals_greedy(stack):
    stub, _, _ = stack
    plain = generate(stub, None, messages=FRANCE, temperature=0, logprobs=2, max_new_tokens=32)[0]
    assert plain[0] == "The capital of France is Paris."
    choice = model_pb2.StructuredOutputs(choice=[plain[0], "I do not know."])
    constrained = generate(stub, choice, messages=FRANCE, temperature=0, logprobs=2, max_new_tokens=32)[0]
    assert constrained[1] == plain[1]
    assert list(constrained[2].logprobs) == list(plain[2].logprobs)  # the last message's: the raw model's


def test_a_stop_string_still_ends_a_constrained_output(stack):
    stub, _, _ = stack
    structured = model_pb2.StructuredOutputs(json=json.dumps(PERSON), disable_any_whitespace=True)
    text, _, last = generate(stub, structured, seed=1, stop=['"age"'])[0]
    assert last.finish_reason == model_pb2.FINISH_REASON_STOP and last.matched_stop_str == '"age"'
    assert text.startswith('{"name": ') and '"age"' not in text


def test_one_schema_is_compiled_once(stack):
    stub, _, model = stack
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    for seed in SEEDS:
        generate(stub, model_pb2.StructuredOutputs(json=schema, disable_any_whitespace=True), seed=seed,
                 max_new_tokens=16)
    compiled = [event for event in model.log_events() if event.get("event") == "grammar_compiled"
                and event.get("chars") == len(schema)]
    assert len(compiled) == 1


@pytest.mark.parametrize("structured, phrase", [
    (dict(json='{"type": "objekt"}'), 'structured.json does not compile: Unsupported type "objekt"'),
    (dict(json='{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum greater than maximum"),
    (dict(json="not json"), "Failed to parse JSON"),
    (dict(regex="[a-"), "structured.regex does not compile: Regex parsing error at position 4"),
    (dict(grammar='root ::= item'), 'structured.grammar does not compile: EBNF parser error at line 1, column 10: '
                                    'Rule "item" is not defined'),
    (dict(regex="a", choice=["a"]), "exactly one of json, json_object, regex, choice and grammar, not regex and choice"),
    (dict(), "and sets none"),
    (dict(choice=["a", ""]), "structured.choice has an empty string"),
], ids=["schema-type", "schema-bounds", "schema-not-json", "regex", "grammar", "two-kinds", "no-kind", "empty-choice"])
def test_a_bad_constraint_is_invalid_argument(stack, structured, phrase):
    stub, cache, _ = stack
    with pytest.raises(grpc.RpcError) as raised:
        generate(stub, model_pb2.StructuredOutputs(**structured), max_new_tokens=4)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert phrase in raised.value.details()
    no_block_leased(cache)


def test_min_tokens_and_ignore_eos_are_refused_with_a_constraint(stack):
    stub, _, _ = stack
    for extra, name in ((dict(min_tokens=2), "min_tokens"), (dict(ignore_eos=True), "ignore_eos")):
        with pytest.raises(grpc.RpcError) as raised:
            generate(stub, model_pb2.StructuredOutputs(regex="a+"), max_new_tokens=4, **extra)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{name} cannot be combined with structured output" in raised.value.details()


# -- the OpenAI API, through the official client ------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    legs: int = pydantic.Field(ge=0, le=4)


def chat(client, **fields):
    """Greedy unless told otherwise: the temperature-1 guarantees are the gRPC tests' above."""
    fields.setdefault("temperature", 0)
    return client.chat.completions.create(model="smollm2", messages=fields.pop("messages", ASK),
                                          max_tokens=fields.pop("max_tokens", 96), seed=1, **fields)


def test_response_format_json_schema_and_json_object(client, stack):
    answer = chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}, messages=[{"role": "user", "content": "A person?"}])
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    # Any object: nothing bounds its length, so a length stop leaves it unclosed. All of it,
    # to the last character, must still be what a JSON object can start with: xgrammar's own
    # JSON grammar, over a byte vocabulary, accepts the text and (after a stop) its end.
    answer = chat(client, response_format={"type": "json_object"}, max_tokens=32)
    content = answer.choices[0].message.content
    assert content.startswith("{") and json_prefix(content), content
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    no_block_leased(stack[1])


def json_prefix(text: str) -> bool:
    """Whether text is the start (or the whole) of a JSON value: xgrammar's built-in JSON
    grammar, compiled for a vocabulary of single bytes, accepts every byte of it."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([i]).decode("latin-1") for i in range(256)], xgr.VocabType.RAW)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(xgr.Grammar.builtin_json_grammar()))
    return matcher.accept_string(text)


def test_json_prefix_tells_a_cut_object_from_prose():
    assert json_prefix('{"name": "Ann", "pets": ["c') and json_prefix('{"a": 1}')
    assert not json_prefix('{"a": 1} and more') and not json_prefix("Here is a person: {")


def test_parse_with_a_pydantic_model(client):
    answer = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "A pet?"}],
                                           response_format=Pet, max_tokens=128, seed=2)
    pet = answer.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


def check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required_and_named_return_valid_tool_calls(client):
    answer = chat(client, tools=TOOLS, tool_choice="required")
    assert answer.choices[0].finish_reason == "tool_calls"
    check_calls(answer.choices[0].message.tool_calls, SCHEMAS)
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(client, tools=TOOLS, tool_choice=named, temperature=1)
    assert answer.choices[0].finish_reason == "tool_calls"
    check_calls(answer.choices[0].message.tool_calls, ["get_time"])


def streamed_calls(client, **fields):
    """The tool calls of a streamed answer, put together as the openai client's users do."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chat(client, stream=True, **fields):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] = call["name"] or delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return finish, list(calls.values())


def test_tool_calls_stream(client):
    for tool_choice, names in (("required", SCHEMAS), ({"type": "function", "function": {"name": "get_weather"}},
                                                       ["get_weather"])):
        finish, calls = streamed_calls(client, tools=TOOLS, tool_choice=tool_choice, temperature=1,
                                       parallel_tool_calls=False)
        assert finish == "tool_calls"
        assert len(calls) == 1 and all(call["id"] and call["name"] in names for call in calls)
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_tool_choice_none_answers_text_and_auto_needs_a_template_that_renders_tools(client):
    answer = chat(client, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, tools=TOOLS)
    assert 'tool_choice "auto"' in raised.value.message and "Hermes" in raised.value.message


def test_vllm_structured_outputs_extra_on_both_endpoints(client):
    answer = chat(client, extra_body={"structured_outputs": {"choice": CITIES}}, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    assert answer.choices[0].message.content in CITIES
    completion = client.completions.create(model="smollm2", prompt="Born on ", max_tokens=16, seed=3,
                                           extra_body={"structured_outputs": {"regex": DATE}})
    assert re.fullmatch(DATE, completion.choices[0].text)


@pytest.mark.parametrize("fields, phrase", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     'structured.json does not compile: Unsupported type "objekt"'),
    (dict(extra_body={"structured_outputs": {"regex": "[a-"}}), "structured.regex does not compile"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= item"}}), 'Rule "item" is not defined'),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
     "tool_choice names the function 'fly', which is not among tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "drop response_format"),
], ids=["schema", "regex", "grammar", "unknown-tool", "tools-and-format"])
def test_bad_constraints_are_400(client, stack, fields, phrase):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, max_tokens=4, **fields)
    assert phrase in raised.value.message
    no_block_leased(stack[1])
