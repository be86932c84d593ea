"""A real mooncake_master for the remote KV tier's tests: the binary the
mooncake-transfer-engine-non-cuda wheel installs beside the venv's python, on a free
loopback port (clients hand-shake peer to peer, so no metadata server runs); killed and
started again on the same port to play a master that goes down and comes back."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from harness.processes import _die_with_parent, free_port, wait_until_answering

START_TIMEOUT_S = 30.0


def master_binary() -> Path:
    return Path(sys.executable).parent / "mooncake_master"


class MooncakeMaster:
    def __init__(self, tmp_path: Path) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = tmp_path / f"mooncake-master-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def url(self, **settings: int) -> str:
        """``mooncake://`` at this master; ``settings`` (segment, buffer) in its query."""
        query = "&".join(f"{name}={value}" for name, value in settings.items())
        return f"mooncake://127.0.0.1:{self.port}" + (f"?{query}" if query else "")

    def start(self) -> MooncakeMaster:
        argv = [str(master_binary()), f"-rpc_port={self.port}", "-rpc_address=127.0.0.1",
                f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        wait_until_answering(self.process, self._listening, f"mooncake_master on port {self.port}", self.log_path,
                             START_TIMEOUT_S)
        return self

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL, as a crash: the port closes and the master forgets every object."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()
