"""OpenAI request bodies -> GenerateRequests, field by field, with OpenAI's semantics.

Nothing here judges a value (that is validation.py's job, behind both front doors); it
only moves fields across, fills in OpenAI's defaults where they differ from the proto's
zero values (temperature 1.0), and refuses what cannot even be put into the proto (a
negative seed into a uint64, a logit_bias key that is not a token id).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationFields
from model_service.api.openai_http.structured import structured_of
from model_service.api.openai_http.tools import ToolPlan
from pagedkv.model.v1 import model_pb2

# OpenAI samples at temperature 1 unless told otherwise; the proto's zero value is greedy.
OPENAI_DEFAULT_TEMPERATURE = 1.0
# JSON may spell a lone UTF-16 surrogate ("\\ud800"); it is no Unicode text, a proto string
# cannot hold it, and it must be a 400, not the 500 of an escaped UnicodeEncodeError.
_SURROGATE = re.compile("[\ud800-\udfff]")
# --max-prompts-per-request's default: the prompts of one /v1/completions body, each a
# request of its own. As many as --max-queued-requests' default lets wait.
DEFAULT_MAX_PROMPTS = 256


def refusing_surrogates(translate):
    """`translate(body, ...)`, with a lone surrogate anywhere in the body a 400 naming its field."""

    @functools.wraps(translate)
    def wrapper(body, *args, **kwargs):
        try:
            return translate(body, *args, **kwargs)
        except UnicodeEncodeError:
            param = _surrogate_path(body.model_dump(exclude_none=True))
            raise ApiError(400, f"{param or 'a string'} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                           "without its pair), which is not Unicode text: send valid UTF-8 / paired escapes",
                           param=param, code="invalid_value") from None

    return wrapper


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The dotted path (messages.0.content) of the first string with a lone surrogate."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _surrogate_path(key, path) if isinstance(key, str) else None
        found = found or _surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


@refusing_surrogates
def chat_request(body: ChatCompletionRequest, request_id: str, tools: ToolPlan | None = None) -> model_pb2.GenerateRequest:
    """tools: what tools.plan_tools made of the body's tools (None: no tools to render or call)."""
    request = model_pb2.GenerateRequest(request_id=request_id)
    add_messages(request, body.messages, body.chat_template_kwargs)
    if tools is not None:
        request.tools_json = json.dumps(tools.tools, ensure_ascii=False)  # the template's `tools`, in order
    structured = structured_of(body)
    if tools is not None and tools.structured is not None:
        if structured is not None:
            raise ApiError(400, f"tool_choice {tools.mode!r} constrains the output to the tools' schemas; "
                           "drop response_format / structured_outputs", param="tool_choice", code="invalid_value")
        structured = tools.structured
    if structured is not None:
        request.sampling.structured.CopyFrom(structured)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    _fill(request, body, max_tokens, param)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    if body.logprobs:
        _set(request.sampling, "logprobs", body.top_logprobs or 0, "top_logprobs")
    return request


def add_messages(request: model_pb2.GenerateRequest, messages: list[ChatMessage],
                 chat_template_kwargs: dict | None) -> None:
    for index, message in enumerate(messages):
        request.messages.add(role=message.role, content=_message_text(message.content, index),
                             tool_calls=_tool_calls(message.tool_calls, index), tool_call_id=message.tool_call_id or "")
    if chat_template_kwargs:
        request.chat_template_kwargs.update(chat_template_kwargs)


_CALL_FORM = '{"id": "call_...", "type": "function", "function": {"name": "...", "arguments": "{...}"}}'


