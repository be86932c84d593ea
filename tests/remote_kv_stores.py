"""The stores the remote KV tier's tests run against, one kind a backend: a real
valkey-server or mooncake_master (``harness/store_process.py``), and the URL a replica
gives --remote-kv for it. ``BACKENDS`` parametrizes a test over both; Mooncake's
parameter (and a test marked ``skip_without_mooncake``) is skipped, saying why, where its client
library does not load (it needs the system library libibverbs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from cache_service.tiers.remote_backends import MOONCAKE_INSTALL, mooncake_load_error
from harness.mooncake_master import MooncakeMaster
from harness.store_process import StoreProcess
from harness.valkey_server import ValkeyServer

MOONCAKE_LOAD_ERROR = mooncake_load_error()
MOONCAKE_SKIP = f"Mooncake Store's client does not load ({MOONCAKE_LOAD_ERROR}); {MOONCAKE_INSTALL}"
skip_without_mooncake = pytest.mark.skipif(MOONCAKE_LOAD_ERROR is not None, reason=MOONCAKE_SKIP)
# Each marked with its backend (tests/conftest.py's "remote kv backends" line reads the marks).
BACKENDS = [pytest.param("valkey", id="valkey", marks=pytest.mark.valkey),
            pytest.param("mooncake", id="mooncake", marks=[pytest.mark.mooncake, skip_without_mooncake])]
# What each replica's Mooncake client gives the store (segment) and stages transfers in (buffer).
MOONCAKE_SMALL = {"segment": 16 << 20, "buffer": 16 << 20}


class StoreUnderTest:
    """One store of a backend: ``start``/``kill`` (again and again, on the same port) and ``url``."""

    def __init__(self, backend: str, process: StoreProcess, url: str) -> None:
        self.backend = backend
        self.process = process
        self.url = url

    def start(self) -> StoreUnderTest:
        self.process.start()
        return self

    def kill(self) -> None:
        self.process.kill()

    def __enter__(self) -> StoreUnderTest:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


def new_store(backend: str, tmp_path: Path) -> StoreUnderTest:
    """A store of ``backend`` on a port of its own, not started yet."""
    if backend == "valkey":
        server = ValkeyServer(tmp_path)
        return StoreUnderTest(backend, server, server.url)
    master = MooncakeMaster(tmp_path)
    return StoreUnderTest(backend, master, master.url(**MOONCAKE_SMALL))


@contextlib.contextmanager
def full_store(backend: str, tmp_path: Path) -> Iterator[str]:
    """The URL of a running store of ``backend`` that refuses every write for want of memory."""
    if backend == "valkey":
        # At maxmemory with noeviction: it refuses every write (OOM).
        with ValkeyServer(tmp_path, "--maxmemory-policy", "noeviction") as server:
            client = server.client()
            for index in range(32):
                client.set(f"filler-{index}", b"x" * 65536)
            client.config_set("maxmemory", "1mb")  # below what it holds
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set("one-more", b"x")
            yield server.url
        return
    # A pure client (segment=0) of a master no node gives memory to.
    with MooncakeMaster(tmp_path) as master:
        yield master.url(segment=0, buffer=MOONCAKE_SMALL["buffer"])
