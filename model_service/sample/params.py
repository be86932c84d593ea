"""Per-request sampling options: what a request asked for, validated, with no wire types.

`SamplingOptions` checks everything that needs nothing but the options themselves; the
front doors build them from their own messages (api/sampling_proto.py for gRPC's
SamplingParams) and add the checks that need the model (vocab size, max_model_len).
`InvalidRequest` is what both doors map to INVALID_ARGUMENT / HTTP 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Limits on stop strings: each one is searched for in every decoded delta, so their
# number and length bound the per-token cost of stop detection.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Temperatures below this sample as greedy: dividing logits by a smaller number can
# overflow float32 to inf, and softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5
# Completions of one prompt (n), alternatives per logprob (as OpenAI and vLLM), entries
# of logit_bias: each bounds per-step work or the size of a response message.
MAX_COMPLETIONS = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
MAX_PRESENCE_FREQUENCY = 2.0


class InvalidRequest(ValueError):
    """A request the service can never run as asked; the message says what to change."""


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a structured output asked for (SamplingParams.structured); compiled by sample/grammar.py."""

    kind: str  # json, json_object, regex, choice or grammar
    text: str  # the schema, regex or grammar; choices as a JSON list; "" for json_object
    any_whitespace: bool = True
    strict: bool = True  # JSON: no property or item the schema does not name


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    max_new_tokens: int
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1 disables top-p
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 is off
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, no text
    # Tokens of a completion gathered into one streamed message (its first goes at once); 1: each alone.
    stream_interval: int = 1
    # False: no streaming, each completion whole in one message when it ends (GenerateRequest.stream).
    stream: bool = True
    # False: this request never speculates (--speculative-method), whatever the server does.
    speculate: bool = True
    # SamplingParams.structured, and its xgrammar CompiledGrammar once validation compiled it.
    structured: StructuredSpec | None = None
    grammar: object = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # Checks that need nothing but the options themselves; the ones that need the
        # model (vocab size, max_model_len) live in from_proto.
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise InvalidRequest(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens}"
            )
        if math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise InvalidRequest(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}"
            )
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"seed must be in [0, 2**64), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"
            )
        for index, stop in enumerate(self.stop):
            if not stop:
                raise InvalidRequest(f"stop[{index}] is empty; stop strings must be non-empty")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(
                    f"stop[{index}] is {len(stop)} characters long; "
                    f"the limit is {MAX_STOP_STRING_CHARS}"
                )
        if self.stop and not self.detokenize:
            raise InvalidRequest(
                "stop strings are matched in the generated text, which detokenize=false turns off; "
                "drop stop (stop_token_ids still work) or leave detokenize unset"
            )
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be >= 0")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise InvalidRequest(f"stream_interval must be a positive integer, got {self.stream_interval}")
        if not 1 <= self.n <= MAX_COMPLETIONS:
            raise InvalidRequest(f"n must be in [0, {MAX_COMPLETIONS}] (0 and 1: one completion), got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}] when set, got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if math.isnan(value) or not -MAX_PRESENCE_FREQUENCY <= value <= MAX_PRESENCE_FREQUENCY:
                raise InvalidRequest(f"{name} must be in [-2, 2] (0 is off), got {value}")
        if math.isnan(self.repetition_penalty) or math.isinf(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty}"
            )
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 is off), got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequest(
                f"min_tokens must be in [0, max_new_tokens] = [0, {self.max_new_tokens}], got {self.min_tokens}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
            )
        for token_id, bias in self.logit_bias:
            if math.isnan(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias[{token_id}] must be in [-100, 100], got {bias}")
        if self.structured is not None and (self.ignore_eos or self.min_tokens):
            # The grammar decides where the output ends: it allows only EOS (or a stop id) there.
            raise InvalidRequest(f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined with "
                                 "structured output, whose end is where the grammar is complete; drop it")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a stage of logits_processing applies to this request at all."""
        return self.uses_history or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def uses_history(self) -> bool:
        """Whether a penalty needs the sequence's token counts (TokenHistory)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
