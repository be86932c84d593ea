"""Attaching to the cache service, and giving a session back early.

attach() retries Attach until the cache service answers (or the engine stops), maps the
pool it lends, and starts what keeps the session alive: the local lease deadline and the
heartbeat. What runs on the pool (the runner, the scheduler) is the engine's to build
from the `Attachment`. A session that cannot be used is given back at once rather than
left to expire at its TTL, when the cache service can still be reached
(detach_unmapped, detach_after_failure).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog
import torch

from model_service.cache.client import CacheClient, Heartbeat, LeaseDeadline
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import KvGeometry
from pagedkv.pool_memory.populate import populate_in_background

log = structlog.get_logger()


class FatalAttachError(RuntimeError):
    """Attach was refused for a reason retrying cannot fix (geometry, auth, too little memory)."""


@dataclass(frozen=True, slots=True)
class AttachSettings:
    """What an engine asks the cache service for, the same at every (re-)attach."""

    client_name: str
    geometry: KvGeometry
    workspace_bytes: int
    max_model_len: int
    model_fingerprint: str
    served_model_name: str = ""
    # (dtype or GGUF block type, bytes) of the weights as held, for the sizing report.
    weights_bytes_by_type: tuple[tuple[str, int], ...] = ()
    # LoRA adapter slots and the bytes of those loaded (AttachRequest's, for the sizing).
    lora_slot_bytes: int = 0
    lora_resident_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Attachment:
    """A live session: its id, the sizing the cache service did, the mapped pool, and
    what keeps the session alive."""

    session_id: str
    sizing: cache_pb2.SizingReport
    kv_pool: torch.Tensor
    lease_deadline: LeaseDeadline
    heartbeat: Heartbeat
    # The cache service applies TruncateOp (AttachResponse.supports_truncate).
    supports_truncate: bool = False


def attach(cache: CacheClient, asked: AttachSettings, device: torch.device, *, stopping: threading.Event,
           on_unreachable: Callable[[], None],
           on_heartbeat_failure: Callable[[str, BaseException], None]) -> Attachment | None:
    """Attaches, retrying while the cache service is unreachable (calling on_unreachable
    before each wait); None once `stopping` is set. Raises FatalAttachError when retrying
    cannot help.

    Every try sends one attach key, new for this call: a try whose deadline passed may
    still have opened a session, and the next try then gets that session back rather
    than leaving it to expire at its TTL. A later attach() (after the session was lost)
    picks a new key, so it never gets the lost session back."""
    delay = 0.2
    attach_key = secrets.token_hex(16)
    while not stopping.is_set():
        sent_at = time.monotonic()
        try:
            reply = cache.attach(asked.client_name, asked.geometry, asked.workspace_bytes, asked.max_model_len,
                                 model_fingerprint=asked.model_fingerprint,
                                 served_model_name=asked.served_model_name, attach_key=attach_key,
                                 weights_bytes_by_type=dict(asked.weights_bytes_by_type),
                                 lora_slot_bytes=asked.lora_slot_bytes, lora_resident_bytes=asked.lora_resident_bytes)
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
    if kv_pool.device.type == "cpu":
        # The pool's pages into this process ahead of the prompts that would first touch
        # them, off the engine thread (pagedkv/pool_memory/populate.py says why).
        populate_in_background(kv_pool)
    lease_deadline = LeaseDeadline(reply.lease_ttl_ms / 1000, acked_at=sent_at)
    heartbeat = Heartbeat(cache, reply.session_id, reply.lease_ttl_ms / 3000, on_failure=on_heartbeat_failure,
                          deadline=lease_deadline).start()
    return Attachment(session_id=reply.session_id, sizing=reply.sizing, kv_pool=kv_pool,
                      lease_deadline=lease_deadline, heartbeat=heartbeat, supports_truncate=reply.supports_truncate)


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
