"""The remote KV tier's backends, by the scheme of --remote-kv's URL.

A backend is its own file with a ``RemoteStore`` (``remote_store.py``) and one more entry
here. Mooncake Store's client is imported only when a ``mooncake://`` URL asks for it: it
needs the system library libibverbs, which a Valkey deployment need not install.
"""

from __future__ import annotations

import urllib.parse

from cache_service.tiers.remote_mooncake import MooncakeStore, parse_mooncake_query
from cache_service.tiers.remote_store import RemoteKvRefused, RemoteStore, StoreAddress
from cache_service.tiers.remote_valkey import ValkeyStore

BACKENDS: dict[str, type[RemoteStore]] = {"valkey": ValkeyStore, "redis": ValkeyStore, "mooncake": MooncakeStore}
MOONCAKE_INSTALL = ("pip install 'pagedkv[mooncake]' (the mooncake-transfer-engine-non-cuda wheel) "
                    "and the system library libibverbs (apt-get install libibverbs1)")


def mooncake_load_error() -> str | None:
    """Why Mooncake Store's client does not load here, or None when it does."""
    try:
        import mooncake.store  # noqa: F401, PLC0415
    except ImportError as error:
        return str(error)
    return None


def parse_remote_url(url: str) -> StoreAddress:
    """``valkey://HOST:PORT[/DB]``, ``redis://HOST:PORT[/DB]`` or
    ``mooncake://MASTER_HOST:PORT[?segment=BYTES&buffer=BYTES&host=ADDRESS]``;
    RemoteKvRefused otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in BACKENDS:
        raise RemoteKvRefused(f"--remote-kv {url!r}: the scheme must be one of {', '.join(sorted(BACKENDS))} "
                              "(e.g. valkey://127.0.0.1:6379)")
    if parts.scheme == "mooncake":
        return _mooncake_address(url, parts)
    port = _port(url, parts, "the store's host and port", f"{parts.scheme}://10.0.0.5:6379")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise RemoteKvRefused(f"--remote-kv {url!r}: only {parts.scheme}://HOST:PORT[/DB] is understood "
                              "(no user, password, query or fragment)")
    path = parts.path.strip("/")
    if path and not (path.isdigit() and int(path) < 16384):
        raise RemoteKvRefused(f"--remote-kv {url!r}: the path is the database number, e.g. /0; got {parts.path!r}")
    return StoreAddress(parts.scheme, parts.hostname, port, int(path) if path else 0)


def _port(url: str, parts: urllib.parse.SplitResult, what: str, example: str) -> int:
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise RemoteKvRefused(f"--remote-kv {url!r}: give {what}, e.g. {example}")
    return port


def _mooncake_address(url: str, parts: urllib.parse.SplitResult) -> StoreAddress:
    port = _port(url, parts, "mooncake_master's host and RPC port", "mooncake://10.0.0.5:50051")
    if parts.username or parts.password or parts.fragment or parts.path.strip("/"):
        raise RemoteKvRefused(f"--remote-kv {url!r}: only mooncake://HOST:PORT[?segment=BYTES&buffer=BYTES&host=ADDRESS] "
                              "is understood (no user, password, path or fragment)")
    settings = parse_mooncake_query(url, parts.query)
    reason = mooncake_load_error()
    if reason is not None:
        raise RemoteKvRefused(f"--remote-kv {url!r}: Mooncake Store's client does not load ({reason}); {MOONCAKE_INSTALL}")
    return StoreAddress("mooncake", parts.hostname, port, 0, settings)


def open_store(address: StoreAddress, timeout_s: float) -> RemoteStore:
    """A client of the store at ``address`` (it connects on first use, so a store that is
    down at start-up is only a store that is down)."""
    return BACKENDS[address.scheme](address, timeout_s)
