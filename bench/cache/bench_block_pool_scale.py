"""A pool of 10 million blocks: start-up time and memory, then leasing through it, in turns
against another BlockPool implementation (the previous one, from a file) when given.

    python -m bench.cache.bench_block_pool_scale [--blocks 10000000] [--other old_block_pool.py]

Each case runs in a fresh process; memory is the growth of its peak resident set
(ru_maxrss) over what it held before building the pool. Cases: building the pool; taking 1 million blocks in 16-block
sequences and freeing them all; taking every block once (the worst case for the lazy
pool, which then holds an object per block like the eager one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import resource
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_pool_class(path: str | None):
    if path is None:
        from cache_service.blocks.block_pool import BlockPool
        return BlockPool
    spec = importlib.util.spec_from_file_location("other_block_pool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BlockPool


def run_case(path: str | None, num_blocks: int, case: str) -> dict:
    pool_class = load_pool_class(path)
    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

    before = peak_mb()
    started = time.perf_counter()
    pool = pool_class(num_blocks, 16)
    built_s = time.perf_counter() - started
    result = {"build_s": round(built_s, 3), "build_MB": round(peak_mb() - before)}
    if case in ("lease_1m", "lease_all"):
        count = 1_000_000 if case == "lease_1m" else num_blocks
        started = time.perf_counter()
        held = [pool.take(16) for _ in range(count // 16)]
        for blocks in held:
            pool.free(blocks)
        result["lease_s"] = round(time.perf_counter() - started, 2)
        result["peak_MB"] = round(peak_mb() - before)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10_000_000)
    parser.add_argument("--other", default=None, help="a block_pool.py to compare with, in turns")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.path, args.blocks, args.case)))
        return 0
    sides = [("this", None)] + ([("other", args.other)] if args.other else [])
    for case in ("build", "lease_1m", "lease_all"):
        for round_index in range(args.rounds):
            for name, path in sides:  # A/B alternating
                argv = [sys.executable, "-m", "bench.cache.bench_block_pool_scale", "--blocks", str(args.blocks),
                        "--case", case]
                if path:
                    argv += ["--path", path]
                # -m from the repository root: the child measures this tree's pool, whatever is installed.
                out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True).stdout
                print(f"{case:<10} round {round_index} {name:<6} {out.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
