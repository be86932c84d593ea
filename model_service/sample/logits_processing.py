"""Logits processing before temperature: penalties, logit_bias and min_tokens.

The sampler runs these stages on the device, for every row of a step in one pass each,
with per-row parameters as tensors; rows that use none of them are left out, and a step
where no row uses any builds nothing (`prepare` returns None). The stages, in order, as
transformers and vLLM apply them:

1. repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, over prompt and
   generated tokens): a seen token's logit is divided by the penalty when positive and
   multiplied by it when negative;
2. presence and frequency penalties (OpenAI's definitions, over generated tokens):
   logit -= frequency * count + presence * (count > 0);
3. logit_bias: added to the named tokens' logits;
4. min_tokens: EOS and stop token ids get -inf until that many tokens are generated.

Temperature, min_p, top-k and top-p follow in `sampling.sample`.

Token counts are kept incrementally in `TokenHistory`, one row of the vocabulary per
sequence that uses a penalty, updated once per step for all of them with one scatter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from model_service.device_copies import to_device


# Each stage below is a few whole-width passes over [R, V], done in place: at a large batch
# and vocabulary every pass reads and writes the whole tensor, so the pass count is the cost.


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits [R, V], seen [R, V] bool, penalty [R, 1] (1 is off) → logits, edited in place."""
    factor = torch.where(logits < 0, penalty, penalty.reciprocal())  # [R, V]
    factor.masked_fill_(~seen, 1.0)
    return logits.mul_(factor)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """logits [R, V], counts [R, V] float32 (generated tokens), presence/frequency [R, 1]
    → logits, edited in place."""
    logits.addcmul_(counts, frequency.neg())
    return logits.addcmul_(counts.clamp(max=1.0), presence.neg())


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """Adds bias[j] to logits[rows[j], token_ids[j]], in place; returns logits."""
    return logits.index_put_((rows, token_ids), bias, accumulate=True)


