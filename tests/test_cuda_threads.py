"""Every thread that launches device work runs on the model's CUDA device, not cuda:0.

torch.cuda.set_device is per thread, and Triton launches, current_stream() and graph
capture follow the calling thread's current device. Without a GPU these tests fake CUDA's
per-thread device (FakeCuda); the last one runs on a machine with two GPUs.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from model_service.loading.loader import load_model
from model_service.sched.sequence import Sequence
from model_service.worker.runner import ModelRunner
from model_service.worker.torch_threads import run_in_passing_thread, use_device


class FakeCuda:
    """torch.cuda's per-thread current device, streams and events, recorded per thread."""

    def __init__(self, monkeypatch) -> None:
        self._local = threading.local()
        self.records: list[object] = []  # the stream each event was recorded on
        fake = self

        class Event:
            def record(self, stream=None):
                fake.records.append(stream)

            def synchronize(self):
                pass

        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", self.current_device)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)

    def set_device(self, device) -> None:
        self._local.device = device if isinstance(device, int) else device.index

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)  # CUDA's default for a new thread

    def current_stream(self, device=None):
        return SimpleNamespace(device=device, thread_device=self.current_device())


@pytest.fixture()
def fake_cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def test_a_passing_thread_runs_on_its_callers_cuda_device(fake_cuda):
    use_device(torch.device("cuda:1"))  # what --device cuda:1 does in the main thread
    assert run_in_passing_thread(torch.cuda.current_device) == 1
    use_device(2)
    assert run_in_passing_thread(torch.cuda.current_device) == 2


def test_use_device_leaves_cpu_alone(fake_cuda):
    use_device(torch.device("cpu"))
    use_device(None)
    assert torch.cuda.current_device() == 0


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _sequence(length: int = 5) -> Sequence:
    return Sequence(request_id="r", token_ids=list(range(3, 3 + length)), prompt_len=length, options=None,
                    arrival=0, block_table=[0])


def test_the_write_fence_records_on_the_pools_device_stream(fake_cuda):
    # The runner's fence on a pool on cuda:1, asked from a thread whose current device is 0:
    # the event goes on cuda:1's stream (a bare record() would take cuda:0's).
    pool = SimpleNamespace(shape=(1, 2, 4, 16, 1, 8), device=torch.device("cuda:1"))
    runner = ModelRunner(SimpleNamespace(), pool, 16)
    runner.record_writes()
    assert len(fake_cuda.records) == 1 and fake_cuda.records[0].device == torch.device("cuda:1")
    runner.wait_for_writes()


def test_a_step_records_its_fence(tiny):
    config = tiny.config
    pool = torch.zeros(config.num_layers, 2, 2, 16, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(tiny.model, pool, 16)
    streams = []
    runner.new_event = lambda: SimpleNamespace(record=streams.append)
    runner.execute([(_sequence(), 5)])
    assert streams == [None]  # CPU: no stream


def test_the_engine_thread_sets_the_engine_device_before_any_step(monkeypatch, tiny, tmp_path):
    from model_service.engine import loop
    from model_service.engine.settings import EngineSettings
    from pagedkv import pool_memory
    from test_engine_recovery import FakeCache, Unavailable

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(loop, "use_device", lambda device: calls.append((threading.current_thread().name, device)))
    config = tiny.config
    shared = pool_memory.create_shared_pool((config.num_layers, 2, 8, 16, config.num_kv_heads, config.head_dim),
                                            torch.float32, str(tmp_path))
    try:
        engine = loop.Engine(tiny, EngineSettings(max_model_len=64), FakeCache(
            pool_memory.shared_handle_to_proto(shared.handle), Unavailable()), torch.device("cpu"), torch.float32)
        engine.start()
        try:
            assert engine.connected.wait(60)
        finally:
            engine.stop(5)
    finally:
        shared.close()
    # First thing in the engine thread, before the attach that captures graphs and maps the pool.
    assert calls == [("engine", engine.device)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (runs a model on cuda:1)")
def test_a_model_on_cuda_1_steps_from_a_new_thread():  # pragma: no cover - GPU only
    device = torch.device("cuda:1")
    torch.cuda.set_device(device)  # as --device cuda:1 does in the main thread
    try:
        _steps_on_cuda_1_from_a_new_thread(device)
    finally:
        torch.cuda.set_device(0)  # the tests after this one run on cuda:0


def _steps_on_cuda_1_from_a_new_thread(device: torch.device) -> None:  # pragma: no cover - GPU only
    loaded = load_model("tiny", torch.float32, device, attention_backend="triton")
    reference = load_model("tiny", torch.float32, "cpu", attention_backend="torch")
    config = loaded.config
    results = {}

    def engine_like() -> None:
        use_device(device)
        pool = torch.zeros(config.num_layers, 2, 2, 16, config.num_kv_heads, config.head_dim, device=device)
        runner = ModelRunner(loaded.model, pool, 16)
        _, logits = runner.execute([(_sequence(), 5)])
        runner.wait_for_writes()
        results["cuda"] = logits.float().cpu()

    thread = threading.Thread(target=engine_like)
    thread.start()
    thread.join()
    pool = torch.zeros(config.num_layers, 2, 2, 16, config.num_kv_heads, config.head_dim)
    _, expected = ModelRunner(reference.model, pool, 16).execute([(_sequence(), 5)])
    torch.testing.assert_close(results["cuda"], expected.float(), atol=1e-3, rtol=1e-3)
