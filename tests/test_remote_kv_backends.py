"""The remote KV tier's behaviour that is the same on every backend, run against a real
store of each (tests/remote_kv_stores.py: valkey-server, and mooncake_master where
Mooncake Store's client loads; skipped, saying why, elsewhere).

First on the ledger, in this process (tests/remote_replica.py): replicas sharing one store
per backend, each test on prompts of its own. Then two replicas, each a cache service and
a model service of the tiny model, sharing that store: started once per backend, the test
that kills and restarts the store last. A store that dies, is down, comes back or is full
costs recomputation (or a hit in a replica's own tiers), never a failed call; a value not
sealed under the cluster's key, or from another namespace, is never promoted.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_generate import greedy
from remote_kv_stores import BACKENDS, full_store, new_store
from remote_replica import (
    FULL,
    SERVICE_ARGS,
    SERVICE_FULL,
    SERVICE_PROMPT,
    WAIT_S,
    Replica,
    close_all,
    commit,
    digests,
    fresh_prompt,
    remote_row,
    write_key,
)

from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.remote_values import RemoteValues
from harness.cache_helpers import attach, cache_stub, stats, wait_for
from harness.processes import SHARED_LEASE_TTL, start_replicas, stop_all
from pagedkv.model.v1 import model_pb2_grpc
from scrape import metric
from test_kv_tiers import BS, GEOMETRY, MODEL

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def store(backend, tmp_path_factory):
    """The store the module's tests share, one a backend."""
    with new_store(backend, tmp_path_factory.mktemp(f"{backend}-store")) as shared:
        yield shared


@pytest.fixture
def key_file(tmp_path):
    return write_key(tmp_path / "remote.key")


# -- replicas on the ledger ------------------------------------------------------------------


def test_a_prefix_one_replica_committed_is_promoted_by_another_with_its_bytes(store, key_file):
    prompt = fresh_prompt()

    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        assert (await a.run(prompt)).cached_tokens == 0
        await a.flush()
        assert a.remote.counters.demotions == 3
        got = await b.run(prompt)
        assert (got.cached_tokens, got.cached_tokens_remote, got.cached_tokens_host) == (FULL, FULL, 0)
        counters = b.remote.counters
        assert (counters.promotions, counters.hit_tokens, counters.bytes_out) == (3, FULL, 3 * GEOMETRY.payload_bytes)
        again = await b.run(prompt)  # now in b's own pool
        assert (again.cached_tokens, again.cached_tokens_remote) == (FULL, 0)
        await b.flush()
        assert b.remote.counters.demotions == 0, "blocks read from the store are not written back"
        # A longer prompt on the same prefix: its first blocks from b's pool, the next from a's writes.
        longer = prompt[:-1] + fresh_prompt()[:9]
        await a.run(longer)
        await a.flush()
        assert a.remote.counters.errors == 0
        b.evict_everything()
        got = await b.run(longer)
        assert (got.cached_tokens, got.cached_tokens_remote) == (5 * BS, 5 * BS)
        close_all(a, b)

    asyncio.run(body())


def test_a_value_sealed_under_another_key_is_never_promoted(store, key_file):
    prompt = fresh_prompt()

    async def body():
        a, b = Replica(store.url, key_file), Replica(store.url, key_file)
        await a.run(prompt)
        await a.flush()
        # The second block's own bytes, under its own store key, sealed with a key the
        # cluster does not share: only its MAC is wrong. The first block stays, so the hit
        # stops after it.
        second = digests(prompt)[1]
        forger = RemoteValues(os.urandom(32), GEOMETRY)
        forged = forger.encode(second, a.expected(prompt, 1).contiguous())
        assert len(forged) == a.remote.values.value_bytes
        a.remote.store.put_many([(a.remote.values.key_of(second), forged)])
        got = await b.run(prompt)
        assert (got.cached_tokens, got.cached_tokens_remote, b.remote.remote.rejected) == (BS, BS, 1)
        close_all(a, b)

    asyncio.run(body())


