"""/v1/chat/completions through the official `openai` client, against a real model service
whose checkpoint carries a chat template (harness/hf_checkpoints.py's tiny Llama, with a
template written into its tokenizer_config.json).

The messages go into GenerateRequest.messages and are rendered by the same code as a gRPC
call's: the prompt equals transformers' `apply_chat_template`, and the greedy answer equals
gRPC's for those token ids. The template shows tools, calls and results in Hermes's format,
so a tool call's round trip and tool_choice "auto" run here too. The client CLI
(model_service/client.py) runs against the same service: --chat and --system, --n,
--logprobs and --abort, each compared with what gRPC gives.
"""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import openai
import pytest
from google.protobuf import struct_pb2
from scrape import metric

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from model_service import client as cli
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

MODEL = "llama-chat"
# A ChatML-like template with a variable of its own, as real checkpoints have, which shows
# the model its tools, its calls and their results in Hermes's format (as Qwen2.5's does),
# so tool_choice "auto" is served with it.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|extra|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call></s>\n{% endif %}"
    "{% for message in messages %}<|extra|>{{ message['role'] }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{\"name\": "
    "{{ call.function.name | tojson }}, \"arguments\": {{ call.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}{% elif message['role'] == 'tool' %}<tool_response>{{ message.tool_call_id }}: "
    "{{ message['content'] }}</tool_response>{% else %}{{ message['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|extra|>assistant\n{% if brief %}Briefly: {% endif %}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Paged attention keeps the KV cache in fixed-size blocks."},
    {"role": "user", "content": "The quick brown fox?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_checkpoint("llama", tmp_path_factory.mktemp("llama-chat"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def services(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(checkpoint), "--served-model-name", MODEL) as model:
        channel = grpc.insecure_channel(model.address)
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


@pytest.fixture(scope="module")
def client(services):
    return openai.OpenAI(base_url=services[1].http_url, api_key="unused", max_retries=0, timeout=120)


def template_ids(checkpoint, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **kwargs)


def grpc_text(stub, **fields) -> str:
    sampling = fields.pop("sampling")
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **fields)
    return "".join(response.text for response in stub.Generate(request, timeout=120))


GREEDY = dict(max_new_tokens=10, temperature=0, ignore_eos=True)


def test_chat_prompt_is_transformers_apply_chat_template(client, services, checkpoint):
    _, _, stub = services
    ids = template_ids(checkpoint, MESSAGES)
    expected = grpc_text(stub, prompt_token_ids=ids, sampling=GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 10
    # The same messages through gRPC.
    grpc_messages = [model_pb2.ChatMessage(**message) for message in MESSAGES]
    assert grpc_text(stub, messages=grpc_messages, sampling=GREEDY) == expected


def test_chat_template_kwargs_reach_the_template(client, checkpoint):
    ids = template_ids(checkpoint, MESSAGES, brief=True)
    assert ids != template_ids(checkpoint, MESSAGES)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"chat_template_kwargs": {"brief": True}})
    assert chat.usage.prompt_tokens == len(ids)


def test_grpc_chat_template_kwargs_reach_the_template(services, checkpoint):
    """The template's own variable, set through gRPC: the prompt is the one transformers
    renders with it, not the shorter one without it."""
    _, _, stub = services
    brief, plain = template_ids(checkpoint, MESSAGES, brief=True), template_ids(checkpoint, MESSAGES)
    assert len(brief) != len(plain)
    kwargs = struct_pb2.Struct()
    kwargs.update({"brief": True})
    request = model_pb2.GenerateRequest(messages=[model_pb2.ChatMessage(**message) for message in MESSAGES],
                                        chat_template_kwargs=kwargs, sampling=model_pb2.SamplingParams(**GREEDY))
    last = list(stub.Generate(request, timeout=120))[-1]
    assert last.usage.prompt_tokens == len(brief)


def test_chat_stream_sends_the_role_first_then_content_then_the_reason(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[1:-1])
    assert content == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_async_client_chat(services, client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})

    async def streamed() -> str:
        async with openai.AsyncOpenAI(base_url=services[1].http_url, api_key="unused", max_retries=0) as aclient:
            answer = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                           temperature=0, extra_body={"ignore_eos": True})
            stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            assert answer.choices[0].message.content == text
            return text

    assert asyncio.run(streamed()) == whole.choices[0].message.content


