"""The cache service as a real process on a free port, over real channels."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch

from harness.cache_helpers import (
    TINY_GEOMETRY, allocate, attach, cache_stub, extend, fork, lease, leased_blocks, release, stats, wait_for,
)
from harness.processes import start_cache_service
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc

OK = cache_pb2.LEASE_STATUS_OK
NO_FREE = cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS
# 2 layers × 2 KV heads × head_dim 16 × fp32 × 16 tokens × 2 = 8 KiB a block; 64 blocks.
BLOCK_BYTES = 8192
POOL_ARGS = ("--kv-cache-bytes", str(64 * BLOCK_BYTES), "--headroom", "0")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # No session expires here; one whose hold hangs up gives its blocks back at once.
    with start_cache_service(tmp_path_factory.mktemp("cache"), *POOL_ARGS, "--lease-ttl-ms", "60000",
                             "--reclaim-grace-ms", "0") as service:
        yield service


@pytest.fixture()
def stub(cache):
    """The shared service's stub; afterwards the test must have released every lease and
    detached every session it opened, so that no test's leak fails a later one."""
    stub = cache_stub(cache.address)
    assert (stats(stub).blocks_leased, stats(stub).sessions) == (0, 0), "an earlier test leaked"
    yield stub
    after = stats(stub)
    assert (after.blocks_leased, after.sequences, after.sessions) == (0, 0, 0), (
        f"this test left {after.blocks_leased} blocks leased, {after.sequences} sequences, {after.sessions} sessions"
    )


def detach(stub, *sessions: str) -> None:
    for session in sessions:
        stub.Detach(cache_pb2.DetachRequest(session_id=session), timeout=10)


def test_sizing_before_attach_is_failed_precondition_and_a_pool_too_small_is_a_clear_error(tmp_path):
    """One service with no pool yet: GetSizing is refused; so is an Attach whose max_model_len
    the pool cannot hold, and it leaves no pool behind (GetSizing is refused again)."""
    with start_cache_service(tmp_path, *POOL_ARGS) as service:
        stub = cache_stub(service.address)
        for check in ("sizing", "attach", "sizing"):
            with pytest.raises(grpc.RpcError) as error:
                if check == "sizing":
                    stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)
                else:
                    attach(stub, max_model_len=4096)
            if check == "sizing":
                assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "first model service attaches" in error.value.details()
            else:
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "4,096" in error.value.details() or "4096" in error.value.details()


def test_lease_until_full_then_release_everything(stub):
    session = attach(stub).session_id
    sizing = stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)
    assert sizing.num_blocks == 64 and sizing.bytes_per_block == BLOCK_BYTES and sizing.limited_by == "kv_cache_bytes"
    assert sizing.max_total_tokens == 64 * 16

    # 64 sequences of one block each fill the pool, all in one batched call.
    reply = lease(stub, session, *[allocate(16) for _ in range(64)])
    assert [r.status for r in reply.results] == [OK] * 64
    assert reply.blocks_available == 0
    held = [r.sequence_id for r in reply.results]
    assert len({b for r in reply.results for b in r.block_ids}) == 64, "a block was handed out twice"

    # The next op reports no free blocks, per op, and undoes nothing else.
    reply = lease(stub, session, release(held[0]), allocate(16), allocate(16))
    assert [r.status for r in reply.results] == [OK, OK, NO_FREE]
    assert "block" in reply.results[2].message
    held = held[1:] + [reply.results[1].sequence_id]
    assert stats(stub).blocks_leased == 64

    lease(stub, session, *[release(s) for s in held])
    after = stats(stub)
    assert (after.blocks_free, after.blocks_leased, after.sequences) == (64, 0, 0)
    detach(stub, session)


def test_extend_fork_and_prefix_reuse(stub):
    session = attach(stub).session_id
    prompt = list(range(100, 140))  # 40 tokens: two full blocks and a partial one
    first = lease(stub, session, allocate(40, prompt)).results[0]
    assert first.status == OK and len(first.block_ids) == 3 and first.cached_tokens == 0

    grown = lease(stub, session, extend(first.sequence_id, 49)).results[0]
    assert grown.status == OK and len(grown.block_ids) == 1  # only the appended block

    child = lease(stub, session, fork(first.sequence_id)).results[0]
    assert child.status == OK and child.block_ids[:3] == first.block_ids
    assert child.copy.src_block == grown.block_ids[0] and child.copy.dst_block == child.block_ids[3]

    lease(stub, session, release(child.sequence_id), release(first.sequence_id, True, prompt))
    assert stats(stub).blocks_cached >= 2

    again = lease(stub, session, allocate(40, prompt)).results[0]
    assert again.cached_tokens == 32 and again.block_ids[:2] == first.block_ids[:2]
    lease(stub, session, release(again.sequence_id))
    assert leased_blocks(stub) == 0
    detach(stub, session)


