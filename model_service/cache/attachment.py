"""An engine's session with the cache service: attaching, and giving a session back early.

attach() retries Attach until the cache service answers (or the engine stops), maps the
pool it lends, and builds what the session runs with: the model runner over the pool,
the scheduler sized by the reply, the local lease deadline and the heartbeat that keeps
the session alive. A session that cannot be used is given back at once rather than left
to expire at its TTL, when the cache service can still be reached
(detach_unmapped, detach_after_failure).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
import torch

from model_service.cache.client import CacheClient, Heartbeat, LeaseDeadline
from model_service.worker.decode_graphs import DecodeGraphPool
from model_service.loading.loader import LoadedModel
from model_service.worker.runner import ModelRunner
from model_service.sched.scheduler import Scheduler, SchedulerLimits
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import KvGeometry

log = structlog.get_logger()


class FatalAttachError(RuntimeError):
    """Attach was refused for a reason retrying cannot fix (geometry, auth, too little memory)."""


# With leasing ahead on, a finished sequence's release may wait this long for a lease call
# that goes out anyway (top-ups come every block_size steps or so): a release alone would
# be a call of its own, and at 48 streams one finishes nearly every other step.
RELEASE_HOLD_S = 0.1


@dataclass(frozen=True, slots=True)
class AttachSettings:
    """What an engine attaches with, the same at every (re-)attach: what it asks the
    cache service for, and how it schedules on the pool it gets."""

    client_name: str
    geometry: KvGeometry
    workspace_bytes: int
    max_model_len: int
    model_fingerprint: str
    max_num_seqs: int
    max_batch_tokens: int
    scheduling_policy: str
    # Blocks a decoding sequence is leased ahead of need (scheduler.py, top-ups).
    lease_ahead_blocks: int = 1
    served_model_name: str = ""


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    sizing: cache_pb2.SizingReport
    runner: ModelRunner
    scheduler: Scheduler
    lease_deadline: LeaseDeadline
    heartbeat: Heartbeat


def attach(cache: CacheClient, asked: AttachSettings, loaded: LoadedModel, device: torch.device,
           decode_graph_pool: DecodeGraphPool | None, *, stopping: threading.Event,
           on_unreachable: Callable[[], None],
           on_heartbeat_failure: Callable[[str, BaseException], None]) -> Session | None:
    """Attaches, retrying while the cache service is unreachable (calling on_unreachable
    before each wait); None once `stopping` is set. Raises FatalAttachError when retrying
    cannot help."""
    delay = 0.2
    while not stopping.is_set():
        sent_at = time.monotonic()
        try:
            reply = cache.attach(asked.client_name, asked.geometry, asked.workspace_bytes, asked.max_model_len,
                                 model_fingerprint=asked.model_fingerprint,
                                 served_model_name=asked.served_model_name)
            break
        except grpc.RpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise FatalAttachError(f"the cache service refused Attach: {error.code().name}: {error.details()}")
            log.warning("cache_unreachable", address=cache.address, retry_in_s=delay)
            on_unreachable()
            stopping.wait(delay)
            # At most 1 s between tries: a restarted cache service is re-attached to
            # within about a second (the channel's reconnect backoff is capped alike).
            delay = min(delay * 2, 1.0)
    else:
        return None
    try:
        kv_pool = pool_memory.map_pool(reply.pool)
    except (pool_memory.PoolMappingError, ValueError) as error:
        # Most often a new cache service whose pool lives where this process cannot see
        # it (a restarted cache container has a new /dev/shm). Give the session back now,
        # not at its TTL, then exit: a restart (compose's restart policy) sees the new pool.
        detach_unmapped(cache, reply.session_id, error)
        raise FatalAttachError(f"cannot map the cache service's KV pool: {error}") from error
    if kv_pool.device.type != device.type:
        kv_pool = kv_pool.to(device)  # pragma: no cover - a misconfigured deployment
    block_size = reply.sizing.block_size
    graphs = None
    if decode_graph_pool is not None:
        graphs = decode_graph_pool.capture(kv_pool, block_size)
        log.info("decode_graphs_captured", buckets=graphs.buckets, captures=graphs.captures,
                 memory_bytes=decode_graph_pool.memory_bytes)
    scheduler = Scheduler(
        SchedulerLimits(block_size=block_size, max_num_seqs=asked.max_num_seqs,
                        max_batch_tokens=asked.max_batch_tokens,
                        lookahead_tokens=asked.lease_ahead_blocks * block_size, max_model_len=asked.max_model_len,
                        release_hold_s=RELEASE_HOLD_S if asked.lease_ahead_blocks else 0.0),
        blocks_available=reply.sizing.num_blocks, policy=asked.scheduling_policy,
    )
    lease_deadline = LeaseDeadline(reply.lease_ttl_ms / 1000, acked_at=sent_at)
    heartbeat = Heartbeat(cache, reply.session_id, reply.lease_ttl_ms / 3000, on_failure=on_heartbeat_failure,
                          deadline=lease_deadline).start()
    return Session(session_id=reply.session_id, sizing=reply.sizing,
                   runner=ModelRunner(loaded.model, kv_pool, block_size, graphs), scheduler=scheduler,
                   lease_deadline=lease_deadline, heartbeat=heartbeat)


def detach_unmapped(cache: CacheClient, session_id: str, error: Exception) -> None:
    try:
        cache.detach(session_id)
        log.error("pool_unmappable_detached", session=session_id[:8], error=str(error))
    except grpc.RpcError as detach_error:  # the session then expires at its TTL
        log.error("pool_unmappable_detach_failed", session=session_id[:8], error=str(error),
                  code=detach_error.code().name)


def detach_after_failure(cache: CacheClient, session_id: str, cause: BaseException) -> None:
    """After a failure that was not the cache service going away (a rejected op, an
    internal error), give the old session's leases back now rather than at its TTL."""
    if isinstance(cause, grpc.RpcError) and cause.code() in (grpc.StatusCode.UNAVAILABLE,
                                                             grpc.StatusCode.DEADLINE_EXCEEDED):
        return
    try:
        reclaimed = cache.detach(session_id)
        log.info("detached_after_failure", session=session_id[:8], blocks_reclaimed=reclaimed)
    except grpc.RpcError as detach_error:  # NOT_FOUND: the service already dropped it
        log.info("detach_after_failure_failed", code=detach_error.code().name)