def test_bad_messages_are_400_with_the_grpc_path_s_message(client, services):
    cache, _, stub = services
    with pytest.raises(grpc.RpcError) as grpc_error:
        list(stub.Generate(model_pb2.GenerateRequest(messages=[model_pb2.ChatMessage(role="wizard", content="hi")]),
                           timeout=30))
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert error.value.body["message"] == grpc_error.value.details()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def test_messages_over_the_prompt_byte_cap_are_refused_before_rendering(client, services):
    cache, _, stub = services
    info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10)
    # Over 32 bytes a token (validation.py) of the longest prompt, split over two messages.
    half = "x" * ((info.max_model_len - 1) * 32 // 2 + 1)
    messages = [{"role": "system", "content": half}, {"role": "user", "content": half}]
    with pytest.raises(grpc.RpcError) as grpc_error:
        list(stub.Generate(model_pb2.GenerateRequest(messages=[model_pb2.ChatMessage(**m) for m in messages]),
                           timeout=30))
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the messages' text is at least" in grpc_error.value.details()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert error.value.body["message"] == grpc_error.value.details()
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def test_chat_logprobs_and_top_logprobs_equal_grpc_s(client, services):
    _, _, stub = services
    request = model_pb2.GenerateRequest(
        messages=[model_pb2.ChatMessage(**message) for message in MESSAGES],
        sampling=model_pb2.SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
    entries = [entry for response in stub.Generate(request, timeout=120) for entry in response.logprobs]
    assert len(entries) == 5
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True,
                                                                      "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [item.token for item in content] == [f"token_id:{entry.token_id}" for entry in entries]
    assert [item.logprob for item in content] == [entry.logprob for entry in entries]
    assert [[(top.token, top.logprob) for top in item.top_logprobs] for item in content] == [
        [(f"token_id:{top.token_id}", top.logprob) for top in entry.top] for entry in entries]
    # logprobs without top_logprobs: the sampled token's alone, named by its text.
    named = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                           logprobs=True, extra_body={"ignore_eos": True})
    content = named.choices[0].logprobs.content
    assert [item.logprob for item in content] == [entry.logprob for entry in entries]
    assert all(item.top_logprobs == [] and not item.token.startswith("token_id:") for item in content)


def test_chat_n_2_streams_both_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=1.0,
                                                 seed=3, stream=True, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=1.0,
                                           seed=3, extra_body={"ignore_eos": True})
    for choice in whole.choices:
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == choice.index)
        assert streamed == choice.message.content
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 12


# ---------------------------------------------------------------- structured output's compiles, on /metrics



def test_grammar_compiles_cache_hits_and_compile_seconds_are_on_metrics(client, services):
    _, model, _ = services
    series = {
        "ok": ("pagedkv_model_grammar_compiles_total", dict(kind="regex", result="ok")),
        "invalid": ("pagedkv_model_grammar_compiles_total", dict(kind="regex", result="invalid")),
        "hits": ("pagedkv_model_grammar_cache_hits_total", dict(kind="regex")),
        "timed": ("pagedkv_model_grammar_compile_seconds_count", dict(kind="regex")),
        "in_buckets": ("pagedkv_model_grammar_compile_seconds_bucket", dict(kind="regex", le="+Inf")),
        "seconds": ("pagedkv_model_grammar_compile_seconds_sum", dict(kind="regex")),
    }
    before = {key: metric(model, name, **labels) for key, (name, labels) in series.items()}
    for seed in (1, 2):  # one regex twice: compiled once, then found in the cache
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, seed=seed,
                                                extra_body={"structured_outputs": {"regex": "[a-e]{3}metrics"}})
        assert re.fullmatch("[a-e]{3}metrics", answer.choices[0].message.content)
    for _ in range(2):  # a regex that does not compile is never cached: compiled (and refused) each time
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                           extra_body={"structured_outputs": {"regex": "[metrics-"}})
    after = {key: metric(model, name, **labels) for key, (name, labels) in series.items()}
    delta = {key: after[key] - before[key] for key in series}
    assert delta["ok"] == 1 and delta["invalid"] == 2 and delta["hits"] == 1, delta
    assert delta["timed"] == delta["in_buckets"] == 3 and delta["seconds"] > 0, delta
    # The kept grammars' bytes are reported, within --grammar-cache-bytes (64 MiB by default).
    assert 0 < metric(model, "pagedkv_model_grammar_cache_bytes") <= 64 << 20


