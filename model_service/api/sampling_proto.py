"""gRPC's SamplingParams -> SamplingOptions, with the checks that need the model.

The one mapping from the wire's sampling message; the OpenAI API builds a
GenerateRequest (openai_http/to_generate.py) and comes through here too.
"""

from __future__ import annotations

import json

from model_service.sample.grammar import MAX_CHOICES, MAX_STRUCTURED_CHARS
from model_service.sample.params import InvalidRequest, SamplingOptions, StructuredSpec
from pagedkv.model.v1 import model_pb2

# The engine suppresses a request's stop ids while it is under min_tokens, on every step:
# that costs a row time in proportion to its stop ids, and the whole vocabulary as stop ids
# would cost more than a whole decode step.
MAX_STOP_TOKEN_IDS = 1024


def options_from_proto(
    sampling: model_pb2.SamplingParams,
    *,
    prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    default_max_new_tokens: int,
    min_stream_interval: int = 1,
    stream: bool = True,
) -> SamplingOptions:
    """A request's SamplingParams as validated options; raises InvalidRequest with what to change."""
    room = max_model_len - prompt_tokens
    if sampling.HasField("max_new_tokens"):
        max_new_tokens = sampling.max_new_tokens
        if max_new_tokens <= 0:
            raise InvalidRequest(
                f"max_new_tokens must be > 0 when set (leave it unset for the "
                f"default), got {max_new_tokens}"
            )
    else:
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {prompt_tokens} tokens, which leaves no room to "
                f"generate within max_model_len={max_model_len}; shorten the prompt"
            )
        max_new_tokens = min(default_max_new_tokens, room)
    if prompt_tokens + max_new_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt_tokens ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) = "
            f"{prompt_tokens + max_new_tokens} exceeds max_model_len={max_model_len}; "
            f"ask for at most {max(room, 0)} new tokens or shorten the prompt"
        )
    if sampling.top_k > vocab_size:
        raise InvalidRequest(
            f"top_k must be <= vocab_size ({vocab_size}), got {sampling.top_k}"
        )
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"{len(sampling.stop_token_ids):,} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} stop_token_ids "
            "per request (each is checked on every step it runs)"
        )
    too_large = sorted(t for t in sampling.stop_token_ids if t >= vocab_size)
    if too_large:
        raise InvalidRequest(
            f"stop_token_ids must be < vocab_size ({vocab_size}), got {too_large[:8]}"
        )
    bias_too_large = sorted(t for t in sampling.logit_bias if t >= vocab_size)
    if bias_too_large:
        raise InvalidRequest(
            f"logit_bias token ids must be < vocab_size ({vocab_size}), got {bias_too_large[:8]}"
        )
    structured = structured_from_proto(sampling.structured) if sampling.HasField("structured") else None
    # float32 on the wire: the float() keeps what the client sent, NaN and inf
    # included, for __post_init__ to reject.
    return SamplingOptions(
        max_new_tokens=max_new_tokens,
        temperature=float(sampling.temperature),
        top_k=sampling.top_k,
        top_p=float(sampling.top_p) if sampling.HasField("top_p") else 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        stop_token_ids=frozenset(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        n=max(sampling.n, 1),
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        presence_penalty=float(sampling.presence_penalty),
        frequency_penalty=float(sampling.frequency_penalty),
        repetition_penalty=(float(sampling.repetition_penalty)
                            if sampling.HasField("repetition_penalty") else 1.0),
        min_p=float(sampling.min_p),
        min_tokens=sampling.min_tokens,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in sampling.logit_bias.items())),
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        skip_special_tokens=(sampling.skip_special_tokens
                             if sampling.HasField("skip_special_tokens") else True),
        detokenize=sampling.detokenize if sampling.HasField("detokenize") else True,
        stream_interval=max(sampling.stream_interval, min_stream_interval),  # 0: the service's
        stream=stream,
        structured=structured,
        speculate=sampling.speculate if sampling.HasField("speculate") else True,
    )


def structured_from_proto(structured: model_pb2.StructuredOutputs) -> StructuredSpec:
    """Exactly one kind set, within the size limits; whether it compiles is validation's to ask."""
    given = [kind for kind, is_set in (
        ("json", bool(structured.json)), ("json_object", structured.json_object),
        ("regex", bool(structured.regex)), ("choice", bool(structured.choice)),
        ("grammar", bool(structured.grammar))) if is_set]
    if len(given) != 1:
        raise InvalidRequest(
            "structured must set exactly one of json, json_object, regex, choice and grammar, "
            + (f"not {' and '.join(given)}" if given else "and sets none"))
    kind = given[0]
    if kind == "choice":
        if len(structured.choice) > MAX_CHOICES:
            raise InvalidRequest(f"structured.choice has {len(structured.choice)} entries; at most {MAX_CHOICES}")
        if any(not choice for choice in structured.choice):
            raise InvalidRequest("structured.choice has an empty string; every choice must be non-empty")
        text = json.dumps(list(structured.choice), ensure_ascii=False)
    else:
        text = "" if kind == "json_object" else getattr(structured, kind)
    if len(text) > MAX_STRUCTURED_CHARS:
        raise InvalidRequest(f"structured.{kind} is {len(text):,} characters; at most {MAX_STRUCTURED_CHARS:,}")
    strict = (structured.disable_additional_properties
              if structured.HasField("disable_additional_properties") else True)
    return StructuredSpec(kind=kind, text=text, any_whitespace=not structured.disable_any_whitespace, strict=strict)