def test_stats_per_model_fingerprint(stub):
    a1 = attach(stub, "a1", model_fingerprint="fp-stats-a", served_model_name="alpha").session_id
    a2 = attach(stub, "a2", model_fingerprint="fp-stats-a", served_model_name="alpha-2").session_id
    b = attach(stub, "b", model_fingerprint="fp-stats-b").session_id
    prompt = list(range(200, 240))  # 40 tokens: two full blocks and a partial one
    first = lease(stub, a1, allocate(40, prompt)).results[0]
    lease(stub, a1, release(first.sequence_id, True, prompt))  # its 2 full blocks cached, for model a only
    shared = lease(stub, a2, allocate(40, prompt)).results[0]
    assert shared.cached_tokens == 32
    child = lease(stub, a2, fork(shared.sequence_id)).results[0]  # the 2 full blocks again, a copy of the third
    other = lease(stub, b, allocate(40, prompt)).results[0]
    assert other.cached_tokens == 0 and child.status == OK

    now = stats(stub)
    assert [m.model_fingerprint for m in now.models] == sorted(m.model_fingerprint for m in now.models)
    models = {m.model_fingerprint: m for m in now.models}
    a, b_stats = models["fp-stats-a"], models["fp-stats-b"]
    assert (a.sessions, list(a.served_model_names), a.sequences, a.blocks_leased) == (2, ["alpha", "alpha-2"], 2, 4)
    assert (a.prefix_queries, a.prefix_hits) == (80, 32)
    assert (b_stats.sessions, list(b_stats.served_model_names), b_stats.sequences, b_stats.blocks_leased) == (1, [], 1, 3)
    assert (b_stats.prefix_queries, b_stats.prefix_hits) == (40, 0)
    assert sum(m.blocks_leased for m in now.models) == now.blocks_leased == 7

    lease(stub, a2, release(child.sequence_id), release(shared.sequence_id))
    lease(stub, b, release(other.sequence_id))
    detach(stub, a2, b)
    models = {m.model_fingerprint: m for m in stats(stub).models}
    a, b_stats = models["fp-stats-a"], models["fp-stats-b"]
    assert (a.sessions, list(a.served_model_names), a.sequences, a.blocks_leased) == (1, ["alpha"], 0, 0)
    assert (a.prefix_queries, a.prefix_hits) == (80, 32), "what was asked stays counted"
    assert (b_stats.sessions, b_stats.sequences, b_stats.blocks_leased) == (0, 0, 0)
    detach(stub, a1)


def test_another_sessions_sequence_is_permission_denied(stub):
    owner, intruder = attach(stub, "owner").session_id, attach(stub, "intruder").session_id
    sequence = lease(stub, owner, allocate(16)).results[0].sequence_id
    for op in (release(sequence), extend(sequence, 40), fork(sequence)):
        result = lease(stub, intruder, op).results[0]
        assert result.status == cache_pb2.LEASE_STATUS_PERMISSION_DENIED, op
    assert lease(stub, owner, release(sequence)).results[0].status == OK
    # Released twice, or never issued: NOT_FOUND, per op.
    for op in (release(sequence), extend(987654, 16)):
        assert lease(stub, owner, op).results[0].status == cache_pb2.LEASE_STATUS_NOT_FOUND
    assert lease(stub, owner, cache_pb2.LeaseOp()).results[0].status == cache_pb2.LEASE_STATUS_INVALID_ARGUMENT
    assert leased_blocks(stub) == 0
    detach(stub, owner, intruder)


def test_geometry_mismatch_is_failed_precondition(stub):
    session = attach(stub).session_id
    with pytest.raises(grpc.RpcError) as error:
        attach(stub, num_layers=3)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "3 layers" in error.value.details() and "restart the cache service" in error.value.details()
    detach(stub, session)


