"""One request's state as the engine sees it: tokens, blocks, and where it stands."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from model_service.sample.params import SamplingOptions


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    ALLOCATING = "allocating"  # an allocate op is in flight to the cache service
    RUNNING = "running"  # holds a block table; prefilling or decoding
    # Completion i > 0 of an n-request: waits for completion 0 to prefill the prompt and
    # sample its first token, then forks completion 0's blocks (a fork op in flight: FORKING).
    FORK_PENDING = "fork_pending"
    FORKING = "forking"
    FINISHED = "finished"


class Finish(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    ABORTED = "aborted"


# weakref_slot: the scheduler's per-sequence memos (sched/inflight_prefixes.py's BlockChains)
# are weak, so they end with the sequence.
@dataclass(eq=False, slots=True, weakref_slot=True)
class Sequence:
    request_id: str
    # Prompt followed by generated tokens; token_ids[:prompt_len] is the prompt.
    token_ids: list[int]
    prompt_len: int
    options: SamplingOptions
    # Order of arrival (shared by the n completions of a request): the newest running
    # sequence is the one preempted.
    arrival: int
    # Which of its request's n completions this is.
    index: int = 0
    # Lower runs first under the priority policy (GenerateRequest.priority).
    priority: int = 0
    status: Status = Status.WAITING
    # The cache service's id of this sequence's lease; None while it holds no blocks.
    lease_id: int | None = None
    block_table: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the pool (computed, or found in the prefix cache).
    num_computed: int = 0
    # Tokens of full blocks committed to the prefix cache while leased (CommitOp), or
    # found there at allocation.
    committed_tokens: int = 0
    # Prompt tokens the prefix cache supplied at first admission (usage.cached_tokens).
    cached_tokens: int = 0
    cached_tokens_tiers: tuple[int, int, int] = (0, 0, 0)  # of cached_tokens: from the host, disk, remote tier
    admitted_once: bool = False
    # The scheduler's step count when it last became RUNNING: its prompt could start then.
    ready_step: int = 0
    # Set when the cache service had no block for this sequence's next token.
    starved: bool = False
    preemptions: int = 0
    # The longest its block table has been (Usage.peak_kv_blocks); kept across preemptions.
    peak_blocks: int = 0
    # Tokens whose K/V were in the pool at some point (computed, forked or found cached):
    # computing one of them again is a recompute, after a preemption (Usage.recomputed_tokens).
    ever_computed: int = 0
    recomputed_tokens: int = 0
    finish: Finish | None = None
    # Completion 0 of an n-request: the other completions, to fork once the prompt is in
    # the pool and this sequence's first token is sampled (they sample theirs from the same row).
    fork_children: list[Sequence] = field(default_factory=list)
    # Ask the cache service for cached prefix blocks at allocation (off while prompt
    # logprobs are still to compute: a cached position has no logits).
    reuse_prefix: bool = True
    # GenerateRequest.cache_salt: only sequences of the same salt share cached blocks.
    cache_salt: str = ""
    # Whose request it is (--api-keys), by name; "": no tenant.
    tenant: str = ""
    # The LoRA adapter it runs with (model_service/lora/; only its `name` is read here, for the
    # per-adapter block counts); None: the base model.
    # Its namespace is in cache_salt already.
    lora: Any = None
    # Speculative decoding: tokens proposed and accepted so far; spec_off once acceptance stays low.
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_off: bool = False

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model: a prompt (chunk) or the last sampled token."""
        return len(self.token_ids) - self.num_computed

    def capacity(self, block_size: int) -> int:
        return len(self.block_table) * block_size

    def drop_blocks(self) -> None:
        """Forget the lease (released, or lost with the cache service); recompute from scratch."""
        self.lease_id = None
        self.block_table = []
        self.num_computed = 0
        self.committed_tokens = 0
        self.starved = False
