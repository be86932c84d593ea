"""scripts/gpu_first_run.sh and scripts/gpu_wheels.py on a machine without CUDA: their
arguments, the wheel list a CPU machine would download for the GPU image (dry run: nothing
is fetched), and every GPU step skipped with a reason rather than passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_first_run.sh"
sys.path.insert(0, str(REPO / "scripts"))

import gpu_wheels  # noqa: E402

GPU_STEPS = ("gpu_check_kernels", "gpu_check_services", "cuda_ipc_and_worker_tests", "tier_stack_tests")


def run(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})})


def test_help_and_bad_arguments():
    shown = run("--help")
    assert shown.returncode == 0
    for option in ("--prepare", "--dry-run", "--wheels", "--out", "--no-install", "--budget-s"):
        assert option in shown.stdout
    for args, message in ((["--bogus"], "unknown argument '--bogus'"),
                          (["--budget-s", "5"], "--budget-s must be a whole number of seconds, at least 60"),
                          (["--budget-s", "1e3"], "--budget-s must be a whole number"),
                          (["--out"], "--out needs a value"),
                          (["--wheels", "--no-install"], "--wheels needs a value"),
                          (["--dry-run"], "--dry-run goes with --prepare")):
        refused = run(*args)
        assert refused.returncode == 2 and message in refused.stderr, (args, refused.stderr)


def test_prepare_dry_run_lists_the_wheels_and_downloads_nothing(tmp_path):
    dest = tmp_path / "wheels"
    listed = run("--prepare", "--dry-run", "--wheels", str(dest))
    assert listed.returncode == 0, listed.stderr
    out = listed.stdout
    for name in gpu_wheels.MISSING:
        assert f"  {name}==" in out
    for flag in ("pip download", "--no-deps", "--only-binary=:all:", "--python-version 3.12",
                 "--platform manylinux2014_x86_64", "--implementation cp"):
        assert flag in out
    assert "dry run: nothing downloaded" in out and not dest.exists()


def test_the_wheel_set_leaves_the_images_own_builds_alone():
    wheels = gpu_wheels.wheel_set()
    assert set(map(gpu_wheels.normalize, gpu_wheels.MISSING)) <= set(wheels)
    assert "pydantic-core" in wheels and "starlette" in wheels  # what fastapi needs, its binary part too
    for image_build in ("torch", "triton", "numpy", "transformers"):
        assert image_build not in wheels
    assert not any(name.startswith("nvidia-") for name in wheels)
    command = gpu_wheels.download_command({"structlog": "1.0"}, Path("/x"), "3.12")
    assert command[-1] == "structlog==1.0" and "--no-deps" in command


def test_install_from_an_empty_folder_names_the_fix(tmp_path, capsys):
    assert gpu_wheels.main(["install", "--dest", str(tmp_path)]) == 2
    assert "run `python scripts/gpu_wheels.py download` on a CPU machine first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_wheels.main(["install", "--dry-run"])
    with pytest.raises(SystemExit):
        gpu_wheels.main(["download", "--python-version", "3.12; rm -rf /"])


def test_without_cuda_every_gpu_step_is_skipped_with_its_reason(tmp_path):
    out = tmp_path / "logs"
    result = run("--no-install", env={"OUT": str(out)}, timeout=240)
    # Nothing checked on a GPU is not a pass.
    assert result.returncode == 2, result.stdout + result.stderr
    summary = (out / "summary.txt").read_text()
    assert "ok   versions" in summary and "SKIP install: --no-install" in summary
    for name in GPU_STEPS:
        assert f"SKIP {name}: no CUDA device (torch.cuda.is_available() is False)" in summary
    assert "nothing checked on a GPU" in summary
    assert "cuda available False" in (out / "versions.log").read_text()
