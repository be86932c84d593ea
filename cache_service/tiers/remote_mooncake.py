"""The remote KV tier on Mooncake Store (``mooncake://MASTER_HOST:PORT``), with the
``mooncake-transfer-engine-non-cuda`` wheel (the ``mooncake`` extra; it loads only where
the system library libibverbs is installed).

Each cache service is a client of one ``mooncake_master``; over TCP it also contributes
``segment`` bytes of its own memory to the cluster's store (0: a pure client, whose
writes land in other nodes' segments), which other nodes read from directly, so
``host`` is the address peers reach this node at. Handshakes go peer to peer
(P2PHANDSHAKE), so the master is the only service a cluster runs besides the cache services.

A read asks ``batch_is_exist`` first: the bytes call answers an absent key and a master
that is down alike (an empty value), while the existence call says -1 for an error,
which is StoreDown. Writes are upserts (a put on an existing key is refused, not
replaced); a refused write is StoreDown when the master did not answer, StoreFull
otherwise (no segment has room). The client is set up on first use in the tier's worker
thread, so a master that is down at start-up is only a master that is down (a connect
to it, bounded by --remote-kv-timeout-ms, comes first).
"""

from __future__ import annotations

import socket
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.tiers.remote_store import RemoteKvRefused, RemoteStore, StoreAddress, StoreDown, StoreFull

# The client's errors for a master or peer that did not answer (mooncake's ErrorCode:
# the RPC and transfer ranges); any other refusal of a write is a store without room.
_UNREACHABLE = range(-999, -899)
DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_BUFFER_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class MooncakeSettings:
    segment_bytes: int
    buffer_bytes: int
    host: str | None  # None: the address this node reaches the master from


def parse_mooncake_query(url: str, query: str) -> MooncakeSettings:
    """``segment=BYTES``, ``buffer=BYTES`` and ``host=ADDRESS`` in the URL's query."""
    allowed = {"segment", "buffer", "host"}
    try:
        pairs = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=3)
    except ValueError:
        pairs = {"": [""]}
    unknown = set(pairs) - allowed
    if unknown or any(len(values) != 1 for values in pairs.values()):
        raise RemoteKvRefused(f"--remote-kv {url!r}: the query takes segment=BYTES (memory this node gives the "
                              "store; 0: a pure client), buffer=BYTES and host=ADDRESS, each once")
    sizes = {}
    for name, default in (("segment", DEFAULT_SEGMENT_BYTES), ("buffer", DEFAULT_BUFFER_BYTES)):
        text = pairs.get(name, [str(default)])[0]
        if not text.isdigit() or int(text) >= 1 << 40:
            raise RemoteKvRefused(f"--remote-kv {url!r}: {name} is a number of bytes below 1 TiB, got {text!r}")
        sizes[name] = int(text)
    host = pairs.get("host", [None])[0]
    if host is not None and not host:
        raise RemoteKvRefused(f"--remote-kv {url!r}: host is the address other nodes reach this one at")
    if sizes["buffer"] == 0:
        raise RemoteKvRefused(f"--remote-kv {url!r}: buffer must be more than 0 bytes")
    return MooncakeSettings(sizes["segment"], sizes["buffer"], host)


def _local_address(master_host: str, master_port: int) -> str:
    """The address of the interface this node reaches the master through (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, master_port))
        return probe.getsockname()[0]


class MooncakeStore(RemoteStore):
    def __init__(self, address: StoreAddress, timeout_s: float) -> None:
        self.address = address
        self.settings = address.options
        self.timeout_s = timeout_s
        self._client = None
        self._lock = threading.Lock()

    def _store(self):
        with self._lock:
            if self._client is None:
                try:
                    from mooncake.store import MooncakeDistributedStore
                except ImportError as error:  # checked at start-up; here only if the library went away
                    raise StoreDown(f"the Mooncake library does not load: {error}") from None
                # The client's setup retries a master that does not answer for a minute
                # and more; a connect bounded by the tier's timeout says so at once.
                try:
                    socket.create_connection((self.address.host, self.address.port), timeout=self.timeout_s).close()
                except OSError as error:
                    raise StoreDown(f"mooncake_master at {self.address.host}:{self.address.port}: {error}") from None
                client = MooncakeDistributedStore()
                host = self.settings.host or _local_address(self.address.host, self.address.port)
                code = client.setup({
                    "local_hostname": host, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
                    "global_segment_size": str(self.settings.segment_bytes),
                    "local_buffer_size": str(self.settings.buffer_bytes),
                    "master_server_addr": f"{self.address.host}:{self.address.port}"})
                if code != 0:
                    raise StoreDown(f"mooncake_master at {self.address.host}:{self.address.port} refused the setup ({code})")
                self._client = client
            return self._client

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        client = self._store()
        present = client.batch_is_exist(list(keys))
        if any(flag < 0 for flag in present):
            raise StoreDown("mooncake_master did not answer batch_is_exist")
        wanted = [key for key, flag in zip(keys, present, strict=True) if flag == 1]
        values = dict(zip(wanted, client.get_batch(wanted), strict=True)) if wanted else {}
        # A value evicted between the two calls reads as empty, an absent block.
        return [(values.get(key) or None) and values[key][:max_bytes + 1] for key in keys]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        code = self._store().upsert_batch([key for key, _ in items], [value for _, value in items])
        if code in _UNREACHABLE:
            raise StoreDown(f"mooncake_master did not take the write ({code})")
        if code < 0:
            raise StoreFull(f"the Mooncake store refused the write ({code})")

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
