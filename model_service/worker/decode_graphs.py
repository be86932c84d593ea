"""Decode steps replayed from captured graphs (CUDA graphs on GPU).

A decode step's shapes depend on only two things once block tables are padded to the
longest sequence the model serves: the batch size, bucketed here, and nothing else. So
a graph is captured once per bucket at start-up, and new prompt lengths or batch sizes
never capture again (`captures` stays where start-up left it).

Padding rows write to slot -1, which the K/V write kernel skips, and attend over a
context of 0 tokens; their outputs are dropped.

Memory. Every graph of the process is captured into one memory pool (one
torch.cuda.graph_pool_handle()), largest bucket first: the smaller graphs then reuse the
largest one's intermediate buffers instead of each keeping its own pool (PyTorch's
default), so the graphs cost about what the largest alone costs, plus each one's output.
DecodeGraphPool captures them once before Attach, over a one-block scratch pool, so that
their memory is already reserved (and counted in the workspace) when the cache service
reads free device memory to size the pool; each Attach then recaptures into the same pool.
Entering torch.cuda.graph empties the allocator's cache (torch 2.13), the warmup's
activations with it, so DecodeGraphPool empties it itself before measuring (memory_bytes
is the graphs' alone) and, after every capture, holds the warmup's workspace again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq

import torch

from model_service.attention.metadata import AttentionMetadata
from model_service.models.llama import LlamaForCausalLM
from model_service.sched.sequence import Sequence

# Captures a zero-argument step function and returns what replays it.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_num_seqs: padding wastes < 8 rows."""
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return sorted(set(buckets + [max_num_seqs]))


