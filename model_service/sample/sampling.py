"""Per-request sampling options and the batched sampler.

`SamplingOptions.from_proto` turns a request's `SamplingParams` into validated options
(the servicer maps `InvalidRequest` to INVALID_ARGUMENT). `sample` picks one token per
row of a logits batch: first the adjustments of `logits_processing` (penalties,
logit_bias, min_tokens) when some row uses them, then greedy rows by one argmax, sampled
rows by temperature, min_p, top-k and top-p, each drawn with the row's own
`torch.Generator` so that a seeded request gives the same tokens whatever else shares
its batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from model_service.cpu_kernels import argmax as cpu_argmax
from model_service.cpu_kernels import layer_ops
from model_service.sample.logits_processing import LogitsAdjustments, TokenHistory, apply_min_p
from pagedkv.model.v1 import model_pb2

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

    @classmethod
    def from_proto(
        cls,
        sampling: model_pb2.SamplingParams,
        *,
        prompt_tokens: int,
        max_model_len: int,
        vocab_size: int,
        default_max_new_tokens: int,
        min_stream_interval: int = 1,
        stream: bool = True,
    ) -> SamplingOptions:
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
        # float32 on the wire: the float() keeps what the client sent, NaN and inf
        # included, for __post_init__ to reject.
        return cls(
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
        )


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator for one request: seeded from `seed`, or from the OS when it is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    options: Sequence[SamplingOptions],
    generators: Sequence[torch.Generator | None],
    adjustments: LogitsAdjustments | None = None,
    history: TokenHistory | None = None,
) -> torch.Tensor:
    """One token id per row. logits: [B, V], any float dtype → [B] int64. logits is not
    modified. Every stage that computes with them does so in float32 (adjustments on a
    float32 copy, sampled rows scaled into one); greedy rows need only their argmax, which
    float32 would not change.

    A row's draw depends only on its own logits, options and generator, never on the
    other rows: filtering is row-wise and each row draws with its own generator.
    `adjustments` (penalties, logit_bias, min_tokens; None when no row uses them) come
    first, reading token counts from `history`.
    """
    batch, vocab = logits.shape
    if len(options) != batch or len(generators) != batch:
        raise ValueError(
            f"logits has {batch} rows but got {len(options)} options and "
            f"{len(generators)} generators"
        )
    if adjustments is not None:
        logits = adjustments.apply(logits, history)
    sampled_rows = [row for row, opts in enumerate(options) if not opts.greedy]
    # One argmax answers every greedy row; sampled rows overwrite their entries below.
    if len(sampled_rows) < batch:
        token_ids = argmax_rows(logits)  # [B]
        if not sampled_rows:
            return token_ids
    else:
        token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)

    device = logits.device
    every_row = len(sampled_rows) == batch
    rows = torch.tensor(sampled_rows, device=device)
    sampled = [options[row] for row in sampled_rows]
    temperature = torch.tensor([o.temperature for o in sampled], dtype=torch.float32, device=device)
    chosen = logits if every_row else logits.index_select(0, rows)
    scaled = chosen.float() / temperature.unsqueeze(1)  # [S, V], a new tensor: edited in place
    if any(o.min_p > 0 for o in sampled):
        apply_min_p(scaled, torch.tensor([o.min_p for o in sampled], device=device).unsqueeze(1))

    # Every step below works row by row (elementwise, or a reduction along V) and keeps
    # vocabulary order, so a row's result does not depend on the rows beside it. Top-k
    # and top-p become thresholds (ties at a threshold are all kept).
    top_ks = [o.top_k if 0 < o.top_k < vocab else 0 for o in sampled]  # 0: no top-k
    if any(top_ks):
        best = torch.topk(scaled, max(top_ks), dim=-1).values  # [S, K], descending
        kth_index = torch.tensor([max(k - 1, 0) for k in top_ks], device=device).unsqueeze(1)
        has_top_k = torch.tensor([k > 0 for k in top_ks], device=device).unsqueeze(1)
        # The k-th best logit, or -inf (nothing below it) for rows without top-k: [S, 1]
        threshold = best.gather(1, kth_index).masked_fill_(~has_top_k, float("-inf"))
        scaled.masked_fill_(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    del scaled

    top_p_rows = [index for index, o in enumerate(sampled) if o.top_p < 1.0]
    if top_p_rows:
        all_top_p = len(top_p_rows) == len(sampled)
        top_p_index = torch.tensor(top_p_rows, device=device)
        top_p = torch.tensor([sampled[i].top_p for i in top_p_rows], device=device).unsqueeze(1)
        # After top-k, at most max(k) tokens per row have a probability above 0.
        row_ks = [top_ks[i] for i in top_p_rows]
        support = max(row_ks) if all(row_ks) else vocab
        nucleus = _nucleus_threshold(
            probs if all_top_p else probs.index_select(0, top_p_index), top_p, support
        )  # [P, 1]
        if all_top_p:
            threshold = nucleus
        else:  # 0 for rows without top-p: nothing is below it
            threshold = torch.zeros(len(sampled), 1, device=device).index_copy_(0, top_p_index, nucleus)
        probs.masked_fill_(probs < threshold, 0.0)

    # Inverse-CDF draw: one uniform from each row's own generator. (torch.multinomial
    # a row at a time cost ~20 times a whole-batch pass over the logits on CPU.)
    uniform = torch.stack([
        torch.rand((), device=device, generator=generators[row]) for row in sampled_rows
    ])  # [S]
    cdf = probs.cumsum_(dim=-1)  # [S, V]
    total = cdf[:, -1]
    # Strictly below the total, so the first cdf entry above it exists; that entry is
    # where the cdf rose, so its token has a probability > 0.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    drawn.clamp_(max=vocab - 1)  # only NaN logits could reach vocab
    if every_row:
        return drawn
    token_ids[rows] = drawn
    return token_ids


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first one on ties, as torch.argmax), int64."""
    if logits.device.type == "cpu":
        library = layer_ops.library_for(logits) if logits.dim() == 2 and logits.shape[1] else None
        if library is not None:  # in the logits' own dtype: no float32 copy (cpu_kernels/argmax.py)
            return cpu_argmax.argmax_rows(library, logits)
        # torch's CPU argmax over a [48, 32000] batch takes ~1.7 ms, numpy's ~0.2 ms on this
        # 2-core machine: the difference was 7 % of a decode step at batch 48.
        rows = logits.float().contiguous().numpy()  # numpy has no bfloat16
        return torch.from_numpy(rows.argmax(axis=-1).astype("int64", copy=False))
    return logits.argmax(dim=-1)


