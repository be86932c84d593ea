"""bench/gpu_check.py on a machine without CUDA: it parses its arguments and says plainly
that it checked nothing (exit 2), rather than failing on an import or passing vacuously."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env)


def test_without_cuda_it_exits_2_and_says_so():
    result = run("--min-bandwidth-fraction", "0.5", "--skip", "services")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device: nothing checked" in result.stderr
    assert "[ok]" not in result.stdout


def test_help_lists_every_check_and_bad_thresholds_are_refused():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for name in ("kernels", "bandwidth", "graph_memory", "graphs", "model", "services"):
        assert name in result.stdout
    refused = run("--min-bandwidth-fraction", "0")
    assert refused.returncode == 2 and "--min-bandwidth-fraction must be in (0, 1]" in refused.stderr
    refused = run("--skip", "everything")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr
