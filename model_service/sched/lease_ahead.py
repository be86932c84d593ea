"""Fewer lease calls: blocks leased ahead of need, and releases that wait for a call.

Pure Python, like the scheduler that uses it. A lease call costs the engine more than its
wait: the cache service's and the gRPC threads' work takes a core from the engine's
OpenMP team while the forward pass runs, and a step with a call in flight measured
markedly slower than one without (docs/benchmark-log.md, "Fewer lease calls"). At 48 streams and 16-token
blocks some stream crosses a block boundary nearly every step, and one finishes nearly
every other step; so a call that goes out anyway also

- tops up each decoding sequence to `lookahead_tokens` past its next token (`top_ups`),
  so the next call is due when the first of them runs out, about every block_size steps;
- carries the releases that waited for it (`PendingReleases`): a sequence that finished
  normally may wait up to `hold_s` for such a call; a cancel, an abort or a preemption
  never waits, nor does anything while a sequence waits for blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from model_service.sched.lease_ops import Release, blocks_for
from model_service.sched.sequence import Sequence


def top_ups(batch: list[tuple[Sequence, int]], extends: list[tuple[Sequence, int]], available: int,
            block_size: int, lookahead_tokens: int, max_model_len: int) -> list[tuple[Sequence, int]]:
    """(sequence, tokens to hold) for each decoding sequence of `batch` short of
    `lookahead_tokens` past its next token, never past the most it can grow to, and all
    of them together at most half of the `available` blocks (what this call's needed ops
    leave). `extends`: this call's needed extends, which the top-ups go beyond."""
    held = {id(seq): blocks_for(tokens, block_size) for seq, tokens in extends}
    spare = available // 2
    asked: list[tuple[Sequence, int]] = []
    for seq, new_tokens in batch:
        if spare <= 0:
            break
        if new_tokens != 1:
            continue  # a prefill chunk: its table covers the prompt already
        target = ahead_target(seq, lookahead_tokens, max_model_len)
        have = held.get(id(seq), len(seq.block_table))
        more = min(blocks_for(target, block_size) - have, spare)
        if more > 0:
            spare -= more
            asked.append((seq, min(target, (have + more) * block_size)))
    return asked


def ahead_target(seq: Sequence, lookahead_tokens: int, max_model_len: int) -> int:
    """The tokens a decoding sequence's table holds once topped up: `lookahead_tokens`
    past the position the step after this one writes (num_computed + 1), never past the
    most it can grow to."""
    return min(seq.num_computed + 2 + lookahead_tokens, longest(seq, max_model_len))


def longest(seq: Sequence, max_model_len: int) -> int:
    """The most tokens a sequence can hold: its prompt and every token it may still
    sample, within max_model_len (0: no limit)."""
    most = seq.prompt_len + seq.options.max_new_tokens if seq.options is not None else len(seq.token_ids) + 1
    return min(most, max_model_len) if max_model_len else most


class PendingReleases:
    """Releases queued for the next lease call that goes out, and whether they may wait."""

    def __init__(self, hold_s: float, clock: Callable[[], float]) -> None:
        self._hold_s = hold_s
        self._clock = clock
        self._releases: list[Release] = []
        self._since = 0.0  # when the oldest was queued
        self._urgent = False  # one of them frees blocks someone is short of, or was promised at once

    def __bool__(self) -> bool:
        return bool(self._releases)

    def add(self, release: Release, urgent: bool) -> None:
        if not self._releases:
            self._since = self._clock()
        self._releases.append(release)
        self._urgent = self._urgent or urgent

    def blocks(self) -> int:
        """An estimate of what they free: shared blocks free nothing."""
        return sum(release.num_blocks for release in self._releases)

    def may_wait(self, others_run: bool, someone_waits: bool) -> bool:
        """For a call that would carry nothing else: wait while others run (a call will go
        out soon), nobody waits for blocks, none is urgent and the oldest is within hold_s."""
        return (others_run and not someone_waits and not self._urgent
                and self._clock() - self._since < self._hold_s)

    def take(self) -> list[Release]:
        releases, self._releases, self._urgent = self._releases, [], False
        return releases
