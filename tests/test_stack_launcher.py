"""`python -m pagedkv.stack` (what `make run` runs), the health probe, and harness/processes.py,
all against real processes on free ports."""

from __future__ import annotations

import glob
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from harness.processes import free_port, start_cache_service, start_model_service
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.health_probe import wait_serving

REPO = Path(__file__).resolve().parent.parent
MODEL_SERVICE_MISSING = not (REPO / "model_service" / "__main__.py").exists()
needs_model_service = pytest.mark.skipif(
    MODEL_SERVICE_MISSING, reason="model_service/__main__.py does not exist yet (the model service is being written)"
)
SHM_DIR = "/dev/shm"
READY_TIMEOUT_S = 240.0
ADDRESS = re.compile(r"(model|cache) service (127\.0\.0\.1:[0-9]+)")


class Stack:
    """A `python -m pagedkv.stack` subprocess whose stdout is read for the ready line."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.stderr_path = tmp_path / "stack.stderr.log"
        environment = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_")}
        environment.update(env or {})
        argv = [sys.executable, "-m", "pagedkv.stack", "--cache-port", "0", "--model-port", "0",
                "--cache-metrics-port", "0", "--model-metrics-port", "0", "--model-http-port", "0", *args]
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                            env=environment, cwd=REPO)
        self.stdout = ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while "\n" not in self.stdout:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pytest.fail(f"no ready line within {timeout_s}s; stderr:\n{self.stderr()}")
                if selector.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(self.process.stdout.fileno(), 65536).decode()
                    if not chunk:
                        self.process.wait(timeout=30)
                        pytest.fail(f"stack exited {self.process.returncode} before its ready line; "
                                    f"stdout: {self.stdout!r}; stderr:\n{self.stderr()}")
                    self.stdout += chunk
        return self.stdout.splitlines()[0]

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stack still running {timeout_s}s after being told to stop; stderr:\n{self.stderr()}")

    def children(self) -> dict[str, int]:
        """pid of each service child, by its module name."""
        found = {}
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) != self.process.pid:
                    continue
                cmdline = Path(stat).with_name("cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):  # it exited while we looked
                continue
            module = cmdline[2].decode() if len(cmdline) > 2 and cmdline[1] == b"-m" else "?"
            found[module] = int(Path(stat).parent.name)
        return found

    def kill(self) -> None:
        children = self.children()  # before the stack goes: orphans are no longer its children
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.stdout.close()


@pytest.fixture
def start_stack(tmp_path):
    stacks: list[Stack] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Stack:
        stack = Stack(tmp_path, *args, env=env)
        stacks.append(stack)
        return stack

    yield start
    for stack in stacks:
        stack.kill()


def addresses(ready_line: str) -> dict[str, str]:
    return dict(ADDRESS.findall(ready_line))


def pool_files(cache_pid: int) -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"pagedkv-{cache_pid}-*.kv"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def attach_small_pool(cache_address: str) -> None:
    """Makes the cache service create its pool (it does on the first Attach), so /dev/shm has a file."""
    with grpc.insecure_channel(cache_address) as channel:
        cache_pb2_grpc.CacheServiceStub(channel).Attach(
            cache_pb2.AttachRequest(
                client_name="test_stack_launcher",
                geometry=cache_pb2.Geometry(num_layers=1, num_kv_heads=1, head_dim=8,
                                            dtype=cache_pb2.DTYPE_FLOAT32, device="cpu"),
                max_model_len=16,
            ),
            timeout=30,
        )


# -- the whole stack ----------------------------------------------------------------------


@needs_model_service
def test_stack_serves_both_and_stops_cleanly_on_sigint(start_stack):
    stack = start_stack("--model", "tiny", "--kv-cache-bytes", "64MiB")
    ready = stack.wait_ready()
    found = addresses(ready)
    assert set(found) == {"model", "cache"}, ready
    assert f"-m model_service.client \"Hello\" --max-new-tokens 32 --address {found['model']}" in ready
    children = stack.children()
    assert set(children) == {"cache_service", "model_service"}, children
    model_argv = Path(f"/proc/{children['model_service']}/cmdline").read_bytes().split(b"\0")
    assert model_argv[model_argv.index(b"--weights") + 1] == b"native", model_argv  # make run's default
    wait_serving(found["cache"], timeout_s=5)
    wait_serving(found["model"], timeout_s=5)
    assert pool_files(children["cache_service"]), "the model service attached, so the pool file should exist"

    stack.process.send_signal(signal.SIGINT)

    assert stack.wait() == 0, stack.stderr()
    assert all(gone(pid) for pid in children.values()), stack.stderr()
    assert pool_files(children["cache_service"]) == []


@needs_model_service
def test_stack_exits_with_the_model_services_code_when_it_cannot_start(start_stack, tmp_path):
    stack = start_stack("--model", str(tmp_path / "no-such-checkpoint"))
    code = stack.wait(timeout_s=READY_TIMEOUT_S)
    assert code != 0
    assert "model service exited with code" in stack.stderr()
    assert stack.process.stdout.read() == b"", "no ready line for a stack that never served"


# -- the cache service alone (--cache-only) ----------------------------------------------


def test_cache_only_stack_stops_cleanly_and_leaves_no_pool_file(start_stack):
    stack = start_stack("--cache-only", "--kv-cache-bytes", "8MiB")
    ready = stack.wait_ready()
    found = addresses(ready)
    assert set(found) == {"cache"}, ready
    (cache_pid,) = stack.children().values()
    wait_serving(found["cache"], timeout_s=5)
    attach_small_pool(found["cache"])
    assert len(pool_files(cache_pid)) == 1

    stack.process.send_signal(signal.SIGINT)

    assert stack.wait() == 0, stack.stderr()
    assert gone(cache_pid)
    assert pool_files(cache_pid) == []
    assert "stopped on SIGINT" in stack.stderr()


def test_sigterm_stops_the_stack_too(start_stack):
    stack = start_stack("--cache-only")
    stack.wait_ready()
    (cache_pid,) = stack.children().values()
    stack.process.send_signal(signal.SIGTERM)
    assert stack.wait() == 0, stack.stderr()
    assert gone(cache_pid)


def test_a_dead_child_stops_the_stack_with_its_code_and_its_pool_file_is_removed(start_stack):
    stack = start_stack("--cache-only", "--kv-cache-bytes", "8MiB")
    found = addresses(stack.wait_ready())
    (cache_pid,) = stack.children().values()
    attach_small_pool(found["cache"])
    (pool_file,) = pool_files(cache_pid)

    os.kill(cache_pid, signal.SIGKILL)  # it cannot unlink its pool itself

    assert stack.wait() == 128 + signal.SIGKILL
    stderr = stack.stderr()
    assert f"cache service exited with code -{int(signal.SIGKILL)}" in stderr
    assert "last lines of its stderr" in stderr and "grpc_listening" in stderr
    assert not os.path.exists(pool_file)


def test_a_child_that_fails_at_start_up_is_reported_with_its_stderr(start_stack):
    stack = start_stack("--cache-only", env={"PAGEDKV_BLOCK_SIZE": "sixteen"})
    assert stack.wait() == 2  # argparse's exit code, passed on
    stderr = stack.stderr()
    assert "cache service exited with code 2 while starting" in stderr
    assert "PAGEDKV_BLOCK_SIZE='sixteen' is not valid" in stderr


def test_stack_rejects_a_bad_kv_cache_budget_before_starting_anything(start_stack):
    stack = start_stack("--cache-only", "--kv-cache-bytes", "lots")
    assert stack.wait() == 2
    assert "--kv-cache-bytes" in stack.stderr()
    assert stack.children() == {}


def test_stack_flags_have_env_twins():
    from pagedkv.stack import build_parser

    help_text = build_parser().format_help()
    for twin in ["PAGEDKV_MODEL", "PAGEDKV_CACHE_PORT", "PAGEDKV_MODEL_PORT", "PAGEDKV_CACHE_METRICS_PORT",
                 "PAGEDKV_MODEL_METRICS_PORT", "PAGEDKV_KV_CACHE_BYTES", "PAGEDKV_CACHE_ONLY", "PAGEDKV_WEIGHTS"]:
        assert twin in help_text
    defaults = build_parser().parse_args([])
    assert (defaults.model_port, defaults.cache_port, defaults.model_metrics_port, defaults.cache_metrics_port) == (
        50051, 50052, 9401, 9402)
    assert defaults.kv_cache_bytes == "1GiB" and defaults.model == "smollm2" and defaults.weights == "native"


# -- the health probe ---------------------------------------------------------------------


def test_health_probe_cli_exits_0_when_serving_and_1_when_nothing_listens(tmp_path):
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        serving = subprocess.run([sys.executable, "-m", "pagedkv.health_probe", cache.address],
                                 capture_output=True, text=True, timeout=30)
        assert serving.returncode == 0, serving.stderr
        named = subprocess.run([sys.executable, "-m", "pagedkv.health_probe", cache.address,
                                "--service", "pagedkv.cache.v1.CacheService", "--timeout", "0"],
                               capture_output=True, text=True, timeout=30)
        assert named.returncode == 0, named.stderr
        unknown = subprocess.run([sys.executable, "-m", "pagedkv.health_probe", cache.address,
                                  "--service", "no.such.Service", "--timeout", "0.3"],
                                 capture_output=True, text=True, timeout=30)
        assert unknown.returncode == 1
        assert "NOT_FOUND" in unknown.stderr
    nothing = subprocess.run([sys.executable, "-m", "pagedkv.health_probe", f"127.0.0.1:{free_port()}",
                              "--timeout", "0.5"], capture_output=True, text=True, timeout=30)
    assert nothing.returncode == 1
    assert "not SERVING after 0.5s; last answer: UNAVAILABLE" in nothing.stderr


def test_health_probe_now_answers_at_once_what_the_service_says(tmp_path):
    # A model service with no cache service is up but NOT_SERVING, as one whose cache went
    # away: `--now` (the container health checks') fails on that answer instead of waiting
    # --timeout for it to change; the subprocess timeout is far below that 600 s.
    probe = [sys.executable, "-m", "pagedkv.health_probe", "--now", "--timeout", "600"]
    with start_model_service(tmp_path, f"127.0.0.1:{free_port()}", wait_serving=False) as model:
        not_serving = subprocess.run([*probe, model.address], capture_output=True, text=True, timeout=60)
        assert not_serving.returncode == 1
        assert f"{model.address}: NOT_SERVING" in not_serving.stderr
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        serving = subprocess.run([*probe, cache.address], capture_output=True, text=True, timeout=60)
        assert serving.returncode == 0, serving.stderr
    refused = subprocess.run([*probe, f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr


def test_wait_serving_times_out_naming_what_it_saw():
    with pytest.raises(TimeoutError, match=r"not SERVING after 0.2s; last answer: UNAVAILABLE"):
        wait_serving(f"127.0.0.1:{free_port()}", timeout_s=0.2)


# -- harness/processes.py -------------------------------------------------------------------


def test_process_helper_exposes_the_service_and_stops_it(tmp_path):
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        assert cache.returncode is None
        assert cache.address.startswith("127.0.0.1:") and cache.metrics_url.endswith("/metrics")
        wait_serving(cache.address, timeout_s=1)
        from urllib.request import urlopen

        with urlopen(cache.metrics_url, timeout=10) as response:
            assert response.status == 200
    assert cache.returncode == 0
    assert "grpc_listening" in cache.logs()
    assert any(event.get("event") == "stopped" for event in cache.log_events())


def test_process_helper_kill_and_stop_with_a_signal(tmp_path):
    first = start_cache_service(tmp_path)
    second = start_cache_service(tmp_path, timeout_s=60)
    assert first.address != second.address
    assert first.kill() == -signal.SIGKILL
    assert second.stop(signal.SIGINT, timeout=30) == 0
    assert gone(first.pid) and gone(second.pid)


def test_process_helper_reports_a_service_that_cannot_start(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2 before listening.*--block-size"):
        start_cache_service(tmp_path, "--block-size", "sixteen")
