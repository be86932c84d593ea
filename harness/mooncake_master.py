"""A real mooncake_master for the remote KV tier's tests: the binary the
mooncake-transfer-engine-non-cuda wheel ships inside its package, on a free
loopback port (clients hand-shake peer to peer, so no metadata server runs); start, kill
and start again: ``harness/store_process.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from harness.processes import free_port
from harness.store_process import StoreProcess


def master_binary() -> Path:
    """The binary inside the installed ``mooncake`` package: the ``mooncake_master`` script
    pip puts in the venv's bin/ starts with the python of whichever venv installed it, a
    path that need not exist where the venv is used (a copied or linked venv)."""
    spec = importlib.util.find_spec("mooncake")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the mooncake package is not installed: pip install 'pagedkv[mooncake]'")
    return Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"


class MooncakeMaster(StoreProcess):
    name = "mooncake_master"

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.metrics_port = free_port()

    def url(self, **settings: int) -> str:
        """``mooncake://`` at this master; ``settings`` (segment, buffer) in its query."""
        query = "&".join(f"{name}={value}" for name, value in settings.items())
        return f"mooncake://127.0.0.1:{self.port}" + (f"?{query}" if query else "")

    def argv(self) -> list[str]:
        return [str(master_binary()), f"-rpc_port={self.port}", "-rpc_address=127.0.0.1",
                f"-metrics_port={self.metrics_port}", "-metrics_host=127.0.0.1"]
