"""The ceiling a float32 product can reach on one thread of this CPU: fma_peak.c's register
FMA chains at each vector width the CPU has (AVX2: 8 lanes, AVX-512F: 16), in GFLOP/s (two
flops a lane an FMA), the best of --rounds, timed by the thread's CPU time.

f32_panel_product.py prints its panels' GFLOP/s against it; alone:

    .venv/bin/python -m bench.kernels.fma_peak [--rounds 5] [--seconds 0.2]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_service.cpu_kernels import f32_matmul, levels

SOURCE = Path(__file__).with_name("fma_peak.c")
LANES = {"avx2": 8, "avx512": 16}
CHAINS = 12  # fma_peak.c's


def _library() -> ctypes.CDLL:
    target = Path(tempfile.gettempdir()) / "pagedkv-fma-peak.so"
    if not target.exists() or target.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(target), str(SOURCE)], check=True)
    library = ctypes.CDLL(str(target))
    for name in LANES:
        function = getattr(library, f"fma_peak_{name}")
        function.argtypes, function.restype = [ctypes.c_int64], ctypes.c_float
    return library


def peaks(rounds: int = 5, seconds: float = 0.2) -> dict[str, float]:
    """GFLOP/s of one thread at each of AVX2 and AVX-512F that this CPU runs (by the f32
    linears' level check, so a level the kernels cannot use is not measured either)."""
    library = _library()
    best_level = levels.best(f32_matmul.FAMILY.name)
    out = {}
    for name, lanes in LANES.items():
        if f32_matmul.LEVELS.index(name) > best_level:
            continue
        function = getattr(library, f"fma_peak_{name}")
        iterations = 1_000_000
        function(iterations)
        best = 0.0
        for _ in range(rounds):
            started = time.thread_time()
            function(iterations)
            spent = time.thread_time() - started
            if spent < seconds / 4:  # too short to time: more iterations, same round
                iterations *= 4
                continue
            best = max(best, 2 * lanes * CHAINS * iterations / spent / 1e9)
        out[name] = best
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2)
    args = parser.parse_args()
    for name, gflops in peaks(args.rounds, args.seconds).items():
        print(f"{name}: {gflops:.1f} GFLOP/s on one thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
