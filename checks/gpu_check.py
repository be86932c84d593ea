"""GPU check: run on a machine with a CUDA GPU (no GPU in CI or on the dev machines).

    python -m checks.gpu_check                    # prints a report; exit 1 if a check fails
    python -m checks.gpu_check --min-bandwidth-fraction 0.4 --skip services
    python -m checks.gpu_check --only kernels --only fp8_kv

Exit status: 0 every check passed, 1 a check failed, 2 nothing was checked (no CUDA
device, or every check skipped: a run that checks nothing never passes).
Every check can fail; a dependency a check needs that does not import fails that check.

Needs torch with CUDA and triton for every check; the model and services checks also need
what the services and the tests need (transformers, tokenizers, safetensors, grpcio,
protobuf, structlog, prometheus-client): run it from the project's test environment.

Every check compares with something independent of what it checks, and prints its bound;
a markdown table of all of them comes last (for BENCHMARKS.md). One command, meant to fit
in ten minutes on one H200 (most of it Triton compiling the kernel variants).

1. kernels: the Triton decode kernel against a plain gather + float64 SDPA
   (reference_decode), float32/float16/bfloat16, head_dim 64 and 128, GQA groups 1, 3, 4
   and 8, with and without a sliding window, whole and split context (heuristic, 1, 8),
   random block tables whose ids are distinct across rows, a padded entry; each element
   within its dtype's rounding of the reference plus float32 accumulation (UNIT_ROUNDOFF).
   The K/V write against plain indexing, bit for bit. LoRA's segmented product
   (models/lora_triton.py, through LoraStep as the model calls it), float32/float16/bfloat16:
   a decode batch of 8 adapters (ranks 1-64, powers of two and not) with base rows, and
   prefill runs (long, empty, over one rank block, an adapter without the projection),
   against float64 matmuls (harness/lora_segments.py: within a unit in the last place
   plus float32 accumulation), rows outside the runs untouched.
fp8_kv: an 8-bit pool (e4m3 and e5m2, scales other than 1; float16 q at head_dim 64, bfloat16
   at 128; groups 1 and 8; splits auto, 1, 8): the decode kernel against the
   same float64 reference over the pool's dequantized values, within the same bound; the
   8-bit write against torch's own cast of K/V over their scales, byte for byte.
2. bandwidth: the decode kernel's K/V read rate must reach --min-bandwidth-fraction of a
   device-to-device copy of the same bytes measured in the same run (a copy reads and
   writes each byte; the kernel only reads them); the split must make one 32K-token
   sequence at least 2x faster than the whole-context kernel (8 of the SMs busy).
3. graph_memory: the decode graphs share one memory pool: all buckets together may
   reserve at most --max-graph-memory-ratio times what the largest bucket's graph alone
   reserves (plus the smaller graphs' outputs); separate pools (PyTorch's default) are
   measured for the record. DecodeGraphPool.memory_bytes (what the workspace reported at
   Attach includes) must be what the driver (mem_get_info) lost while they were captured.
4. graphs: over a pool of random K/V with random, distinct block tables and tokens a row,
   graph replays (24 rows, 7 rows in a larger bucket, 3 short rows, each also reversed)
   match the eager step row for row, and nothing is captured again.
sampling: sample() on CUDA at temperature > 0 (temperature alone; top-k with top-p;
   min-p), 16,384 rows of one logits row, each row its own generator: the drawn tokens'
   frequencies within --max-sampling-tv total variation of the distribution computed in
   float64 from the same logits (reference_distribution, no code shared with the sampler).
cuda_n: the model on the last GPU (cuda:N, N = device_count - 1) as --device cuda:N runs
   it: the warmup in a passing thread, a prefill and graph-replayed decode steps in a new
   thread (the engine's), against the CPU path's logits.
tiers: the KV tiers over a CUDA pool of random bfloat16 K/V (cache_service/tiers): 256 blocks
   demoted to an exactly pinned host tier (the bytes pinned are the tier's, no power-of-two
   rounding: torch's caching host allocator grows by nothing) and promoted back by one
   allocate, then 32 blocks through a disk tier without a host tier; every promoted block
   equal byte for byte to a CPU copy of the pool taken before (no code shared with the
   tiers). The promotion's rate against one pinned-to-device copy of the same bytes is
   measured for the record.
5. model: the whole model on CUDA (Triton kernels) against transformers on CUDA, bfloat16
   and float16, Llama and Mistral (sliding window): logits within harness/low_precision.py's
   tolerance over prefill and decode.
6. services: the cache service and two model services as real processes on one GPU, at
   once: the cache service allocates the pool on the GPU and hands it over by CUDA IPC in
   Attach to both; both (decode graphs on) serve every prompt concurrently, greedy and
   equal to transformers on CUDA up to a near tie; the workspace at Attach includes the
   graphs' memory; one service reads the K/V the other wrote through the prefix cache
   and still agrees with transformers; nothing stays leased. Then tokens/s end to end: 8
   streams of 128 tokens through one service against transformers' generate() of the same
   batch on the same GPU; the ratio must reach --min-throughput-ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHECKS = ("kernels", "fp8_kv", "bandwidth", "graph_memory", "graphs", "sampling", "cuda_n", "tiers", "model",
          "services")
FAILURES: list[str] = []
# (check, result, measured, bound): the table printed at the end, for BENCHMARKS.md.
ROWS: list[tuple[str, str, str, str]] = []


def check(name: str, ok: bool, detail: str = "", measured: str = "", bound: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    ROWS.append((name, "ok" if ok else "FAIL", measured or detail[:60], bound))
    if not ok:
        FAILURES.append(name)


def print_table() -> None:
    print("\n| check | result | measured | bound |\n|---|---|---|---|")
    for row in ROWS:
        print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--min-bandwidth-fraction", type=float, default=0.3,
                        help="the decode kernel's read rate must reach this fraction of the copy's (default 0.3)")
    parser.add_argument("--max-graph-memory-ratio", type=float, default=1.5,
                        help="all decode graphs may reserve this many times the largest one alone (default 1.5)")
    parser.add_argument("--max-sampling-tv", type=float, default=0.05,
                        help="largest total variation between drawn and float64 token frequencies (default 0.05)")
    parser.add_argument("--min-throughput-ratio", type=float, default=0.25,
                        help="the services' tokens/s over transformers' generate() on the same batch (default 0.25)")
    parser.add_argument("--services-logs", type=Path, default=None,
                        help="keep the services' stderr logs here (default: a temporary folder, removed after)")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, help="leave out a check (repeatable)")
    parser.add_argument("--only", action="append", default=[], choices=CHECKS,
                        help="run only this check (repeatable; the others are skipped)")
    args = parser.parse_args(argv)
    if args.only:
        args.skip = sorted(set(args.skip) | (set(CHECKS) - set(args.only)))
    if set(args.skip) >= set(CHECKS):
        parser.error("every check is skipped: nothing would be checked, and a run that checks nothing never passes")
    if not 0 < args.max_sampling_tv < 1:
        parser.error(f"--max-sampling-tv must be in (0, 1), got {args.max_sampling_tv}")
    if args.min_throughput_ratio <= 0:
        parser.error(f"--min-throughput-ratio must be positive, got {args.min_throughput_ratio}")
    if not 0 < args.min_bandwidth_fraction <= 1:
        parser.error(f"--min-bandwidth-fraction must be in (0, 1], got {args.min_bandwidth_fraction}")
    if args.max_graph_memory_ratio < 1:
        parser.error(f"--max-graph-memory-ratio must be >= 1, got {args.max_graph_memory_ratio}")
    return args


# Unit roundoff of each output dtype: rounding a float32 result to it moves it by at most
# this much relative. The Triton kernels compute in float32 from inputs in the dtype, and the
# reference below computes in float64 from the same inputs, so an element may differ by its
# rounding (u x |reference|) plus float32 accumulation over at most 1,024 positions and 128
# dims, which ACCUMULATION_SLACK x max|v| bounds (1,024 x 2^-24 is 6e-5).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
ACCUMULATION_SLACK = 1e-4


def random_pool(layers, blocks, block_size, kv_heads, head_dim, dtype):
    import torch

    return torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)


def random_tables(batch: int, width: int, num_blocks: int, device: str = "cuda"):
    """[batch, width] int32 block ids, all distinct across every row (a mix-up of two rows'
    blocks shows), drawn from num_blocks >= batch * width."""
    import torch

    assert num_blocks >= batch * width, (num_blocks, batch, width)
    return torch.randperm(num_blocks, device=device)[: batch * width].view(batch, width).to(torch.int32)


def reference_decode(q, kv_layer, tables, lens, scale, window=None):
    """Gather each sequence's K/V from its table and run SDPA in float64: shares no code
    with the paged paths (torch_paged.py, the Triton and C kernels)."""
    import torch
    import torch.nn.functional as F

    num_seqs, q_heads, head_dim = q.shape
    block_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    out = torch.zeros(num_seqs, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for row in range(num_seqs):
        length = int(lens[row])
        if length == 0:
            continue
        blocks = tables[row, : -(-length // block_size)].long()
        k = kv_layer[0, blocks].reshape(-1, kv_heads, head_dim)[:length]
        v = kv_layer[1, blocks].reshape(-1, kv_heads, head_dim)[:length]
        if window is not None:
            k, v = k[max(0, length - window):], v[max(0, length - window):]
        group = q_heads // kv_heads
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [q_heads, n, dim]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        out[row] = F.scaled_dot_product_attention(q[row].double()[:, None, :], k, v, scale=scale)[:, 0, :]
    return out


def dtype_margin(got, reference, v_max: float, dtype_name: str) -> float:
    """Largest |got - reference| over its bound (see UNIT_ROUNDOFF); <= 1 passes."""
    bound = UNIT_ROUNDOFF[dtype_name] * reference.abs() + ACCUMULATION_SLACK * v_max
    return float(((got.double() - reference).abs() / bound).max())


def kernels_match(args) -> None:
    import torch

    from model_service.attention import triton_kernels

    torch.manual_seed(0)
    batch, kv_heads, block_size, width = 16, 4, 16, 44
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype)[6:]
        for head_dim in (64, 128):
            pool = random_pool(1, batch * width + 64, block_size, kv_heads, head_dim, dtype)[0]
            v_max = float(pool[1].abs().max())
            worst: dict[tuple, float] = {}
            for group in (1, 3, 4, 8):
                for window in (None, 100):
                    for num_splits in (None, 1, 8):  # None: the heuristic (2 here on 132 SMs)
                        lens = torch.randint(1, width * block_size, (batch,), device="cuda", dtype=torch.int32)
                        lens[0] = 0  # a padded batch entry: zeros
                        tables = random_tables(batch, width, pool.shape[1])
                        q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
                        scale = head_dim ** -0.5
                        expected = reference_decode(q, pool, tables, lens, scale, window)
                        got = triton_kernels.decode_attention_triton(q, pool, tables, lens, scale,
                                                                     sliding_window=window, num_splits=num_splits)
                        worst[(group, window, num_splits)] = dtype_margin(got, expected, v_max, name)
            key, margin = max(worst.items(), key=lambda item: item[1])
            check(f"decode {name} head_dim {head_dim}", margin <= 1.0,
                  f"{len(worst)} cases (groups 1/3/4/8, window none/100, splits auto/1/8); worst error "
                  f"{margin:.2f} of the bound u|ref| + {ACCUMULATION_SLACK:g} max|v| at group, window, splits {key}",
                  measured=f"{margin:.2f} of bound", bound="<= 1")
            k = torch.randn(64, kv_heads, head_dim, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            slots = torch.randperm(pool.shape[1] * block_size, device="cuda")[:64]
            slots[5] = -1  # a padding token: written nowhere
            expected_pool = pool.clone()
            flat = expected_pool.view(2, -1, kv_heads, head_dim)
            flat[0, slots[slots >= 0]] = k[slots >= 0]
            flat[1, slots[slots >= 0]] = v[slots >= 0]
            triton_kernels.write_kv_triton(k, v, pool, slots)
            check(f"write_kv {name} head_dim {head_dim}", torch.equal(pool, expected_pool),
                  "63 slots written, a -1 slot skipped, against plain indexing")
    lora_segments_match()


def lora_segments_match() -> None:
    import torch

    from harness import lora_segments

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        results = [lora_segments.through_lora_step(segments, in_features, out_features, dtype, "cuda", seed)
                   for seed, segments in enumerate((lora_segments.DECODE_SEGMENTS, lora_segments.PREFILL_SEGMENTS))
                   for in_features, out_features in lora_segments.DEVICE_SHAPES]
        worst = max(margin for margin, _, _ in results)
        untouched = all(equal for _, equal, _ in results)
        served = all(triton for _, _, triton in results)
        check(f"lora segments {str(dtype)[6:]}", served and worst <= 1.0 and untouched,
              f"{len(results)} batches (decode: 8 adapters and base rows; with prefill runs); served by Triton: "
              f"{served}; worst error {worst:.2f} of the bound; rows outside the runs untouched: {untouched}",
              measured=f"{worst:.2f} of bound", bound="<= 1")


def _fp8_pool(source, scales, kv_dtype):
    """[2, ...] float32 K/V -> the 8-bit pool torch's own cast makes of K / k_scale, V / v_scale
    (saturated to the format's range), as kv_dtype."""
    import torch

    limit = torch.finfo(kv_dtype).max
    halves = [(source[i] / scales[i]).clamp(-limit, limit).to(kv_dtype).view(torch.uint8) for i in (0, 1)]
    return torch.stack(halves).view(kv_dtype)


def fp8_kv_match(args) -> None:
    import torch

    from model_service.attention import triton_kernels

    torch.manual_seed(1)
    batch, kv_heads, block_size, width = 16, 4, 16, 44
    scales = (0.05, 0.02)  # not 1: the kernels fold both into the softmax and the output
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv_name = str(kv_dtype)[6:]
        # Two (q dtype, head_dim) pairs and groups 1 and 8: each combination is a compile
        # of its own, and the 16-bit pools' matrix is the kernels check's.
        for dtype, head_dim in ((torch.float16, 64), (torch.bfloat16, 128)):
            name = str(dtype)[6:]
            source = random_pool(1, batch * width + 64, block_size, kv_heads, head_dim, torch.float32)[0]
            pool = _fp8_pool(source, scales, kv_dtype)
            dequantized = torch.stack([pool[0].double() * scales[0], pool[1].double() * scales[1]])
            v_max = float(dequantized[1].abs().max())
            worst: dict[tuple, float] = {}
            for group in (1, 8):
                for num_splits in (None, 1, 8):
                    lens = torch.randint(1, width * block_size, (batch,), device="cuda", dtype=torch.int32)
                    tables = random_tables(batch, width, pool.shape[1])
                    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
                    scale = head_dim ** -0.5
                    expected = reference_decode(q, dequantized, tables, lens, scale)
                    got = triton_kernels.decode_attention_triton(q, pool, tables, lens, scale,
                                                                 num_splits=num_splits, kv_scales=scales)
                    worst[(group, num_splits)] = dtype_margin(got, expected, v_max, name)
            key, margin = max(worst.items(), key=lambda item: item[1])
            check(f"decode {kv_name} pool, {name} q, head_dim {head_dim}", margin <= 1.0,
                  f"{len(worst)} cases (groups 1/8, splits auto/1/8) against float64 over the dequantized "
                  f"pool; worst {margin:.2f} of the bound at group, splits {key}",
                  measured=f"{margin:.2f} of bound", bound="<= 1")
        k = torch.randn(64, kv_heads, 128, device="cuda", dtype=torch.bfloat16) * 3
        v = torch.randn_like(k) * 3
        k[0, 0, 0] = 1e6  # saturates: the largest finite value, never inf or NaN
        layer = torch.zeros(2, 40, block_size, kv_heads, 128, device="cuda", dtype=kv_dtype)
        slots = torch.randperm(40 * block_size, device="cuda")[:64]
        triton_kernels.write_kv_triton(k, v, layer, slots, kv_scales=scales)
        expected = _fp8_pool(torch.stack([k.float(), v.float()]), scales, kv_dtype)
        written = layer.view(torch.uint8).view(2, -1, kv_heads, 128)[:, slots]
        check(f"write_kv {kv_name} pool", torch.equal(written, expected.view(torch.uint8)),
              "64 tokens (one saturating) against torch's cast of K/k_scale and V/v_scale, byte for byte")


def reference_distribution(logits, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """The probabilities sample() draws from, in float64 from one row of logits: temperature,
    min-p (below min_p x the best probability: out), top-k (below the k-th logit: out, ties
    kept), then the nucleus (the best tokens up to and including the first at which the
    mass ranked above it reaches top_p; ties with its smallest kept), renormalised."""
    import torch

    scaled = logits.double() / temperature
    if min_p > 0:
        probs = torch.softmax(scaled, -1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], float("-inf"))
    probs = torch.softmax(scaled, -1)
    if top_p < 1:
        ordered = torch.sort(probs, descending=True).values
        above = torch.cumsum(ordered, 0) - ordered
        smallest = ordered[above < top_p].min()
        probs = probs.masked_fill(probs < smallest, 0.0)
    return probs / probs.sum()


def sampling_distribution(args) -> None:
    import torch

    from model_service.sample.params import SamplingOptions
    from model_service.sample.sampler import make_generator, sample

    rows, vocab = 16384, 1000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 3  # float32, as the sampler reads
    cases = (("temperature 0.7", dict(temperature=0.7)),
             ("temperature 1, top-k 50, top-p 0.9", dict(temperature=1.0, top_k=50, top_p=0.9)),
             ("temperature 1.3, min-p 0.05", dict(temperature=1.3, min_p=0.05)))
    for seed, (name, knobs) in enumerate(cases):
        options = [SamplingOptions(max_new_tokens=1, **knobs)] * rows
        generators = [make_generator(seed * rows + row, "cuda") for row in range(rows)]
        drawn = sample(logits.cuda().expand(rows, vocab), options, generators).cpu()
        frequencies = torch.bincount(drawn, minlength=vocab).double() / rows
        expected = reference_distribution(logits, **knobs)
        tv = 0.5 * float((frequencies - expected).abs().sum())
        outside = int(frequencies[expected == 0].gt(0).sum())
        check(f"sampling on CUDA, {name}", tv <= args.max_sampling_tv and outside == 0,
              f"{rows} rows: total variation {tv:.3f} from float64 (bound {args.max_sampling_tv:g}); "
              f"{outside} tokens drawn outside the reference's support", measured=f"TV {tv:.3f}",
              bound=f"<= {args.max_sampling_tv:g}, none outside")


def _steps_on(runner, model):
    """Logits (CPU float32) of a prefill of 20 tokens then 6 decode steps of one sequence."""
    import torch

    from model_service.sched.sequence import Sequence

    tokens = [(index * 37) % model.config.vocab_size for index in range(26)]
    sequence = Sequence("a", tokens[:20], 20, None, 0, block_table=[0, 1])
    out = []
    _, logits = runner.execute([(sequence, 20)])
    out.append(logits.float().cpu())
    sequence.num_computed = 20
    for position in range(20, 26):
        sequence.token_ids.append(tokens[position])
        _, logits = runner.execute([(sequence, 1)])
        out.append(logits.float().cpu())
        sequence.num_computed += 1
    runner.wait_for_writes()
    return torch.cat(out)


def cuda_n(args) -> None:
    import threading

    import torch

    from model_service.loading.tiny import build_tiny_model
    from model_service.worker.decode_graphs import DecodeGraphs, cuda_graph_capture
    from model_service.worker.runner import ModelRunner, measure_workspace
    from model_service.worker.torch_threads import run_in_passing_thread, use_device

    index = torch.cuda.device_count() - 1
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)  # what --device cuda:N does in the main thread (server.resolve_device)
    try:
        model = build_tiny_model(torch.float32, device, attention_backend="triton")
        config = model.config
        shape = (config.num_layers, config.num_kv_heads, config.head_dim)
        workspace = run_in_passing_thread(lambda: measure_workspace(model, shape, torch.float32, device, 16, 64,
                                                                     max_num_seqs=8))
        result: dict = {}

        def engine_thread() -> None:  # as Engine._run: the device first, then attach and steps
            try:
                use_device(device)
                pool = torch.zeros(config.num_layers, 2, 4, 16, config.num_kv_heads, config.head_dim, device=device)
                graphs = DecodeGraphs(model, pool, 16, 4, 64, cuda_graph_capture())
                runner = ModelRunner(model, pool, 16, graphs)
                result["logits"] = _steps_on(runner, model)
                result["replays"] = graphs.replays
            except Exception as error:  # reported below, in the main thread
                result["error"] = error

        thread = threading.Thread(target=engine_thread, name="engine")
        thread.start()
        thread.join()
    finally:
        torch.cuda.set_device(0)  # the checks after this one run on cuda:0
    if "error" in result:
        raise result["error"]
    reference = build_tiny_model(torch.float32, "cpu", attention_backend="torch")
    pool = torch.zeros(config.num_layers, 2, 4, 16, config.num_kv_heads, config.head_dim)
    expected = _steps_on(ModelRunner(reference, pool, 16), reference)
    error = float((result["logits"] - expected).abs().max())
    note = "" if index else " (one GPU here: cuda:0 named explicitly)"
    check(f"cuda:{index}: warmup, prefill and graph decode from new threads vs the CPU path",
          error < 2e-3 and result["replays"] == 6 and workspace > 0,
          f"max |logit diff| {error:.1e} over 7 steps, {result['replays']} graph replays, warmup workspace "
          f"{workspace:,} bytes{note}", measured=f"{error:.1e}", bound="< 2e-3, 6 replays")