# The nucleus almost always lies within the best few hundred tokens; looking there first
# avoids sorting the whole vocabulary (a sort costs ~6 passes over it, topk(1024) ~2).
NUCLEUS_CANDIDATES = 1024


def _nucleus_threshold(probs: torch.Tensor, top_p: torch.Tensor, support: int) -> torch.Tensor:
    """probs [P, V], top_p [P, 1] → [P, 1]: the smallest probability in each nucleus.

    `support` bounds how many tokens of a row may have a probability above 0 (the top-k).

    The nucleus is the best tokens, in order, up to and including the first at which
    the mass of those ranked above it reaches top_p; the best token is always in it.
    """
    candidates = min(NUCLEUS_CANDIDATES, support, probs.shape[1])
    best = torch.topk(probs, candidates, dim=-1).values  # [P, C], descending
    threshold, kept = _threshold_in_sorted(best, top_p)
    if candidates < probs.shape[1]:
        # A nucleus that takes every candidate may reach past them (a flat distribution):
        # those rows sort in full.
        for index in (kept.squeeze(1) == candidates).nonzero().squeeze(1).tolist():
            if int((probs[index] > 0).sum()) <= candidates:
                continue  # the nucleus is every token left (top-k, or ties at its edge)
            row = torch.sort(probs[index], descending=True).values.unsqueeze(0)
            threshold[index] = _threshold_in_sorted(row, top_p[index : index + 1])[0][0]
    return threshold


def _threshold_in_sorted(
    sorted_probs: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """sorted_probs [P, C] descending, top_p [P, 1] → (threshold [P, 1], nucleus size [P, 1])."""
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = (mass_above < top_p).sum(dim=-1, keepdim=True)  # >= 1: the best has 0 above
    return sorted_probs.gather(1, kept - 1), kept
