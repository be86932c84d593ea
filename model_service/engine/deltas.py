"""What a request's stream receives: `Delta`s of one completion's new tokens, text and end.

The engine queues them, holds some back (stream_interval, or no streaming) and joins
held ones in place (`join_into`); the front doors turn them into their wire messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from model_service.sample.logprobs import TokenLogprob
from model_service.sched.sequence import Finish


@dataclass(slots=True)
class Delta:
    """What a request's stream receives: new tokens and text of one completion, and at
    the end its reason."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_tiers: tuple[int, int, int] = (0, 0, 0)  # of cached_tokens: from the host, disk, remote tier
    # This completion's own, in its last delta: the most blocks (and bytes) of the pool it
    # held at once, and the tokens it computed again after preemptions.
    peak_kv_blocks: int = 0
    peak_kv_bytes: int = 0
    recomputed_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # (grpc.StatusCode, message) when the request ends with an error status.
    error: tuple[grpc.StatusCode, str] | None = None
    index: int = 0  # which of the n completions
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # the request's first delta only
    matched_stop: str | int | None = None  # last delta of a completion ended by STOP


Sink = Callable[[Delta], None]


def join_into(first: Delta, following: Delta) -> Delta:
    """Appends `following`, the next delta of the same completion, to `first` and returns
    `first`: tokens, text and logprobs in order; what only a stream's first delta carries
    (prompt logprobs) stays `first`'s, what only its last carries (finish, usage, matched
    stop, error) comes from `following`. In place, so that a completion held back whole
    (no streaming) costs time linear in its length. Neither delta may have been delivered."""
    first.token_ids.extend(following.token_ids)
    first.text += following.text
    first.logprobs.extend(following.logprobs)
    if first.prompt_logprobs is None:
        first.prompt_logprobs = following.prompt_logprobs
    first.finish = following.finish
    first.prompt_tokens = following.prompt_tokens
    first.completion_tokens = following.completion_tokens
    first.cached_tokens = following.cached_tokens
    first.cached_tokens_tiers = following.cached_tokens_tiers
    first.peak_kv_blocks = following.peak_kv_blocks
    first.peak_kv_bytes = following.peak_kv_bytes
    first.recomputed_tokens = following.recomputed_tokens
    first.spec_proposed_tokens = following.spec_proposed_tokens
    first.spec_accepted_tokens = following.spec_accepted_tokens
    first.error = following.error
    first.matched_stop = following.matched_stop
    return first