def timed(fn, repeats: int = 50) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def decode_bandwidth(args) -> None:
    import torch

    from model_service.attention import triton_kernels

    dtype, batch, kv_heads, group, head_dim, block_size, context = torch.bfloat16, 64, 8, 4, 128, 16, 2048
    blocks_per_seq = context // block_size
    pool = random_pool(1, batch * blocks_per_seq, block_size, kv_heads, head_dim, dtype)[0]
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * pool.element_size()

    kernel_s = timed(lambda: triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0))
    source = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16)  # kv_bytes bytes
    target = torch.empty_like(source)
    copy_s = timed(lambda: target.copy_(source))
    # A copy reads and writes each byte; the kernel only reads K/V.
    copy_gbps, kernel_gbps = 2 * kv_bytes / copy_s / 1e9, kv_bytes / kernel_s / 1e9
    fraction = kernel_gbps / copy_gbps
    print(json.dumps({"decode_kernel_ms": kernel_s * 1e3, "decode_read_GBps": kernel_gbps,
                      "d2d_copy_GBps": copy_gbps, "kernel_over_copy": fraction}), flush=True)
    check("decode bandwidth", fraction >= args.min_bandwidth_fraction,
          f"{kernel_gbps:.0f} GB/s read = {fraction:.2f} of the copy's {copy_gbps:.0f} GB/s "
          f"(needs >= {args.min_bandwidth_fraction:g})",
          measured=f"{kernel_gbps:.0f} GB/s ({fraction:.2f} of copy)", bound=f">= {args.min_bandwidth_fraction:g}")

    # One long sequence: without a split, 8 programs (one per kv head) read 32K positions on
    # 8 of the GPU's SMs; the split spreads them over the rest.
    context, single_blocks = 32768, 32768 // block_size
    pool = random_pool(1, single_blocks, block_size, kv_heads, head_dim, dtype)[0]
    tables = torch.randperm(single_blocks, device="cuda").view(1, -1).to(torch.int32)
    lens = torch.full((1,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(1, kv_heads * group, head_dim, device="cuda", dtype=dtype)
    splits = triton_kernels.choose_num_splits(1, kv_heads, single_blocks, triton_kernels.sm_count(q.device))
    whole_s = timed(lambda: triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0, num_splits=1))
    split_s = timed(lambda: triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0))
    speedup = whole_s / split_s
    check("split decode of one 32K sequence", speedup >= 2.0,
          f"{splits} splits: {split_s * 1e6:.0f} us against {whole_s * 1e6:.0f} us whole ({speedup:.1f}x)",
          measured=f"{speedup:.1f}x ({splits} splits, {split_s * 1e6:.0f} us)", bound=">= 2x")


