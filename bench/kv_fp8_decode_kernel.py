"""The C decode-attention kernel on an fp8 pool against a bfloat16 one, in turns, one thread:
SmolLM2's decode shape (batch 48, 3 KV heads, group 3, head_dim 64, block 16, contexts
100-300), bfloat16 q; median of 7 rounds of 20 calls each.

    .venv/bin/python bench/kv_fp8_decode_kernel.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_service import cpu_kernels  # noqa: E402
from model_service.attention.kv_quant import quantize  # noqa: E402
from model_service.cpu_kernels import paged_decode  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    library = cpu_kernels.load()
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, group, head_dim, block_size, longest = 48, 3, 3, 64, 16, 300
    blocks = batch * -(-longest // block_size)
    pool = torch.randn(2, blocks + 4, block_size, kv_heads, head_dim, generator=generator)
    tables = torch.randperm(blocks + 4, generator=generator)[:blocks].view(batch, -1).to(torch.int32)
    lens = torch.randint(100, longest, (batch,), generator=generator, dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=generator).to(torch.bfloat16)
    pools = {"bfloat16": pool.to(torch.bfloat16), "fp8_e4m3": quantize(pool, 1.0, torch.float8_e4m3fn),
             "fp8_e5m2": quantize(pool, 1.0, torch.float8_e5m2)}
    times: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(7):
        for name, kv_layer in pools.items():
            started = time.perf_counter()
            for _ in range(20):
                paged_decode.paged_decode_attention(library, q, kv_layer, tables, lens, head_dim**-0.5)
            times[name].append((time.perf_counter() - started) / 20 * 1e3)
    base = sorted(times["bfloat16"])[3]
    for name, values in times.items():
        median = sorted(values)[3]
        print(f"{name}: {median:.2f} ms a call ({median / base:.2f}x bfloat16)")


if __name__ == "__main__":
    main()
