"""Request bodies of the OpenAI API (and vLLM's extra parameters), as pydantic models.

Only shapes and types live here. Whether a value is acceptable (temperature >= 0, top_p in
(0, 1], lengths, token ids) is decided by the same validation the gRPC path runs, after
the body is translated into a GenerateRequest, so both front doors accept and refuse the
same things with the same messages.

Unknown fields are refused (400 naming the field) rather than ignored: a misspelt
`max_token` would otherwise silently generate the default length. Fields OpenAI defines
that this server does not implement (tools, structured output, audio, ...) are declared so
that a request using them gets a 400 saying so; their "off" values are accepted, since
clients send those routinely. Structured output and tools are implemented (structured.py,
tools.py), tool calls and tool results in the conversation too (to_generate.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(Body):
    include_usage: bool = False
    # vLLM's: usage in every chunk. Accepted off only.
    continuous_usage_stats: bool = False


class StructuredOutputsBody(Body):
    """vLLM's `structured_outputs` extra: exactly one of json, json_object, regex, choice, grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None


class GenerationFields(Body):
    """What /v1/chat/completions and /v1/completions share."""

    model: str
    max_tokens: int | None = None
    # OpenAI's default is 1.0 (sampling), not greedy: unset means 1.0 here too.
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Token id (as a string, JSON keys are strings) -> bias added to its logit.
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    # vLLM's extra parameters (clients pass them in extra_body).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    # pagedkv's own: false keeps this request from speculating (--speculative-method).
    speculate: bool | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    # Logprob entries name tokens as "token_id:N" instead of their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's structured output (StructuredOutputsParams): SamplingParams.structured.
    structured_outputs: StructuredOutputsBody | None = None

    # What vllm-router writes into every body it renders or forwards (SGLang's names, at
    # their defaults): no_stop_trim is include_stop_str_in_output; hidden states are not
    # returned (only false passes); reasoning is never split from the content here, so
    # the reasoning switches change nothing (include_reasoning false, which would drop it,
    # is refused).
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: bool | None = None

    # Accepted and ignored: they change nothing about the output (user: an end-user id
    # for OpenAI's abuse tracking).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ChatMessage(Body):
    role: str
    # A string, or content parts of which only text ones are supported.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # An assistant turn's calls (a list of function calls, checked in to_generate.py so a
    # wrong shape gets a message that shows the right one) and a tool turn's call id.
    tool_calls: Any = None
    tool_call_id: str | None = None
    # The legacy form of tool_calls: refused (unsupported.py).
    function_call: dict[str, Any] | None = None
    refusal: str | None = None


class JsonSchemaFormat(Body):
    name: str = "response"
    description: str | None = None
    # OpenAI's name is `schema` (a BaseModel attribute, hence the alias).
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # Accepted either way: the output is always constrained to the schema.
    strict: bool | None = None


class ResponseFormat(Body):
    type: str  # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    # Function calling (tools.py) and structured output (structured.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    # OpenAI fields this server does not implement: only their "off" values pass.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None


class TokenizeCompletionRequest(Body):
    """POST /tokenize with a text prompt (vLLM's schema)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(Body):
    """POST /tokenize with messages, rendered by the chat template (vLLM's schema)."""

    model: str | None = None
    messages: list[ChatMessage]
    # The template's text already holds the special tokens: none are added unless asked.
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(GenerationFields):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    # The sampled token's logprob plus this many alternatives.
    logprobs: int | None = None

    # OpenAI fields this server does not implement: only their "off" values pass.
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class LoadLoraAdapterRequest(Body):
    """POST /v1/load_lora_adapter (vLLM's schema)."""

    lora_name: str = ""
    lora_path: str = ""


class UnloadLoraAdapterRequest(Body):
    """POST /v1/unload_lora_adapter (vLLM's schema; lora_int_id is accepted and not used: names pick)."""

    lora_name: str = ""
    lora_int_id: int | None = None