def cuda_graph_capture(pool=None) -> Capture:
    """Captures on CUDA into `pool` (a torch.cuda.graph_pool_handle(); None: a new one,
    shared by every graph this capture function makes)."""
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    # One side stream for every capture: PyTorch keeps a cuBLAS workspace per (handle,
    # stream) for the life of the process, so a new stream per capture would add one each
    # time (tens of MiB on Hopper), after the pool was sized.
    streams: list[torch.cuda.Stream] = []

    def capture(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        device = torch.cuda.current_device()  # the capturing thread's (torch_threads.use_device)
        if not streams:
            streams.append(torch.cuda.Stream(device))
        side = streams[0]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up: lazy init and autotuning stay out of the graph
            step()
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Captured on the side stream, named: torch.cuda.graph's default capture stream is
        # made once a process, on the device current at the first capture anywhere.
        with torch.cuda.graph(graph, pool=pool, stream=side):
            output = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    return capture


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_pool: torch.Tensor, block_size: int, max_num_seqs: int,
                 max_model_len: int, capture: Capture) -> None:
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_pool.device
        largest = self.buckets[-1]
        # Static inputs: every replay reads these; run() fills them in place.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((largest, self.max_blocks), dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.captures = 0
        self.replays = 0
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        with torch.inference_mode():  # as every replay runs: no autograd state in the graphs
            for size in reversed(self.buckets):  # largest first: smaller graphs reuse its memory (one pool)
                self._replays[size] = capture(self._step(model, kv_pool, size))
                self.captures += 1

    def _step(self, model: LlamaForCausalLM, kv_pool: torch.Tensor, size: int) -> Callable[[], torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size], query_lens=(1,) * size,
            # Host-side lengths are only read by the torch path's trimming; the graph
            # path (Triton) reads the device tensor, so the maximum is safe here.
            context_lens_host=(self.max_blocks * self.block_size,) * size,
            num_decode_seqs=size, block_size=self.block_size,
        )

        def step() -> torch.Tensor:
            return model(self.input_ids[:size], self.positions[:size], kv_pool, meta)

        return step

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def can_run(self, batch: Seq[tuple[Sequence, int]]) -> bool:
        return (all(new_tokens == 1 for _, new_tokens in batch)
                and self.bucket_for(len(batch)) is not None
                and all(len(seq.block_table) <= self.max_blocks for seq, _ in batch))

    @torch.inference_mode()
    def run(self, batch: Seq[tuple[Sequence, int]]) -> torch.Tensor:
        """Hidden states [len(batch), hidden] of one decode step."""
        size = self.bucket_for(len(batch))
        block_size = self.block_size
        ids, positions, slots, lens = [], [], [], []
        tables = torch.zeros((size, self.max_blocks), dtype=torch.int32)
        for row, (seq, _) in enumerate(batch):
            position = seq.num_computed
            ids.append(seq.token_ids[position])
            positions.append(position)
            slots.append(seq.block_table[position // block_size] * block_size + position % block_size)
            lens.append(position + 1)
            tables[row, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        padding = size - len(batch)
        # From pinned memory: a copy from pageable memory waits for the stream first.
        pin = self.input_ids.is_cuda
        staged = (torch.tensor(ids + [0] * padding), torch.tensor(positions + [0] * padding),
                  torch.tensor(slots + [-1] * padding), torch.tensor(lens + [0] * padding, dtype=torch.int32), tables)
        targets = (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.block_tables)
        for target, values in zip(targets, staged):
            target[:size].copy_(values.pin_memory() if pin else values, non_blocking=True)
        self.replays += 1
        # The graph's output buffer: the next replay overwrites it, so use it before then.
        return self._replays[size]()[: len(batch)]


def reserved_bytes(device: torch.device) -> int:
    """Device memory the caching allocator holds (what other processes cannot have); 0 off CUDA."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def release_cached(device: torch.device) -> None:
    """Give the allocator's unused cached memory back to the driver (what entering
    torch.cuda.graph does anyway, in torch 2.13)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def hold_in_cache(device: torch.device, num_bytes: int) -> None:
    """Leave num_bytes cached (reserved, unused) in the allocator's default pool: one
    allocation of that size, freed at once, stays reserved for the next that fits."""
    if device.type == "cuda" and num_bytes > 0:
        torch.empty(num_bytes, dtype=torch.uint8, device=device)  # freed at once: the reference is dropped


class DecodeGraphPool:
    """The decode graphs of every Attach of this process, in one memory pool.

    Built before the first Attach: it captures every bucket over a one-block scratch pool
    (the capture's warmup steps attend over no context and write nowhere), which reserves
    the graphs' memory; `memory_bytes` is how much, and belongs in the workspace reported
    at Attach. `capture(kv_pool, block_size)` captures the graphs of an attached pool into
    the same memory pool, then drops the previous graphs: their buffers are reused, not
    added to.
    """

    def __init__(self, model: LlamaForCausalLM, max_num_seqs: int, max_model_len: int,
                 capture: Capture | None = None, scratch_block_size: int = 16, workspace_bytes: int = 0) -> None:
        config = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._capture = capture or cuda_graph_capture()
        scratch = torch.zeros((config.num_layers, 2, 1, scratch_block_size, config.num_kv_heads, config.head_dim),
                              dtype=parameter.dtype, device=self.device)
        self.workspace_bytes = workspace_bytes
        # Capturing empties the allocator's cache, the warmup's activations with it: give
        # them back first, so the growth measured is the graphs' alone (it was negative
        # when the warmup's scratch outweighed the graphs), then hold the warmup's
        # workspace again (_after_capture), so that the cache service's reading of free
        # memory still leaves it to this process's prefills.
        release_cached(self.device)
        before = reserved_bytes(self.device)
        self.graphs = DecodeGraphs(model, scratch, scratch_block_size, max_num_seqs, max_model_len, self._capture)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.memory_bytes = max(reserved_bytes(self.device) - before, 0)
        self._after_capture()

    def _after_capture(self) -> None:
        hold_in_cache(self.device, self.workspace_bytes)

    def drop(self) -> None:
        """Forget the graphs of a pool that is gone (the cache service was lost): they point
        into its memory. Their memory pool stays, for the next Attach's capture."""
        self.graphs = None

    def capture(self, kv_pool: torch.Tensor, block_size: int) -> DecodeGraphs:
        graphs = DecodeGraphs(self.model, kv_pool, block_size, self.max_num_seqs, self.max_model_len, self._capture)
        self.graphs = graphs  # the previous graphs go; their memory stays in the shared pool
        self._after_capture()  # this capture emptied the cache again
        return graphs
