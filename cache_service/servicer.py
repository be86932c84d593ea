"""CacheService over gRPC: validates, maps errors to status codes, calls KvPool/Ledger."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import structlog

from cache_service import metrics
from cache_service.ledger import InvalidLease, Ledger, LeaseError
from cache_service.pool import GeometryMismatch, KvPool, NoPool
from cache_service.sessions import MAX_ATTACH_KEY_CHARS, MIN_ATTACH_KEY_CHARS, UnknownSession
from cache_service.sizing import SizingError
from cache_service.tiers.disk_folder import DiskFolderRefused
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.kv_geometry import KvGeometry

log = structlog.get_logger()

# One call carries at most one engine step's worth of ops; far more is a client bug.
MAX_OPS_PER_CALL = 65536
# A fingerprint is a hash and a salt a tenant key: both short. Each live sequence keeps its salt.
MAX_FINGERPRINT_CHARS = 256
MAX_SERVED_MODEL_NAME_CHARS = 256
MAX_SALT_CHARS = 256
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

LEASE_STATUS = {
    "NO_FREE_BLOCKS": cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS,
    "NOT_FOUND": cache_pb2.LEASE_STATUS_NOT_FOUND,
    "PERMISSION_DENIED": cache_pb2.LEASE_STATUS_PERMISSION_DENIED,
    "INVALID_ARGUMENT": cache_pb2.LEASE_STATUS_INVALID_ARGUMENT,
    "LIMIT_EXCEEDED": cache_pb2.LEASE_STATUS_LIMIT_EXCEEDED,
}


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
        self._reclaims: set[asyncio.Task] = set()  # a task the loop holds only weakly could be collected

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
            )
        except (ValueError, GeometryMismatch) as error:
            await abort_for(context, error)
        return cache_pb2.AttachResponse(
            session_id=attachment.session.session_id,
            lease_ttl_ms=self.pool.settings.lease_ttl_ms,
            sizing=attachment.sizing.to_proto(),
            pool=attachment.handle,
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
            self.holder_gone(session)
            raise
        finally:
            ended.cancel()
            stopping.cancel()
        if session.ended_by == "expired":
            await context.abort(grpc.StatusCode.NOT_FOUND, "the session expired (it missed its heartbeats for the "
                                                           "lease TTL, or its hold's connection closed); Attach again")
        if not session.ended_by:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the cache service is stopping")

    def holder_gone(self, session) -> None:
        """Ends a session whose hold's connection closed, as a TTL expiry does (its leases
        wait out the reclaim grace), without waiting for the TTL."""
        if self.pool.sessions.lapse(session.session_id) is None:
            return  # it ended already (detached or expired)
        log.warning("session_holder_gone", session=session.owner, client=session.client_name,
                    reclaim_in_ms=self.pool.settings.reclaim_grace_ms)
        metrics.SESSIONS_EXPIRED.inc(self.pool.expire_sessions())
        # The reaper looks only every quarter TTL: this reclaim runs when the grace ends.
        task = asyncio.get_running_loop().create_task(self._reclaim_after(self.pool.settings.reclaim_grace_ms / 1000))
        self._reclaims.add(task)
        task.add_done_callback(self._reclaims.discard)

    async def _reclaim_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.pool.reclaim_expired()

    async def Detach(self, request, context):
        try:
            released = await self.pool.detach(request.session_id)
        except UnknownSession as error:
            await abort_for(context, error)
        return cache_pb2.DetachResponse(blocks_reclaimed=released)

    async def Lease(self, request, context):
        started = time.perf_counter()
        try:
            # A lease call is proof of life too.
            session = self.pool.heartbeat(request.session_id)
            ledger, _ = self.pool.require_pool()
            if len(request.ops) > MAX_OPS_PER_CALL:
                raise ValueError(f"{len(request.ops)} ops in one Lease call; at most {MAX_OPS_PER_CALL}")
        except (UnknownSession, NoPool, ValueError) as error:
            await abort_for(context, error)
        prompts = [(op.allocate.prompt_token_ids, (session.model_fingerprint, op.allocate.cache_salt))
                   for op in request.ops if op.WhichOneof("op") == "allocate"]
        blocks = await self.pool.read_ahead(prompts)
        if blocks:
            try:  # the session may have ended while the disk was read
                self.pool.heartbeat(request.session_id)
            except UnknownSession as error:
                await abort_for(context, error)
        with self.pool.reading_ahead(blocks):
            results = [apply_op(ledger, session.owner, op, session.model_fingerprint) for op in request.ops]
        count_ops(request.ops, results)
        self.pool.publish_kv_events()  # one batch per call at most
        self.pool.check_invariants("lease")
        metrics.LEASE_CALL_SECONDS.observe(time.perf_counter() - started)
        return cache_pb2.LeaseResponse(results=results, blocks_available=ledger.blocks_available())

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
        return sizing.to_proto()

    async def GetStats(self, request, context):
        self.pool.check_invariants("get_stats")  # a test's last look at the pool checks it too
        return stats_proto(self.pool)


def apply_op(ledger: Ledger, owner: str, op: cache_pb2.LeaseOp, model_fingerprint: str = "") -> cache_pb2.LeaseResult:
    """Applies one op of ``owner``'s (a session serving ``model_fingerprint``); a failure
    becomes this op's result and touches nothing else."""
    kind = op.WhichOneof("op")
    try:
        if kind == "allocate":
            salt = op.allocate.cache_salt
            if len(salt) > MAX_SALT_CHARS:
                raise InvalidLease(f"cache_salt is {len(salt)} characters; at most {MAX_SALT_CHARS}")
            allocation = ledger.allocate(owner, op.allocate.num_tokens, op.allocate.prompt_token_ids,
                                         (model_fingerprint, salt))
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_OK, sequence_id=allocation.sequence_id,
                block_ids=allocation.block_ids, cached_tokens=allocation.cached_tokens,
                cached_tokens_host=allocation.cached_tokens_host, cached_tokens_disk=allocation.cached_tokens_disk,
            )
        elif kind == "extend":
            appended = ledger.extend(owner, op.extend.sequence_id, op.extend.num_tokens)
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_OK, sequence_id=op.extend.sequence_id, block_ids=appended
            )
        elif kind == "fork":
            fork = ledger.fork(owner, op.fork.sequence_id, op.fork.num_tokens)
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_OK, sequence_id=fork.sequence_id, block_ids=fork.block_ids
            )
            if fork.copy is not None:
                result.copy.src_block, result.copy.dst_block = fork.copy
        elif kind == "release":
            released = ledger.release(
                owner, op.release.sequence_id, op.release.cache_prefix, op.release.token_ids
            )
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_OK, sequence_id=op.release.sequence_id, blocks_released=released
            )
        elif kind == "commit":
            committed = ledger.commit(owner, op.commit.sequence_id, op.commit.token_ids)
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_OK, sequence_id=op.commit.sequence_id, blocks_committed=committed
            )
        else:
            result = cache_pb2.LeaseResult(
                status=cache_pb2.LEASE_STATUS_INVALID_ARGUMENT,
                message="empty lease op: set one of allocate, extend, fork, release, commit",
            )
    except LeaseError as error:
        result = cache_pb2.LeaseResult(status=LEASE_STATUS[error.code], message=str(error))
        if kind in ("extend", "fork", "release", "commit"):
            result.sequence_id = getattr(op, kind).sequence_id
    return result


