"""A store server the remote KV tier's tests run against (valkey-server, mooncake_master):
started on a free loopback port and awaited until it answers, killed (SIGKILL, as a
crash) and started again on the same port to play a store that goes down and comes back.
A backend's starter (``harness/valkey_server.py``, ``harness/mooncake_master.py``) says
only how to run its binary and how to tell that it answers."""

from __future__ import annotations

import abc
import socket
import subprocess
import sys
import time
from pathlib import Path

from harness.processes import free_port
from pagedkv import libc

START_TIMEOUT_S = 30.0
_POLL_S = 0.05


class StoreProcess(abc.ABC):
    name = "store"

    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.log_path = Path(tmp_path) / f"{self.name}-{self.port}.log"
        self.process: subprocess.Popen | None = None

    @abc.abstractmethod
    def argv(self) -> list[str]:
        """The command line that serves on ``self.port``."""

    def answers(self) -> bool:
        """Whether it serves yet; by default, whether its port takes a connection."""
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def start(self, timeout_s: float = START_TIMEOUT_S):
        """Starts it and returns once it answers; RuntimeError, with its log's tail, if it
        exits first or ``timeout_s`` passes (then it is killed)."""
        with open(self.log_path, "ab") as log:
            # The binary dies with this process, killed or not (pagedkv/exec_with_parent.py).
            self.process = subprocess.Popen([sys.executable, "-m", "pagedkv.exec_with_parent", *self.argv()],
                                            stdout=log, stderr=subprocess.STDOUT, env=libc.with_parent())
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} on port {self.port} exited with {self.process.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.name} on port {self.port} did not answer within {timeout_s} s")
            time.sleep(_POLL_S)
        return self

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: the port closes and everything it held is gone."""
        if self.running():
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
