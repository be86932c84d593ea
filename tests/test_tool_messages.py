"""Tool calls and tool results in a conversation, rendered without a server: an OpenAI chat
body goes through the HTTP mapping (to_generate) and the shared validation that renders
messages (chat_messages.py), and the text equals transformers' `apply_chat_template` on the
same template, given the conversation in transformers' documented form (an assistant turn's
`tool_calls` with the arguments as a dict, a tool turn with its `tool_call_id`, the tools as
`tools`). Two templates: SmolLM2's own (which knows no tools: the calls leave an empty
assistant turn, as in transformers) and a Llama-3.1-style one written here, which renders
tools, calls and results. Each malformed message is refused with a message naming it.
"""

from __future__ import annotations

import copy
import json

import pytest

from harness.hf_checkpoints import write_tokenizer
from model_service.api.openai_http import to_generate
from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest
from model_service.api.openai_http.tools import plan_tools
from model_service.api.validation import GenerateLimits, render_messages
from model_service.sample.params import InvalidRequest
from model_service.text.chat_template import ChatTemplate
from pagedkv.model.v1 import model_pb2

# Llama 3.1's tool-calling template, shortened: tools in the system turn when `tools is not
# none` (transformers passes tools=None without tools; this template does not default it),
# a call as {"name", "parameters"} with `'tool_calls' in message`, a result as an ipython turn.
LLAMA3_TOOLS_TEMPLATE = r"""{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- system_message }}
{%- if tools is not none %}
    {{- "\n\nTo call a function, answer with JSON: {\"name\": function name, \"parameters\": its arguments}.\n\n" }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for tool_call in message.tool_calls %}
            {{- '{"name": "' + tool_call.function.name + '", "parameters": ' }}
            {{- tool_call.function.arguments | tojson }}
            {{- '}' }}
        {%- endfor %}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n[" + message.tool_call_id + "] " }}
        {%- if message.content is mapping %}{{ message.content | tojson }}{% else %}{{ message.content }}{% endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]

# A round trip as the openai client sends it back: the answer's tool calls (content null,
# arguments as JSON text, two calls at once), each call's result, then the next question.
OPENAI_CONVERSATION = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "It is 22 C and sunny; the time is 14:05."},
    {"role": "user", "content": "And in Rome?"},
]


def transformers_form(conversation: list[dict]) -> list[dict]:
    """transformers' documented form: arguments as a dict; content "" where OpenAI's is null
    (what this server renders it as: SmolLM2's template adds content to a string)."""
    messages = copy.deepcopy(conversation)
    for message in messages:
        if message.get("content") is None:
            message["content"] = ""
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tool-template-tokenizer")
    write_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    from model_service.loading.embedded import embedded_model_path
    from model_service.loading.gguf_file import GGUFFile

    return GGUFFile(embedded_model_path()).value("tokenizer.chat_template")


LIMITS = GenerateLimits(vocab_size=384, max_model_len=4096, max_prompt_tokens=4096, default_max_new_tokens=16)


def ours(source: str, messages: list[dict], **fields) -> str:
    """The prompt text the chat endpoint renders for this body."""
    body = ChatCompletionRequest(model="m", messages=messages, **fields)
    request = to_generate.chat_request(body, "r", plan_tools(body, source))
    return render_messages(request, ChatTemplate(source, bos_token="<s>", eos_token="</s>"), LIMITS)


@pytest.mark.parametrize("template", ["smollm2", "llama3-tools"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no-tools"])
def test_tool_calls_and_results_render_as_transformers(reference, smollm2_template, template, with_tools):
    source = smollm2_template if template == "smollm2" else LLAMA3_TOOLS_TEMPLATE
    # "required": the tools reach the template whatever it is ("auto" needs a Hermes one).
    fields = dict(tools=TOOLS, tool_choice="required") if with_tools else {}
    text = ours(source, OPENAI_CONVERSATION, **fields)
    expected = reference.apply_chat_template(transformers_form(OPENAI_CONVERSATION), chat_template=source,
                                             tools=TOOLS if with_tools else None, tokenize=False,
                                             add_generation_prompt=True)
    assert text == expected
    if template == "llama3-tools":  # the calls, results and tools are in it, not dropped
        assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}' in text
        assert "ipython<|end_header_id|>\n\n[call_2] 14:05<|eot_id|>" in text
        assert ("Environment: ipython" in text) == with_tools and ("The weather in a city" in text) == with_tools


def test_tool_choice_none_renders_no_tools(reference):
    text = ours(LLAMA3_TOOLS_TEMPLATE, OPENAI_CONVERSATION, tools=TOOLS, tool_choice="none")
    assert text == reference.apply_chat_template(transformers_form(OPENAI_CONVERSATION),
                                                 chat_template=LLAMA3_TOOLS_TEMPLATE, tokenize=False,
                                                 add_generation_prompt=True)


ASK = {"role": "user", "content": "Weather?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def with_call(**call_fields) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [CALL | call_fields]}


@pytest.mark.parametrize("messages, param, phrase", [
    ([ASK, {"role": "assistant", "tool_calls": {"id": "call_1"}}], "messages.1.tool_calls",
     "messages[1].tool_calls is a dict, not a list"),
    ([ASK, {"role": "assistant", "tool_calls": ["get_weather"]}], "messages.1.tool_calls.0",
     "messages[1].tool_calls[0] is not a function call: send it as the answer gave it"),
    ([ASK, with_call(type="code_interpreter")], "messages.1.tool_calls.0", "is not a function call"),
    ([ASK, with_call(function={"arguments": "{}"})], "messages.1.tool_calls.0", "is not a function call"),
    ([ASK, with_call(function={"name": "get_weather", "arguments": {"city": "Paris"}})],
     "messages.1.tool_calls.0.function.arguments",
     "messages[1].tool_calls[0].function.arguments is a JSON object, not a string: send the arguments as JSON text"),
    ([ASK, with_call(function={"name": "get_weather"})], "messages.1.tool_calls.0.function.arguments",
     "arguments is missing, not a string"),
], ids=["calls-not-a-list", "call-not-an-object", "not-a-function", "no-name", "arguments-a-dict",
        "no-arguments"])
def test_tool_calls_of_the_wrong_shape_are_400_naming_them(messages, param, phrase):
    with pytest.raises(ApiError) as raised:
        to_generate.chat_request(ChatCompletionRequest(model="m", messages=messages), "r")
    assert raised.value.status == 400 and raised.value.param == param
    assert phrase in raised.value.message, raised.value.message


@pytest.mark.parametrize("messages, phrase", [
    ([ASK, with_call(), {"role": "tool", "content": "22"}],
     'messages[2] is a tool result (role "tool") without tool_call_id: set it to the id of the assistant\'s tool call'),
    ([ASK, with_call(function={"name": "get_weather", "arguments": "{city: Paris}"})],
     "messages[1].tool_calls[0]'s arguments are not JSON text (Expecting property name enclosed in double quotes"),
    ([ASK, with_call(function={"name": "get_weather", "arguments": ""})],
     "and '{}' for a call without arguments"),
    ([ASK, with_call(function={"name": "", "arguments": "{}"})],
     "messages[1].tool_calls[0] has no function name"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}],
     "messages[0] is a 'user' message with tool_calls; only assistant messages carry"),
    ([{"role": "user", "content": "x", "tool_call_id": "call_1"}],
     "messages[0] is a 'user' message with tool_call_id; only tool results"),
], ids=["tool-without-id", "arguments-not-json", "arguments-empty", "empty-name", "user-with-calls",
        "user-with-call-id"])
def test_tool_messages_the_template_cannot_be_given_are_invalid(messages, phrase):
    """The shared validation's refusals: INVALID_ARGUMENT through gRPC, 400 through HTTP."""
    request = to_generate.chat_request(ChatCompletionRequest(model="m", messages=messages), "r")
    with pytest.raises(InvalidRequest) as raised:
        render_messages(request, ChatTemplate(LLAMA3_TOOLS_TEMPLATE), LIMITS)
    assert phrase in str(raised.value), str(raised.value)


def test_grpc_tool_calls_render_as_http_s(smollm2_template):
    """The same conversation sent as gRPC ChatMessages renders to the same text."""
    messages = [
        model_pb2.ChatMessage(role="user", content="Weather?"),
        model_pb2.ChatMessage(role="assistant", tool_calls=[
            model_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]),
        model_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="22"),
    ]
    request = model_pb2.GenerateRequest(messages=messages)
    template = ChatTemplate(LLAMA3_TOOLS_TEMPLATE, bos_token="<s>", eos_token="</s>")
    assert render_messages(request, template, LIMITS) == ours(LLAMA3_TOOLS_TEMPLATE, [ASK, with_call(), {
        "role": "tool", "tool_call_id": "call_1", "content": "22"}])