def test_models_tenants_layouts_and_keys_never_meet(store, key_file, tmp_path):
    prompt = fresh_prompt()
    # Readers of what the writer wrote: (geometry, key file) -> the namespaces each reads in.
    # One replica reads in several namespaces (a Mooncake client's close costs a second).
    readers = {
        (GEOMETRY, key_file): {"model": ("model-2", ""), "salt": ("model-1", "tenant-b"),
                               "same": MODEL},  # the control, last: it reads every block
        (DiskGeometry(2, 1, 2, BS, torch.bfloat16), key_file): {"dtype": MODEL},
        (DiskGeometry(2, 2, 1, BS, torch.float32), key_file): {"heads": MODEL},  # as many bytes, another layout
        (GEOMETRY, write_key(tmp_path / "other.key")): {"key": MODEL},
    }

    async def body():
        writer = Replica(store.url, key_file)
        await writer.run(prompt)
        await writer.flush()
        got, replicas = {}, [writer]
        for (geometry, key), namespaces in readers.items():
            reader = Replica(store.url, key, geometry)
            replicas.append(reader)
            for name, namespace in namespaces.items():
                allocation = await reader.run(prompt, namespace)
                got[name] = (allocation.cached_tokens_remote, reader.remote.remote.rejected)
        close_all(*replicas)
        return got

    # Another key reads the writer's values and rejects the first (its MAC); the others
    # look under other store keys and find nothing.
    want = {"model": (0, 0), "salt": (0, 0), "same": (FULL, 0), "dtype": (0, 0), "heads": (0, 0), "key": (0, 1)}
    assert asyncio.run(body()) == want


def test_a_store_killed_mid_request_costs_a_recompute_or_a_local_hit_never_a_failure(backend, key_file, tmp_path):
    prompt = fresh_prompt()
    with new_store(backend, tmp_path) as own:

        async def body():
            a = Replica(own.url, key_file)
            b = Replica(own.url, key_file, host_cache_bytes=4 * GEOMETRY.payload_bytes)
            await a.run(prompt)
            await a.flush()
            # b holds the prompt's first two blocks in its host tier; the third is only in the store.
            await b.run(prompt[:2 * BS + 1])
            b.demote_all()
            b.evict_everything()
            read = b.remote.store.get_many

            def killed_while_asked(keys, max_bytes):
                own.kill()
                return read(keys, max_bytes)

            b.remote.store.get_many = killed_while_asked
            got = await b.run(prompt)  # Stack.run checks every block it was served
            assert (got.cached_tokens, got.cached_tokens_host, got.cached_tokens_remote) == (2 * BS, 2 * BS, 0)
            assert b.remote.counters.errors == 1 and b.remote.down()
            # a serves its own prefix from its pool; a fresh prompt is recomputed and its
            # blocks are dropped, counted, as the store does not answer.
            assert (await a.run(prompt)).cached_tokens == FULL
            assert (await a.run(fresh_prompt())).cached_tokens == 0
            await a.flush()
            assert a.remote.counters.errors == 1 and a.remote.remote.dropped_store_down == 3
            own.start()  # a Mooncake client's close waits seconds on a master that is gone
            close_all(a, b)

        asyncio.run(body())


def test_a_full_store_drops_writes_and_counts_them(backend, key_file, tmp_path):
    prompt = fresh_prompt()
    with full_store(backend, tmp_path) as url:

        async def body():
            replica = Replica(url, key_file)
            await replica.run(prompt)
            await replica.flush()
            assert replica.remote.remote.dropped_store_full == 3
            assert replica.remote.counters.demotions == 0 and not replica.remote.down()
            assert (await replica.run(prompt)).cached_tokens == FULL  # from its own pool, as ever
            replica.close()

        asyncio.run(body())


