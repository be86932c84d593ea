"""Small helpers for tests that talk to a cache service over a real channel."""

from __future__ import annotations

import time

import grpc

from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc

TINY_GEOMETRY = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype=cache_pb2.DTYPE_FLOAT32, device="cpu")


def cache_stub(address: str) -> cache_pb2_grpc.CacheServiceStub:
    return cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(address))


def attach(stub, name: str = "test", metadata=(), max_model_len: int = 64, model_fingerprint: str = "",
           served_model_name: str = "", **geometry) -> cache_pb2.AttachResponse:
    request = cache_pb2.AttachRequest(
        client_name=name,
        geometry=cache_pb2.Geometry(**{**TINY_GEOMETRY, **geometry}),
        max_model_len=max_model_len,
        model_fingerprint=model_fingerprint,
        served_model_name=served_model_name,
    )
    return stub.Attach(request, timeout=10, metadata=metadata)


def allocate(num_tokens: int, prompt=()) -> cache_pb2.LeaseOp:
    return cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=num_tokens, prompt_token_ids=prompt))


def extend(sequence_id: int, num_tokens: int) -> cache_pb2.LeaseOp:
    return cache_pb2.LeaseOp(extend=cache_pb2.ExtendOp(sequence_id=sequence_id, num_tokens=num_tokens))


def truncate(sequence_id: int, num_tokens: int) -> cache_pb2.LeaseOp:
    return cache_pb2.LeaseOp(truncate=cache_pb2.TruncateOp(sequence_id=sequence_id, num_tokens=num_tokens))


def fork(sequence_id: int) -> cache_pb2.LeaseOp:
    return cache_pb2.LeaseOp(fork=cache_pb2.ForkOp(sequence_id=sequence_id))


def release(sequence_id: int, cache_prefix: bool = False, token_ids=()) -> cache_pb2.LeaseOp:
    return cache_pb2.LeaseOp(
        release=cache_pb2.ReleaseOp(sequence_id=sequence_id, cache_prefix=cache_prefix, token_ids=token_ids)
    )


def lease(stub, session_id: str, *ops, metadata=()) -> cache_pb2.LeaseResponse:
    return stub.Lease(cache_pb2.LeaseRequest(session_id=session_id, ops=ops), timeout=10, metadata=metadata)


def stats(stub, metadata=()) -> cache_pb2.CacheStats:
    return stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=metadata)


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    """Polls until predicate() is truthy; fails with `what` and the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(poll_s)
        value = predicate()
    assert value, f"timed out after {timeout_s} s waiting for {what}"
    return value


def leased_blocks(stub) -> int:
    return stats(stub).blocks_leased


def no_block_leased(service, timeout_s: float = 30, metadata=()) -> None:
    """Waits until the cache service at service.address leases no block (fails on a hang)."""
    stub = cache_stub(service.address)
    wait_for(lambda: stats(stub, metadata=metadata).blocks_leased == 0, timeout_s, "every block released")
