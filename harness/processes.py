"""Real service processes for tests, benchmarks and checks: start one, talk to it over a real channel, stop it.

    from harness.processes import free_port, start_cache_service, start_model_service

    def test_something(tmp_path):
        with start_cache_service(tmp_path, "--kv-cache-bytes", "64MiB") as cache:
            with start_model_service(tmp_path, cache.address) as model:
                channel = grpc.insecure_channel(model.address)
                ...
            assert model.returncode == 0          # stopped by SIGTERM at the end of the block
        assert "grpc_listening" in cache.logs()

(pyproject.toml puts the repository root on pytest's sys.path; bench/ and checks/ run with -m
from the root, or by path once installed.)

`start_together(tmp_path, cache_args, *model_args)` starts a cache service and model
services at once (their start-ups overlap); `start_replicas(tmp_path, count, cache_args,
model_args)` starts `count` pairs of a cache service and a model service at once.
`start_cache_service(tmp_path, *extra_args)` runs `python -m cache_service` and
`start_model_service(tmp_path, cache_address, *extra_args)` runs `python -m model_service
--model tiny --cache-service CACHE_ADDRESS`, both with `--port 0 --metrics-port 0
--port-file` in tmp_path (the model service also `--http-port 0`), and return once the port file is written and grpc.health.v1
says SERVING; `extra_args` come last, so they override (`"--model", path`). Keyword-only
options: `timeout_s` (default 120) for start-up, `env` (extra environment variables; the
PAGEDKV_* variables of the calling shell are dropped so a developer's settings never leak
into a test, except the CPU kernel levels' switches (cpu_kernels/levels.py, with
PAGEDKV_CPU_LEVEL and PAGEDKV_CPU_ARCH): a bench run as `PAGEDKV_CPU_LEVEL=avx2 python -m
bench...` (or `PAGEDKV_F32_KERNELS=avx2 ...`) measures its services at that level, and
a suite run so tests it), `wait_serving=False` to return as soon as the port file exists (a model
service with no cache service stays NOT_SERVING). If the process exits or the timeout
passes first, it is killed and the error carries its stderr.

A ServiceProcess has:
- `.address` ("127.0.0.1:PORT"), `.port`, `.metrics_port`, `.metrics_url`
  ("http://127.0.0.1:PORT/metrics", None when metrics are disabled), `.pid`;
- model services: `.http_port` and `.http_url` ("http://127.0.0.1:PORT/v1", the OpenAI
  API's base URL; None with `"--http-port", "-1"`): HTTP is on a free port, never 8000;
- `.stop(sig=signal.SIGTERM, timeout=15.0) -> int`: sends `sig`, waits up to `timeout`,
  SIGKILLs after that, returns the exit code (negative: killed by that signal);
- `.kill() -> int`: SIGKILL and wait (`stop_all(services)` stops several at once);
- `.returncode`: None while it runs;
- `.logs() -> str`: everything it wrote to stderr so far (JSON lines, as in containers),
  and `.log_events() -> list[dict]` the same lines parsed;
- `with` support: the block's end stops it (SIGTERM, then SIGKILL).
Every process started here is also killed when the test session ends, whatever happened,
and the kernel SIGTERMs it if pytest itself is killed (Linux PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pagedkv import libc
from pagedkv.health_probe import wait_serving as _wait_serving

DEFAULT_TIMEOUT_S = 120.0
_POLL_S = 0.05
_running: set[ServiceProcess] = set()
_counter = itertools.count(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (prefer `--port 0` where a server allows it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """One running service; see the module docstring."""

    def __init__(self, name: str, argv: list[str], tmp_path: Path, env: dict[str, str]) -> None:
        number = next(_counter)
        self.name = name
        self.argv = argv
        self.port_file = Path(tmp_path) / f"{name}-{number}.port.json"
        self.stderr_path = Path(tmp_path) / f"{name}-{number}.stderr.log"
        self.port = 0
        self.metrics_port = -1
        self.http_port = -1
        # Never the model service's default HTTP port 8000: tests run side by side.
        http = ["--http-port", "0"] if name == "model" else []
        full_argv = [*argv[:3], "--port", "0", "--metrics-port", "0", *http, "--port-file", str(self.port_file),
                     *argv[3:]]
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                full_argv,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                env=libc.with_parent(env),  # the service dies with this process (libc.die_with_launcher)
                # Our fds are close-on-exec: exec closes them without a loop over the fd table.
                close_fds=False,
            )
        _running.add(self)

    # -- what tests read ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port < 0 else f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def http_url(self) -> str | None:
        """The OpenAI API's base URL ("http://127.0.0.1:PORT/v1"); None when HTTP is off."""
        return None if self.http_port < 0 else f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def logs(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def log_events(self) -> list[dict]:
        events = []
        for line in self.logs().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # tracebacks and other plain lines
                continue
            if isinstance(event, dict):
                events.append(event)
        return events

    # -- life cycle -----------------------------------------------------------------------

    def wait_started(self, timeout_s: float, wait_serving: bool = True) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        try:
            while not self._read_port_file():
                if self.process.poll() is not None:
                    raise RuntimeError(self._describe(f"exited with code {self.process.returncode} before listening"))
                if time.monotonic() > deadline:
                    raise TimeoutError(self._describe(f"wrote no port file within {timeout_s:g}s"))
                time.sleep(_POLL_S)
            if wait_serving:
                try:
                    _wait_serving(self.address, max(0.0, deadline - time.monotonic()),
                                  alive=lambda: self.process.poll() is None)
                except TimeoutError as error:
                    raise TimeoutError(self._describe(str(error))) from None
                except ChildProcessError as error:
                    raise RuntimeError(self._describe(f"exited with code {self.process.returncode}: {error}")) from None
        except BaseException:
            self.kill()
            raise
        return self

    def _read_port_file(self) -> bool:
        try:
            ports = json.loads(self.port_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not yet, or half written
            return False
        self.port = int(ports["port"])
        self.metrics_port = int(ports["metrics_port"])
        self.http_port = int(ports.get("http_port", -1))
        return True

    def _describe(self, what: str) -> str:
        return f"{self.name} service (pid {self.pid}, {' '.join(self.argv[1:])}) {what}; its stderr:\n{self.logs()}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Sends `sig`, waits up to `timeout` seconds, SIGKILLs after that; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self._wait_stopped(timeout)

    def _wait_stopped(self, timeout: float) -> int:
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        _running.discard(self)
        return self.process.returncode

    def kill(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        _running.discard(self)
        return self.process.returncode

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        return f"ServiceProcess({self.name}, pid={self.pid}, address={self.address}, {state})"


# For a stack that a whole module or session shares: a lease TTL that no load outlasts. With
# the default (5 s), a heavily loaded machine delayed the model services' heartbeats past it
# and they lost their sessions mid-suite. Tests of expiry start services of their own, with
# short TTLs.
SHARED_LEASE_TTL = ("--lease-ttl-ms", "600000")


def _test_env(extra: dict[str, str] | None) -> dict[str, str]:
    from model_service.cpu_kernels import levels  # imports torch: not before a service starts

    switches = set(levels.switches())
    env = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDKV_") or name in switches}
    env.update(extra or {})
    return env


def start_cache_service(
    tmp_path: Path,
    *extra_args: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    wait_serving: bool = True,
) -> ServiceProcess:
    argv = [sys.executable, "-m", "cache_service", *map(str, extra_args)]
    return ServiceProcess("cache", argv, tmp_path, _test_env(env)).wait_started(timeout_s, wait_serving)


def start_model_service(
    tmp_path: Path,
    cache_address: str,
    *extra_args: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    wait_serving: bool = True,
) -> ServiceProcess:
    argv = [sys.executable, "-m", "model_service", "--model", "tiny", "--cache-service", cache_address,
            *map(str, extra_args)]
    return ServiceProcess("model", argv, tmp_path, _test_env(env)).wait_started(timeout_s, wait_serving)


def start_together(tmp_path: Path, cache_args, *model_args, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ServiceProcess]:
    """A cache service on the port that ``cache_args`` names (``"--port", free_port()``)
    and one model service per entry of ``model_args`` (each a tuple of its extra args)
    attached to it, started at once so that their imports and model loading overlap;
    returns them in that order, each SERVING. All are spawned from the calling thread:
    PR_SET_PDEATHSIG signals a child when the thread that forked it exits."""
    args = list(map(str, cache_args))
    port = args[args.index("--port") + 1]
    services = [_spawn_cache(tmp_path, args)] + [_spawn_model(tmp_path, port, extra) for extra in model_args]
    return _wait_all(services, timeout_s)


def start_replicas(tmp_path: Path, count: int, cache_args, model_args,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[ServiceProcess, ServiceProcess]]:
    """``count`` replicas started at once (as ``start_together``): each a cache service with
    ``cache_args`` on a port of its own and a model service with ``model_args`` attached to
    it; returns [(cache, model), ...], each SERVING."""
    ports = [str(free_port()) for _ in range(count)]
    caches = [_spawn_cache(tmp_path, [*map(str, cache_args), "--port", port]) for port in ports]
    models = [_spawn_model(tmp_path, port, model_args) for port in ports]
    services = _wait_all(caches + models, timeout_s)
    return list(zip(services[:count], services[count:]))


def stop_all(services, sig: int = signal.SIGTERM, timeout: float = 15.0) -> list[int]:
    """Stops ``services`` at once (their shutdowns overlap): sends each ``sig``, then waits
    for each as ``ServiceProcess.stop`` does; returns their exit codes."""
    for service in services:
        if service.returncode is None:
            service.process.send_signal(sig)
    return [service._wait_stopped(timeout) for service in services]


def _spawn_cache(tmp_path: Path, args: list[str]) -> ServiceProcess:
    return ServiceProcess("cache", [sys.executable, "-m", "cache_service", *args], tmp_path, _test_env(None))


def _spawn_model(tmp_path: Path, cache_port: str, extra) -> ServiceProcess:
    return ServiceProcess("model", [sys.executable, "-m", "model_service", "--model", "tiny", "--cache-service",
                                    f"127.0.0.1:{cache_port}", *map(str, extra)], tmp_path, _test_env(None))


def _wait_all(services: list[ServiceProcess], timeout_s: float) -> list[ServiceProcess]:
    try:
        return [service.wait_started(timeout_s) for service in services]
    except BaseException:
        for service in services:
            service.kill()
        raise


@atexit.register
def _kill_leftovers() -> None:
    for service in list(_running):
        service.kill()
