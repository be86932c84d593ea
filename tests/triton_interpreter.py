"""Runs a test file's Triton kernels under Triton's interpreter, in a child pytest.

Why a subprocess. Triton picks interpreted or compiled kernels when @triton.jit runs, reading
TRITON_INTERPRET at that moment. Setting it inside a shared pytest process is fragile both ways:
if any module collected earlier already imported the kernels, they stay compiled and fail on CPU
tensors; and the variable would stay set for every later test, so on a GPU host the model's own
kernels would silently run in the interpreter. So in an ordinary run such a module holds one
test, which calls `run_file` on itself: the same file in a fresh `python -m pytest` with
TRITON_INTERPRET=1 set in its environment, before anything imports triton. In that child (or in
any run started with TRITON_INTERPRET=1, `IN_INTERPRETER`) the kernel tests are defined and run
in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

IN_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[1]


def run_file(test_file: str, timeout: float) -> None:
    """Runs test_file's tests in a child under the interpreter; fails unless all passed
    (none skipped). timeout only ends a hang."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())],
        cwd=REPO_ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    print(f"interpreter run: {summary[0]}")
    assert result.returncode == 0, f"{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary[0] and "skipped" not in summary[0], summary[0]
