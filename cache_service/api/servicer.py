"""CacheService over gRPC: validates, maps errors to status codes, calls KvPool, answers through wire.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc

from cache_service.api import metrics, wire
from cache_service.core.pool import GeometryMismatch, KvPool, NoPool
from cache_service.core.sessions import MAX_ATTACH_KEY_CHARS, MIN_ATTACH_KEY_CHARS, UnknownSession
from cache_service.core.sizing import SizingError
from cache_service.tiers.disk_folder import DiskFolderRefused
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.kv_geometry import KvGeometry

# One call carries at most one engine step's worth of ops; far more is a client bug.
MAX_OPS_PER_CALL = 65536
# A fingerprint is a hash: short (a salt's bound is the lease's, core/lease_ops.py).
MAX_FINGERPRINT_CHARS = 256
MAX_SERVED_MODEL_NAME_CHARS = 256
# The weights' bytes by type come from a model's few dtypes and GGUF block types; the
# report keeps them for the pool's life, so an oversized map is refused.
MAX_WEIGHT_TYPES = 32
MAX_WEIGHT_TYPE_CHARS = 32

# Most specific first: SizingError is a ValueError.
ERROR_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (UnknownSession, grpc.StatusCode.NOT_FOUND),
    (GeometryMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (NoPool, grpc.StatusCode.FAILED_PRECONDITION),
    (DiskFolderRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (SizingError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


async def abort_for(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    for error_type, code in ERROR_STATUS:
        if isinstance(error, error_type):
            await context.abort(code, str(error))
    raise error


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, pool: KvPool) -> None:
        self.pool = pool
        # Set when the server begins to stop: open holds end at once, so they never keep
        # a graceful stop waiting out its grace.
        self.stopping = asyncio.Event()

    async def Attach(self, request, context):
        try:
            if not request.HasField("geometry"):
                raise ValueError("geometry is required: num_layers, num_kv_heads, head_dim, dtype, device")
            geometry = KvGeometry.from_proto(request.geometry)
            if len(request.model_fingerprint) > MAX_FINGERPRINT_CHARS:
                raise ValueError(f"model_fingerprint is {len(request.model_fingerprint)} characters; "
                                 f"at most {MAX_FINGERPRINT_CHARS}")
            if len(request.served_model_name) > MAX_SERVED_MODEL_NAME_CHARS:
                raise ValueError(f"served_model_name is {len(request.served_model_name)} characters; "
                                 f"at most {MAX_SERVED_MODEL_NAME_CHARS}")
            key = request.attach_key
            if key and not MIN_ATTACH_KEY_CHARS <= len(key) <= MAX_ATTACH_KEY_CHARS:
                raise ValueError(f"attach_key is {len(key)} characters; use {MIN_ATTACH_KEY_CHARS} to "
                                 f"{MAX_ATTACH_KEY_CHARS} random ones (e.g. 128 random bits in hex), or none")
            weights = dict(request.weights_bytes_by_type)
            if len(weights) > MAX_WEIGHT_TYPES or any(not 0 < len(kind) <= MAX_WEIGHT_TYPE_CHARS for kind in weights):
                raise ValueError(f"weights_bytes_by_type has {len(weights)} entries; at most {MAX_WEIGHT_TYPES}, "
                                 f"each named by a dtype or block type of 1 to {MAX_WEIGHT_TYPE_CHARS} characters")
            if weights and sum(weights.values()) != request.weights_bytes:
                raise ValueError(f"weights_bytes {request.weights_bytes:,} is not the sum of weights_bytes_by_type "
                                 f"({sum(weights.values()):,})")
            attachment = self.pool.attach(
                request.client_name or "unnamed", geometry, request.workspace_bytes, request.max_model_len,
                request.model_fingerprint, request.served_model_name, key,
                weights_bytes=request.weights_bytes, weights_bytes_by_type=weights,
                lora_slot_bytes=request.lora_slot_bytes, lora_resident_bytes=request.lora_resident_bytes,
            )
        except (ValueError, GeometryMismatch) as error:
            await abort_for(context, error)
        return cache_pb2.AttachResponse(
            session_id=attachment.session.session_id,
            lease_ttl_ms=self.pool.settings.lease_ttl_ms,
            sizing=wire.sizing_to_proto(attachment.sizing),
            pool=wire.pool_handle(attachment.handle),
            supports_truncate=True,
        )

    async def Heartbeat(self, request, context):
        try:
            self.pool.heartbeat(request.session_id)
        except UnknownSession as error:
            await abort_for(context, error)
        return cache_pb2.HeartbeatResponse(lease_ttl_ms=self.pool.settings.lease_ttl_ms)

    async def HoldSession(self, request, context):
        try:
            session = self.pool.heartbeat(request.session_id)
        except UnknownSession as error:
            await abort_for(context, error)
        yield cache_pb2.HoldSessionResponse(lease_ttl_ms=self.pool.settings.lease_ttl_ms)
        ended, stopping = (asyncio.ensure_future(event.wait()) for event in (session.ended, self.stopping))
        try:
            await asyncio.wait((ended, stopping), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The holder's connection closed (or it cancelled the call): it sends no
            # heartbeat again, so its session ends now rather than at its TTL.
            metrics.SESSIONS_EXPIRED.inc(self.pool.reclaims.holder_gone(session))
            raise
        finally:
            ended.cancel()
            stopping.cancel()
        if session.ended_by == "expired":
            await context.abort(grpc.StatusCode.NOT_FOUND, "the session expired (it missed its heartbeats for the "
                                                           "lease TTL, or its hold's connection closed); Attach again")
        if not session.ended_by:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the cache service is stopping")

    async def Detach(self, request, context):
        try:
            released = await self.pool.reclaims.detach(request.session_id)
        except UnknownSession as error:
            await abort_for(context, error)
        return cache_pb2.DetachResponse(blocks_reclaimed=released)

    async def Lease(self, request, context):
        started = time.perf_counter()
        try:
            # A lease call is proof of life too.
            session = self.pool.heartbeat(request.session_id)
            self.pool.require_pool()
            if len(request.ops) > MAX_OPS_PER_CALL:
                raise ValueError(f"{len(request.ops)} ops in one Lease call; at most {MAX_OPS_PER_CALL}")
        except (UnknownSession, NoPool, ValueError) as error:
            await abort_for(context, error)
        try:  # the session may end while the disk blocks its allocations promote are read
            outcomes, blocks_available = await self.pool.lease(session, [wire.lease_op(op) for op in request.ops])
        except UnknownSession as error:
            await abort_for(context, error)
        results = [wire.lease_result(outcome) for outcome in outcomes]
        count_ops(request.ops, results)
        metrics.LEASE_CALL_SECONDS.observe(time.perf_counter() - started)
        return cache_pb2.LeaseResponse(results=results, blocks_available=blocks_available)

    async def ResetPrefixCache(self, request, context):
        try:
            session = self.pool.heartbeat(request.session_id)
            dropped, kept = self.pool.reset_prefix_cache(session, request.all_models)
        except (UnknownSession, NoPool) as error:
            await abort_for(context, error)
        return cache_pb2.ResetPrefixCacheResponse(blocks_dropped=dropped, blocks_kept=kept)

    async def GetSizing(self, request, context):
        try:
            _, sizing = self.pool.require_pool()
        except NoPool as error:
            await abort_for(context, error)
        return wire.sizing_to_proto(sizing)

    async def GetStats(self, request, context):
        self.pool.check_invariants("get_stats")  # a test's last look at the pool checks it too
        return wire.stats_proto(self.pool.stats())


def count_ops(ops, results) -> None:
    # One metric update per kind of op and result, not per op: label lookups cost more
    # than the ledger's work on a block.
    tally = Counter((op.WhichOneof("op") or "empty", result.status) for op, result in zip(ops, results))
    for (kind, status), count in tally.items():
        metrics.LEASE_OPS.labels(kind, cache_pb2.LeaseStatus.Name(status)).inc(count)