def _tiny_cuda_model():
    import torch

    from model_service.loading.tiny import build_tiny_model

    return build_tiny_model(torch.bfloat16, "cuda", attention_backend="triton")


def _mid_cuda_model():
    """A 4-layer model of Llama-3-1B-like width, random: decode activations at batch 128 are
    megabytes, so graph memory is made of large allocations, not the allocator's 2 MB
    small-block segments (which would hide whether buffers are reused)."""
    import torch

    from model_service.models.config import ModelConfig
    from model_service.models.llama import LlamaForCausalLM

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=2048,
                         intermediate_size=8192, num_layers=4, num_heads=16, num_kv_heads=4, head_dim=128,
                         max_position_embeddings=4096)
    model = LlamaForCausalLM(config, attention_backend="triton")
    model.rotary.reset_cache(dtype=torch.bfloat16)
    return model.to(device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)


def graph_memory(args) -> None:
    import gc

    import torch

    from model_service.worker.decode_graphs import DecodeGraphPool, DecodeGraphs, batch_buckets, cuda_graph_capture

    model = _mid_cuda_model()
    config = model.config
    max_num_seqs, max_model_len = 128, 2048
    pool = torch.zeros(config.num_layers, 2, 4, 16, config.num_kv_heads, config.head_dim,
                       device="cuda", dtype=torch.bfloat16)
    buckets = batch_buckets(max_num_seqs)

    def largest_only(capture):
        captured: list[int] = []

        def capture_first(step):
            if captured:
                return step  # the smaller buckets stay eager: only the largest is measured
            captured.append(1)
            return capture(step)
        return capture_first

    def separate_pools(step):  # PyTorch's default: a private pool per graph
        return cuda_graph_capture(torch.cuda.graph_pool_handle())(step)

    def graphs_with(capture):
        return lambda: DecodeGraphs(model, pool, 16, max_num_seqs, max_model_len, capture)

    def growth(make) -> tuple[int, object]:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what earlier graphs left is given back first
        before = torch.cuda.memory_reserved()
        made = make()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - before, made

    growth(graphs_with(cuda_graph_capture()))  # warm-up: kernels compiled, allocator initialised
    # [0]: each measurement's graphs are dropped before the next one is taken.
    alone = growth(graphs_with(largest_only(cuda_graph_capture())))[0]
    shared = growth(graphs_with(cuda_graph_capture()))[0]
    separate = growth(graphs_with(separate_pools))[0]
    measured, graph_pool = growth(lambda: DecodeGraphPool(model, max_num_seqs, max_model_len))
    del graph_pool.graphs
    graph_pool = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The driver's view, independent of the caching allocator that memory_bytes reads: what
    # the cache service's mem_get_info will no longer find free once the graphs exist.
    driver_free_before = torch.cuda.mem_get_info()[0]
    graph_pool = DecodeGraphPool(model, max_num_seqs, max_model_len)
    torch.cuda.synchronize()
    driver_used = driver_free_before - torch.cuda.mem_get_info()[0]
    # Each smaller graph keeps its output [bucket, hidden] alive in the pool.
    outputs = sum(buckets[:-1]) * config.hidden_size * 2
    allowed = args.max_graph_memory_ratio * alone + outputs
    print(json.dumps({"buckets": len(buckets), "largest_alone_bytes": alone, "all_shared_pool_bytes": shared,
                      "all_separate_pools_bytes": separate, "decode_graph_pool_measured_bytes": measured,
                      "decode_graph_pool_memory_bytes": graph_pool.memory_bytes, "driver_used_bytes": driver_used,
                      "outputs_bytes": outputs}),
          flush=True)
    check("graphs share one memory pool", 0 < shared <= allowed,
          f"{len(buckets)} graphs reserve {shared:,} bytes; the largest alone {alone:,} "
          f"(allowed {args.max_graph_memory_ratio:g}x + outputs = {allowed:,.0f}); separate pools {separate:,}",
          measured=f"{shared / 2**20:.0f} MiB (largest alone {alone / 2**20:.0f})",
          bound=f"<= {allowed / 2**20:.0f} MiB")
    # memory_bytes goes into the workspace at Attach: it must be what the driver lost, or the
    # pool is sized over memory the graphs use (or leaves memory idle). 10% or 4 MiB: the
    # allocator's 2 MiB segments and the CUDA context's own lazy growth.
    slack = max(0.1 * driver_used, 4 << 20)
    check("DecodeGraphPool.memory_bytes is what the driver lost",
          0 < graph_pool.memory_bytes and abs(driver_used - graph_pool.memory_bytes) <= slack,
          f"memory_bytes {graph_pool.memory_bytes:,}, device memory taken (mem_get_info) {driver_used:,}",
          measured=f"{graph_pool.memory_bytes / 2**20:.1f} MiB vs driver {driver_used / 2**20:.1f} MiB",
          bound="within 10% or 4 MiB")