def test_a_store_that_is_down_costs_a_recompute_and_is_reconnected_when_back(backend, key_file, tmp_path):
    own = new_store(backend, tmp_path)  # its port, with nothing listening yet
    now = [0.0]  # the tier's clock: the backoff ends when the test says

    async def body():
        replica = Replica(own.url, key_file, clock=lambda: now[0])
        got = await replica.run(fresh_prompt())  # the read fails: the store is down for a while
        assert got.cached_tokens == 0
        assert replica.remote.counters.errors == 1 and replica.remote.down()
        assert replica.remote.remote.dropped_store_down == 3  # its release's blocks are not even queued
        await replica.run(fresh_prompt())  # still backing off: nothing asked of the store
        assert replica.remote.counters.errors == 1 and replica.remote.remote.dropped_store_down == 6
        with own.start():
            now[0] += 60  # past the longest backoff
            later = fresh_prompt()
            await replica.run(later)
            await replica.flush()
            assert replica.remote.remote.reconnects == 1 and replica.remote.counters.demotions == 3
            other = Replica(own.url, key_file)
            got = await other.run(later)
            assert got.cached_tokens_remote == FULL
            close_all(replica, other)

    asyncio.run(body())


# -- two replicas of the tiny model, sharing the store --------------------------------------


@pytest.fixture(scope="module")
def cluster(store, tmp_path_factory):
    """Two replicas (a cache service with the remote tier and a model service each), started at once."""
    tmp_path = tmp_path_factory.mktemp(f"{store.backend}-cluster")
    key = write_key(tmp_path / "remote.key")
    replicas = start_replicas(tmp_path, 2, [*SHARED_LEASE_TTL, *SERVICE_ARGS, "--remote-kv", store.url,
                                            "--remote-kv-key-file", key],
                              ["--max-model-len", "128"])
    yield replicas
    stop_all([model for _, model in replicas])
    stop_all([cache for cache, _ in replicas])
    for cache, _ in replicas:
        assert "invariant_broken" not in cache.logs()


