"""GPU check: run on a machine with a CUDA GPU (no GPU in CI or on the dev machines).

    python bench/gpu_check.py                    # prints a report; exit 1 if a check fails
    python bench/gpu_check.py --min-bandwidth-fraction 0.4 --skip services

Exit status: 0 every check passed, 1 a check failed, 2 no CUDA device (nothing was run).
Every check can fail; a dependency a check needs that does not import fails that check.

Needs torch with CUDA and triton for every check; the model and services checks also need
what the services and the tests need (transformers, tokenizers, safetensors, grpcio,
protobuf, structlog, prometheus-client): run it from the project's test environment.

1. kernels: Triton kernels (K/V write, decode attention) against the PyTorch path on CUDA,
   float32/float16/bfloat16, GQA groups 1, 3, 4, 6, 7 and 8, with and without a sliding window.
2. bandwidth: the decode kernel's K/V read rate must reach --min-bandwidth-fraction of a
   device-to-device copy of the same bytes measured in the same run (a copy reads and
   writes each byte; the kernel only reads them).
3. graph_memory: the decode graphs share one memory pool: all buckets together may
   reserve at most --max-graph-memory-ratio times what the largest bucket's graph alone
   reserves (plus the smaller graphs' outputs); separate pools (PyTorch's default) are
   measured for the record. DecodeGraphPool.memory_bytes (what the workspace reported at
   Attach includes) is checked against the measured growth.
4. graphs: a second batch of shorter prompts (and other batch sizes) replays the graphs
   captured at start-up, matches the eager step and captures none.
5. model: the whole model on CUDA (Triton kernels) against transformers on CUDA, bfloat16
   and float16, Llama and Mistral (sliding window): logits within tests/low_precision.py's
   tolerance over prefill and decode.
6. services: both services as real processes on one GPU: the cache service allocates the
   pool on the GPU and hands it over by CUDA IPC in Attach; the model service (decode
   graphs on) generates greedily, equal to transformers on CUDA up to a near tie; the
   workspace at Attach includes the graphs' memory; a second model service process, after
   the first has stopped, reads the first one's K/V through the prefix cache and gets the
   same tokens; nothing stays leased.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # hf_checkpoints, low_precision, processes, cache_helpers

CHECKS = ("kernels", "bandwidth", "graph_memory", "graphs", "model", "services")
FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--min-bandwidth-fraction", type=float, default=0.3,
                        help="the decode kernel's read rate must reach this fraction of the copy's (default 0.3)")
    parser.add_argument("--max-graph-memory-ratio", type=float, default=1.5,
                        help="all decode graphs may reserve this many times the largest one alone (default 1.5)")
    parser.add_argument("--skip", action="append", default=[], choices=CHECKS, help="leave out a check (repeatable)")
    args = parser.parse_args(argv)
    if not 0 < args.min_bandwidth_fraction <= 1:
        parser.error(f"--min-bandwidth-fraction must be in (0, 1], got {args.min_bandwidth_fraction}")
    if args.max_graph_memory_ratio < 1:
        parser.error(f"--max-graph-memory-ratio must be >= 1, got {args.max_graph_memory_ratio}")
    return args


def random_pool(layers, blocks, block_size, kv_heads, head_dim, dtype):
    import torch

    return torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)


def kernels_match(args) -> None:
    import torch

    from model_service.attention import triton_kernels
    from model_service.attention.torch_paged import decode_attention_torch, write_kv_torch

    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        batch, kv_heads, head_dim, block_size = 16, 4, 128, 16
        pool = random_pool(1, 512, block_size, kv_heads, head_dim, dtype)[0]
        for group in (1, 3, 4, 6, 7, 8):
            for window in (None, 100):
                lens = torch.randint(1, 700, (batch,), device="cuda", dtype=torch.int32)
                tables = torch.randperm(512, device="cuda")[: batch * 44].view(batch, 44).to(torch.int32)
                q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
                scale = head_dim ** -0.5
                expected = decode_attention_torch(q, pool, tables, lens, scale, sliding_window=window)
                got = triton_kernels.decode_attention_triton(q, pool, tables, lens, scale, sliding_window=window)
                error = (got.float() - expected.float()).abs().max().item()
                check(f"decode {str(dtype)[6:]} group {group} window {window}", error < tolerance,
                      f"max abs error {error:.2e} (tolerance {tolerance:.0e})")
        k = torch.randn(64, kv_heads, head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(512 * block_size, device="cuda")[:64]
        a, b = pool.clone(), pool.clone()
        write_kv_torch(k, v, a, slots)
        triton_kernels.write_kv_triton(k, v, b, slots)
        check(f"write_kv {str(dtype)[6:]}", torch.equal(a, b))


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
          f"(needs >= {args.min_bandwidth_fraction:g})")


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
    # Each smaller graph keeps its output [bucket, hidden] alive in the pool.
    outputs = sum(buckets[:-1]) * config.hidden_size * 2
    allowed = args.max_graph_memory_ratio * alone + outputs
    print(json.dumps({"buckets": len(buckets), "largest_alone_bytes": alone, "all_shared_pool_bytes": shared,
                      "all_separate_pools_bytes": separate, "decode_graph_pool_measured_bytes": measured,
                      "decode_graph_pool_memory_bytes": graph_pool.memory_bytes, "outputs_bytes": outputs}),
          flush=True)
    check("graphs share one memory pool", 0 < shared <= allowed,
          f"{len(buckets)} graphs reserve {shared:,} bytes; the largest alone {alone:,} "
          f"(allowed {args.max_graph_memory_ratio:g}x + outputs = {allowed:,.0f}); separate pools {separate:,}")
    check("DecodeGraphPool reports what its graphs reserve",
          0 < graph_pool.memory_bytes and abs(measured - graph_pool.memory_bytes) <= 0.1 * measured,
          f"memory_bytes {graph_pool.memory_bytes:,}, measured around it {measured:,}")


def decode_graphs_do_not_recapture(args) -> None:
    import torch

    from model_service.worker.decode_graphs import DecodeGraphs, cuda_graph_capture
    from model_service.worker.runner import ModelRunner
    from model_service.sched.sequence import Sequence

    model = _tiny_cuda_model()
    config = model.config
    pool = torch.zeros(config.num_layers, 2, 512, 16, config.num_kv_heads, config.head_dim,
                       device="cuda", dtype=torch.bfloat16)
    graphs = DecodeGraphs(model, pool, 16, max_num_seqs=32, max_model_len=1024, capture=cuda_graph_capture())
    captured = graphs.captures

    def batch(lengths):
        out, block = [], 0
        for i, n in enumerate(lengths):
            blocks = -(-n // 16)
            out.append((Sequence(str(i), [1] * n, n - 1, None, i, block_table=list(range(block, block + blocks)),
                                 num_computed=n - 1), 1))
            block += blocks
        return out

    runner = ModelRunner(model, pool, 16, graphs)
    eager = ModelRunner(model, pool, 16)
    first = batch([300] * 24)
    _, logits = runner.execute(first)
    _, expected = eager.execute(first)
    error = (logits.float() - expected.float()).abs().max().item()
    check("graph replay matches the eager step", error < 5e-2, f"max |diff| {error:.2e} (bf16 logits)")
    runner.execute(batch([40] * 7))  # shorter prompts, another batch size
    runner.execute(batch([9, 17, 33]))
    torch.cuda.synchronize()
    check("the runner replays graphs for decode steps", graphs.replays == 3, f"replays {graphs.replays}")
    check("no new graph for shorter prompts or other batch sizes", graphs.captures == captured,
          f"captured at start-up {captured}, after {graphs.captures}")


def model_vs_transformers(args) -> None:
    import torch
    from hf_checkpoints import write_checkpoint
    from low_precision import assert_close_in_dtype
    from paged_runner import PagedRunner
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
    from cache_helpers import cache_stub, stats, wait_for
    from hf_checkpoints import write_checkpoint
    from low_precision import agreeing_prefix, reference_greedy
    from processes import start_cache_service, start_model_service
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
        expected = [reference_greedy(reference, p, 24) for p in prompts]
        model_flags = ("--model", str(path), "--device", "cuda", "--dtype", "bfloat16", "--cuda-graphs", "on",
                       "--max-num-seqs", "8", "--max-model-len", "256")
        env = {"PYTHONPATH": str(ROOT)}  # `python -m model_service` from wherever this runs
        with start_cache_service(tmp, "--memory-fraction", "0.5", timeout_s=300, env=env) as cache:
            cache_client = cache_stub(cache.address)
            with start_model_service(tmp, cache.address, *model_flags, timeout_s=600, env=env) as first:
                stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(first.address))
                results = [generate(stub, p, 24) for p in prompts]
                for i, ((tokens, last), (theirs, logits)) in enumerate(zip(results, expected)):
                    try:
                        agreed = agreeing_prefix(tokens, theirs, logits, torch.bfloat16, f"prompt {i}")
                    except AssertionError as error:
                        check(f"services: prompt {i} greedy vs transformers on CUDA", False, str(error))
                    else:
                        check(f"services: prompt {i} greedy vs transformers on CUDA", True,
                              f"{agreed} of 24 tokens before a near tie")
                events = first.log_events()
                reserved = [e for e in events if e.get("event") == "decode_graphs_reserved"]
                captured = [e for e in events if e.get("event") == "decode_graphs_captured"]
                sizing = cache_client.GetSizing(cache_pb2.GetSizingRequest(), timeout=30)
                graph_bytes = reserved[0]["memory_bytes"] if reserved else 0
                check("services: the pool is on the GPU", sizing.device.startswith("cuda"), f"device {sizing.device!r}")
                check("services: decode graphs captured into a reserved pool", bool(reserved and captured),
                      f"graphs memory {graph_bytes:,} bytes")
                check("services: the workspace at Attach includes the graphs' memory",
                      graph_bytes > 0 and sizing.workspace_bytes >= graph_bytes,
                      f"workspace_bytes {sizing.workspace_bytes:,}, graphs {graph_bytes:,}")
                wait_for(lambda: stats(cache_client).blocks_leased == 0, 60, "the first service's blocks to be released")
            # A second process maps the same pool by IPC and reads the K/V the first wrote.
            with start_model_service(tmp, cache.address, *model_flags, timeout_s=600, env=env) as second:
                stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(second.address))
                tokens, last = generate(stub, prompts[0], 24)
                theirs, logits = expected[0]
                try:
                    agreed = agreeing_prefix(tokens, theirs, logits, torch.bfloat16, "second process")
                except AssertionError as error:
                    agreed, detail = -1, str(error)
                else:
                    detail = f"{agreed} of 24 tokens before a near tie"
                check("services: a second model process reads the first one's cached K/V",
                      last.usage.cached_tokens >= 16 and agreed >= 0,
                      f"cached_tokens {last.usage.cached_tokens} of {len(prompts[0])}; {detail}")
                wait_for(lambda: stats(cache_client).blocks_leased == 0, 60, "every block to be released")
                check("services: nothing left leased", stats(cache_client).blocks_leased == 0)


STEPS = {
    "kernels": kernels_match,
    "bandwidth": decode_bandwidth,
    "graph_memory": graph_memory,
    "graphs": decode_graphs_do_not_recapture,
    "model": model_vs_transformers,
    "services": services_on_one_gpu,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked; run bench/gpu_check.py on a machine with a CUDA GPU", file=sys.stderr)
        return 2
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
    print("FAILED: " + ", ".join(FAILURES) if FAILURES else "all GPU checks passed", flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
