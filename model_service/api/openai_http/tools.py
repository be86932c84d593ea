"""Function calling: OpenAI's tools and tool_choice, constrained or parsed, answered as tool_calls.

- tool_choice "required": the output is constrained (structured output) to a JSON array
  of `{"name": <a tool's name>, "parameters": <that tool's parameters schema>}`, one item
  or more (one only when parallel_tool_calls is false); each item becomes a tool call.
- tool_choice naming a function: the output is constrained to that function's parameters
  schema and is the call's arguments; streamed as they are generated.
- tool_choice "auto" (the default when tools are given): the model chooses, unconstrained,
  so its chat template must show it the tools and its output format must have a parser
  here. The one parser is Hermes's (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
  the format of Qwen2.5, Qwen3 and Hermes templates); a template that does not render
  `tools` in it is refused with a 400 that says to use "required" or a named function.
  Output that is not exactly text then well-formed calls of the given functions (a block
  that is not such JSON or never closes, text after the calls, an unknown function,
  arguments that are not an object) is answered as the content it is, never a 500.
- tool_choice "none": the tools are neither rendered nor called; plain text.
In every mode but "none" the tools go to the chat template as its `tools` variable.
A choice that ends with its calls parsed has finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest
from model_service.api.openai_http.responses import FINISH_REASON, ChatEndpoint, stop_reason
from pagedkv.model.v1 import model_pb2

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str  # "required", "named" or "auto"
    tools: list[dict[str, Any]]  # as the body gave them: what the template renders
    name: str | None = None  # the named function
    structured: model_pb2.StructuredOutputs | None = None  # required and named: the constraint

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole output; no calls when it does not parse."""
        if self.mode == "named":
            return None, [tool_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                              for item in items]
            except (ValueError, TypeError, KeyError):
                return text, []
        content, calls = parse_hermes(text)
        names = {tool["function"]["name"] for tool in self.tools}
        if any(call["function"]["name"] not in names for call in calls):
            return text, []  # a call to a function it was not given: what it wrote is text
        return content, calls