def count_ops(ops, results) -> None:
    # One metric update per kind of op and result, not per op: label lookups cost more
    # than the ledger's work on a block.
    tally = Counter((op.WhichOneof("op") or "empty", result.status) for op, result in zip(ops, results))
    for (kind, status), count in tally.items():
        metrics.LEASE_OPS.labels(kind, cache_pb2.LeaseStatus.Name(status)).inc(count)


def stats_proto(pool: KvPool) -> cache_pb2.CacheStats:
    if pool.ledger is None:
        return cache_pb2.CacheStats(sessions=len(pool.sessions))
    stats = pool.ledger.stats()
    return cache_pb2.CacheStats(
        blocks_total=stats.blocks_total,
        blocks_free=stats.blocks_free,
        blocks_leased=stats.blocks_leased,
        blocks_cached=stats.blocks_cached,
        sessions=len(pool.sessions),
        sequences=stats.sequences,
        prefix_queries=stats.prefix_queries,
        prefix_hits=stats.prefix_hits,
        bytes_reserved=pool.sizing.pool_bytes,
        tiers=[cache_pb2.TierStats(**values) for values in tier_stats(pool)],
        models=model_stats(pool),
    )


def model_stats(pool: KvPool) -> list[cache_pb2.ModelStats]:
    """One ModelStats per model fingerprint that has attached: its live sessions (and their
    served names) from the sessions, what its sequences hold and asked from the ledger."""
    sessions: dict[str, list[str]] = {}
    for session in pool.sessions:
        sessions.setdefault(session.model_fingerprint, []).append(session.served_model_name)
    usage = pool.ledger.model_usage()
    out = []
    for fingerprint in sorted(set(sessions) | set(usage)):
        names = sessions.get(fingerprint, [])
        model = usage.get(fingerprint)
        out.append(cache_pb2.ModelStats(
            model_fingerprint=fingerprint, served_model_names=sorted({name for name in names if name}),
            sessions=len(names), sequences=model.sequences if model else 0,
            blocks_leased=model.blocks_leased if model else 0, prefix_queries=model.prefix_queries if model else 0,
            prefix_hits=model.prefix_hits if model else 0,
        ))
    return out


def tier_stats(pool: KvPool) -> list[dict]:
    """Each configured tier's TierStats fields (GetStats and /metrics read the same)."""
    tiers = pool.tiers
    if tiers is None:
        return []
    out = []
    for tier, configured in (("host", tiers.host is not None), ("disk", tiers.disk is not None)):
        if not configured:
            continue
        counters = tiers.counters[tier]
        total = tiers.blocks_total(tier)
        cached = tiers.index.count(tier)
        out.append(dict(
            tier=tier, blocks_total=total, blocks_cached=cached, blocks_free=max(total - cached, 0),
            hit_tokens=counters.hit_tokens, demotions=counters.demotions, promotions=counters.promotions,
            bytes_in=counters.bytes_in, bytes_out=counters.bytes_out, seconds_in=counters.seconds_in,
            seconds_out=counters.seconds_out, evictions=counters.evictions, errors=counters.errors,
            bytes_used=tiers.disk.used_bytes if tier == "disk" else cached * tiers.bytes_per_block,
            blocks_queued=tiers.blocks_queued(tier),
        ))
    return out