# ---------------------------------------------------------------- tools: calls, results and tool_choice "auto"

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "The quick brown fox?"}]


def sent_back(call, result: str) -> list[dict]:
    """ASK, the call and its result in transformers' form (arguments a dict; content "" for null)."""
    return ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
        "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": result}]


def test_tool_call_round_trip_with_the_openai_client(client, services, checkpoint):
    """tools -> a tool call -> the assistant's call and the tool's result sent back -> an
    answer over exactly the prompt transformers renders from that conversation."""
    cache, _, stub = services
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=160,
                                           seed=1)
    assert first.usage.prompt_tokens == len(template_ids(checkpoint, ASK, tools=TOOLS))
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome"), arguments
    # Sent back as the client's users do: the answer's message object itself, then the result.
    conversation = ASK + [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "22 C"}]
    final = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    ids = template_ids(checkpoint, sent_back(call, "22 C"), tools=TOOLS)
    assert final.usage.prompt_tokens == len(ids)
    assert final.choices[0].message.content == grpc_text(stub, prompt_token_ids=ids, sampling=GREEDY | dict(
        max_new_tokens=8))
    assert final.choices[0].finish_reason == "length" and not final.choices[0].message.tool_calls
    # /tokenize renders tools and calls as generation does.
    status, body = post(services, "/tokenize", {"model": MODEL, "messages": [m if isinstance(m, dict) else
                                                m.model_dump(exclude_unset=True) for m in conversation],
                                                "tools": TOOLS})
    assert status == 200 and body["tokens"] == ids
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def check_call(call) -> None:
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_tool_choice_auto_passes_a_callless_answer_through_as_content(client, services, checkpoint):
    """Greedy, the tiny model writes no <tool_call>: the answer is exactly the text gRPC
    generates from the prompt rendered with the tools, as content, with no tool_calls."""
    _, _, stub = services
    expected = grpc_text(stub, prompt_token_ids=template_ids(checkpoint, ASK, tools=TOOLS),
                         sampling=GREEDY | dict(max_new_tokens=24))
    assert "<tool_call>" not in expected
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    [choice] = answer.choices
    assert choice.message.content == expected and not choice.message.tool_calls
    assert choice.finish_reason == "length"


# What a model that chooses to call writes in Hermes's format, forced with a regex so that
# the random model writes it: the parser, the answer's shape and the stream are the real ones.
SAYS_A_CALL = (r'Let me look\. <tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)", "unit": "C"\}\}</tool_call>')


def test_tool_choice_auto_parses_the_model_s_call_into_tool_calls(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=5,
                                            extra_body={"structured_outputs": {"regex": SAYS_A_CALL}})
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    check_call(call)
    assert json.loads(call.function.arguments) in ({"city": "Paris", "unit": "C"}, {"city": "Rome", "unit": "C"})
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=5,
                                                 stream=True, extra_body={"structured_outputs": {"regex": SAYS_A_CALL}}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "Let me look."
    [streamed] = [call for delta in deltas for call in delta.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("regex", [
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Par',  # cut short: never closed
    r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>',  # a function it was not given
    r'<tool_call>\{"name": "get_weather", "arguments": \[1\]\}</tool_call>',  # arguments not an object
], ids=["unclosed", "unknown-function", "arguments-array"])
def test_tool_choice_auto_answers_malformed_calls_as_content(client, services, regex):
    import re as regexes

    for stream in (False, True):
        answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, seed=6,
                                                stream=stream, extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            deltas = [chunk.choices[0] for chunk in answer if chunk.choices]
            text = "".join(choice.delta.content or "" for choice in deltas)
            assert not any(choice.delta.tool_calls for choice in deltas) and deltas[-1].finish_reason == "stop"
        else:
            [choice] = answer.choices
            text = choice.message.content
            assert not choice.message.tool_calls and choice.finish_reason == "stop"
        assert regexes.fullmatch(regex, text), text
    wait_for(lambda: stats(cache_stub(services[0].address)).blocks_leased == 0, 30, "every block released")


@pytest.mark.parametrize("messages, param, phrase", [
    (ASK + [{"role": "tool", "content": "22 C"}], None,
     'messages[1] is a tool result (role "tool") without tool_call_id'),
    (ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}],
     "messages.1.tool_calls.0.function.arguments", "arguments is a JSON object, not a string"),
    (ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Rome}"}}]}],
     None, "messages[1].tool_calls[0]'s arguments are not JSON text"),
], ids=["tool-without-id", "arguments-a-dict", "arguments-not-json"])
def test_bad_tool_messages_are_400_and_invalid_argument(client, services, messages, param, phrase):
    cache, _, stub = services
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert phrase in error.value.message and error.value.param == param, error.value.message
    if param is None:  # the shared validation's: gRPC says the same
        grpc_messages = [model_pb2.ChatMessage(role=m["role"], content=m["content"] or "", tool_calls=[
            model_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in m.get("tool_calls", ())]) for m in messages]
        with pytest.raises(grpc.RpcError) as grpc_error:
            list(stub.Generate(model_pb2.GenerateRequest(messages=grpc_messages), timeout=30))
        assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert grpc_error.value.details() == error.value.body["message"]
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


