"""Validation of a GenerateRequest: plain code, no gRPC, no engine.

`validate_generate_request` turns a request into prompt token ids and SamplingOptions, or
raises InvalidRequest (the servicer answers INVALID_ARGUMENT) or PoolTooSmall
(RESOURCE_EXHAUSTED). Nothing else escapes it, whatever the client sent: a request it
rejects never reaches the engine, so it never holds a block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from google.protobuf import json_format

from model_service.api.chat_messages import message_bytes, message_chars, template_messages, template_tools
from model_service.text.chat_template import ChatTemplate, ChatTemplateError
from model_service.sample.grammar import GrammarCompiler
from model_service.sample.params import InvalidRequest, MAX_COMPLETIONS, SamplingOptions
from model_service.api.sampling_proto import options_from_proto
from model_service.text.tokenizer import Tokenizer
from pagedkv.model.v1 import model_pb2

MAX_REQUEST_ID_CHARS = 128
# A salt is a tenant's key, not data: short. (The cache service refuses longer ones too.)
MAX_CACHE_SALT_CHARS = 256
# A prompt longer than this many bytes per accepted token cannot fit (real text runs
# about 4 bytes a token): it is refused before tokenizing, which costs time on the
# event loop's behalf and memory in proportion to the text.
MAX_PROMPT_BYTES_PER_TOKEN = 32
# Variables the service sets itself; a request's chat_template_kwargs cannot replace them.
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt")


class PoolTooSmall(Exception):
    """A request larger than the whole pool: it could never run."""


@dataclass(frozen=True, slots=True)
class GenerateLimits:
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    default_max_new_tokens: int
    # The whole pool's tokens; 0 while not attached (the engine then answers UNAVAILABLE).
    max_total_tokens: int = 0
    # Most completions (n) one request may ask for: --max-num-seqs, as they run at once.
    max_completions: int = MAX_COMPLETIONS
    # --stream-interval: the least a request's stream_interval can be.
    stream_interval: int = 1


def validate_generate_request(
    request: model_pb2.GenerateRequest, limits: GenerateLimits, tokenizer: Tokenizer,
    chat_template: ChatTemplate | None = None, grammars: GrammarCompiler | None = None,
) -> tuple[list[int], SamplingOptions]:
    """chat_template: the model's (LoadedModel.chat_template); None refuses `messages`.
    grammars: compiles SamplingParams.structured, on the caller's thread (keep it off the
    event loop and the engine thread); None refuses it."""
    request_id = request.request_id
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    # It goes into every log line of the request: no newlines or escape sequences.
    if not request_id.isprintable():
        raise InvalidRequest("request_id has control characters; use printable text (letters, digits, -_.:)")
    if len(request.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt is {len(request.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    prompt_token_ids = prompt_token_ids_of(request, tokenizer, chat_template, limits)
    vocab_size = limits.vocab_size
    out_of_range = [t for t in prompt_token_ids if t >= vocab_size]
    if out_of_range:
        raise InvalidRequest(
            f"{len(out_of_range)} prompt token ids are >= vocab_size {vocab_size} (first: {out_of_range[0]})"
        )
    if len(prompt_token_ids) > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens; this service accepts at most "
            f"{limits.max_prompt_tokens} (--max-prompt-tokens)"
        )
    options = options_from_proto(
        request.sampling,
        prompt_tokens=len(prompt_token_ids),
        max_model_len=limits.max_model_len,
        vocab_size=vocab_size,
        default_max_new_tokens=limits.default_max_new_tokens,
        min_stream_interval=limits.stream_interval,
        stream=request.stream if request.HasField("stream") else True,
    )
    most = min(MAX_COMPLETIONS, limits.max_completions)
    if options.n > most:
        raise InvalidRequest(
            f"n must be in [0, {most}] (0 and 1: one completion; at most --max-num-seqs run at once), "
            f"got {options.n}"
        )
    if options.structured is not None:
        if grammars is None:
            raise InvalidRequest("structured output is not available in this service")
        # Compiled already, as a rule: both doors await the compile (and count its cache
        # hit) before validating (admit.py). A CompilerBusy passes to the caller: retry later.
        options = replace(options, grammar=grammars.compile(options.structured, count_hit=False))
    total = len(prompt_token_ids) + options.max_new_tokens
    pool_tokens = limits.max_total_tokens
    if pool_tokens and total > pool_tokens:
        raise PoolTooSmall(
            f"prompt ({len(prompt_token_ids)}) + max_new_tokens ({options.max_new_tokens}) = {total} tokens "
            f"can never fit: the whole KV pool holds max_total_tokens={pool_tokens}; "
            "ask for fewer tokens or give the cache service more memory"
        )
    return prompt_token_ids, options


def tokenize_prompt(
    request: model_pb2.GenerateRequest, limits: GenerateLimits, tokenizer: Tokenizer,
    chat_template: ChatTemplate | None = None, add_special_tokens: bool | None = None,
) -> list[int]:
    """The prompt's token ids with the checks of its form (one form, the byte limit, roles,
    template kwargs, token ids in the vocabulary) but not of its length: POST /tokenize
    answers how long a prompt is, with max_model_len beside it."""
    prompt_token_ids = prompt_token_ids_of(request, tokenizer, chat_template, limits, add_special_tokens)
    out_of_range = [t for t in prompt_token_ids if t >= limits.vocab_size]
    if out_of_range:
        raise InvalidRequest(
            f"{len(out_of_range)} prompt token ids are >= vocab_size {limits.vocab_size} (first: {out_of_range[0]})"
        )
    return prompt_token_ids


def check_text_bytes(request: model_pb2.GenerateRequest, limits: GenerateLimits) -> None:
    """The byte cap on a text prompt, or on the messages before the template renders them
    (their text is the prompt's, and the cap is the same)."""
    if request.prompt:
        check_prompt_bytes(request.prompt, limits)
    elif request.messages:
        # The tools and the template's variables are rendered into the prompt with the
        # messages (and converted for the template beforehand): their text counts too.
        variables = request.chat_template_kwargs.ByteSize() if request.HasField("chat_template_kwargs") else 0
        check_prompt_bytes_of(sum(message_chars(message) for message in request.messages) + len(request.tools_json)
                              + variables,
                              lambda: sum(message_bytes(message) for message in request.messages)
                              + len(request.tools_json.encode()) + variables, limits,
                              "the messages' text with chat_template_kwargs is" if variables else "the messages' text is")


def check_prompt_bytes(prompt: str, limits: GenerateLimits) -> None:
    """Refuses, before tokenizing, a text prompt too long in bytes to ever fit."""
    check_prompt_bytes_of(len(prompt), lambda: len(prompt.encode()), limits, "the prompt is")


def check_prompt_bytes_of(characters: int, utf8_bytes, limits: GenerateLimits, what: str) -> None:
    """The byte cap, given a text's length in characters and a way to count its bytes."""
    max_bytes = limits.max_prompt_tokens * MAX_PROMPT_BYTES_PER_TOKEN
    # Characters first (each is at least one byte): a text far over the limit is refused
    # without even encoding it.
    prompt_bytes = characters if characters > max_bytes else utf8_bytes()
    if prompt_bytes > max_bytes:
        raise InvalidRequest(
            f"{what} at least {prompt_bytes:,} bytes; this service accepts at most {max_bytes:,} "
            f"({MAX_PROMPT_BYTES_PER_TOKEN} bytes for each of --max-prompt-tokens {limits.max_prompt_tokens}), "
            "more than could ever fit: send a shorter prompt"
        )


def prompt_token_ids_of(
    request: model_pb2.GenerateRequest, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
    limits: GenerateLimits, add_special_tokens: bool | None = None,
) -> list[int]:
    """The request's one prompt form as token ids: text (tokenized with the tokenizer's
    special tokens, BOS for Llama), ids as given, or messages rendered by the chat template
    (whose text already holds every special token the model expects: none are added).
    ``add_special_tokens`` overrides those defaults (POST /tokenize's parameter)."""
    forms = [name for name, given in (("prompt", bool(request.prompt)),
                                      ("prompt_token_ids", bool(request.prompt_token_ids)),
                                      ("messages", bool(request.messages))) if given]
    if len(forms) > 1:
        raise InvalidRequest(f"set exactly one of prompt, prompt_token_ids and messages, not {' and '.join(forms)}")
    for name, given in (("chat_template_kwargs apply", request.HasField("chat_template_kwargs")),
                        ("tools_json applies", bool(request.tools_json))):
        if given and forms != ["messages"]:
            raise InvalidRequest(f"{name} to messages only; this request sets no messages")
    check_text_bytes(request, limits)
    if request.prompt:
        prompt_token_ids = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens is not False)
    elif request.messages:
        text = render_messages(request, chat_template, limits)
        prompt_token_ids = tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
    else:
        prompt_token_ids = list(request.prompt_token_ids)
    if not prompt_token_ids:
        raise InvalidRequest(
            "the prompt is empty: set prompt (text), prompt_token_ids or messages (a non-empty conversation)"
        )
    return prompt_token_ids


