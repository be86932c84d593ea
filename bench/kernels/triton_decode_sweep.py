"""The Triton decode kernel's launch settings, swept on one GPU: which tile (the
[group, slots, head_dim] product's elements), warps, software-pipelining stages and
context splits read K/V fastest, as a fraction of a device-to-device copy of the same
bytes (checks/gpu_check.py's "decode bandwidth" shape by default).

    python -m bench.kernels.triton_decode_sweep [--batch 64] [--context 2048] [--group 4]
        [--elements 2048,4096] [--warps 2,4] [--stages 1] [--splits 1,2,4,8]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from checks.gpu_check import random_pool, timed
from model_service.attention import triton_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    ints = lambda text: [int(part) for part in text.split(",")]
    parser.add_argument("--elements", type=ints, default=[2048, 4096, 8192], help="product elements, comma list")
    parser.add_argument("--warps", type=ints, default=[2, 4, 8])
    parser.add_argument("--stages", type=ints, default=[1, 2, 3])
    parser.add_argument("--splits", type=ints, default=[1, 2, 4, 8])
    args = parser.parse_args()
    dtype = torch.bfloat16
    blocks_per_seq = args.context // args.block_size
    pool = random_pool(1, args.batch * blocks_per_seq, args.block_size, args.kv_heads, args.head_dim, dtype)[0]
    tables = torch.randperm(args.batch * blocks_per_seq, device="cuda").view(args.batch, -1).to(torch.int32)
    lens = torch.full((args.batch,), args.context, device="cuda", dtype=torch.int32)
    q = torch.randn(args.batch, args.kv_heads * args.group, args.head_dim, device="cuda", dtype=dtype)
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * pool.element_size()
    source = torch.empty(kv_bytes // 2, device="cuda", dtype=dtype)
    target = torch.empty_like(source)
    copy_gbps = 2 * kv_bytes / timed(lambda: target.copy_(source)) / 1e9
    reference = triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0).float()
    original_config, original_elements = triton_kernels.decode_config, triton_kernels.PRODUCT_ELEMENTS
    rows = []
    for elements, warps, stages, splits in itertools.product(args.elements, args.warps, args.stages,
                                                            args.splits):
        def config(*a, **k):
            triton_kernels.PRODUCT_ELEMENTS = elements
            try:
                return {**original_config(*a, **k), "num_warps": warps, "num_stages": stages}
            finally:
                triton_kernels.PRODUCT_ELEMENTS = original_elements
        triton_kernels.decode_config = config
        try:
            run = lambda: triton_kernels.decode_attention_triton(q, pool, tables, lens, 1.0, num_splits=splits)
            error = (run().float() - reference).abs().max().item()
            gbps = kv_bytes / timed(run) / 1e9
        except Exception as failure:  # a setting that does not compile (registers, shared memory)
            print(json.dumps({"elements": elements, "warps": warps, "stages": stages, "splits": splits,
                              "error": repr(failure)[:200]}), flush=True)
            continue
        finally:
            triton_kernels.decode_config = original_config
        rows.append((gbps, elements, warps, stages, splits, error))
        print(json.dumps({"elements": elements, "warps": warps, "stages": stages, "splits": splits,
                          "GBps": round(gbps), "of_copy": round(gbps / copy_gbps, 3), "max_diff": error}), flush=True)
    print(f"copy {copy_gbps:.0f} GB/s (read + write); best settings:")
    for gbps, elements, warps, stages, splits, error in sorted(rows, reverse=True)[:12]:
        print(f"  {gbps:6.0f} GB/s = {gbps / copy_gbps:.2f} of copy: elements {elements} warps {warps} "
              f"stages {stages} splits {splits} (max diff {error:.1e})")


if __name__ == "__main__":
    main()