# ---------------------------------------------------------------- what routers ask: /tokenize and render


def post(services, path: str, body: dict) -> tuple[int, object]:
    import urllib.error
    import urllib.request

    base = services[1].http_url.removesuffix("/v1")
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# What vllm-router 0.1.17 writes into the chat bodies it renders and forwards.
ROUTER_FIELDS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                 "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


def test_tokenize_answers_in_vllms_schema(services, checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompt = "The quick brown fox jumps over the lazy dog."
    status, body = post(services, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert status == 200
    assert body["tokens"] == tokenizer(prompt).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    assert "".join(body["token_strs"][1:]) == tokenizer.decode(body["tokens"][1:])
    status, body = post(services, "/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert body["tokens"] == tokenizer(prompt, add_special_tokens=False).input_ids and body["token_strs"] is None
    status, body = post(services, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    assert status == 200 and body["tokens"] == template_ids(checkpoint, MESSAGES)


def test_render_gives_the_token_ids_generation_runs(client, services, checkpoint):
    ids = template_ids(checkpoint, MESSAGES)
    status, chat = post(services, "/v1/chat/completions/render",
                        {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0.5, **ROUTER_FIELDS})
    assert status == 200 and chat["token_ids"] == ids and chat["model"] == MODEL
    assert chat["request_id"].startswith("chatcmpl-")
    assert chat["sampling_params"]["max_tokens"] == 3 and chat["sampling_params"]["temperature"] == 0.5
    # The body the router then forwards generates over those same ids.
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                            extra_body={k: v for k, v in ROUTER_FIELDS.items() if k != "logprobs"})
    assert answer.usage.prompt_tokens == len(ids)
    status, rendered = post(services, "/v1/completions/render",
                            {"model": MODEL, "prompt": ["one prompt", "another"], "max_tokens": 2})
    assert status == 200 and len(rendered) == 2
    assert rendered[0]["token_ids"] == post(services, "/tokenize", {"prompt": "one prompt"})[1]["tokens"]
    status, [as_ids] = post(services, "/v1/completions/render", {"model": MODEL, "prompt": [5, 6, 7]})
    assert status == 200 and as_ids["token_ids"] == [5, 6, 7] and as_ids["request_id"].startswith("cmpl-")


@pytest.mark.parametrize("path, body, status, in_message", [
    ("/v1/completions/render", {"prompt": "x", "max_tokens": 10**6}, 400, "max_model_len"),
    ("/v1/completions/render", {"prompt": [10**7], "max_tokens": 1}, 400, "vocab_size"),
    ("/v1/completions/render", {"prompt": "", "max_tokens": 1}, 400, "empty"),
    ("/v1/chat/completions/render", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "known roles"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "return_hidden_states": True}, 400, "not supported"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "model": "gpt-4o"}, 404, "does not exist"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "does not exist"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400, "not supported"),
    ("/tokenize", {"prompt": "x", "max_tokens": 3}, 400, "max_tokens"),
])
def test_render_and_tokenize_refuse_as_generation_does(services, path, body, status, in_message):
    answer_status, answer = post(services, path, {"model": MODEL, **body})
    assert answer_status == status, answer
    assert in_message in answer["error"]["message"]


# -- the client CLI against this service ---------------------------------------------------------


def run_cli(services, capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    """The CLI's exit code, stdout and stderr, run in process against the service."""
    monkeypatch.delenv(cli.AUTH_TOKEN_ENV, raising=False)
    code = cli.main([*argv, "--address", services[1].address, "--timeout", "120"])
    out, err = capsys.readouterr()
    return code, out, err


def grpc_messages(stub, **fields) -> dict[int, list[model_pb2.GenerateResponse]]:
    sampling = fields.pop("sampling")
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **fields)
    by_index: dict[int, list[model_pb2.GenerateResponse]] = {}
    for response in stub.Generate(request, timeout=120):
        by_index.setdefault(response.index, []).append(response)
    return by_index


def test_cli_chat_with_a_system_message_renders_the_template_and_answers_as_grpc(services, checkpoint, capsys,
                                                                               monkeypatch):
    _, _, stub = services
    system, user = MESSAGES[0]["content"], MESSAGES[1]["content"]
    code, out, err = run_cli(services, capsys, monkeypatch, "--system", system, user, "--max-new-tokens", "10",
                             "--ignore-eos")
    assert code == 0, err
    assert out == grpc_text(stub, prompt_token_ids=template_ids(checkpoint, MESSAGES), sampling=GREEDY)
    assert f"[prompt_tokens={len(template_ids(checkpoint, MESSAGES))} completion_tokens=10 " in err
    code, out, err = run_cli(services, capsys, monkeypatch, "--chat", user, "--max-new-tokens", "10", "--ignore-eos")
    only_user = [MESSAGES[1]]
    assert code == 0 and out == grpc_text(stub, prompt_token_ids=template_ids(checkpoint, only_user), sampling=GREEDY)
    assert f"[prompt_tokens={len(template_ids(checkpoint, only_user))} " in err


def test_cli_n_prints_each_completion_whole_as_grpc_samples_them(services, capsys, monkeypatch):
    _, _, stub = services
    code, out, err = run_cli(services, capsys, monkeypatch, "Paged blocks", "--n", "3", "--temperature", "1",
                             "--seed", "7", "--max-new-tokens", "6", "--ignore-eos")
    assert code == 0, err
    expected = grpc_messages(stub, prompt="Paged blocks",
                             sampling=dict(n=3, temperature=1, seed=7, max_new_tokens=6, ignore_eos=True))
    texts = {index: "".join(m.text for m in messages) for index, messages in expected.items()}
    assert len(set(texts.values())) > 1, "three seeded completions should not all be equal"
    assert out == "".join(f"--- completion {index} ---\n{texts[index]}\n" for index in range(3))
    assert "completion_tokens=18 " in err and "finish_reason=LENGTH,LENGTH,LENGTH]" in err


def test_cli_logprobs_prints_each_token_s_logprob_and_top_as_grpc_gives_them(services, capsys, monkeypatch):
    _, _, stub = services
    code, out, err = run_cli(services, capsys, monkeypatch, "The quick brown fox", "--logprobs", "2",
                             "--max-new-tokens", "4", "--ignore-eos")
    assert code == 0, err
    [messages] = grpc_messages(stub, prompt="The quick brown fox",
                               sampling=dict(logprobs=2, max_new_tokens=4, temperature=0, ignore_eos=True)).values()
    entries = [entry for message in messages for entry in message.logprobs]
    assert len(entries) == 4 and all(len(entry.top) == 2 for entry in entries)
    lines = [line for line in err.splitlines() if line.startswith("[0] ")]
    assert lines == ["[0] " + cli._logprob_text(entry) for entry in entries]
    assert out == "".join(message.text for message in messages)


def test_cli_abort_ends_a_live_request_and_counts_only_live_ones(services, capsys, monkeypatch):
    cache, _, stub = services
    request = model_pb2.GenerateRequest(prompt="abort me", request_id="cli-abort-me", sampling=model_pb2.SamplingParams(
        max_new_tokens=500, ignore_eos=True))
    call = stub.Generate(request, timeout=120)
    first = next(call)  # it runs
    code, out, err = run_cli(services, capsys, monkeypatch, "--abort", "cli-abort-me", "--abort", "not-a-live-one")
    assert code == 0, err
    assert out == "aborted: 1 of 2\n"
    last = [first, *call][-1]
    assert last.finish_reason == model_pb2.FINISH_REASON_ABORT and last.usage.completion_tokens < 500
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "the aborted request's blocks released")