def decode_graphs_do_not_recapture(args) -> None:
    import torch

    from model_service.sched.sequence import Sequence
    from model_service.worker.decode_graphs import DecodeGraphs, cuda_graph_capture
    from model_service.worker.runner import ModelRunner

    model = _tiny_cuda_model()
    config = model.config
    block_size, num_blocks = 16, 1024
    # Random K/V in every block and distinct random tables and tokens per row: a replay that
    # mixed up rows, read a stale table or attended over the wrong length differs.
    pool = torch.randn(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                       device="cuda", dtype=torch.bfloat16)
    graphs = DecodeGraphs(model, pool, block_size, max_num_seqs=32, max_model_len=1024, capture=cuda_graph_capture())
    captured = graphs.captures
    generator = torch.Generator().manual_seed(5)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()

    def batch(lengths):
        out = []
        for i, n in enumerate(lengths):
            table = [free_blocks.pop() for _ in range(-(-n // block_size))]
            tokens = torch.randint(4, config.vocab_size, (n,), generator=generator).tolist()
            out.append((Sequence(str(i), tokens, n - 1, None, i, block_table=table, num_computed=n - 1), 1))
        return out

    runner = ModelRunner(model, pool, block_size, graphs)
    eager = ModelRunner(model, pool, block_size)
    lengths = torch.randint(1, 1000, (24,), generator=generator).tolist()
    for name, rows in (("24 rows", batch(lengths)), ("7 rows, another bucket", batch(lengths[:7])),
                       ("3 short rows", batch([9, 17, 33]))):
        _, expected = eager.execute(rows)
        _, logits = runner.execute(rows)
        _, reversed_logits = runner.execute(rows[::-1])
        error = max((logits.float() - expected.float()).abs().max().item(),
                    (reversed_logits.flip(0).float() - expected.float()).abs().max().item())
        # Same kernels and order either way: graphs replay the eager step's launches, so any
        # difference is a mix-up; 5e-2 is a few bf16 units of these logits.
        check(f"graph replay matches the eager step ({name}, and reversed)", error < 5e-2,
              f"max |diff| {error:.2e} (bf16 logits)", measured=f"{error:.1e}", bound="< 5e-2")
    torch.cuda.synchronize()
    check("the runner replays graphs for decode steps", graphs.replays == 6, f"replays {graphs.replays}",
          measured=str(graphs.replays), bound="6")
    check("no new graph for shorter prompts or other batch sizes", graphs.captures == captured,
          f"captured at start-up {captured}, after {graphs.captures}", measured=str(graphs.captures),
          bound=str(captured))


def model_vs_transformers(args) -> None:
    import torch
    from harness.hf_checkpoints import write_checkpoint
    from harness.low_precision import assert_close_in_dtype
    from harness.paged_runner import PagedRunner
    from transformers import AutoModelForCausalLM

    from model_service.loading.loader import load_model

    with tempfile.TemporaryDirectory() as directory:
        for kind in ("llama", "mistral"):
            path = write_checkpoint(kind, Path(directory) / kind)
            for dtype in (torch.bfloat16, torch.float16):
                name = f"model {kind} {str(dtype)[6:]} on CUDA vs transformers on CUDA"
                loaded = load_model(str(path), dtype, "cuda", attention_backend="triton")
                reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
                prompt = loaded.tokenizer.encode("Paged attention keeps the KV cache in blocks; 日本語 🙂 too.")
                with torch.inference_mode():
                    expected = reference(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
                runner = PagedRunner(loaded.model, loaded.config)
                try:
                    (logits,) = runner.step([("a", prompt[:9])], num_decode_seqs=0)
                    assert_close_in_dtype(logits, expected[:9], dtype, f"{name}: prefill")
                    for position in range(9, len(prompt)):  # decode: the Triton kernel, past mistral's window
                        (logits,) = runner.step([("a", [prompt[position]])], num_decode_seqs=1)
                        assert_close_in_dtype(logits, expected[position : position + 1], dtype,
                                              f"{name}: decode {position}")
                except AssertionError as error:
                    check(name, False, str(error))
                else:
                    check(name, True, f"{len(prompt)} positions")
                del loaded, reference, runner
                torch.cuda.empty_cache()


def services_on_one_gpu(args) -> None:
    import grpc
    import torch
    from harness.cache_helpers import cache_stub, stats, wait_for
    from harness.hf_checkpoints import write_checkpoint
    from harness.low_precision import agreeing_prefix, reference_greedy_with_logits
    from harness.processes import start_cache_service, start_model_service
    from transformers import AutoModelForCausalLM

    from pagedkv.cache.v1 import cache_pb2
    from pagedkv.model.v1 import model_pb2, model_pb2_grpc

    def generate(stub, prompt, max_new_tokens):
        request = model_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=model_pb2.SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True))
        responses = list(stub.Generate(request, timeout=300))
        return [t for r in responses for t in r.token_ids], responses[-1]

    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        path = write_checkpoint("llama", tmp / "llama")
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
        generator = torch.Generator().manual_seed(3)
        prompts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (40, 7, 23, 61)]
        expected = [reference_greedy_with_logits(reference, p, 24) for p in prompts]
        model_flags = ("--model", str(path), "--device", "cuda", "--dtype", "bfloat16", "--cuda-graphs", "on",
                       "--max-num-seqs", "8", "--max-model-len", "256")
        # `python -m model_service` from wherever this runs, with what this process imports from
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        # Where the services write their logs: kept when asked, so a start that runs past the
        # caller's time limit still says how far it got.
        logs = args.services_logs or tmp
        logs.mkdir(parents=True, exist_ok=True)
        with start_cache_service(logs, "--memory-fraction", "0.5", timeout_s=120, env=env) as cache:
            cache_client = cache_stub(cache.address)
            # Two model services at once on the one pool (each maps it by CUDA IPC).
            # A start that takes minutes is a hang: fail with the service's log in the error,
            # inside the caller's time limit, rather than be killed without one.
            with start_model_service(logs, cache.address, *model_flags, timeout_s=150, env=env) as first, \
                    start_model_service(logs, cache.address, *model_flags, timeout_s=150, env=env) as second:
                stubs = [model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(service.address))
                         for service in (first, second)]
                # Every prompt on both services, all requests in flight together.
                jobs = [(s, i) for s in range(2) for i in range(len(prompts))]
                with ThreadPoolExecutor(len(jobs)) as executor:
                    results = list(executor.map(lambda job: generate(stubs[job[0]], prompts[job[1]], 24), jobs))
                for (service, i), (tokens, last) in zip(jobs, results):
                    theirs, logits = expected[i]
                    name = f"services: service {service + 1} prompt {i} greedy vs transformers (both at once)"
                    try:
                        agreed = agreeing_prefix(tokens, theirs, logits, torch.bfloat16, name)
                    except AssertionError as error:
                        check(name, False, str(error))
                    else:
                        check(name, True, f"{agreed} of 24 tokens before a near tie", measured=f"{agreed}/24 agree",
                              bound="until a near tie")
                sizing = cache_client.GetSizing(cache_pb2.GetSizingRequest(), timeout=30)
                check("services: the pool is on the GPU", sizing.device.startswith("cuda"), f"device {sizing.device!r}",
                      measured=sizing.device, bound="cuda")
                for number, service in ((1, first), (2, second)):
                    events = service.log_events()
                    reserved = [e for e in events if e.get("event") == "decode_graphs_reserved"]
                    captured = [e for e in events if e.get("event") == "decode_graphs_captured"]
                    graph_bytes = reserved[0]["memory_bytes"] if reserved else 0
                    check(f"services: service {number} captured its decode graphs into a reserved pool",
                          bool(reserved and captured) and graph_bytes > 0, f"graphs memory {graph_bytes:,} bytes",
                          measured=f"{graph_bytes / 2**20:.1f} MiB", bound="> 0")
                check("services: the workspace at Attach includes the graphs' memory",
                      sizing.workspace_bytes >= graph_bytes > 0,
                      f"workspace_bytes {sizing.workspace_bytes:,}, graphs {graph_bytes:,}",
                      measured=f"{sizing.workspace_bytes / 2**20:.0f} MiB", bound=f">= {graph_bytes / 2**20:.1f} MiB")
                wait_for(lambda: stats(cache_client).blocks_leased == 0, 60, "both services' blocks to be released")
                # The second service reads K/V that the first wrote, through the prefix cache.
                fresh = torch.randint(4, 300, (64,), generator=generator).tolist()
                theirs, logits = reference_greedy_with_logits(reference, fresh, 8)
                generate(stubs[0], fresh, 8)
                second_tokens, last = generate(stubs[1], fresh, 8)
                try:
                    agreed = agreeing_prefix(second_tokens, theirs, logits, torch.bfloat16, "cached prefix")
                except AssertionError as error:
                    agreed, detail = -1, str(error)
                else:
                    detail = f"{agreed} of 8 tokens before a near tie"
                # 64 prompt tokens = 4 blocks; the last prompt token is always computed again.
                check("services: one service reads the other's cached K/V",
                      last.usage.cached_tokens >= 48 and agreed >= 0,
                      f"cached_tokens {last.usage.cached_tokens} of 64; {detail}",
                      measured=f"{last.usage.cached_tokens} cached, {agreed}/8 agree",
                      bound=">= 48 of 64, agree until a near tie")
                wait_for(lambda: stats(cache_client).blocks_leased == 0, 60, "every block to be released")
                check("services: nothing left leased", stats(cache_client).blocks_leased == 0,
                      measured=str(stats(cache_client).blocks_leased), bound="0")
                throughput(args, stubs[0], reference, generator, generate)


