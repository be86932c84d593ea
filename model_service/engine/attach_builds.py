"""What runs on a pool the cache service lends: built at each Attach, dropped when it is lost."""

from __future__ import annotations

import structlog
import torch
from torch import nn

from model_service.spec.speculator import Speculator
from model_service.cache.attachment import Attachment
from model_service.engine.settings import EngineSettings
from model_service.sched.scheduler import Scheduler, SchedulerLimits
from model_service.sched.tenant_budgets import compute_budgets
from model_service.worker.decode_graphs import DecodeGraphPool
from model_service.worker.runner import ModelRunner

log = structlog.get_logger()

# With leasing ahead on, a finished sequence's release may wait this long for a lease call
# that goes out anyway (top-ups come every block_size steps or so): a release alone would
# be a call of its own, and at 48 streams one finishes nearly every other step.
RELEASE_HOLD_S = 0.1


def build_runner(model: nn.Module, attachment: Attachment, device: torch.device,
                 decode_graph_pool: DecodeGraphPool | None) -> ModelRunner:
    """The runner over the attachment's pool, with decode graphs recaptured into it (CUDA)."""
    kv_pool = attachment.kv_pool
    if kv_pool.device.type != device.type:
        kv_pool = kv_pool.to(device)  # pragma: no cover - a misconfigured deployment
    block_size = attachment.sizing.block_size
    graphs = None
    if decode_graph_pool is not None:
        graphs = decode_graph_pool.capture(kv_pool, block_size)
        log.info("decode_graphs_captured", buckets=graphs.buckets, captures=graphs.captures,
                 memory_bytes=decode_graph_pool.memory_bytes)
    return ModelRunner(model, kv_pool, block_size, graphs)


def build_scheduler(settings: EngineSettings, attachment: Attachment, eos_token_ids: frozenset[int]) -> Scheduler:
    """A scheduler for the attachment's pool: its block size and its blocks."""
    block_size = attachment.sizing.block_size
    return Scheduler(
        SchedulerLimits(block_size=block_size, max_num_seqs=settings.max_num_seqs,
                        max_batch_tokens=settings.max_batch_tokens,
                        max_prefill_tokens_while_decoding=settings.max_prefill_tokens_while_decoding,
                        prefix_hold_min_tokens=settings.prefix_hold_min_tokens,
                        lookahead_tokens=settings.lease_ahead_blocks * block_size,
                        max_model_len=settings.max_model_len,
                        release_hold_s=RELEASE_HOLD_S if settings.lease_ahead_blocks else 0.0,
                        truncate_tables=attachment.supports_truncate),
        blocks_available=attachment.sizing.num_blocks, policy=settings.scheduling_policy,
        eos_token_ids=eos_token_ids, tenant_kv_blocks=dict(settings.tenant_kv_blocks),
        tenant_budgets=compute_budgets(settings.tenant_compute_budgets),
        speculator=Speculator(settings.speculative, block_size, settings.max_model_len)
        if settings.speculative.enabled else None,
    )
