"""The engine against a fake cache client: what it does when a lease call fails."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
import pytest
import torch

from model_service.engine import Engine, EngineSettings
from model_service.models.loader import load_model
from model_service.sampling import SamplingOptions
from model_service.scheduler import LeaseLost
from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class FakeCache:
    """Attaches fine; every Lease call fails with `failure`."""

    address = "fake:0"

    def __init__(self, handle: cache_pb2.PoolHandle, failure: BaseException) -> None:
        self.handle = handle
        self.failure = failure
        self.attached: list[str] = []
        self.detached: list[str] = []
        self.reattached = threading.Event()

    def attach(self, client_name, geometry, workspace_bytes, max_model_len):
        session = f"session-{len(self.attached)}"
        self.attached.append(session)
        if len(self.attached) > 1:
            self.reattached.set()
        sizing = cache_pb2.SizingReport(block_size=16, num_blocks=8, max_total_tokens=128)
        return cache_pb2.AttachResponse(session_id=session, lease_ttl_ms=60_000, sizing=sizing, pool=self.handle)

    def heartbeat(self, session_id):
        pass

    def lease(self, session_id, ops):
        result: Future = Future()
        result.set_exception(self.failure)
        return result

    def detach(self, session_id):
        self.detached.append(session_id)
        return 0


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
        # A session that failed for a reason other than the service going away is given
        # back at once; an unreachable service cannot be told anything.
        assert cache.detached == (["session-0"] if detaches else [])
    finally:
        engine.stop(0)


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
