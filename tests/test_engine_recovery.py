"""The engine against a fake cache client: what it does when a lease call fails."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import grpc
import pytest
import torch
from recorded_events import recording_events

from model_service.engine.loop import Engine, EngineUnavailable
from model_service.engine.settings import EngineSettings
from model_service.loading.loader import load_model
from model_service.sample.params import SamplingOptions
from model_service.sched.lease_ops import Allocated, Committed, Extended, LeaseAnswer, LeaseLost, Refused, Released
from model_service.sched.sequence import Finish
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class NoHold:
    """HoldSession on a cache service that predates it: the session lives by heartbeats alone."""

    def __iter__(self):
        raise Unimplemented()

    def cancel(self) -> None:
        pass


class Unimplemented(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self):
        return "Method not found!"


class FakeCache:
    """Attaches fine; every Lease call fails with `failure`."""

    address = "fake:0"

    def __init__(self, handle: cache_pb2.PoolHandle, failure: BaseException) -> None:
        self.handle = handle
        self.failure = failure
        self.attached: list[str] = []
        self.detached: list[str] = []
        self.reattached = threading.Event()

    def attach(self, client_name, geometry, workspace_bytes, max_model_len, model_fingerprint="", served_model_name="",
               attach_key="", weights_bytes_by_type=None, lora_slot_bytes=0, lora_resident_bytes=0):
        session = f"session-{len(self.attached)}"
        self.attached.append(session)
        if len(self.attached) > 1:
            self.reattached.set()
        sizing = cache_pb2.SizingReport(block_size=16, num_blocks=8, max_total_tokens=128)
        return cache_pb2.AttachResponse(session_id=session, lease_ttl_ms=60_000, sizing=sizing, pool=self.handle)

    def heartbeat(self, session_id, timeout_s=None):
        pass

    def hold(self, session_id):
        return NoHold()

    def lease(self, session_id, ops):
        result: Future = Future()
        result.set_exception(self.failure)
        return result

    def detach(self, session_id):
        self.detached.append(session_id)
        return 0


class RecordingGraphPool:
    """A DecodeGraphPool stand-in recording drop and capture; its graphs run nothing."""

    memory_bytes = 0

    def __init__(self) -> None:
        self.calls: list[str] = []

    def drop(self) -> None:
        self.calls.append("drop")

    def capture(self, kv_pool, block_size):
        self.calls.append("capture")
        return SimpleNamespace(buckets=[], captures=0, can_run=lambda batch: False)


@pytest.fixture()
def pool_handle(tmp_path):
    loaded = load_model("tiny")
    config = loaded.config
    shared = pool_memory.create_shared_pool(
        (config.num_layers, 2, 8, 16, config.num_kv_heads, config.head_dim), torch.float32, str(tmp_path))
    yield loaded, pool_memory.shared_handle_to_proto(shared.handle)
    shared.close()


@pytest.mark.parametrize("failure, detaches", [
    (LeaseLost("extend of request r failed: INVALID_ARGUMENT"), True),
    (Unavailable(), False),
])
def test_failed_lease_ends_requests_with_unavailable_and_reattaches(pool_handle, failure, detaches):
    loaded, handle = pool_handle
    cache = FakeCache(handle, failure)
    engine = Engine(loaded, EngineSettings(max_model_len=64), cache, torch.device("cpu"), torch.float32)
    engine.start()
    try:
        assert engine.connected.wait(60)
        graph_pool = RecordingGraphPool()
        engine.decode_graph_pool = graph_pool  # as on CUDA, where graphs point into the pool
        ended = threading.Event()
        deltas = []

        def sink(delta):
            deltas.append(delta)
            if delta.finish is not None:
                ended.set()

        engine.submit("r", [1, 2, 3], SamplingOptions(max_new_tokens=4), sink)
        assert ended.wait(60), "the request never ended"
        assert deltas[-1].error[0] == grpc.StatusCode.UNAVAILABLE
        assert cache.reattached.wait(60), "the engine did not attach again"
        # The lost pool's graphs were dropped before the new pool's were captured.
        assert engine.connected.wait(60)  # cleared when the cache was lost; set after the capture
        assert graph_pool.calls[:2] == ["drop", "capture"], graph_pool.calls
        # A session that failed for a reason other than the service going away is given
        # back at once; an unreachable service cannot be told anything.
        assert cache.detached == (["session-0"] if detaches else [])
    finally:
        engine.stop(0)


class UnreachableAfterFirstAttach(FakeCache):
    """The first Attach works; then the cache service is gone for good."""

    def attach(self, *args, **kwargs):
        if self.attached:
            self.attached.append("refused")
            raise Unavailable()
        return super().attach(*args, **kwargs)


def test_a_request_submitted_as_the_cache_drops_ends_instead_of_waiting(pool_handle):
    loaded, handle = pool_handle
    cache = UnreachableAfterFirstAttach(handle, Unavailable())
    engine = Engine(loaded, EngineSettings(max_model_len=64), cache, torch.device("cpu"), torch.float32)
    engine.start()
    try:
        assert engine.connected.wait(10)
        first = threading.Event()
        engine.submit("r0", [1, 2, 3], SamplingOptions(max_new_tokens=4), lambda d: d.finish and first.set())
        assert first.wait(10)
        deadline = time.monotonic() + 10
        while len(cache.attached) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.connected.is_set()
        # The race: submit() saw the engine connected just before the connection dropped.
        engine.connected.set()
        deltas = []
        ended = threading.Event()
        engine.submit("late", [1, 2, 3], SamplingOptions(max_new_tokens=4),
                      lambda d: (deltas.append(d), d.finish and ended.set()))
        engine.connected.clear()
        assert ended.wait(15), "the request waited for a re-attach that never comes"
        assert deltas[-1].error[0] == grpc.StatusCode.UNAVAILABLE
        assert engine.pending == 0
    finally:
        engine.stop(0)


class HealthyCache(FakeCache):
    """Leases succeed from one huge block; heartbeats can be made to hang."""

    def __init__(self, handle, block_size: int, ttl_ms: int) -> None:
        super().__init__(handle, None)
        self.block_size = block_size
        self.ttl_ms = ttl_ms
        self.heartbeats_hang = threading.Event()
        self.released = threading.Event()

    def attach(self, client_name, geometry, workspace_bytes, max_model_len, model_fingerprint="", served_model_name="",
               attach_key="", weights_bytes_by_type=None, lora_slot_bytes=0, lora_resident_bytes=0):
        self.attached.append(f"session-{len(self.attached)}")
        sizing = cache_pb2.SizingReport(block_size=self.block_size, num_blocks=1, max_total_tokens=self.block_size)
        return cache_pb2.AttachResponse(session_id=self.attached[-1], lease_ttl_ms=self.ttl_ms, sizing=sizing,
                                        pool=self.handle)

    def heartbeat(self, session_id, timeout_s=None):
        if self.heartbeats_hang.is_set():
            self.released.wait(timeout_s)  # answered by nobody: the deadline passes
            raise DeadlineExceeded()

    def lease(self, session_id, ops):
        answer = LeaseAnswer(forks=tuple(Refused("NO_FREE_BLOCKS") for _ in ops.forks),  # no n > 1 here
                             releases=tuple(Released() for _ in ops.releases),
                             extends=tuple(Extended() for _ in ops.extends),
                             commits=tuple(Committed() for _ in ops.commits),
                             allocations=tuple(Allocated(1, (0,)) for _ in ops.allocations))
        result: Future = Future()
        result.set_result(answer)
        return result


@contextlib.contextmanager
def engine_on_healthy_cache(tmp_path, ttl_ms: int):
    """A started, attached engine on the tiny model over a HealthyCache of one 2048-token
    block; yields (engine, cache); stops the engine and frees the pool afterwards."""
    loaded = load_model("tiny")
    config = loaded.config
    block_size = 2048
    shared = pool_memory.create_shared_pool(
        (config.num_layers, 2, 1, block_size, config.num_kv_heads, config.head_dim), torch.float32, str(tmp_path))
    cache = HealthyCache(pool_memory.shared_handle_to_proto(shared.handle), block_size, ttl_ms=ttl_ms)
    engine = Engine(loaded, EngineSettings(max_model_len=block_size), cache, torch.device("cpu"), torch.float32)
    engine.start()
    try:
        assert engine.connected.wait(10)
        yield engine, cache
    finally:
        cache.released.set()  # a heartbeat hung by the test returns
        engine.stop(0)
        shared.close()


class DeadlineExceeded(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_the_engine_stops_writing_once_its_lease_may_have_expired(tmp_path):
    """Fenced writes: heartbeats stop getting through (a stalled network, or this process
    paused) while a request decodes inside one block, so no lease call proves the session
    alive either. Past TTL - margin the engine must stop stepping: the cache service may
    have handed its blocks to someone else."""
    with engine_on_healthy_cache(tmp_path, ttl_ms=600) as (engine, cache):
        deltas = []
        ended = threading.Event()
        first_token = threading.Event()

        def sink(delta):
            deltas.append(delta)
            if delta.token_ids:
                first_token.set()
            if delta.finish is not None:
                ended.set()

        engine.submit("long", [1, 2, 3], SamplingOptions(max_new_tokens=2000, ignore_eos=True), sink)
        assert first_token.wait(10)
        cache.heartbeats_hang.set()
        assert ended.wait(30), "the request never ended"
        error = deltas[-1].error
        assert error is not None and error[0] == grpc.StatusCode.UNAVAILABLE, deltas[-1]
        assert "stopped writing" in error[1]
        generated = sum(len(d.token_ids) for d in deltas)
        assert generated < 2000, "the engine kept stepping past its lease deadline"
        # It gave the old session up and attached again.
        assert "session-0" in cache.detached


def test_stop_lets_running_requests_finish_but_accepts_no_new_ones(tmp_path):
    with engine_on_healthy_cache(tmp_path, ttl_ms=60_000) as (engine, _):
        deltas = []
        ended = threading.Event()
        started = threading.Event()

        def sink(delta):
            deltas.append(delta)
            started.set()
            if delta.finish is not None:
                ended.set()

        engine.submit("running", [1, 2, 3], SamplingOptions(max_new_tokens=1500, ignore_eos=True), sink)
        assert started.wait(10)
        stopper = threading.Thread(target=engine.stop, args=(60.0,))
        stopper.start()
        refused_while_running = None
        deadline = time.monotonic() + 30
        while refused_while_running is None and time.monotonic() < deadline:
            try:
                key = engine.submit("new", [1, 2], SamplingOptions(max_new_tokens=1), lambda delta: None)
                engine.cancel(key)
            except EngineUnavailable as error:
                assert "shutting down" in str(error)
                refused_while_running = not ended.is_set()
            time.sleep(0.001)
        assert refused_while_running, "new requests were accepted during the grace period"
        stopper.join(60)
        assert ended.is_set() and deltas[-1].finish is Finish.LENGTH and deltas[-1].error is None
        assert sum(len(d.token_ids) for d in deltas) == 1500


def test_a_pool_it_cannot_map_is_detached_before_the_engine_gives_up(pool_handle, tmp_path):
    # The cache service answers Attach with a pool file this process cannot see (a new
    # cache container's /dev/shm): the session goes back at once and the engine stops.
    loaded, handle = pool_handle
    unseen = cache_pb2.PoolHandle()
    unseen.CopyFrom(handle)
    unseen.shared_memory.path = str(tmp_path / "elsewhere" / "pagedkv-pool")
    cache = FakeCache(unseen, Unavailable())
    fatal: list[BaseException] = []
    gave_up = threading.Event()
    served: list[bool] = []

    def on_fatal(error):
        fatal.append(error)
        gave_up.set()

    engine = Engine(loaded, EngineSettings(max_model_len=64), cache, torch.device("cpu"), torch.float32,
                    on_serving=served.append, on_fatal=on_fatal)
    engine.start()
    try:
        assert gave_up.wait(60), "the engine neither mapped the pool nor gave up"
        assert cache.attached == ["session-0"] and cache.detached == ["session-0"]
        assert "does not exist here" in str(fatal[0]), fatal
        assert True not in served and not engine.connected.is_set()
    finally:
        engine.stop(0)


def test_attach_waits_longer_than_other_cache_calls():
    # A large pool's first Attach can outlast the 10 s of other calls; giving up early would
    # leave the session the cache service still opens, and the retry would open another.
    from model_service.cache.client import ATTACH_TIMEOUT_S, CacheClient
    from pagedkv.kv_geometry import KvGeometry

    seen = {}

    class RecordingStub:
        def Attach(self, request, timeout, metadata):
            seen["attach"] = timeout
            return cache_pb2.AttachResponse()

        def GetStats(self, request, timeout, metadata):
            seen["stats"] = timeout
            return None

    client = CacheClient("127.0.0.1:1")
    try:
        client.stub = RecordingStub()
        client.attach("test", KvGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu"),
                      0, 64)
        client.stats()
    finally:
        client.close()
    assert seen == {"attach": ATTACH_TIMEOUT_S, "stats": 10.0}


class FailsTheSecondAllocation(HealthyCache):
    """Lends its one block to the first sequence (with room for more, it says), then fails
    the next allocation as a lost lease; logs its detaches beside the runner's events."""

    def __init__(self, handle, block_size: int, log: list) -> None:
        super().__init__(handle, block_size, ttl_ms=60_000)
        self.log = log
        self.allocations = 0

    def lease(self, session_id, ops):
        self.allocations += len(ops.allocations)
        if self.allocations > 1:
            result: Future = Future()
            result.set_exception(LeaseLost("allocate failed: INVALID_ARGUMENT"))
            return result
        answer = super().lease(session_id, ops).result()
        result = Future()
        result.set_result(dataclasses.replace(answer, blocks_available=10))
        return result

    def detach(self, session_id):
        self.log.append(("detach", session_id))
        return super().detach(session_id)


