"""The remote KV tier's backends, by the scheme of --remote-kv's URL.

A second backend (Mooncake Store, say) is its own file with a ``RemoteStore``
(``remote_store.py``) and one more entry here.
"""

from __future__ import annotations

import urllib.parse

from cache_service.tiers.remote_store import RemoteKvRefused, RemoteStore, StoreAddress
from cache_service.tiers.remote_valkey import ValkeyStore

BACKENDS: dict[str, type[RemoteStore]] = {"valkey": ValkeyStore, "redis": ValkeyStore}


def parse_remote_url(url: str) -> StoreAddress:
    """``valkey://HOST:PORT[/DB]`` or ``redis://HOST:PORT[/DB]``; RemoteKvRefused otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "mooncake":
        raise RemoteKvRefused(f"--remote-kv {url!r}: the Mooncake Store backend is not built yet; "
                              "use a Valkey server (valkey://HOST:PORT)")
    if parts.scheme not in BACKENDS:
        raise RemoteKvRefused(f"--remote-kv {url!r}: the scheme must be one of {', '.join(sorted(BACKENDS))} "
                              "(e.g. valkey://127.0.0.1:6379)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise RemoteKvRefused(f"--remote-kv {url!r}: give the store's host and port, e.g. {parts.scheme}://10.0.0.5:6379")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise RemoteKvRefused(f"--remote-kv {url!r}: only {parts.scheme}://HOST:PORT[/DB] is understood "
                              "(no user, password, query or fragment)")
    path = parts.path.strip("/")
    if path and not (path.isdigit() and int(path) < 16384):
        raise RemoteKvRefused(f"--remote-kv {url!r}: the path is the database number, e.g. /0; got {parts.path!r}")
    return StoreAddress(parts.scheme, parts.hostname, port, int(path) if path else 0)


def open_store(address: StoreAddress, timeout_s: float) -> RemoteStore:
    """A client of the store at ``address`` (it connects on first use, so a store that is
    down at start-up is only a store that is down)."""
    return BACKENDS[address.scheme](address, timeout_s)