@pytest.mark.parametrize("geometry", [dict(num_layers=0), dict(dtype=cache_pb2.DTYPE_UNSPECIFIED), dict(device="tpu")])
def test_malformed_geometry_is_invalid_argument(stub, geometry):
    with pytest.raises(grpc.RpcError) as error:
        attach(stub, **geometry)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_session_is_not_found(stub):
    for call, request in [
        (stub.Heartbeat, cache_pb2.HeartbeatRequest(session_id="nope")),
        (stub.Detach, cache_pb2.DetachRequest(session_id="nope")),
        (stub.Lease, cache_pb2.LeaseRequest(session_id="nope", ops=[allocate(16)])),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            call(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "Attach again" in error.value.details()


def keyed_attach(stub, attach_key: str, name: str = "retrying", **fields) -> cache_pb2.AttachResponse:
    request = cache_pb2.AttachRequest(client_name=name, geometry=cache_pb2.Geometry(**TINY_GEOMETRY),
                                      max_model_len=64, attach_key=attach_key, **fields)
    return stub.Attach(request, timeout=10)


def test_an_attach_repeated_with_its_key_gets_the_same_session(stub):
    # A retry of an Attach whose reply never came back (its deadline passed while the
    # service went on to open the session) names the same key and gets that session.
    key = "a1" * 16
    first = keyed_attach(stub, key)
    again = keyed_attach(stub, key)
    assert again.session_id == first.session_id and stats(stub).sessions == 1
    assert again.sizing == first.sizing and again.pool.shared_memory.path == first.pool.shared_memory.path
    # Another key, or none (the behaviour before attach_key), opens a session of its own.
    other = keyed_attach(stub, "b2" * 16).session_id
    plain = [attach(stub, "retrying").session_id for _ in range(2)]
    assert len({first.session_id, other, *plain}) == 4 and stats(stub).sessions == 4
    for attach_key, fields, expected in [
        (key, dict(name="someone-else"), "another client"),
        (key, dict(model_fingerprint="f" * 32), "another client, model fingerprint"),
        ("short", {}, "attach_key is 5 characters; use 16 to 128"),
        ("x" * 129, {}, "attach_key is 129 characters"),
    ]:
        with pytest.raises(grpc.RpcError) as error:
            keyed_attach(stub, attach_key, **fields)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expected in error.value.details()
    assert stats(stub).sessions == 4
    detach(stub, first.session_id, other, *plain)
    # A detached session's key is forgotten: it opens a new session.
    fresh = keyed_attach(stub, key).session_id
    assert fresh != first.session_id
    detach(stub, fresh)


class ReplyLost:
    """A CacheService stub whose first Attach reaches the service, which opens the session,
    but whose reply the client never reads: the deadline passed first."""

    def __init__(self, stub) -> None:
        self.stub = stub
        self.attach_keys: list[str] = []

    def Attach(self, request, timeout, metadata):
        self.attach_keys.append(request.attach_key)
        reply = self.stub.Attach(request, timeout=timeout, metadata=metadata)
        if len(self.attach_keys) == 1:
            raise DeadlineExceeded()
        return reply

    def __getattr__(self, name):
        return getattr(self.stub, name)


class DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_a_model_service_whose_attach_timed_out_leaves_no_orphan_session(stub, cache):
    from model_service.cache.attachment import AttachSettings, attach as attach_engine
    from model_service.cache.client import CacheClient
    from pagedkv.kv_geometry import KvGeometry

    client = CacheClient(cache.address)
    lossy = ReplyLost(client.stub)
    client.stub = lossy
    settings = AttachSettings(client_name="engine", geometry=KvGeometry(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu"),
        workspace_bytes=0, max_model_len=64, model_fingerprint="")
    unreachable = []
    attachments = []
    try:
        for _ in range(2):
            attachments.append(attach_engine(client, settings, torch.device("cpu"), stopping=threading.Event(),
                                             on_unreachable=lambda: unreachable.append(1),
                                             on_heartbeat_failure=lambda session_id, error: None))
            if len(attachments) == 1:
                # The retry named the first try's key: the session that try opened, not a second.
                assert unreachable == [1] and len(lossy.attach_keys) == 2
                assert lossy.attach_keys[0] == lossy.attach_keys[1] and len(lossy.attach_keys[0]) == 32
                assert stats(stub).sessions == 1
        # A new attach (after a lost session) picks a new key, and so a new session.
        assert lossy.attach_keys[2] != lossy.attach_keys[0]
        assert attachments[1].session_id != attachments[0].session_id and stats(stub).sessions == 2
    finally:
        for attachment in attachments:
            # Detach first: stopping the heartbeat hangs up the session's hold, which ends it.
            client.detach(attachment.session_id)
            attachment.heartbeat.stop()
        client.close()


def test_pool_handle_maps_in_this_process_and_is_private(stub):
    reply = attach(stub)
    assert reply.pool.WhichOneof("memory") == "shared_memory"
    path = Path(reply.pool.shared_memory.path)
    assert path.stat().st_mode & 0o777 == 0o600
    pool = pool_memory.map_pool(reply.pool)
    assert list(pool.shape) == [2, 2, 64, 16, 2, 16]
    pool[1, 1, 63].fill_(3.5)  # a second mapping of the same memory: both see it
    assert float(pool_memory.map_pool(reply.pool)[1, 1, 63, 0, 0, 0]) == 3.5
    detach(stub, reply.session_id)


def test_detach_and_ttl_reclaim_leases(tmp_path):
    # A 3 s TTL and a heartbeat every poll (0.1 s): `alive` survives a stall of this process
    # 30 times longer than its heartbeat interval; the reclaim itself may take its time.
    with start_cache_service(tmp_path, *POOL_ARGS, "--lease-ttl-ms", "3000", "--reclaim-grace-ms", "0") as service:
        stub = cache_stub(service.address)
        alive = attach(stub, "alive").session_id
        silent = keyed_attach(stub, "k" * 32, "silent").session_id
        lease(stub, silent, allocate(64), allocate(20))
        lease(stub, alive, allocate(16))
        assert leased_blocks(stub) == 7
        # `silent` never heartbeats again; `alive` does, so only silent's 6 blocks come back.
        def reclaimed():
            stub.Heartbeat(cache_pb2.HeartbeatRequest(session_id=alive), timeout=10)
            return leased_blocks(stub) == 1
        wait_for(reclaimed, 60.0, "the silent session's leases to be reclaimed", poll_s=0.1)
        with pytest.raises(grpc.RpcError) as error:
            lease(stub, silent, allocate(16))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        # An expired session's attach key is forgotten with it: the key opens a new one.
        again = keyed_attach(stub, "k" * 32, "silent").session_id
        assert again != silent
        detach(stub, again)
        assert stub.Detach(cache_pb2.DetachRequest(session_id=alive), timeout=10).blocks_reclaimed == 1
        assert leased_blocks(stub) == 0 and stats(stub).sessions == 0


def hold(address: str, session_id: str) -> tuple[grpc.Channel, object]:
    """A HoldSession call on a channel of its own (closing the channel hangs up), past its first message."""
    channel = grpc.insecure_channel(address)
    call = cache_pb2_grpc.CacheServiceStub(channel).HoldSession(cache_pb2.HoldSessionRequest(session_id=session_id))
    assert next(call).lease_ttl_ms == 60000
    return channel, call


def test_a_held_session_ends_when_its_holders_connection_closes(cache, stub):
    """Long before the TTL: the session ends, its calls get NOT_FOUND, its blocks come back.
    Many holds of one session, all hung up at once, end it once; another session is untouched."""
    held, other = attach(stub, "held").session_id, attach(stub, "other").session_id
    lease(stub, held, allocate(64), allocate(20))
    lease(stub, other, allocate(16))
    holds = [hold(cache.address, held) for _ in range(20)]
    other_channel, other_call = hold(cache.address, other)
    assert stats(stub).sessions == 2 and leased_blocks(stub) == 7
    for channel, _ in holds:
        channel.close()
    wait_for(lambda: (stats(stub).sessions, leased_blocks(stub)) == (1, 1), 60,
             "the hung-up session to end and its blocks to come back")
    with pytest.raises(grpc.RpcError) as error:
        lease(stub, held, allocate(16))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    # The other session's hold ends OK when it detaches, and the session with it.
    assert stub.Detach(cache_pb2.DetachRequest(session_id=other), timeout=10).blocks_reclaimed == 1
    assert list(other_call) == []
    other_channel.close()


def test_a_hold_on_an_unknown_session_is_not_found(stub):
    for session_id in ("", "0" * 32, "x" * 10_000):
        with pytest.raises(grpc.RpcError) as error:
            next(stub.HoldSession(cache_pb2.HoldSessionRequest(session_id=session_id), timeout=10))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND and "Attach again" in error.value.details()


def test_open_holds_end_unavailable_at_once_when_the_cache_service_stops(tmp_path):
    # A grace far beyond the wait: a stop that waited for the holds to end would be SIGKILLed.
    with start_cache_service(tmp_path, *POOL_ARGS, "--lease-ttl-ms", "60000", "--grace-s", "600") as service:
        session = attach(cache_stub(service.address)).session_id
        channel, call = hold(service.address, session)
        assert service.stop(signal.SIGTERM, timeout=60) == 0
        with pytest.raises(grpc.RpcError) as error:
            next(call)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in error.value.details()
        channel.close()


def test_budget_too_small_is_a_clear_error(tmp_path):
    with start_cache_service(tmp_path, "--kv-cache-bytes", "4KiB") as service:
        with pytest.raises(grpc.RpcError) as error:
            attach(cache_stub(service.address))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "8,192" in error.value.details() or "8.00 KiB" in error.value.details()


@pytest.fixture(scope="module")
def auth_cache(tmp_path_factory):
    """One service with a token for every case of test_auth_token (each starts no session it keeps)."""
    with start_cache_service(tmp_path_factory.mktemp("auth"), *POOL_ARGS, "--auth-token", "s3cret") as service:
        yield service


@pytest.mark.parametrize("metadata, code", [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", "Bearer s3cret"),), None),
])
def test_auth_token(auth_cache, metadata, code):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(auth_cache.address)
    # Health needs no token: orchestrators probe it.
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    stub = cache_stub(auth_cache.address)
    if code is None:
        session = attach(stub, metadata=metadata).session_id
        assert stats(stub, metadata=metadata).sessions == 1
        stub.Detach(cache_pb2.DetachRequest(session_id=session), timeout=10, metadata=metadata)
    else:
        for call in (lambda: attach(stub, metadata=metadata), lambda: stats(stub, metadata=metadata)):
            with pytest.raises(grpc.RpcError) as error:
                call()
            assert error.value.code() == code
            assert "--auth-token" in error.value.details()
        # HoldSession is behind the token too.
        with pytest.raises(grpc.RpcError) as error:
            next(stub.HoldSession(cache_pb2.HoldSessionRequest(session_id="0" * 32), timeout=10, metadata=metadata))
        assert error.value.code() == code


def test_sigterm_unlinks_the_pool_and_start_up_removes_stale_ones(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    dead_pid = 2**22 + 12345  # above any pid_max default: never alive
    stale = shm_dir / f"pagedkv-{dead_pid}-deadbeef.kv"
    stale.write_bytes(b"\0" * 64)
    # A live pool is one whose file its cache service holds locked, whatever its name says.
    live = shm_dir / f"pagedkv-{dead_pid + 1}-cafe.kv"
    live.write_bytes(b"\0" * 64)
    live_lock = os.open(live, os.O_RDONLY)
    fcntl.flock(live_lock, fcntl.LOCK_EX)
    service = start_cache_service(tmp_path, *POOL_ARGS, "--shm-dir", str(shm_dir))
    try:
        assert not stale.exists(), "a dead owner's pool file survived start-up"
        assert live.exists(), "a live service's pool file was removed"
        pool_file = Path(attach(cache_stub(service.address)).pool.shared_memory.path)
        assert pool_file.exists()
    finally:
        os.close(live_lock)
        assert service.stop(signal.SIGTERM) == 0
    assert not pool_file.exists(), "the pool file outlived the cache service"


def test_an_fp8_pool_refuses_a_bfloat16_attach_and_is_mapped_as_fp8(tmp_path):
    """Models with different KV dtypes never share a pool: the second geometry is refused."""
    fp8 = dict(dtype=cache_pb2.DTYPE_FLOAT8_E4M3)
    with start_cache_service(tmp_path, *POOL_ARGS) as service:
        stub = cache_stub(service.address)
        reply = attach(stub, **fp8)
        assert reply.sizing.dtype == cache_pb2.DTYPE_FLOAT8_E4M3 and reply.sizing.bytes_per_block == BLOCK_BYTES // 4
        assert reply.sizing.num_blocks == 4 * 64  # the same bytes, a quarter of float32's block
        assert any("fp8_e4m3" in line for line in reply.sizing.explanation)
        pool = pool_memory.map_pool(reply.pool)
        assert pool.dtype == torch.float8_e4m3fn
        with pytest.raises(grpc.RpcError) as error:
            attach(stub, dtype=cache_pb2.DTYPE_BFLOAT16)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "fp8_e4m3" in error.value.details()
        detach(stub, reply.session_id)