def suppress_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Sets logits[rows[j], token_ids[j]] to -inf, in place (min_tokens); returns logits."""
    return logits.index_put_((rows, token_ids), torch.full((), float("-inf"), device=logits.device))


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scaled [R, V] (after temperature), min_p [R, 1] (0 is off) → [R, V], in place.

    As transformers' MinPLogitsWarper: tokens whose probability is below min_p times the
    best token's get -inf.
    """
    probs = torch.softmax(scaled, dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill_(probs < threshold, float("-inf"))


class TokenHistory:
    """Per sequence: counts of its generated tokens and a mask of every token it has seen
    (prompt and generated), one row a sequence, on the device. Grows by doubling."""

    def __init__(self, vocab_size: int, device: torch.device | str, rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.float32, device=self.device)
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=self.device)
        self._free = list(range(rows - 1, -1, -1))

    def open(self, prompt_token_ids: Sequence[int]) -> int:
        """A row for a new sequence, its prompt marked as seen; returns the row's slot."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        if prompt_token_ids:
            self.seen[slot, to_device(list(prompt_token_ids), torch.int64, self.device)] = True
        return slot

    def copy(self, source: int) -> int:
        """A row for a sequence that continues from another one's history (a fork)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot] = self.counts[source]
        self.seen[slot] = self.seen[source]
        return slot

    def close(self, slot: int) -> None:
        self._free.append(slot)

    def record(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """Adds one generated token to each slot's row: one scatter for the whole step."""
        if not slots:
            return
        rows = to_device(list(slots), torch.int64, self.device)
        tokens = to_device(list(token_ids), torch.int64, self.device)
        self.counts.index_put_((rows, tokens), torch.ones(len(slots), device=self.device), accumulate=True)
        self.seen[rows, tokens] = True

    @property
    def open_rows(self) -> int:
        return self.counts.shape[0] - len(self._free)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self._free = list(range(2 * old - 1, old - 1, -1))


@dataclass(frozen=True, slots=True)
class RowAdjustment:
    """What one row of a step needs before temperature; built by the engine per row."""

    history_slot: int | None = None  # the row's TokenHistory slot, when it uses a penalty
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    suppressed_token_ids: tuple[int, ...] = ()  # min_tokens not yet reached: EOS and stop ids

    @property
    def active(self) -> bool:
        return self.history_slot is not None or bool(self.logit_bias or self.suppressed_token_ids)


@dataclass(frozen=True, slots=True)
class LogitsAdjustments:
    """One step's per-row parameters for the stages above, as device tensors."""

    # Rows that use a penalty, their history slots and parameters: [H], [H], [H, 1] each.
    penalty_rows: torch.Tensor | None
    history_slots: torch.Tensor | None
    repetition: torch.Tensor | None
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    uses_repetition: bool
    uses_presence_frequency: bool
    every_row: bool  # every row of the batch uses a penalty: no gather and scatter of rows
    # Flattened (row, token, value) triples.
    bias_rows: torch.Tensor | None
    bias_token_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    suppress_rows: torch.Tensor | None
    suppress_token_ids: torch.Tensor | None

    def apply(self, logits: torch.Tensor, history: TokenHistory | None) -> torch.Tensor:
        """logits [B, V] → a new float32 tensor [B, V] with every stage applied."""
        adjusted = logits.float().clone()
        if self.penalty_rows is not None:
            rows = self.penalty_rows
            chosen = adjusted if self.every_row else adjusted.index_select(0, rows)  # [H, V]
            if self.uses_repetition:
                seen = history.seen.index_select(0, self.history_slots)
                apply_repetition_penalty(chosen, seen, self.repetition)
            if self.uses_presence_frequency:
                counts = history.counts.index_select(0, self.history_slots)
                apply_presence_frequency(chosen, counts, self.presence, self.frequency)
            if not self.every_row:
                adjusted.index_copy_(0, rows, chosen)
        if self.bias_rows is not None:
            apply_logit_bias(adjusted, self.bias_rows, self.bias_token_ids, self.bias_values)
        if self.suppress_rows is not None:
            suppress_tokens(adjusted, self.suppress_rows, self.suppress_token_ids)
        return adjusted


def prepare(rows: Iterable[RowAdjustment | None], device: torch.device | str) -> LogitsAdjustments | None:
    """This step's adjustments, or None when no row needs any (the batch then pays nothing)."""
    rows = list(rows)
    penalty_rows: list[int] = []
    slots: list[int] = []
    repetition: list[float] = []
    presence: list[float] = []
    frequency: list[float] = []
    bias: list[tuple[int, int, float]] = []
    suppress: list[tuple[int, int]] = []
    for row, adjustment in enumerate(rows):
        if adjustment is None or not adjustment.active:
            continue
        if adjustment.history_slot is not None:
            penalty_rows.append(row)
            slots.append(adjustment.history_slot)
            repetition.append(adjustment.repetition_penalty)
            presence.append(adjustment.presence_penalty)
            frequency.append(adjustment.frequency_penalty)
        bias.extend((row, token_id, value) for token_id, value in adjustment.logit_bias)
        suppress.extend((row, token_id) for token_id in adjustment.suppressed_token_ids)
    if not (penalty_rows or bias or suppress):
        return None

    def column(values: list[float]) -> torch.Tensor:
        return to_device(values, torch.float32, device).unsqueeze(1)

    def indices(values) -> torch.Tensor:
        return to_device(list(values), torch.int64, device)

    return LogitsAdjustments(
        penalty_rows=indices(penalty_rows) if penalty_rows else None,
        history_slots=indices(slots) if penalty_rows else None,
        repetition=column(repetition) if penalty_rows else None,
        presence=column(presence) if penalty_rows else None,
        frequency=column(frequency) if penalty_rows else None,
        uses_repetition=any(value != 1.0 for value in repetition),
        uses_presence_frequency=any(presence) or any(frequency),
        every_row=len(penalty_rows) == len(rows),
        bias_rows=indices(r for r, _, _ in bias) if bias else None,
        bias_token_ids=indices(t for _, t, _ in bias) if bias else None,
        bias_values=to_device([v for _, _, v in bias], torch.float32, device) if bias else None,
        suppress_rows=indices(r for r, _ in suppress) if suppress else None,
        suppress_token_ids=indices(t for _, t in suppress) if suppress else None,
    )
