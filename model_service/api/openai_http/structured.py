"""OpenAI's response_format and vLLM's structured_outputs -> SamplingParams.structured.

Only the shape is checked here; whether the schema, regex or grammar compiles is decided
by the validation both front doors share (it compiles them), so a bad one gets the same
message over HTTP (400) as over gRPC (INVALID_ARGUMENT).
"""

from __future__ import annotations

import json

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest, GenerationFields, StructuredOutputsBody
from pagedkv.model.v1 import model_pb2


def structured_of(body: GenerationFields) -> model_pb2.StructuredOutputs | None:
    """The body's constraint, or None: response_format (chat) or structured_outputs, not both."""
    response_format = body.response_format if isinstance(body, ChatCompletionRequest) else None
    if response_format is not None and response_format.type == "text":
        response_format = None
    if response_format is not None and body.structured_outputs is not None:
        raise ApiError(400, "set response_format or structured_outputs, not both", param="structured_outputs",
                       code="invalid_value")
    if response_format is not None:
        return _from_response_format(response_format)
    if body.structured_outputs is not None:
        return _from_structured_outputs(body.structured_outputs)
    return None


def _from_response_format(response_format) -> model_pb2.StructuredOutputs:
    if response_format.type == "json_object":
        return model_pb2.StructuredOutputs(json_object=True)
    if response_format.type == "json_schema":
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema (a JSON schema object)",
                           param="response_format.json_schema.schema", code="invalid_value")
        return model_pb2.StructuredOutputs(json=json.dumps(response_format.json_schema.schema_))
    raise ApiError(400, f"response_format.type is {response_format.type!r}; known types: text, json_object, "
                   "json_schema", param="response_format.type", code="invalid_value")


def _from_structured_outputs(given: StructuredOutputsBody) -> model_pb2.StructuredOutputs:
    structured = model_pb2.StructuredOutputs(disable_any_whitespace=given.disable_any_whitespace)
    if given.json_ is not None:
        structured.json = given.json_ if isinstance(given.json_, str) else json.dumps(given.json_)
    if given.json_object:
        structured.json_object = True
    if given.regex is not None:
        structured.regex = given.regex
    if given.choice is not None:
        structured.choice.extend(given.choice)
    if given.grammar is not None:
        structured.grammar = given.grammar
    if given.disable_additional_properties is not None:
        structured.disable_additional_properties = given.disable_additional_properties
    return structured
