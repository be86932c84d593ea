"""The remote KV tier's store: the few calls the tier makes, behind which any backend sits.

The tier (``remote_tier.py``) needs a batch get, a batch put and a close; a backend maps
its client's failures onto StoreDown (unreachable, timed out: back off and retry later)
and StoreFull (the store refuses writes for want of memory: drop them). Everything else a
backend raises is a bug of its own and is counted by the tier as an error, never a failed
request. Adding a backend is one new file with a class like ``ValkeyStore`` and a line in
``remote_backends.BACKENDS``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cache_service.tiers.disk_folder import KEY_BYTES, read_key


class StoreDown(ConnectionError):
    """The store did not answer (down, unreachable, or slower than the tier's timeout)."""


class StoreFull(RuntimeError):
    """The store refused a write for want of memory (maxmemory with noeviction)."""


class RemoteKvRefused(ValueError):
    """--remote-kv or its key file cannot be used; the message says why and what to do."""


class RemoteStore(abc.ABC):
    """A key-value store reached over the network; each method runs in a worker thread."""

    @abc.abstractmethod
    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        """Each key's value (None: absent), in one round trip; a value longer than
        ``max_bytes`` comes back cut to ``max_bytes + 1`` bytes, so a huge value (from
        whoever else writes to the store) costs no more memory than a block."""

    @abc.abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Stores every (key, value), in one round trip; StoreFull if the store refuses them."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drops the connections."""


@dataclass(frozen=True, slots=True)
class StoreAddress:
    scheme: str
    host: str
    port: int
    db: int
    options: object = None  # a backend's own settings (remote_mooncake.MooncakeSettings)

    def __str__(self) -> str:
        if self.scheme == "mooncake":
            return f"mooncake://{self.host}:{self.port}"
        return f"{self.scheme}://{self.host}:{self.port}/{self.db}"


def load_remote_key(path: str | Path) -> bytes:
    """--remote-kv-key-file's key: every cache service of the cluster reads the same one,
    so it is never made here (a key made here would be this service's alone)."""
    return read_key(Path(path), "the remote tier's key (--remote-kv-key-file)", RemoteKvRefused,
                    f"make one with: head -c {KEY_BYTES} /dev/urandom > FILE && chmod 600 FILE, "
                    "and give every cache service of the cluster the same")
