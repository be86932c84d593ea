"""GenerateRequest.messages -> what the chat template is given, tool calls and tool results included.

A template sees each message as transformers' `apply_chat_template` hands it over: a dict
with role and content; an assistant turn's calls under `tool_calls`, each
`{"id", "type": "function", "function": {"name", "arguments"}}` with the arguments parsed
from their JSON text (templates render them with `tojson` or read their keys, as
transformers' chat-templating guide and vLLM's renderer give them); a tool turn's
`tool_call_id`. A key a message does not use is absent, not empty: templates test
`'tool_calls' in message`. The tools (GenerateRequest.tools_json) are its `tools`, their
keys in the order sent. Every message that cannot be rendered so is refused here with a
message that names it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from model_service.sample.params import InvalidRequest
from model_service.text.chat_template import KNOWN_ROLES
from pagedkv.model.v1 import model_pb2


def template_messages(messages: Sequence[model_pb2.ChatMessage]) -> list[dict[str, Any]]:
    return [_template_message(index, message) for index, message in enumerate(messages)]


def _template_message(index: int, message: model_pb2.ChatMessage) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in KNOWN_ROLES:
        raise InvalidRequest(f"{where}.role is {message.role!r}; known roles: {', '.join(KNOWN_ROLES)}")
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequest(f"{where} is a {message.role!r} message with tool_calls; only assistant messages "
                                 "carry the calls the model made")
        rendered["tool_calls"] = [_tool_call(f"{where}.tool_calls[{number}]", call)
                                  for number, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidRequest(f"{where} is a tool result (role \"tool\") without tool_call_id: set it to the id "
                                 "of the assistant's tool call whose result it is")
        rendered["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id:
        raise InvalidRequest(f"{where} is a {message.role!r} message with tool_call_id; only tool results (role "
                             "\"tool\") answer a call")
    return rendered


def _tool_call(where: str, call: model_pb2.ToolCall) -> dict[str, Any]:
    if not call.name:
        raise InvalidRequest(f"{where} has no function name: name the function that was called")
    try:
        arguments = json.loads(call.arguments)
    except ValueError as error:
        raise InvalidRequest(f"{where}'s arguments are not JSON text ({error}): send them as the call gave them, "
                             "e.g. '{\"city\": \"Paris\"}', and '{}' for a call without arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def template_tools(tools_json: str) -> list[Any]:
    """GenerateRequest.tools_json as the template's `tools`: a JSON array of objects."""
    try:
        tools = json.loads(tools_json)
    except ValueError as error:
        raise InvalidRequest(f"tools_json is not JSON text ({error}): send the tools as a JSON array") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidRequest("tools_json must be a JSON array of tool objects, e.g. [{\"type\": \"function\", "
                             "\"function\": {\"name\": ..., \"parameters\": {...}}}]")
    return tools


def message_chars(message: model_pb2.ChatMessage) -> int:
    """The characters of a message's text: what the prompt byte cap counts before rendering."""
    return len(message.role) + len(message.content) + len(message.tool_call_id) + sum(
        len(call.id) + len(call.name) + len(call.arguments) for call in message.tool_calls)


def message_bytes(message: model_pb2.ChatMessage) -> int:
    """The same in UTF-8 bytes."""
    return len(message.role.encode()) + len(message.content.encode()) + len(message.tool_call_id.encode()) + sum(
        len(call.id.encode()) + len(call.name.encode()) + len(call.arguments.encode()) for call in message.tool_calls)
