"""Per-request sampling options and the batched sampler.

`SamplingOptions.from_proto` turns a request's `SamplingParams` into validated options
(the servicer maps `InvalidRequest` to INVALID_ARGUMENT). `sample` picks one token per
row of a logits batch: greedy rows by one argmax, sampled rows by temperature, top-k and
top-p, each drawn with the row's own `torch.Generator` so that a seeded request gives the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.model.v1 import model_pb2

# Limits on stop strings: each one is searched for in every decoded delta, so their
# number and length bound the per-token cost of stop detection.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Temperatures below this sample as greedy: dividing logits by a smaller number can
# overflow float32 to inf, and softmax of inf is NaN.
GREEDY_TEMPERATURE = 1e-5


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
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_proto(
        cls,
        sampling: model_pb2.SamplingParams,
        *,
        prompt_tokens: int,
        max_model_len: int,
        vocab_size: int,
        default_max_new_tokens: int,
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
) -> torch.Tensor:
    """One token id per row. logits: [B, V] float32 → [B] int64.

    A row's draw depends only on its own logits, options and generator, never on the
    other rows: filtering is row-wise and each row draws with its own generator.
    """
    batch, vocab = logits.shape
    if len(options) != batch or len(generators) != batch:
        raise ValueError(
            f"logits has {batch} rows but got {len(options)} options and "
            f"{len(generators)} generators"
        )
    # One argmax answers every greedy row; sampled rows overwrite their entries below.
    token_ids = logits.argmax(dim=-1)  # [B]
    sampled_rows = [row for row, opts in enumerate(options) if not opts.greedy]
    if not sampled_rows:
        return token_ids

    device = logits.device
    rows = torch.tensor(sampled_rows, device=device)
    sampled = [options[row] for row in sampled_rows]
    temperature = torch.tensor(
        [opts.temperature for opts in sampled], dtype=torch.float32, device=device
    )
    scaled = logits.index_select(0, rows).float() / temperature.unsqueeze(1)  # [S, V]

    top_ks = [opts.top_k if 0 < opts.top_k < vocab else vocab for opts in sampled]
    max_k = max(top_ks)
    # Only the max_k best candidates of any row can survive; topk is sorted descending.
    if max_k < vocab:
        sorted_logits, sorted_ids = torch.topk(scaled, max_k, dim=-1)  # [S, K]
    else:
        sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True)  # [S, V]
    rank = torch.arange(sorted_logits.shape[1], device=device)  # [K]
    k = torch.tensor(top_ks, device=device).unsqueeze(1)  # [S, 1]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))

    probs = torch.softmax(sorted_logits, dim=-1)  # [S, K]
    top_p = torch.tensor([opts.top_p for opts in sampled], dtype=torch.float32, device=device)
    # Drop a candidate when the ones ranked above it already hold top_p of the mass; the
    # best candidate has nothing above it, so at least one token always survives.
    mass_above = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_above >= top_p.unsqueeze(1), 0.0)

    # Generators cannot be batched: each row draws with its own (multinomial normalises).
    choices = []
    for index, row in enumerate(sampled_rows):
        choices.append(torch.multinomial(probs[index], 1, generator=generators[row]))
    choice = torch.cat(choices)  # [S]
    token_ids[rows] = sorted_ids.gather(1, choice.unsqueeze(1)).squeeze(1)
    return token_ids
