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


def test_its_decode_reference_and_dtype_bound_hold_on_cpu():
    # The GPU run trusts reference_decode (gather + float64 SDPA) and dtype_margin's bound:
    # here they meet the torch path on CPU, computing in float32 from inputs in the dtype and
    # rounding its output to the dtype, as the Triton kernel does.
    import importlib.util

    import torch

    from model_service.attention.torch_paged import decode_attention_torch

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    torch.manual_seed(0)
    batch, kv_heads, group, head_dim, block_size, width = 4, 2, 3, 64, 16, 6
    tables = gpu_check.random_tables(batch, width, batch * width + 5, device="cpu")
    assert tables.unique().numel() == batch * width
    lens = torch.tensor([0, 1, 50, 96], dtype=torch.int32)
    for dtype, window in ((torch.float32, None), (torch.bfloat16, 20), (torch.float16, None)):
        pool = torch.randn(2, batch * width + 5, block_size, kv_heads, head_dim).to(dtype)
        q = torch.randn(batch, kv_heads * group, head_dim).to(dtype)
        expected = gpu_check.reference_decode(q, pool, tables, lens, 0.125, window)
        assert torch.equal(expected[0], torch.zeros_like(expected[0]))
        ours = decode_attention_torch(q.float(), pool.float(), tables, lens, 0.125, sliding_window=window).to(dtype)
        v_max = float(pool[1].abs().max())
        margin = gpu_check.dtype_margin(ours[1:], expected[1:], v_max, str(dtype)[6:])
        assert margin <= 1.0, (dtype, margin)
        # The bound can fail: one output element off by a few of the dtype's units.
        wrong = ours.clone()
        wrong[2, 1, 3] += 8 * gpu_check.UNIT_ROUNDOFF[str(dtype)[6:]] * max(1.0, float(expected[2, 1, 3].abs())) + 1e-3
        assert gpu_check.dtype_margin(wrong[1:], expected[1:], v_max, str(dtype)[6:]) > 1.0
