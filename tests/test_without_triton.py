"""The CPU install has no triton (pyproject's `gpu` and `test` extras bring it; `make run`
and the CPU image leave it out): nothing on a CPU path may import it.

Each process here starts with a sitecustomize.py that hides triton, as if it were not
installed, and records every attempt to import it, with the innermost frame of
pagedkv's own code that asked. `make run`'s path runs for real: `python -m pagedkv.stack`
(both services), the client CLI, then Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.processes import free_port
from pagedkv.health_probe import wait_serving

REPO = Path(__file__).resolve().parent.parent
OWN_PACKAGES = ("pagedkv", "cache_service", "model_service", "harness", "bench", "checks")

HIDE_TRITON = '''
import json, os, sys, traceback

class HideTriton:
    """Import hook: triton is not installed (ModuleNotFoundError), and each try is logged."""

    def find_spec(self, name, path=None, target=None):
        if name != "triton" and not name.startswith("triton."):
            return None
        own = [f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_stack()
               if any(f"/{package}/" in frame.filename for package in OWN_PACKAGES)]
        with open(os.environ["TRITON_IMPORT_LOG"], "a") as log:
            log.write(json.dumps({"module": name, "pid": os.getpid(), "own_frames": own}) + "\\n")
        raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/test_without_triton.py)", name=name)

OWN_PACKAGES = %r
sys.meta_path.insert(0, HideTriton())
''' % (OWN_PACKAGES,)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def no_triton_env(tmp_path) -> dict[str, str]:
    hook_dir = tmp_path / "hide_triton"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HIDE_TRITON)
    env = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")]))
    env["TRITON_IMPORT_LOG"] = str(tmp_path / "triton-imports.jsonl")
    return env


def import_attempts(env: dict[str, str]) -> list[dict]:
    log = Path(env["TRITON_IMPORT_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_the_hook_hides_triton_and_logs_who_asked(no_triton_env):
    result = subprocess.run([sys.executable, "-c", "from model_service.attention import backend; "
                             "print(backend.load_triton_kernels())"],
                            env=no_triton_env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr
    (attempt,) = import_attempts(no_triton_env)
    assert attempt["module"] == "triton"
    assert any("model_service/attention/triton_kernels.py" in frame for frame in attempt["own_frames"]), attempt


def test_make_runs_stack_and_the_client_work_on_cpu_without_triton(no_triton_env, tmp_path):
    cache_port, model_port = free_port(), free_port()
    stderr_path = tmp_path / "stack.stderr.log"
    with open(stderr_path, "wb") as stderr:
        stack = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.stack", "--model", "tiny", "--kv-cache-bytes", "16MiB",
             "--cache-port", str(cache_port), "--model-port", str(model_port),
             "--cache-metrics-port", "-1", "--model-metrics-port", "-1", "--model-http-port", "0"],
            env=no_triton_env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        try:
            wait_serving(f"127.0.0.1:{model_port}", timeout_s=180)
        except TimeoutError as error:
            pytest.fail(f"{error}; stack stderr:\n{stderr_path.read_text(errors='replace')}")
        client = subprocess.run(
            [sys.executable, "-m", "model_service.client", "Hello", "--max-new-tokens", "4",
             "--address", f"127.0.0.1:{model_port}"],
            env=no_triton_env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=60) == 0, stderr_path.read_text(errors="replace")
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
    own = [attempt for attempt in import_attempts(no_triton_env) if attempt["own_frames"]]
    assert own == [], f"pagedkv code imported triton on CPU: {own}"


@pytest.mark.parametrize("script", ["bench.engine.engine_breakdown"])
def test_bench_scripts_that_load_the_engine_import_without_triton(no_triton_env, script):
    result = subprocess.run([sys.executable, "-m", script, "--help"], env=no_triton_env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    own = [attempt for attempt in import_attempts(no_triton_env) if attempt["own_frames"]]
    assert own == [], f"{script} imports triton on CPU: {own}"
