"""Decode-step graphs: bucketed batch sizes, padded tables, no capture after start-up.

On CPU the capture is a fake (eager: the step function itself is replayed, and the fake
counts its captures), which checks what the graph path owns: bucketing, padding, static
buffers refilled in place, and that new batch sizes and prompt lengths never capture
again. The fake's counters say only what the fake saw: the tests marked `needs_cuda`
capture real CUDA graphs (Triton attention, which skips padding rows) and run only where
CUDA is available.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model_service.attention.backend import PagedAttention
from model_service.worker.decode_graphs import DecodeGraphPool, DecodeGraphs, batch_buckets
from model_service.loading.tiny import build_tiny_model
from model_service.worker.runner import ModelRunner
from model_service.sched.sequence import Sequence

BLOCK_SIZE = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real CUDA graphs")


class SkipPaddingAttention:
    """The PyTorch path, minus padding rows (slot -1), which the Triton write kernel skips
    and index_copy would reject."""

    def __init__(self) -> None:
        self.inner = PagedAttention("torch")

    def __call__(self, q, k, v, kv_layer, meta, scale, sliding_window=None):
        real = int((meta.slot_mapping >= 0).sum())
        if real == len(meta.slot_mapping):  # no padding rows
            return self.inner(q, k, v, kv_layer, meta, scale, sliding_window=sliding_window)
        trimmed = dataclasses.replace(
            meta, slot_mapping=meta.slot_mapping[:real], block_tables=meta.block_tables[:real],
            context_lens=meta.context_lens[:real], query_lens=meta.query_lens[:real],
            context_lens_host=tuple(int(n) for n in meta.context_lens[:real]), num_decode_seqs=real,
        )
        out = torch.zeros_like(q)
        out[:real] = self.inner(q[:real], k[:real], v[:real], kv_layer, trimmed, scale, sliding_window=sliding_window)
        return out


def eager_capture(counter: list[int]):
    def capture(step):
        counter.append(1)
        return step
    return capture


def sizes_capture(sizes: list[int]):
    """Eager, recording each captured bucket's batch size (the step's output rows)."""
    def capture(step):
        sizes.append(step().shape[0])
        return step
    return capture


def decode_batch(lengths: list[int], first_block: int = 0) -> list[tuple[Sequence, int]]:
    batch, next_block = [], first_block
    generator = torch.Generator().manual_seed(sum(lengths))
    for index, length in enumerate(lengths):
        blocks = -(-length // BLOCK_SIZE)
        tokens = torch.randint(0, 256, (length,), generator=generator).tolist()
        # Scattered, non-contiguous blocks: every other block id.
        table = [next_block + 2 * i for i in range(blocks)]
        next_block += 2 * blocks
        seq = Sequence(request_id=str(index), token_ids=tokens, prompt_len=length - 1, options=None,
                       arrival=index, block_table=table, num_computed=length - 1)
        batch.append((seq, 1))
    return batch


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_fake_capture_graph_decode_matches_eager_and_never_recaptures():
    torch.manual_seed(0)
    model = build_tiny_model(attention=SkipPaddingAttention())
    config = model.config
    pool = torch.randn(config.num_layers, 2, 256, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    captures: list[int] = []
    graphs = DecodeGraphs(model, pool, BLOCK_SIZE, max_num_seqs=16, max_model_len=256,
                          capture=eager_capture(captures))
    assert graphs.captures == len(captures) == len(batch_buckets(16))
    eager = ModelRunner(model, pool, BLOCK_SIZE)

    # Batch sizes off the buckets (padding) and on them, prompt lengths never seen before.
    for lengths in ([5], [17, 40, 3], [33] * 8, [100, 7, 64, 12, 90]):
        batch = decode_batch(lengths)
        assert graphs.can_run(batch)
        with torch.inference_mode():
            hidden = graphs.run(batch)
            input_ids, positions, meta = eager.prepare(batch)
            expected = model(input_ids, positions, pool, meta)
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    assert len(captures) == graphs.captures == len(batch_buckets(16)), "a new shape captured a new graph"


def test_runner_replays_graphs_for_decode_steps_and_runs_prefill_eagerly(monkeypatch):
    # A decode step selects its rows by slicing: no index tensor to copy to the device (on
    # CUDA even a copy from pinned memory is a kernel of its own), and the graphs stage
    # their inputs themselves. Every list the runner sends goes through to_device (a copy
    # from pageable memory waits for the stream: a second host sync a step).
    from model_service.worker import runner as runner_module

    indexed = []
    to_device = runner_module.to_device
    monkeypatch.setattr(runner_module, "to_device", lambda values, dtype, device: indexed.append(values) or
                        to_device(values, dtype, device))
    torch.manual_seed(0)
    model = build_tiny_model(attention=SkipPaddingAttention())
    config = model.config
    pool = torch.randn(config.num_layers, 2, 256, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    graphs = DecodeGraphs(model, pool, BLOCK_SIZE, max_num_seqs=8, max_model_len=256, capture=eager_capture([]))
    with_graphs = ModelRunner(model, pool, BLOCK_SIZE, graphs)
    eager = ModelRunner(model, pool, BLOCK_SIZE)

    decode = decode_batch([9, 30, 2])
    due, logits = with_graphs.execute(decode)
    assert graphs.replays == 1 and indexed == []
    expected_due, expected = eager.execute(decode)
    assert due == expected_due == [seq for seq, _ in decode]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert [8, 29, 1] in indexed  # the eager step's positions went through to_device

    prefill = decode_batch([20], first_block=100)
    prefill[0][0].num_computed = 0
    prefill[0] = (prefill[0][0], 20)
    due, logits = with_graphs.execute(prefill)
    assert graphs.replays == 1, "a prefill step went through a decode graph"
    torch.testing.assert_close(logits, eager.execute(prefill)[1], atol=1e-5, rtol=1e-5)
    assert indexed.count([19]) == 2  # a prefill's last position, by index
    assert [list(range(20))] * 2 == [values for values in indexed if values == list(range(20))]  # positions


def test_fake_capture_graphs_are_captured_largest_bucket_first():
    # With one memory pool, the smaller graphs reuse the largest one's buffers only if it
    # was captured first.
    model = build_tiny_model(attention=SkipPaddingAttention())
    config = model.config
    pool = torch.zeros(config.num_layers, 2, 8, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    sizes: list[int] = []
    DecodeGraphs(model, pool, BLOCK_SIZE, max_num_seqs=24, max_model_len=64, capture=sizes_capture(sizes))
    assert sizes == sorted(batch_buckets(24), reverse=True)


def test_fake_capture_graph_pool_captures_before_attach_and_recaptures_per_attach():
    torch.manual_seed(1)
    model = build_tiny_model(attention=SkipPaddingAttention())
    config = model.config
    captures: list[int] = []
    graph_pool = DecodeGraphPool(model, max_num_seqs=8, max_model_len=128, capture=eager_capture(captures))
    assert len(captures) == len(batch_buckets(8))  # before any pool exists
    assert graph_pool.memory_bytes == 0  # CPU: nothing reserved; on CUDA the graphs' private pool

    for attach in range(2):  # a re-attach maps a new pool and captures its graphs again
        pool = torch.randn(config.num_layers, 2, 64, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        graphs = graph_pool.capture(pool, BLOCK_SIZE)
        assert graph_pool.graphs is graphs and len(captures) == (attach + 2) * len(batch_buckets(8))
        batch = decode_batch([9, 30, 2])
        due, logits = ModelRunner(model, pool, BLOCK_SIZE, graphs).execute(batch)
        torch.testing.assert_close(logits, ModelRunner(model, pool, BLOCK_SIZE).execute(batch)[1], atol=1e-5, rtol=1e-5)
        assert graphs.replays == 1


@needs_cuda
def test_cuda_graphs_replay_as_the_eager_step_and_never_recapture():
    """Real CUDA graphs (cuda_graph_capture), not the fake: each bucket captured once, in
    the graph pool, and a replay over new batch sizes and lengths equals the eager step."""
    from model_service.attention.backend import PagedAttention as Attention

    torch.manual_seed(0)
    model = build_tiny_model(device="cuda", attention=Attention("triton"))
    config = model.config
    graph_pool = DecodeGraphPool(model, max_num_seqs=16, max_model_len=256)
    pool = torch.randn(config.num_layers, 2, 256, BLOCK_SIZE, config.num_kv_heads, config.head_dim, device="cuda")
    graphs = graph_pool.capture(pool, BLOCK_SIZE)
    captured = graphs.captures
    assert captured == len(batch_buckets(16)) and graph_pool.memory_bytes > 0
    with_graphs, eager = ModelRunner(model, pool, BLOCK_SIZE, graphs), ModelRunner(model, pool, BLOCK_SIZE)
    for replay, lengths in enumerate(([5], [17, 40, 3], [33] * 8, [100, 7, 64, 12, 90]), start=1):
        batch = decode_batch(lengths)
        _, replayed = with_graphs.execute(batch)
        assert graphs.replays == replay
        torch.testing.assert_close(replayed, eager.execute(batch)[1], atol=1e-4, rtol=1e-4)
    assert graphs.captures == captured, "a new shape captured a new graph"


def test_prefill_and_oversized_batches_take_the_eager_path():
    model = build_tiny_model(attention=SkipPaddingAttention())
    config = model.config
    pool = torch.zeros(config.num_layers, 2, 64, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    graphs = DecodeGraphs(model, pool, BLOCK_SIZE, max_num_seqs=4, max_model_len=64, capture=eager_capture([]))
    prefill = decode_batch([20])
    prefill[0] = (prefill[0][0], 3)
    assert not graphs.can_run(prefill)
    assert not graphs.can_run(decode_batch([5] * 5))
    too_long = decode_batch([5])
    too_long[0][0].block_table.extend(range(10))
    assert not graphs.can_run(too_long)


@pytest.mark.parametrize("choice, device, backend, triton, expected", [
    ("auto", "cpu", "auto", True, False), ("auto", "cuda", "auto", True, True), ("off", "cuda", "auto", True, False),
    ("auto", "cuda", "torch", True, False), ("auto", "cuda", "auto", False, False),
])
def test_cuda_graphs_flag(choice, device, backend, triton, expected):
    from model_service.server import use_cuda_graphs

    assert use_cuda_graphs(choice, torch.device(device), backend, triton) is expected


def test_cuda_graphs_on_without_cuda_is_an_error():
    from model_service.server import use_cuda_graphs

    with pytest.raises(ValueError, match="needs --device cuda"):
        use_cuda_graphs("on", torch.device("cpu"), "auto")


class FakeCuda:
    """What cuda_graph_capture calls on torch.cuda, recorded: streams made, graphs captured
    (the step runs where the capture would record it), devices set."""

    def __init__(self) -> None:
        self.streams_made = 0
        self.graphs = 0
        self.devices_set = []
        self.stream_devices = []  # the device each stream was made or asked for on
        self.capture_streams = []  # the stream each graph was captured on

    def install(self, monkeypatch) -> None:
        import contextlib

        fake = self

        class Stream:
            def __init__(self, device=None) -> None:
                fake.streams_made += 1
                fake.stream_devices.append(device)

            def wait_stream(self, other) -> None:
                pass

        class CUDAGraph:
            def replay(self) -> None:
                pass

        @contextlib.contextmanager
        def graph(cuda_graph, pool=None, stream=None):
            fake.graphs += 1
            fake.capture_streams.append(stream)
            yield

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: fake.stream_devices.append(device) or Stream.__new__(Stream))
        monkeypatch.setattr(torch.cuda, "current_device",
                            lambda: torch.device(fake.devices_set[-1]).index if fake.devices_set else 0)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: fake.devices_set.append(str(device)))


def test_every_capture_shares_one_side_stream(monkeypatch):
    # A stream per capture would leave a cuBLAS workspace per stream for the process's life.
    from model_service.worker.decode_graphs import cuda_graph_capture

    cuda = FakeCuda()
    cuda.install(monkeypatch)
    capture = cuda_graph_capture()
    replays = [capture(lambda: torch.zeros(2)) for _ in range(5)]
    assert cuda.graphs == 5 and cuda.streams_made == 1
    assert torch.equal(replays[3](), torch.zeros(2))


def test_captures_use_the_streams_of_the_threads_current_device(monkeypatch):
    # The capturing thread (the engine's, at Attach) has set the model's device; its streams
    # are named by it rather than left to whichever device a bare current_stream() means.
    from model_service.worker.decode_graphs import cuda_graph_capture

    cuda = FakeCuda()
    cuda.install(monkeypatch)
    torch.cuda.set_device(torch.device("cuda:1"))
    cuda_graph_capture()(lambda: torch.zeros(2))
    assert cuda.stream_devices and set(cuda.stream_devices) == {1}
    # Not torch.cuda.graph's default capture stream, made on whichever device captured first.
    assert len(cuda.capture_streams) == 1 and cuda.capture_streams[0] is not None


def test_device_cuda_n_becomes_the_current_device(monkeypatch):
    # Triton launches and capture streams follow the current device, not the tensors'.
    from model_service.server import resolve_device

    cuda = FakeCuda()
    cuda.install(monkeypatch)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert cuda.devices_set == ["cuda:1"]
    with pytest.raises(ValueError, match=r"--device cuda:2: torch sees 2 GPU\(s\) here \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")
    assert resolve_device("cuda") == torch.device("cuda") and cuda.devices_set == ["cuda:1"]


def test_dropped_graphs_are_gone_and_the_next_attach_captures_again():
    model = build_tiny_model(torch.float32, "cpu", attention_backend="torch")
    captures = []

    def eager(step):
        captures.append(step)
        return step

    graph_pool = DecodeGraphPool(model, 4, 64, capture=eager)
    graph_pool.drop()
    assert graph_pool.graphs is None
    config = model.config
    kv_pool = torch.zeros(config.num_layers, 2, 8, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    assert graph_pool.capture(kv_pool, BLOCK_SIZE) is graph_pool.graphs
    assert len(captures) == 2 * len(batch_buckets(4))


class FakeAllocator:
    """The caching allocator as decode_graphs.py sees it: reserved bytes, of which some are
    cached (unused); emptying the cache gives the cached ones back to the driver."""

    def __init__(self, reserved: int, cached: int) -> None:
        self.reserved, self.cached = reserved, cached

    def empty_cache(self) -> None:
        self.reserved -= self.cached
        self.cached = 0

    def hold(self, num_bytes: int) -> None:
        if num_bytes > self.cached:
            self.reserved += num_bytes - self.cached
            self.cached = num_bytes

    def install(self, monkeypatch) -> None:
        from model_service.worker import decode_graphs

        monkeypatch.setattr(decode_graphs, "reserved_bytes", lambda device: self.reserved)
        monkeypatch.setattr(decode_graphs, "release_cached", lambda device: self.empty_cache())
        monkeypatch.setattr(decode_graphs, "hold_in_cache", lambda device, num_bytes: self.hold(num_bytes))


def test_graph_memory_is_the_graphs_alone_and_the_warmup_workspace_stays_reserved(monkeypatch):
    # torch 2.13 empties the allocator's cache on entering torch.cuda.graph. Measured around
    # the capture, a warmup scratch (500 MiB cached) larger than the graphs (64 MiB) made
    # memory_bytes -436 MiB (Attach's uint64 workspace_bytes then raised), and the cache
    # service found the scratch free and built the pool over it.
    mib = 1 << 20
    allocator = FakeAllocator(reserved=2000 * mib, cached=500 * mib)
    allocator.install(monkeypatch)
    model = build_tiny_model(torch.float32, "cpu", attention_backend="torch")

    def capture(step):
        allocator.empty_cache()  # as torch.cuda.graph's entry does
        allocator.reserved += 8 * mib  # each graph's own memory
        return step

    buckets = len(batch_buckets(8))
    graph_pool = DecodeGraphPool(model, 8, 64, capture=capture, workspace_bytes=500 * mib)
    assert graph_pool.memory_bytes == buckets * 8 * mib
    assert allocator.cached == 500 * mib  # held again for the prefills the pool was sized around
    config = model.config
    kv_pool = torch.zeros(config.num_layers, 2, 8, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    graph_pool.capture(kv_pool, BLOCK_SIZE)  # an Attach: its capture empties the cache again
    assert allocator.cached == 500 * mib


class FakeEvent:
    """A CUDA event as the runner uses it: recorded behind a step, waited on before blocks go back."""

    log: list[str] = []

    def __init__(self) -> None:
        self.number = len([entry for entry in FakeEvent.log if entry.startswith("record")])

    def record(self, stream=None) -> None:
        FakeEvent.log.append(f"record {self.number}")

    def synchronize(self) -> None:
        FakeEvent.log.append(f"synchronize {self.number}")


def test_blocks_are_released_only_after_the_writes_behind_them():
    # A middle prefill chunk samples nothing, so nothing waits for the GPU; the runner records
    # an event behind each step's writes, and wait_for_writes (called by the engine before a
    # lease call that commits or releases blocks) waits for the latest, once.
    FakeEvent.log = []
    model = build_tiny_model(torch.float32, "cpu", attention_backend="torch")
    config = model.config
    pool = torch.zeros(config.num_layers, 2, 16, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    runner = ModelRunner(model, pool, BLOCK_SIZE)
    assert runner.new_event is None  # CPU: execute returns after the writes
    runner.new_event = FakeEvent
    chunk = decode_batch([40])
    chunk[0][0].num_computed = 0
    due, _ = runner.execute([(chunk[0][0], 16)])  # the first 16 of 40 prompt tokens: nothing due
    assert due == [] and FakeEvent.log == ["record 0"]
    chunk[0][0].num_computed = 16
    runner.execute([(chunk[0][0], 16)])
    runner.wait_for_writes()
    runner.wait_for_writes()  # nothing written since: no second wait
    assert FakeEvent.log == ["record 0", "record 1", "synchronize 1"]