def _tool_calls(calls: Any, index: int) -> list[model_pb2.ToolCall]:
    """An assistant message's tool_calls, in OpenAI's form. Whether the arguments are JSON,
    and whether the message may carry calls at all, is the shared validation's to say
    (chat_messages.py), for gRPC as for HTTP."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ApiError(400, f"messages[{index}].tool_calls is a {type(calls).__name__}, not a list: send the calls "
                       f"as the answer gave them, a list of {_CALL_FORM}", param=f"messages.{index}.tool_calls",
                       code="invalid_value")
    return [_tool_call(call, index, number) for number, call in enumerate(calls)]


def _tool_call(call: Any, index: int, number: int) -> model_pb2.ToolCall:
    where, param = f"messages[{index}].tool_calls[{number}]", f"messages.{index}.tool_calls.{number}"
    function = call.get("function") if isinstance(call, dict) else None
    if (not isinstance(function, dict) or call.get("type", "function") != "function"
            or not isinstance(function.get("name"), str) or not isinstance(call.get("id", ""), str)):
        raise ApiError(400, f"{where} is not a function call: send it as the answer gave it, {_CALL_FORM}",
                       param=param, code="invalid_value")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        got = "missing" if arguments is None else f"a JSON {_json_type(arguments)}"
        raise ApiError(400, f"{where}.function.arguments is {got}, not a string: send the arguments as JSON text "
                       "(json.dumps of them, as the answer gave them), e.g. '{\"city\": \"Paris\"}'",
                       param=f"{param}.function.arguments", code="invalid_value")
    return model_pb2.ToolCall(id=call.get("id") or "", name=function["name"], arguments=arguments)


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


@refusing_surrogates
def completion_requests(body: CompletionRequest, request_id: str,
                        max_prompts: int = DEFAULT_MAX_PROMPTS) -> list[model_pb2.GenerateRequest]:
    """One GenerateRequest per prompt of the body (a batch of prompts is several), at most
    `max_prompts` of them (--max-prompts-per-request)."""
    prompts = _prompts(body.prompt)
    if len(prompts) > max_prompts:
        raise ApiError(400, f"prompt is a list of {len(prompts):,} prompts; this server takes at most {max_prompts:,} "
                       "in one body (--max-prompts-per-request): send them in several requests", param="prompt",
                       code="invalid_value")
    requests = []
    for index, prompt in enumerate(prompts):
        request = model_pb2.GenerateRequest(request_id=request_id if len(prompts) == 1 else f"{request_id}-{index}")
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            _set(request, "prompt_token_ids", prompt, "prompt")
        _fill(request, body, body.max_tokens, "max_tokens")
        structured = structured_of(body)
        if structured is not None:
            request.sampling.structured.CopyFrom(structured)
        if body.logprobs is not None:
            _set(request.sampling, "logprobs", body.logprobs, "logprobs")
        requests.append(request)
    return requests


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is an empty list: send a string, strings, or token ids", param="prompt",
                       code="invalid_value")
    if all(isinstance(item, int) for item in prompt):
        return [prompt]
    return list(prompt)


def _message_text(content: str | list[dict] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part_index, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{index}].content[{part_index}] of type {part.get('type')!r} is not "
                           "supported by this server: only text parts ({'type': 'text', 'text': ...})",
                           param=f"messages.{index}.content.{part_index}", code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def _fill(request: model_pb2.GenerateRequest, body: GenerationFields, max_tokens: int | None, max_param: str) -> None:
    sampling = request.sampling
    if max_tokens is not None:
        _set(sampling, "max_new_tokens", max_tokens, max_param)
    _set(sampling, "temperature", OPENAI_DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
         "temperature")
    if body.top_p is not None:
        _set(sampling, "top_p", body.top_p, "top_p")
    if body.n != 1:
        _set(sampling, "n", body.n, "n")
    if body.stop is not None:
        sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.seed is not None:
        _set(sampling, "seed", body.seed, "seed")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "skip_special_tokens", "speculate"):
        value = getattr(body, name)
        if value is not None:
            _set(sampling, name, value, name)
    if body.logit_bias:
        sampling.logit_bias.update({_token_id(key): bias for key, bias in body.logit_bias.items()})
    if body.top_k is not None:
        # vLLM's -1 and the proto's 0 both mean "no top-k".
        _set(sampling, "top_k", 0 if body.top_k == -1 else body.top_k, "top_k")
    if body.stop_token_ids:
        _set(sampling, "stop_token_ids", body.stop_token_ids, "stop_token_ids")
    if not body.stream:
        request.stream = False  # the answer is whole: one message a completion, not one a token
    sampling.ignore_eos = body.ignore_eos
    sampling.include_stop_str_in_output = body.include_stop_str_in_output or body.no_stop_trim
    if body.cache_salt:
        request.cache_salt = body.cache_salt
    _set(request, "priority", body.priority, "priority")


def _token_id(key: str) -> int:
    try:
        token_id = int(key)
    except ValueError:
        token_id = -1
    if token_id < 0 or token_id >= 2**32:
        raise ApiError(400, f"logit_bias key {key!r} is not a token id (a non-negative integer as a string)",
                       param="logit_bias", code="invalid_value")
    return token_id


def _set(message, field: str, value, param: str) -> None:
    """Sets a proto field, turning a value its type cannot hold into a 400 naming `param`."""
    try:
        if isinstance(value, list):
            getattr(message, field).extend(value)
        else:
            setattr(message, field, value)
    except (ValueError, TypeError) as error:
        raise ApiError(400, f"{param}={value!r} is out of range: {error}", param=param, code="invalid_value") from None
