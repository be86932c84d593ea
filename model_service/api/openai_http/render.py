"""POST /tokenize and the render endpoints: a prompt's token ids as vLLM's server gives them, nothing generated.

Prefix-aware routers (vllm-router's kv_aware policy) render each request on the workers
to learn its token ids, hash its blocks as vLLM does and look the hashes up in the
workers' KV events. A render runs the whole validation that generating would (the same
refusals with the same messages) and answers vLLM's token-in request: `token_ids`,
`sampling_params`, `model`, `request_id`, `stream`. /tokenize checks the prompt's form
but not its length: it answers how long a prompt is, with `max_model_len` beside it.
"""

from __future__ import annotations

import json

from typing import Any

from model_service.api.openai_http import to_generate
from model_service.api.openai_http.logprobs import TokenNames
from model_service.api.openai_http.protocol import (
    GenerationFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from model_service.api.openai_http.unsupported import not_supported
from model_service.sample.params import SamplingOptions, StructuredSpec
from pagedkv.model.v1 import model_pb2


@to_generate.refusing_surrogates
def tokenize_request(body: TokenizeCompletionRequest | TokenizeChatRequest) -> model_pb2.GenerateRequest:
    request = model_pb2.GenerateRequest()
    if isinstance(body, TokenizeCompletionRequest):
        request.prompt = body.prompt
        return request
    if not body.add_generation_prompt or body.continue_final_message:
        name = "add_generation_prompt" if not body.add_generation_prompt else "continue_final_message"
        raise not_supported(name, "messages are always rendered with the generation prompt appended")
    to_generate.add_messages(request, body.messages, body.chat_template_kwargs)
    if body.tools:
        request.tools_json = json.dumps(body.tools, ensure_ascii=False)  # rendered as generation renders them
    return request


def tokenize_body(token_ids: list[int], max_model_len: int, names: TokenNames | None) -> dict[str, Any]:
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": [names.text(token_id) for token_id in token_ids] if names is not None else None,
    }


def rendered(request: model_pb2.GenerateRequest, model_name: str, token_ids: list[int], options: SamplingOptions,
             body: GenerationFields) -> dict[str, Any]:
    """One rendered request, in the shape of vLLM's token-in GenerateRequest."""
    return {
        "request_id": request.request_id,
        "model": model_name,
        "token_ids": token_ids,
        "sampling_params": sampling_params(options),
        "stream": body.stream,
        "stream_options": body.stream_options.model_dump() if body.stream_options is not None else None,
        "cache_salt": request.cache_salt or None,
        "priority": request.priority,
        "token_offsets": None,
    }


def sampling_params(options: SamplingOptions) -> dict[str, Any]:
    """The options as vLLM's SamplingParams names them (top_k 0: off)."""
    return {
        "n": options.n,
        "max_tokens": options.max_new_tokens,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "min_p": options.min_p,
        "seed": options.seed,
        "stop": list(options.stop),
        "stop_token_ids": sorted(options.stop_token_ids),
        "ignore_eos": options.ignore_eos,
        "min_tokens": options.min_tokens,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repetition_penalty,
        "logprobs": options.logprobs,
        "prompt_logprobs": options.prompt_logprobs,
        "logit_bias": {str(token_id): bias for token_id, bias in options.logit_bias} or None,
        "include_stop_str_in_output": options.include_stop_str_in_output,
        "skip_special_tokens": options.skip_special_tokens,
        "structured_outputs": structured_outputs(options.structured),
    }


def structured_outputs(spec: StructuredSpec | None) -> dict[str, Any] | None:
    """A structured output as vLLM's StructuredOutputsParams names it."""
    if spec is None:
        return None
    value: Any = True if spec.kind == "json_object" else spec.text
    if spec.kind == "choice":
        value = json.loads(spec.text)
    return {spec.kind: value, "disable_any_whitespace": not spec.any_whitespace,
            "disable_additional_properties": spec.strict}