def plan_tools(body: ChatCompletionRequest, template_source: str | None) -> ToolPlan | None:
    """What the body's tools ask for, or None when they change nothing (none given, or "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice names a tool or requires one, but the request has no tools",
                           param="tool_choice", code="invalid_value")
        return None
    functions = [_function(tool, index) for index, tool in enumerate(body.tools)]
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if not renders_hermes_tools(template_source):
            raise ApiError(400, "tool_choice \"auto\" (the default when tools are given) needs a chat template that "
                           "shows the model its tools in a format with a parser here (Hermes <tool_call>); this "
                           "model's does not: send tool_choice \"required\" or a named function, whose output is "
                           "constrained to the tools' schemas", param="tool_choice", code="unsupported_parameter")
        return ToolPlan("auto", body.tools)
    if choice == "required":
        items = {"anyOf": [{"type": "object",
                            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                           "parameters": function.get("parameters") or _EMPTY_PARAMETERS},
                            "required": ["name", "parameters"]} for function in functions]}
        schema = {"type": "array", "items": items, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", body.tools, structured=model_pb2.StructuredOutputs(json=json.dumps(schema)))
    name = _named(choice)
    for function in functions:
        if function["name"] == name:
            schema = function.get("parameters") or _EMPTY_PARAMETERS
            return ToolPlan("named", body.tools, name=name,
                            structured=model_pb2.StructuredOutputs(json=json.dumps(schema)))
    raise ApiError(400, f"tool_choice names the function {name!r}, which is not among tools "
                   f"({', '.join(repr(f['name']) for f in functions)})", param="tool_choice", code="invalid_value")


def renders_hermes_tools(template_source: str | None) -> bool:
    return bool(template_source) and "tools" in template_source and "<tool_call>" in template_source


def _function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                       "\"parameters\": {...}}}", param=f"tools.{index}", code="invalid_value")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise ApiError(400, f"tools[{index}].function.parameters must be a JSON schema object",
                       param=f"tools.{index}.function.parameters", code="invalid_value")
    return function


def _named(choice: str | dict[str, Any]) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            (choice.get("function") or {}).get("name"), str):
        return choice["function"]["name"]
    raise ApiError(400, f"tool_choice is {choice!r}; it must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice", code="invalid_value")


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes's format: text, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks with nothing but whitespace between and after them. Anything else (a block that is
    not such JSON, an unclosed block, text after the calls) leaves the whole output as
    content: the client gets what the model wrote, never part of a call.

    The tags are found with str.find, each character looked at a bounded number of
    times: a regular expression around the block's text backtracks on a long run of
    whitespace (which a model looping on it writes), for minutes at ten thousand."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls, position = [], start
    while (position := _SPACE.match(text, position).end()) < len(text):
        if not text.startswith(HERMES_OPEN, position):
            return text, []  # text after the calls, or between them
        end = text.find(HERMES_CLOSE, position + len(HERMES_OPEN))
        if end < 0:
            return text, []  # never closed
        call = _hermes_call(text[position + len(HERMES_OPEN):end])
        if call is None:
            return text, []
        calls.append(call)
        position = end + len(HERMES_CLOSE)
    content = text[:start].strip()
    return content or None, calls


def _hermes_call(block: str) -> dict[str, Any] | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None  # OpenAI's arguments are an object: clients json.loads them and index it
    return tool_call(call["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(slots=True)
class _Streamed:
    text: list[str] = field(default_factory=list)  # held back until the end (required, auto)
    call_id: str | None = None  # named: the one call's id, sent in its first chunk


class ToolCallEndpoint(ChatEndpoint):
    """Chat answers whose output is tool calls (required, named) or may hold them (auto)."""

    def __init__(self, *args, plan: ToolPlan, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self._streamed: dict[int, _Streamed] = {}

    def _choice_body(self, index, choice):
        body = super()._choice_body(index, choice)
        content, calls = self.plan.parse(body["message"]["content"])
        if calls and (choice.finish_reason == "stop" or self.plan.mode == "named"):
            body["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
            if choice.finish_reason == "stop":
                body["finish_reason"] = "tool_calls"
        return body

    def stream_choices(self, prompt_index, response):
        if self.plan.mode == "named":
            return self._stream_named(prompt_index, response)
        index = self.choice_index(prompt_index, response)
        streamed = self._streamed.setdefault(index, _Streamed())
        streamed.text.append(response.text)
        if not response.finish_reason:
            return []
        self.usage.add(prompt_index, response)
        finish = FINISH_REASON.get(response.finish_reason, "stop")
        content, calls = self.plan.parse("".join(streamed.text))
        chunks = []
        if content:
            chunks.append([{"index": index, "delta": {"content": content}, "logprobs": None, "finish_reason": None}])
        if calls and finish == "stop":
            finish = "tool_calls"
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            chunks.append([{"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}])
        chunks.append([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish,
                        "stop_reason": stop_reason(response)}])
        return chunks

    def _stream_named(self, prompt_index, response):
        index = self.choice_index(prompt_index, response)
        streamed = self._streamed.setdefault(index, _Streamed())
        chunks = []
        if response.text or response.logprobs:
            call: dict[str, Any] = {"index": 0, "function": {"arguments": response.text}}
            if streamed.call_id is None:
                streamed.call_id = f"call_{uuid.uuid4().hex[:24]}"
                call = {"index": 0, "id": streamed.call_id, "type": "function",
                        "function": {"name": self.plan.name, "arguments": response.text}}
            logprobs = {"content": self._logprobs(response, 0)} if self.logprobs else None
            chunks.append([{"index": index, "delta": {"tool_calls": [call]}, "logprobs": logprobs,
                            "finish_reason": None}])
        if response.finish_reason:
            self.usage.add(prompt_index, response)
            finish = FINISH_REASON.get(response.finish_reason, "stop")
            chunks.append([{"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": "tool_calls" if finish == "stop" else finish,
                            "stop_reason": stop_reason(response)}])
        return chunks