def max_template_chars(limits: GenerateLimits) -> int:
    """What a chat template may build: twice the prompt's byte cap (the messages are under
    it), and room for the template's own text."""
    return 2 * limits.max_prompt_tokens * MAX_PROMPT_BYTES_PER_TOKEN + (1 << 16)


def render_messages(request: model_pb2.GenerateRequest, chat_template: ChatTemplate | None,
                    limits: GenerateLimits) -> str:
    if chat_template is None:
        raise InvalidRequest(
            "this model has no chat template, so messages cannot be rendered; send prompt or prompt_token_ids "
            "(or serve a checkpoint with a chat template: chat_template.jinja, tokenizer_config.json or GGUF metadata)"
        )
    messages = template_messages(request.messages)
    kwargs = template_kwargs(request)
    try:
        return chat_template.render(messages, add_generation_prompt=True, max_chars=max_template_chars(limits),
                                    **kwargs)
    except ChatTemplateError as error:
        raise InvalidRequest(str(error)) from None


def template_kwargs(request: model_pb2.GenerateRequest) -> dict[str, Any]:
    kwargs = {}
    if request.HasField("chat_template_kwargs"):
        kwargs = _integral_floats_as_ints(json_format.MessageToDict(request.chat_template_kwargs))
        reserved = sorted(set(kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(reserved)}: the service sets it")
    if request.tools_json:
        if "tools" in kwargs:
            raise InvalidRequest("tools are set twice, in tools_json and in chat_template_kwargs; send them in "
                                 "tools_json alone (it keeps their keys in order)")
        kwargs["tools"] = template_tools(request.tools_json)
    return kwargs


def _integral_floats_as_ints(value: Any) -> Any:
    # A Struct holds every number as a double; JSON (where these come from) has 2, not 2.0,
    # and templates compare and index with them.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    return value