def test_a_lost_session_is_given_back_only_after_the_writes_in_flight(tmp_path):
    # The engine sends a lease call and runs a step while it is on the wire; when the
    # answer says the session is lost, that step's kernels may still write into the pool.
    # The session is given back (its blocks to others) only after they landed.
    loaded = load_model("tiny")
    config = loaded.config
    block_size = 2048
    shared = pool_memory.create_shared_pool(
        (config.num_layers, 2, 1, block_size, config.num_kv_heads, config.head_dim), torch.float32, str(tmp_path))
    log: list = []
    cache = FailsTheSecondAllocation(pool_memory.shared_handle_to_proto(shared.handle), block_size, log)
    engine = Engine(loaded, EngineSettings(max_model_len=block_size), cache, torch.device("cpu"), torch.float32)
    engine.start()
    try:
        assert engine.connected.wait(10)
        engine.runner.new_event = recording_events(log)
        first_token = threading.Event()
        ended = threading.Event()
        engine.submit("first", [1, 2, 3], SamplingOptions(max_new_tokens=1000, ignore_eos=True),
                      lambda delta: (delta.token_ids and first_token.set(), delta.finish and ended.set()))
        assert first_token.wait(30)
        engine.submit("second", [4, 5, 6], SamplingOptions(max_new_tokens=4), lambda delta: None)
        assert ended.wait(30), "the lost session's request never ended"
        deadline = time.monotonic() + 30
        while not any(entry[0] == "detach" for entry in log) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop(0)
        shared.close()
    detach = next(i for i, entry in enumerate(log) if entry[0] == "detach")
    last_record = max(i for i, entry in enumerate(log[:detach]) if entry[0] == "record")
    assert ("synchronize", log[last_record][1]) in log[last_record:detach], log[max(last_record - 3, 0):detach + 1]