def throughput(args, stub, reference, generator, generate, streams: int = 8, new_tokens: int = 128) -> None:
    """tokens/s end to end (gRPC, scheduler, decode graphs, sampling, streaming) against
    transformers' generate() of the same batch on the same GPU, each measured after a warm-up."""
    import torch

    prompts = [torch.randint(4, 300, (32,), generator=generator).tolist() for _ in range(streams)]

    def ours() -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(streams) as executor:
            produced = sum(len(tokens) for tokens, _ in executor.map(lambda p: generate(stub, p, new_tokens), prompts))
        return produced / (time.perf_counter() - started)

    def theirs() -> float:
        ids = torch.tensor(prompts, device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            out = reference.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=0)
        torch.cuda.synchronize()
        return (out.shape[1] - ids.shape[1]) * streams / (time.perf_counter() - started)

    ours(), theirs()  # warm-up: kernels, graphs, allocator
    service_tps, reference_tps = ours(), theirs()
    ratio = service_tps / reference_tps
    print(json.dumps({"service_tokens_per_s": service_tps, "transformers_tokens_per_s": reference_tps,
                      "ratio": ratio, "streams": streams, "new_tokens": new_tokens}), flush=True)
    check("services: tokens/s end to end vs transformers generate()", ratio >= args.min_throughput_ratio,
          f"{streams} streams x {new_tokens} tokens: {service_tps:.0f} tokens/s through gRPC, transformers "
          f"{reference_tps:.0f} ({ratio:.2f}x; needs >= {args.min_throughput_ratio:g})",
          measured=f"{service_tps:.0f} tok/s ({ratio:.2f}x)", bound=f">= {args.min_throughput_ratio:g}x")