@pytest.mark.timeout(300)  # whichever cluster test runs first starts the cluster
def test_a_replica_serves_a_prefix_another_computed_with_the_same_greedy_output(cluster):
    (cache_a, model_a), (_, model_b) = cluster
    prompt = [4 + (index * 37) % 240 for index in range(100)]  # six full blocks a second request may reuse
    stub_a = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_a.address))
    stub_b = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_b.address))
    written = remote_row(cache_stub(cache_a.address)).demotions
    want, last = greedy(stub_a, prompt, 8)
    assert last.usage.cached_tokens == 0
    wait_for(lambda: remote_row(cache_stub(cache_a.address)).demotions >= written + 6, WAIT_S, "a's prefix in the store")
    got, last = greedy(stub_b, prompt, 8)
    assert got == want
    assert (last.usage.cached_tokens, last.usage.cached_tokens_remote) == (96, 96)
    # OpenAI's usage says the same, for a prompt a computed and b has not seen.
    other = [token + 1 for token in prompt]
    greedy(stub_a, other, 8)
    wait_for(lambda: remote_row(cache_stub(cache_a.address)).demotions >= written + 12, WAIT_S, "the second prefix")
    body = json.dumps({"model": "tiny", "prompt": other, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{model_b.http_url}/completions", data=body, method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        details = json.loads(response.read())["usage"]["prompt_tokens_details"]
    assert (details["cached_tokens"], details["cached_tokens_remote"]) == (96, 96)


@pytest.mark.timeout(300)  # whichever cluster test runs first starts the cluster
def test_two_cache_services_share_prefixes_through_the_store_and_never_across_namespaces(cluster):
    (first, _), (second, _) = cluster
    a, b = cache_stub(first.address), cache_stub(second.address)
    session_a = attach(a, "lease-a", model_fingerprint="tiny-1").session_id
    session_b = attach(b, "lease-b", model_fingerprint="tiny-1").session_id
    other_model = attach(b, "other", model_fingerprint="tiny-2").session_id
    written, hits = remote_row(a).demotions, stats(b).prefix_hits
    assert commit(a, session_a, SERVICE_PROMPT).cached_tokens == 0
    wait_for(lambda: remote_row(a).demotions >= written + 4, WAIT_S, "the prefix written to the store")
    assert commit(b, other_model, SERVICE_PROMPT).cached_tokens == 0  # another model's never meets
    assert commit(b, session_b, SERVICE_PROMPT, salt="tenant").cached_tokens == 0  # nor another tenant's
    read = remote_row(b)
    got = commit(b, session_b, SERVICE_PROMPT)
    assert (got.cached_tokens, got.cached_tokens_remote) == (SERVICE_FULL, SERVICE_FULL)
    row = remote_row(b)
    assert (row.promotions - read.promotions, row.hit_tokens - read.hit_tokens) == (4, SERVICE_FULL)
    assert stats(b).prefix_hits - hits == SERVICE_FULL


@pytest.mark.timeout(300)  # whichever cluster test runs first starts the cluster
def test_a_store_killed_and_restarted_fails_no_lease_is_reconnected_and_metrics_say_so(cluster, store):
    """Last of the cluster's tests: it kills the store they share, then starts it again."""
    (first, _), (second, _) = cluster
    a, b = cache_stub(first.address), cache_stub(second.address)
    session_a, session_b = attach(a, "kill-a").session_id, attach(b, "kill-b").session_id
    prompts = iter(range(100_000, 10**7, 1000))

    def fresh() -> list[int]:
        start = next(prompts)
        return list(range(start, start + len(SERVICE_PROMPT)))

    def count(service, outcome: str) -> float:
        return metric(service, "pagedkv_cache_remote_kv_total", outcome=outcome)

    def errors(service) -> float:
        return metric(service, "pagedkv_cache_tier_errors_total", tier="remote")

    shared = fresh()
    written = remote_row(a).demotions
    commit(a, session_a, shared)
    wait_for(lambda: remote_row(a).demotions >= written + 4, WAIT_S, "the prefix written to the store")
    errors_before = [errors(first), errors(second)]
    store.kill()
    # b finds the store gone: it recomputes; a's next writes are dropped, counted.
    assert commit(b, session_b, shared).cached_tokens == 0
    assert errors(second) > errors_before[1]
    dropped = count(first, "dropped_store_down")
    commit(a, session_a, fresh())
    wait_for(lambda: count(first, "dropped_store_down") >= dropped + 4, WAIT_S, "a's writes dropped while down")
    assert errors(first) > errors_before[0]
    store.start()
    # a writes again once its backoff is over (a fresh prompt a call, each one more write).
    written = remote_row(a).demotions
    deadline = time.monotonic() + WAIT_S
    while remote_row(a).demotions == written:
        assert time.monotonic() < deadline, "a never wrote to the store again"
        commit(a, session_a, fresh())
        time.sleep(0.05)
    assert count(first, "reconnects") >= 1
    # One more prefix, written once everything a queued before it is out of the queue.
    wait_for(lambda: remote_row(a).blocks_queued == 0, WAIT_S, "a's writes done")
    before = remote_row(a).demotions
    last = fresh()
    commit(a, session_a, last)
    wait_for(lambda: remote_row(a).demotions >= before + 4, WAIT_S, "the last prefix written")

    # b asks the store again once its backoff is over (each fresh prompt is a read).
    def b_reconnected() -> bool:
        commit(b, session_b, fresh())
        return count(second, "reconnects") >= 1

    wait_for(b_reconnected, WAIT_S, "b reconnected")
    got = commit(b, session_b, last)
    assert (got.cached_tokens, got.cached_tokens_remote) == (SERVICE_FULL, SERVICE_FULL)
