"""What the remote KV tier's test modules share: a Replica (one cache service's ledger and
tiers over a pool tensor, in this process; ``test_kv_tiers.Stack`` with a remote tier),
and a real cache service with a remote tier together with the Lease calls its tests make.

Every block a Replica's sequence writes gets contents that depend on its namespace and
whole prefix, so a block promoted with the wrong bytes, for the wrong prefix, or from
another namespace shows up as a mismatch."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.remote_values import chain_digests
from cache_service.tiers.settings import TierSettings
from harness.cache_helpers import lease, release, stats
from harness.processes import start_cache_service
from pagedkv.cache.v1 import cache_pb2
from test_kv_tiers import BS, GEOMETRY, MODEL, Stack

PROMPT = list(range(100, 113))  # three full blocks a second allocate may reuse, and one token
FULL = 3 * BS
WAIT_S = 60  # bounded waits: they fail only on a hang
_prompts = itertools.count(1000, 100)


def fresh_prompt() -> list[int]:
    """Three full blocks and a token that no other test of the process wrote (for a store
    the tests share)."""
    start = next(_prompts)
    return list(range(start, start + 3 * BS + 1))


def write_key(path, data: bytes | None = None, mode: int = 0o600):
    path.write_bytes(os.urandom(32) if data is None else data)
    os.chmod(path, mode)
    return path


def digests(tokens, namespace=MODEL):
    return chain_digests(tokens, BS, (len(tokens) - 1) // BS, namespace)


class Replica(Stack):
    """A ledger with a remote tier (and a host tier where ``host_cache_bytes``) over a pool
    tensor: one cache service's worth."""

    def __init__(self, url: str, key_file, geometry: DiskGeometry = GEOMETRY, timeout_ms: int = 10_000,
                 queue_blocks: int = 64, clock=time.monotonic, device=lambda tensor: tensor,
                 host_cache_bytes: int = 0) -> None:
        super().__init__(TierSettings(remote_kv=url, remote_kv_key_file=str(key_file), remote_kv_timeout_ms=timeout_ms,
                                      remote_kv_queue_blocks=queue_blocks, host_cache_bytes=host_cache_bytes),
                         geometry, clock=clock, device=device)
        self.remote = self.tiers.remote

    async def run(self, tokens: list[int], namespace=MODEL):
        """``Stack.run`` as a Lease call makes it: after the read-ahead, with its blocks."""
        ahead = await self.tiers.promotions.read_ahead([(tokens, namespace)])
        with self.tiers.promotions.reading_ahead(ahead):
            return super().run(tokens, namespace)

    async def flush(self) -> None:
        """Runs the writer until every offered block is written or dropped."""
        writer = asyncio.get_running_loop().create_task(
            self.remote.run(self.tiers._copy_out, self.tiers._still_registered))
        deadline = time.monotonic() + WAIT_S
        try:
            while self.remote.queue or self.remote.writing:
                assert time.monotonic() < deadline, "the remote writer hung"
                await asyncio.sleep(0.01)
        finally:
            writer.cancel()

    def close(self) -> None:
        self.tiers.close()


def close_all(*replicas: Replica) -> None:
    """Closes them at once: a Mooncake client's close waits out its heartbeat thread."""
    with ThreadPoolExecutor(len(replicas)) as pool:
        list(pool.map(Replica.close, replicas))


# -- a real cache service with a remote tier -----------------------------------------------

SERVICE_BS = 16  # the cache service's default --block-size
SERVICE_PROMPT = list(range(1000, 1000 + 4 * SERVICE_BS + 1))
SERVICE_FULL = 4 * SERVICE_BS
SERVICE_ARGS = ("--kv-cache-bytes", "1MiB", "--max-blocks", "16", "--remote-kv-timeout-ms", "10000",
                "--check-invariants")


def remote_service(tmp_path, store_url, key_file, *extra):
    return start_cache_service(tmp_path, *SERVICE_ARGS, "--remote-kv", store_url, "--remote-kv-key-file", key_file,
                               *extra)


def commit(stub, session: str, prompt: list[int], salt: str = "") -> cache_pb2.LeaseResult:
    """Allocates ``prompt`` and releases it into the prefix cache (its blocks go to the store)."""
    op = cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=len(prompt), prompt_token_ids=prompt,
                                                         cache_salt=salt))
    [allocated] = lease(stub, session, op).results
    assert allocated.status == cache_pb2.LEASE_STATUS_OK, allocated.message
    [released] = lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=prompt)).results
    assert released.status == cache_pb2.LEASE_STATUS_OK, released.message
    return allocated


def remote_row(stub):
    return next(row for row in stats(stub).tiers if row.tier == "remote")
