"""The remote KV tier on Valkey (or Redis up to 7.2, the last under an open-source licence), with redis-py.

One pipeline of GETRANGEs answers a chain's blocks in one round trip (MGET would, but
would take a value of any length into memory); a pipeline of SETs (no transaction: each
stands on its own) writes a batch, on a connection of its own with a longer timeout. A
server evicting under maxmemory simply answers fewer keys; one at maxmemory with
noeviction refuses the writes (OOM), which is StoreFull. Connection errors and timeouts
are StoreDown; redis-py makes a new connection on the next call, which is how the tier
reconnects after its backoff.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache_service.tiers.remote_store import RemoteStore, StoreAddress, StoreDown, StoreFull

# Blocks no replica reads again leave on the server's own terms (maxmemory-policy); a
# TTL bounds what a server without maxmemory keeps of prefixes nobody asks for.
VALUE_TTL_S = 24 * 3600
# The least a write batch may take: a batch of large blocks is megabytes, which a Lease
# call's read timeout (--remote-kv-timeout-ms) is not sized for; no Lease call waits on it.
MIN_WRITE_TIMEOUT_S = 10.0


class ValkeyStore(RemoteStore):
    def __init__(self, address: StoreAddress, timeout_s: float) -> None:
        self.reads = _client(address, timeout_s)
        self.writes = _client(address, max(timeout_s, MIN_WRITE_TIMEOUT_S))

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        pipe = self.reads.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(key, 0, max_bytes)  # inclusive end: max_bytes + 1 bytes at most
        try:
            values = pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as error:
            raise StoreDown(str(error)) from None
        return [value or None for value in values]  # an absent key reads as b""

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        pipe = self.writes.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value, ex=VALUE_TTL_S)
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            raise StoreDown(str(error)) from None
        for result in results:
            if isinstance(result, redis.exceptions.OutOfMemoryError):
                raise StoreFull(str(result))
            if isinstance(result, Exception):
                raise result

    def close(self) -> None:
        self.reads.close()
        self.writes.close()


def _client(address: StoreAddress, timeout_s: float) -> redis.Redis:
    # No retry in redis-py: a failed call is StoreDown at once, and the tier backs off.
    return redis.Redis(host=address.host, port=address.port, db=address.db, socket_timeout=timeout_s,
                       socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0), health_check_interval=0)