def tier_round_trip(device: str, blocks: int, host_blocks: int, disk_dir: str | None, promote: int,
                    layers: int = 4, kv_heads: int = 8, head_dim: int = 128, block_size: int = 16) -> dict:
    """Random K/V in a pool on ``device``; ``promote`` blocks of one prompt go to the tiers
    (host_blocks slots; a disk tier in disk_dir) and come back by one allocate. Returns
    whether every promoted block equals its bytes before, and what it measured."""
    import asyncio

    import torch

    from cache_service.core.ledger import Ledger
    from cache_service.tiers.disk_tier import DiskGeometry
    from cache_service.tiers.kv_tiers import KvTiers
    from cache_service.tiers.settings import TierSettings

    dtype = torch.bfloat16
    pool = torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    reference = pool.cpu()
    bytes_per_block = pool[:, :, 0].nbytes
    settings = TierSettings(host_cache_bytes=host_blocks * bytes_per_block, disk_cache_dir=disk_dir,
                            disk_cache_bytes=(promote + 1) * (bytes_per_block + 4096) if disk_dir else 0)
    host_stats = torch.cuda.host_memory_stats if device != "cpu" else dict
    before = host_stats().get("allocated_bytes.current", 0)
    ledger = Ledger(blocks, block_size)
    tiers = KvTiers(ledger.pool, pool, settings, bytes_per_block,
                    DiskGeometry(layers, kv_heads, head_dim, block_size, dtype))
    ledger.tiers = tiers
    try:
        caching_allocator_growth = host_stats().get("allocated_bytes.current", 0) - before
        tokens = [(index * 7) % 1000 + 1 for index in range(promote * block_size + 1)]
        namespace = ("gpu-check", "")
        first = ledger.allocate("check", len(tokens), tokens, namespace)
        originals = list(first.block_ids[:promote])
        ledger.release("check", first.sequence_id, cache_prefix=True, token_ids=tokens)
        while tiers.demotions.queue:
            tiers.demotions.demote_some(16)

        async def write_all() -> None:
            while tiers.demotions.disk_queue:
                await tiers.demotions.write_some()

        asyncio.run(write_all())
        whole = ledger.allocate("check", blocks * block_size)  # evicts every cached block
        ledger.release("check", whole.sequence_id)
        started = time.perf_counter()
        again = ledger.allocate("check", len(tokens), tokens, namespace)
        tiers.promotions.settle()
        promote_s = time.perf_counter() - started
        got = pool[:, :, list(again.block_ids[:promote])].cpu()
        equal = again.cached_tokens == promote * block_size and torch.equal(
            got.view(torch.int16), reference[:, :, originals].view(torch.int16))
        return dict(equal=equal, cached_tokens=again.cached_tokens, promote_s=promote_s,
                    promoted_bytes=promote * bytes_per_block, caching_allocator_growth=caching_allocator_growth,
                    pinned_bytes=tiers.host.tensor.nbytes if tiers.host is not None else 0,
                    errors=tiers.counters["host"].errors + tiers.counters["disk"].errors)
    finally:
        tiers.close()


