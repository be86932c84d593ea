"""What an engine is built with: the scheduler's limits, the session's identity, the pool's dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_service.sched.scheduler import POLICIES
from model_service.spec.settings import SpeculativeSettings

# Every decoding stream waits for a step's whole prefill chunk, and once the decode stack
# runs in C each chunk token costs a step more than the decode rows do
# (bench/engine/step_time_vs_chunk.py measures it), so a long chunk is a long gap between a
# stream's tokens. The cap holds unless more prompts wait than streams decode
# (SchedulingPolicy.prefill_capped); with that rule 64 brought the inter-token latency's tail
# and the time to first token's under vLLM's server at eight streams, where 128 left the
# first behind (docs/benchmark-log.md, "The prefill cap in a burst"). Before the decode
# stack, 512 had been chosen: a step of 32 streams was slow enough that smaller chunks cost
# c32 its lead ("the cap, quiet").
DEFAULT_PREFILL_TOKENS_WHILE_DECODING = 64
# Two blocks of 16: a prompt waits a step or so for a prefix this long rather than compute it
# again (sched/inflight_prefixes.py; bench/engine/sched_sim.py's prefix16 row in docs/benchmark-log.md).
DEFAULT_PREFIX_HOLD_MIN_TOKENS = 32


@dataclass(frozen=True, slots=True)
class EngineSettings:
    max_model_len: int
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_queued_requests: int = 256
    # Prompt tokens a step carries beside decoding sequences; 0: max_batch_tokens alone.
    max_prefill_tokens_while_decoding: int = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    # A waiting prompt sharing at least this many tokens of full blocks with a prompt being
    # computed waits for them to be committed; 0: never waits.
    prefix_hold_min_tokens: int = DEFAULT_PREFIX_HOLD_MIN_TOKENS
    client_name: str = "model_service"
    workspace_bytes: int = 0
    # LoRA adapter slots (--max-loras × the largest adapter --max-lora-rank allows) and the
    # bytes of those loaded, told to the cache service at Attach for the pool's sizing.
    lora_slot_bytes: int = 0
    lora_resident_bytes: int = 0
    # Replay decode steps from CUDA graphs captured per batch-size bucket (CUDA only).
    cuda_graphs: bool = False
    # fcfs, or priority (GenerateRequest.priority, lower first).
    scheduling_policy: str = "fcfs"
    # The checkpoint's content hash (loading/fingerprint.py): its prefix cache is its own.
    model_fingerprint: str = ""
    # The name clients call the model by (--served-model-name, else the model id): sent in
    # Attach so the cache service's logs say which model a session serves.
    served_model_name: str = ""
    # Blocks a decoding sequence is leased ahead of need, in calls that go out anyway.
    lease_ahead_blocks: int = 1
    # What the pool stores (--kv-cache-dtype); None: the compute dtype.
    kv_cache_dtype: torch.dtype | None = None
    # (tenant, blocks): each tenant's share of the pool (--api-keys kv_blocks), which the
    # scheduler makes it give up first when the pool is short.
    tenant_kv_blocks: tuple[tuple[str, int], ...] = ()
    # (tenant, max_tokens_per_s, burst_tokens) from --api-keys (sched/tenant_budgets.py).
    tenant_compute_budgets: tuple[tuple[str, int, int], ...] = ()
    # Speculative decoding (--speculative-method and its flags); off by default.
    speculative: SpeculativeSettings = SpeculativeSettings()

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_batch_tokens", "max_queued_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("lease_ahead_blocks", "max_prefill_tokens_while_decoding", "prefix_hold_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name)}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