@pytest.mark.parametrize("fields, phrase", [
    (dict(tools_json="[{"), "tools_json is not JSON text"),
    (dict(tools_json='{"type": "function"}'), "tools_json must be a JSON array of tool objects"),
    (dict(tools_json="[1]"), "tools_json must be a JSON array of tool objects"),
    (dict(tools_json="[]", chat_template_kwargs={"tools": []}), "tools are set twice"),
    (dict(tools_json="[]", prompt="hi", messages=[]), "tools_json applies to messages only"),
], ids=["not-json", "not-an-array", "not-objects", "twice", "with-a-prompt"])
def test_bad_tools_json_is_invalid(fields, phrase):
    from google.protobuf import struct_pb2

    from model_service.api.validation import prompt_token_ids_of
    from model_service.text.tokenizer import ByteTokenizer

    kwargs = fields.pop("chat_template_kwargs", None)
    request = model_pb2.GenerateRequest(**({"messages": [model_pb2.ChatMessage(role="user", content="hi")]} | fields))
    if kwargs is not None:
        request.chat_template_kwargs.CopyFrom(struct_pb2.Struct())
        request.chat_template_kwargs.update(kwargs)
    with pytest.raises(InvalidRequest) as raised:
        prompt_token_ids_of(request, ByteTokenizer(), ChatTemplate(LLAMA3_TOOLS_TEMPLATE), LIMITS)
    assert phrase in str(raised.value), str(raised.value)
