"""GPU check: run on a machine with a CUDA GPU (no GPU in CI or on the dev machines).

    python bench/gpu_check.py            # prints a report; exit 1 if a check fails

Needs torch with CUDA, triton, protobuf and structlog (imported by the model config
loader); nothing else of the services. On an image that has the first three, a
structlog wheel is all that must be brought along.

1. Triton kernels (K/V write, decode attention) against the PyTorch path on CUDA, in
   float32, float16 and bfloat16.
2. Decode kernel bandwidth (bytes of K/V and q read per second) against a
   device-to-device copy of the same bytes, measured in the same run.
3. The pool shared by CUDA IPC: this process allocates it and exports the handle the
   cache service would send; a second process maps it, reads what we wrote, writes back.
4. Decode graphs: a second batch of shorter prompts (and other batch sizes) replays the
   graphs captured at start-up and captures none.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model_service.attention import triton_kernels  # noqa: E402
from model_service.attention.torch_paged import decode_attention_torch, write_kv_torch  # noqa: E402

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")
    if not ok:
        FAILURES.append(name)


def random_pool(layers, blocks, block_size, kv_heads, head_dim, dtype):
    return torch.randn(layers, 2, blocks, block_size, kv_heads, head_dim, device="cuda", dtype=dtype)


def kernels_match() -> None:
    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        for group in (1, 4, 8):
            batch, kv_heads, head_dim, block_size = 16, 4, 128, 16
            pool = random_pool(1, 512, block_size, kv_heads, head_dim, dtype)[0]
            lens = torch.randint(1, 700, (batch,), device="cuda", dtype=torch.int32)
            tables = torch.randperm(512, device="cuda")[: batch * 44].view(batch, 44).to(torch.int32)
            q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
            scale = head_dim ** -0.5
            expected = decode_attention_torch(q, pool, tables, lens, scale)
            got = triton_kernels.decode_attention_triton(q, pool, tables, lens, scale)
            error = (got.float() - expected.float()).abs().max().item()
            check(f"decode {str(dtype)[6:]} group {group}", error < tolerance, f"max abs error {error:.2e}")
        k = torch.randn(64, kv_heads, head_dim, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(512 * block_size, device="cuda")[:64]
        a, b = pool.clone(), pool.clone()
        write_kv_torch(k, v, a, slots)
        triton_kernels.write_kv_triton(k, v, b, slots)
        check(f"write_kv {str(dtype)[6:]}", torch.equal(a, b))


def decode_bandwidth() -> None:
    dtype, batch, kv_heads, group, head_dim, block_size, context = torch.bfloat16, 64, 8, 4, 128, 16, 2048
    blocks_per_seq = context // block_size
    pool = random_pool(1, batch * blocks_per_seq, block_size, kv_heads, head_dim, dtype)[0]
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, device="cuda", dtype=dtype)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * pool.element_size()

    def timed(fn, repeats=50) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    kernel_s = timed(lambda: triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0))
    source = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    copy_s = timed(lambda: target.copy_(source))
    # A copy reads and writes each byte; the kernel only reads K/V.
    copy_gbps, kernel_gbps = 2 * kv_bytes / copy_s / 1e9, kv_bytes / kernel_s / 1e9
    print(json.dumps({"decode_kernel_ms": kernel_s * 1e3, "decode_read_GBps": kernel_gbps,
                      "d2d_copy_GBps": copy_gbps, "kernel_over_copy": kernel_gbps / copy_gbps}))
    check("decode bandwidth measured", kernel_gbps > 0)


def _child_maps_pool(info, queue) -> None:
    from pagedkv import pool_memory

    try:
        pool = pool_memory.import_cuda_pool(info)
        seen = float(pool[0, 1, 3, 0, 0, 0])
        pool[0, 0, 5].fill_(7.0)
        torch.cuda.synchronize()
        queue.put(("ok", seen))
    except Exception as error:  # reported to the parent
        queue.put(("error", repr(error)))


def ipc_pool_sharing() -> None:
    from pagedkv import pool_memory

    pool = torch.zeros(2, 2, 16, 16, 4, 64, device="cuda", dtype=torch.bfloat16)
    pool[0, 1, 3].fill_(3.0)
    torch.cuda.synchronize()
    info = pool_memory.export_cuda_pool(pool)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_child_maps_pool, args=(info, queue))
    child.start()
    status, value = queue.get(timeout=120)
    child.join(timeout=60)
    check("second process maps the pool by CUDA IPC", status == "ok" and value == 3.0, f"{status} {value}")
    check("writes of the second process are seen here", float(pool[0, 0, 5, 0, 0, 0]) == 7.0)


def decode_graphs_do_not_recapture() -> None:
    from model_service.decode_graphs import DecodeGraphs, cuda_graph_capture
    from model_service.models.tiny import build_tiny_model
    from model_service.runner import ModelRunner
    from model_service.sequence import Sequence

    model = build_tiny_model(torch.bfloat16, "cuda", attention_backend="triton")
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU machine")
        return 2
    print(f"device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    for step in (kernels_match, decode_bandwidth, ipc_pool_sharing, decode_graphs_do_not_recapture):
        try:
            step()
        except Exception as error:
            check(step.__name__, False, repr(error))
    print("FAILED: " + ", ".join(FAILURES) if FAILURES else "all GPU checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