def kv_tiers_on_cuda(args) -> None:
    import torch

    host = tier_round_trip("cuda", blocks=512, host_blocks=300, disk_dir=None, promote=256)
    host_bytes = 300 * host["promoted_bytes"] // 256
    check("tiers: host tier on CUDA, 256 blocks promoted by one allocate", host["equal"] and not host["errors"],
          f"cached_tokens {host['cached_tokens']}, bytes equal to the pool's before: {host['equal']}",
          measured="equal" if host["equal"] else "DIFFERENT", bound="byte for byte")
    check("tiers: host tier pinned exactly", host["pinned_bytes"] == host_bytes
          and host["caching_allocator_growth"] < host_bytes,
          f"{host['pinned_bytes']:,} bytes for 300 slots of {host_bytes // 300:,}; torch's caching host allocator "
          f"grew by {host['caching_allocator_growth']:,}", measured=f"{host['pinned_bytes']:,} B",
          bound=f"= {host_bytes:,} B")
    staged = torch.empty(host["promoted_bytes"], dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(staged, device="cuda")
    dma_s = timed(lambda: target.copy_(staged, non_blocking=True), repeats=5)
    rate, dma_rate = host["promoted_bytes"] / host["promote_s"], host["promoted_bytes"] / dma_s
    check("tiers: promotion rate (for the record)", True,
          f"{rate / 1e9:.2f} GB/s promoting 256 blocks (staging and all); one pinned DMA of the same bytes "
          f"{dma_rate / 1e9:.2f} GB/s", measured=f"{rate / dma_rate:.2f} of a DMA", bound="for the record")
    with tempfile.TemporaryDirectory() as folder:
        disk = tier_round_trip("cuda", blocks=64, host_blocks=0, disk_dir=folder, promote=32)
    check("tiers: disk tier without a host tier on CUDA, 32 blocks", disk["equal"] and not disk["errors"],
          f"cached_tokens {disk['cached_tokens']}, errors {disk['errors']}, bytes equal: {disk['equal']}",
          measured="equal" if disk["equal"] else "DIFFERENT", bound="byte for byte, no error")


STEPS = {
    "kernels": kernels_match,
    "fp8_kv": fp8_kv_match,
    "bandwidth": decode_bandwidth,
    "graph_memory": graph_memory,
    "graphs": decode_graphs_do_not_recapture,
    "sampling": sampling_distribution,
    "cuda_n": cuda_n,
    "tiers": kv_tiers_on_cuda,
    "model": model_vs_transformers,
    "services": services_on_one_gpu,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked; run checks/gpu_check.py on a machine with a CUDA GPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for name, step in STEPS.items():
        if name in args.skip:
            print(f"[skip] {name}", flush=True)
            continue
        try:
            step(args)
        except Exception as error:
            traceback.print_exc()
            check(name, False, repr(error))
    print_table()
    print(f"\n{time.perf_counter() - started:.0f} s", flush=True)
    if not ROWS:
        print("nothing checked: no check ran or reported a result", file=sys.stderr, flush=True)
        return 2
    print("FAILED: " + ", ".join(FAILURES) if FAILURES else "all GPU checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
