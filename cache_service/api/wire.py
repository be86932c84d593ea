"""The cache service's proto mappings: the wire's messages to and from core's plain records.

Only api/ imports the generated protos; core/ returns dataclasses and this module maps
them (SizingReport, the pool handle, lease ops and their outcomes, GetStats).
"""

from __future__ import annotations

from dataclasses import asdict

from cache_service.core import lease_ops
from cache_service.core.ledger import Allocation, Fork
from cache_service.core.sizing import SizingReport
from cache_service.core.stats import PoolStats
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import dtype_from_name, dtype_from_proto, dtype_name, dtype_to_proto

LEASE_STATUS = {
    "NO_FREE_BLOCKS": cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS,
    "NOT_FOUND": cache_pb2.LEASE_STATUS_NOT_FOUND,
    "PERMISSION_DENIED": cache_pb2.LEASE_STATUS_PERMISSION_DENIED,
    "INVALID_ARGUMENT": cache_pb2.LEASE_STATUS_INVALID_ARGUMENT,
    "LIMIT_EXCEEDED": cache_pb2.LEASE_STATUS_LIMIT_EXCEEDED,
}
OK = cache_pb2.LEASE_STATUS_OK


def sizing_to_proto(report: SizingReport) -> cache_pb2.SizingReport:
    values = asdict(report)
    values["dtype"] = dtype_to_proto(dtype_from_name(report.dtype))
    return cache_pb2.SizingReport(**values)


def sizing_from_proto(report: cache_pb2.SizingReport) -> SizingReport:
    values = {name: getattr(report, name) for name in SizingReport.__dataclass_fields__}
    values["dtype"] = dtype_name(dtype_from_proto(report.dtype))
    values["explanation"] = list(report.explanation)
    values["weights_bytes_by_type"] = dict(report.weights_bytes_by_type)
    return SizingReport(**values)


def pool_handle(handle: pool_memory.SharedPoolHandle | pool_memory.CudaIpcInfo) -> cache_pb2.PoolHandle:
    """AttachResponse.pool for the handle KvPool.attach returned."""
    return pool_memory.handle_to_proto(handle)


def lease_op(op: cache_pb2.LeaseOp) -> lease_ops.LeaseOp:
    """The plain record of one LeaseOp (the repeated fields are passed on, not copied)."""
    kind = op.WhichOneof("op")
    if kind == "allocate":
        return lease_ops.AllocateOp(op.allocate.num_tokens, op.allocate.prompt_token_ids, op.allocate.cache_salt,
                                   op.allocate.lora_name)
    if kind == "extend":
        return lease_ops.ExtendOp(op.extend.sequence_id, op.extend.num_tokens)
    if kind == "fork":
        return lease_ops.ForkOp(op.fork.sequence_id, op.fork.num_tokens)
    if kind == "release":
        return lease_ops.ReleaseOp(op.release.sequence_id, op.release.cache_prefix, op.release.token_ids)
    if kind == "commit":
        return lease_ops.CommitOp(op.commit.sequence_id, op.commit.token_ids)
    if kind == "truncate":
        return lease_ops.TruncateOp(op.truncate.sequence_id, op.truncate.num_tokens)
    return lease_ops.EmptyOp()


def lease_result(outcome: lease_ops.LeaseOutcome) -> cache_pb2.LeaseResult:
    kind = type(outcome)
    if kind is Allocation:
        return cache_pb2.LeaseResult(
            status=OK, sequence_id=outcome.sequence_id, block_ids=outcome.block_ids,
            cached_tokens=outcome.cached_tokens, cached_tokens_host=outcome.cached_tokens_host,
            cached_tokens_disk=outcome.cached_tokens_disk, cached_tokens_remote=outcome.cached_tokens_remote,
        )
    if kind is lease_ops.Extended:
        return cache_pb2.LeaseResult(status=OK, sequence_id=outcome.sequence_id, block_ids=outcome.block_ids)
    if kind is Fork:
        result = cache_pb2.LeaseResult(status=OK, sequence_id=outcome.sequence_id, block_ids=outcome.block_ids)
        if outcome.copy is not None:
            result.copy.src_block, result.copy.dst_block = outcome.copy
        return result
    if kind is lease_ops.Released:
        return cache_pb2.LeaseResult(status=OK, sequence_id=outcome.sequence_id,
                                     blocks_released=outcome.blocks_released)
    if kind is lease_ops.Committed:
        return cache_pb2.LeaseResult(status=OK, sequence_id=outcome.sequence_id,
                                     blocks_committed=outcome.blocks_committed)
    if kind is lease_ops.Refused:
        return cache_pb2.LeaseResult(status=LEASE_STATUS[outcome.error.code], message=str(outcome.error),
                                     sequence_id=outcome.sequence_id)
    raise TypeError(f"no LeaseResult for a {kind.__name__}")


def stats_proto(stats: PoolStats) -> cache_pb2.CacheStats:
    ledger = stats.ledger
    if ledger is None:
        return cache_pb2.CacheStats(sessions=stats.sessions)
    return cache_pb2.CacheStats(
        blocks_total=ledger.blocks_total,
        blocks_free=ledger.blocks_free,
        blocks_leased=ledger.blocks_leased,
        blocks_cached=ledger.blocks_cached,
        sessions=stats.sessions,
        sequences=ledger.sequences,
        prefix_queries=ledger.prefix_queries,
        prefix_hits=ledger.prefix_hits,
        blocks_truncated=ledger.blocks_truncated,
        bytes_reserved=stats.bytes_reserved,
        tiers=[cache_pb2.TierStats(**row) for row in stats.tiers],
        models=[cache_pb2.ModelStats(**asdict(model)) for model in stats.models],
    )
