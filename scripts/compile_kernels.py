"""Compile every Triton kernel configuration the backend can launch for sm_80 and sm_90.

No GPU needed (model_service/attention/aot.py). tests/test_kernels_compile.py compiles a
representative set in CI; this is the whole matrix: model dtypes x GQA groups 1-8 x head
dims 64 and 128 x every allowed block size x split / whole-context decode x the pool's K/V
(the model dtype, or 8-bit e4m3 / e5m2 bytes: --kv-cache-dtype), the split reduction at
every split count's pad, the K/V write (of the model dtype, and of an 8-bit pool's
bytes), and LoRA's shrink (every rank block) and expand, for decode runs and prefill ones
(models/lora_triton.py). Exits 1 on a compile error or a spilled register. Each configuration compiles on
one core, so --jobs spreads them:

    PYTHONPATH=$PWD python scripts/compile_kernels.py --jobs 16
    PYTHONPATH=$PWD python scripts/compile_kernels.py --archs sm_90 --dtypes bf16 --block-sizes 16,32
    PYTHONPATH=$PWD python scripts/compile_kernels.py --kv fp8_e4m3   # the 8-bit pools' kernels only
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's own default, without its warning

from cache_service.core.pool import MAX_BLOCK_SIZE  # noqa: E402

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "u8": "uint8"}
# --kv: the pool's K/V dtype as the kernels see it, and FP8_KIND (triton_kernels.FP8_KINDS).
KV_KINDS = {"model": 0, "fp8_e4m3": 1, "fp8_e5m2": 2}
# LoRA: a rank for each of the shrink's rank blocks (16, 32, 64), and a decode run's rows and
# a prefill run's (their row blocks).
LORA_RANKS = (8, 32, 64)
LORA_RUN_ROWS = (1, 512)


def configurations(args: argparse.Namespace) -> list[tuple]:
    """(kind, dtype name, arguments) for every configuration asked for."""
    jobs = []
    fp8_kinds = [KV_KINDS[kv] for kv in args.kv]
    # An 8-bit pool's write kernel stores bytes whatever the model dtype, and e4m3's and
    # e5m2's alike: one u8 set.
    write_dtypes = [dtype for dtype in args.dtypes if 0 in fp8_kinds] + (["u8"] if any(fp8_kinds) else [])
    for head_dim in args.head_dims:
        for block_size in args.block_sizes:
            for dtype in args.dtypes:
                for group in args.groups:
                    for split in (False, True):
                        for fp8_kind in fp8_kinds:
                            jobs.append(("decode", dtype, (group, head_dim, block_size, split, fp8_kind)))
            for dtype in write_dtypes:
                for kv_heads in (1, 2, 8):
                    jobs.append(("write_kv", dtype, (kv_heads, head_dim, block_size)))
        for dtype in args.dtypes:
            for splits_pad in (2, 4, 8, 16, 32):
                jobs.append(("reduce", dtype, (head_dim, splits_pad)))
    for dtype in args.dtypes:
        for longest in LORA_RUN_ROWS:
            for max_rank in LORA_RANKS:
                jobs.append(("lora_shrink", dtype, (max_rank, longest)))
            jobs.append(("lora_expand", dtype, (longest,)))
    return [(arch, *job) for arch in args.archs for job in jobs]


def compile_one(arch: str, kind: str, dtype_name: str, arguments: tuple) -> tuple[bool, str]:
    import torch

    from model_service.attention import aot

    builder = {"decode": aot.decode_config, "write_kv": aot.write_kv_config, "reduce": aot.reduce_config,
               "lora_shrink": aot.lora_shrink_config, "lora_expand": aot.lora_expand_config}[kind]
    try:
        report = aot.compile_kernel(*builder(getattr(torch, DTYPE_NAMES[dtype_name]), *arguments), arch)
    except Exception as error:  # a compile error is a result to report, not a crash
        return False, f"{kind} {arch} {dtype_name} {arguments}: COMPILE ERROR {type(error).__name__}: {error}"[:2000]
    return not report.spills, report.row() + ("  SPILLS" if report.spills else "")


def kv_kinds(raw: str) -> list[str]:
    kinds = raw.split(",")
    unknown = [kind for kind in kinds if kind not in KV_KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown --kv {unknown}; choose from {', '.join(KV_KINDS)}")
    return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="sm_80,sm_90", type=lambda raw: raw.split(","))
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", type=lambda raw: raw.split(","))
    parser.add_argument("--groups", default="1,2,3,4,5,6,7,8", type=lambda raw: [int(x) for x in raw.split(",")])
    parser.add_argument("--head-dims", default="64,128", type=lambda raw: [int(x) for x in raw.split(",")])
    parser.add_argument("--block-sizes", default=",".join(str(1 << n) for n in range(MAX_BLOCK_SIZE.bit_length())),
                        type=lambda raw: [int(x) for x in raw.split(",")])
    parser.add_argument("--kv", default=",".join(KV_KINDS), type=kv_kinds,
                        help="the pool's K/V: model (the model dtype), fp8_e4m3, fp8_e5m2 (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    jobs = configurations(args)
    print(f"{len(jobs)} configurations, {args.jobs} at a time", flush=True)
    failures = 0
    with ProcessPoolExecutor(args.jobs) as executor:
        for future in as_completed([executor.submit(compile_one, *job) for job in jobs]):
            ok, row = future.result()
            failures += not ok
            print(row, flush=True)
    print(f"{len(jobs) - failures} of {len(jobs)} compiled without spills")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
