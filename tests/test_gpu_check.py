"""checks/gpu_check.py on a machine without CUDA: it parses its arguments and says plainly
that it checked nothing (exit 2), rather than failing on an import or passing vacuously;
a run that skips every check, or whose checks report nothing, never passes either; the
references its GPU checks trust hold on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from checks import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "checks.gpu_check", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_without_cuda_it_exits_2_and_says_so():
    result = run("--min-bandwidth-fraction", "0.5", "--skip", "services")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no CUDA device: nothing checked" in result.stderr
    assert "[ok]" not in result.stdout


def test_help_lists_every_check_and_bad_thresholds_are_refused():
    result = run("--help")
    assert result.returncode == 0, result.stderr
    for name in ("kernels", "fp8_kv", "bandwidth", "graph_memory", "graphs", "sampling", "cuda_n", "tiers", "model",
                 "services", "--max-sampling-tv", "--min-throughput-ratio", "--only"):
        assert name in result.stdout
    refused = run("--min-bandwidth-fraction", "0")
    assert refused.returncode == 2 and "--min-bandwidth-fraction must be in (0, 1]" in refused.stderr
    refused = run("--skip", "everything")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


def test_its_decode_reference_and_dtype_bound_hold_on_cpu():
    # The GPU run trusts reference_decode (gather + float64 SDPA) and dtype_margin's bound:
    # here they meet the torch path on CPU, computing in float32 from inputs in the dtype and
    # rounding its output to the dtype, as the Triton kernel does.
    import torch

    from model_service.attention.torch_paged import decode_attention_torch

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


def test_skipping_every_check_is_refused():
    every = [argument for name in gpu_check.CHECKS for argument in ("--skip", name)]
    result = run(*every)
    assert result.returncode == 2 and "every check is skipped: nothing would be checked" in result.stderr
    assert run("--only", "kernels", "--skip", "kernels").returncode == 2
    args = gpu_check.parse_args(["--only", "sampling", "--only", "fp8_kv"])
    assert set(gpu_check.CHECKS) - set(args.skip) == {"sampling", "fp8_kv"}


def test_checks_that_report_nothing_do_not_pass(monkeypatch, capsys):
    # With a (faked) GPU, steps that return without a result: exit 2, not "all GPU checks passed".
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake")
    monkeypatch.setattr(gpu_check, "STEPS", {name: (lambda args: None) for name in gpu_check.CHECKS})
    assert gpu_check.main([]) == 2
    captured = capsys.readouterr()
    assert "nothing checked" in captured.err and "all GPU checks passed" not in captured.out
    # One real result makes it a run that checked something.
    monkeypatch.setattr(gpu_check, "STEPS", {"kernels": lambda args: gpu_check.check("one", True)})
    assert gpu_check.main(["--only", "kernels"]) == 0


def test_its_sampling_reference_matches_the_cpu_sampler_and_the_bound_can_fail():
    # reference_distribution (float64, its own code) against the CPU path of sample(): the
    # drawn frequencies within the total variation bound gpu_check uses; a sampler at the
    # wrong temperature lands outside it.
    import torch

    from model_service.sample.params import SamplingOptions
    from model_service.sample.sampler import make_generator, sample

    rows, vocab = 16384, 1000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(7)) * 3
    for knobs in (dict(temperature=0.7), dict(temperature=1.0, top_k=50, top_p=0.9),
                  dict(temperature=1.3, min_p=0.05)):
        drawn = sample(logits.expand(rows, vocab), [SamplingOptions(max_new_tokens=1, **knobs)] * rows,
                       [make_generator(row, "cpu") for row in range(rows)])
        frequencies = torch.bincount(drawn, minlength=vocab).double() / rows
        expected = gpu_check.reference_distribution(logits, **knobs)
        assert abs(float(expected.sum()) - 1) < 1e-9
        assert 0.5 * float((frequencies - expected).abs().sum()) <= 0.05, knobs
        assert int(frequencies[expected == 0].gt(0).sum()) == 0, knobs
    hotter = gpu_check.reference_distribution(logits, temperature=1.0)
    colder = gpu_check.reference_distribution(logits, temperature=0.7)
    assert 0.5 * float((hotter - colder).abs().sum()) > 0.05


def test_its_fp8_pool_and_reference_agree_with_the_torch_path_on_cpu():
    # fp8_kv trusts _fp8_pool (torch's cast over the scales) and reference_decode over the
    # dequantized pool: here they meet the torch path's 8-bit decode within the same bound.
    import torch

    from model_service.attention.torch_paged import decode_attention_torch

    torch.manual_seed(1)
    batch, kv_heads, group, head_dim, block_size, width = 4, 2, 4, 64, 16, 5
    scales = (0.05, 0.02)
    tables = gpu_check.random_tables(batch, width, batch * width + 3, device="cpu")
    lens = torch.tensor([1, 17, 50, 80], dtype=torch.int32)
    q = torch.randn(batch, kv_heads * group, head_dim).to(torch.bfloat16)
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        source = torch.randn(2, batch * width + 3, block_size, kv_heads, head_dim)
        source[0, 0, 0, 0, 0] = 1e6  # saturates to the format's largest value
        pool = gpu_check._fp8_pool(source, scales, kv_dtype)
        assert pool.dtype == kv_dtype and torch.isfinite(pool.float()).all()
        dequantized = torch.stack([pool[0].double() * scales[0], pool[1].double() * scales[1]])
        expected = gpu_check.reference_decode(q, dequantized, tables, lens, head_dim ** -0.5)
        ours = decode_attention_torch(q.float(), pool, tables, lens, head_dim ** -0.5,
                                      kv_scales=scales).to(torch.bfloat16)
        v_max = float(dequantized[1].abs().max())
        assert gpu_check.dtype_margin(ours, expected, v_max, "bfloat16") <= 1.0, kv_dtype


def test_its_tier_round_trip_holds_on_cpu(tmp_path):
    # The GPU run's tiers check, on a small CPU pool: what it compares and counts is right.
    small = dict(layers=2, kv_heads=1, head_dim=8, block_size=4)
    host = gpu_check.tier_round_trip("cpu", blocks=16, host_blocks=9, disk_dir=None, promote=8, **small)
    assert host["equal"] and host["cached_tokens"] == 32 and host["errors"] == 0
    assert host["pinned_bytes"] == 9 * host["promoted_bytes"] // 8
    disk = gpu_check.tier_round_trip("cpu", blocks=16, host_blocks=0, disk_dir=str(tmp_path), promote=8, **small)
    assert disk["equal"] and disk["cached_tokens"] == 32 and disk["errors"] == 0
