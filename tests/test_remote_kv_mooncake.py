"""The remote KV tier against a real mooncake_master (the mooncake-transfer-engine-non-cuda
wheel's binary), where Mooncake Store's client loads (it needs the system library
libibverbs); skipped, saying why, elsewhere. The same cases as tests/test_remote_kv.py's
Valkey ones, through the same Replica: a prefix one replica computed promoted by another,
a forged value, a foreign namespace, a master killed mid-run, a store with no room.
One master serves the module; each test writes under prompts of its own."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from grpc_generate import greedy

from cache_service.tiers.remote_backends import MOONCAKE_INSTALL, mooncake_load_error, parse_remote_url
from cache_service.tiers.remote_store import RemoteKvRefused
from harness.cache_helpers import cache_stub, wait_for
from harness.mooncake_master import MooncakeMaster
from harness.processes import start_model_service
from pagedkv.model.v1 import model_pb2_grpc
from test_kv_tiers import BS, GEOMETRY
from test_remote_kv import FULL, WAIT_S, Replica, _digests, remote_row, remote_service, write_key

LOAD_ERROR = mooncake_load_error()
needs_mooncake = pytest.mark.skipif(LOAD_ERROR is not None,
                                    reason=f"Mooncake Store's client does not load ({LOAD_ERROR}); {MOONCAKE_INSTALL}")
pytestmark = [pytest.mark.timeout(120)]

SMALL = {"segment": 16 << 20, "buffer": 16 << 20}  # what each test replica gives the store
_prompts = itertools.count(1000, 100)


def fresh_prompt() -> list[int]:
    """Three full blocks and a token no other test of the module wrote (the master is shared)."""
    start = next(_prompts)
    return list(range(start, start + 3 * BS + 1))


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    if LOAD_ERROR is not None:
        pytest.skip(f"Mooncake Store's client does not load ({LOAD_ERROR}); {MOONCAKE_INSTALL}")
    with MooncakeMaster(tmp_path_factory.mktemp("mooncake")) as server:
        yield server


@pytest.fixture
def key_file(tmp_path):
    return write_key(tmp_path / "remote.key")


@needs_mooncake
def test_a_prefix_one_replica_committed_is_promoted_by_another_with_its_bytes(master, key_file):
    prompt = fresh_prompt()

    async def body():
        a, b = Replica(master.url(**SMALL), key_file), Replica(master.url(**SMALL), key_file)
        assert (await a.run(prompt)).cached_tokens == 0
        await a.flush()
        assert a.remote.counters.demotions == 3
        got = await b.run(prompt)
        assert (got.cached_tokens, got.cached_tokens_remote) == (FULL, FULL)
        assert b.remote.counters.bytes_out == 3 * GEOMETRY.payload_bytes
        await a.run(prompt)  # a put on a key the store holds is an upsert, not a failure
        await a.flush()
        assert a.remote.counters.errors == 0
        a.close()
        b.close()

    asyncio.run(body())


@needs_mooncake
@pytest.mark.parametrize("damage", ["forged", "foreign-key", "foreign-model"])
def test_a_forged_value_or_a_foreign_namespace_is_never_promoted(master, key_file, tmp_path, damage):
    prompt = fresh_prompt()

    async def body():
        a = Replica(master.url(**SMALL), key_file)
        await a.run(prompt)
        await a.flush()
        namespace, key = ("model-1", ""), key_file
        if damage == "forged":
            # A value of the right length under the second block's key, not under the cluster's key.
            forger = Replica(master.url(**SMALL), key_file)
            key_of = a.remote.values.key_of
            forger.remote.store.put_many([(key_of(_digests(prompt)[1]), b"\0" * a.remote.values.value_bytes)])
            forger.close()
        elif damage == "foreign-key":
            key = write_key(tmp_path / "other.key")
        else:
            namespace = ("model-2", "")
        b = Replica(master.url(**SMALL), key)
        got = await b.run(prompt, namespace)
        expected = {"forged": (BS, 1), "foreign-key": (0, 1), "foreign-model": (0, 0)}[damage]
        assert (got.cached_tokens_remote, b.remote.remote.rejected) == expected
        a.close()
        b.close()

    asyncio.run(body())


@needs_mooncake
def test_a_master_killed_mid_run_costs_a_recompute_not_a_failure(tmp_path, key_file):
    with MooncakeMaster(tmp_path) as own:
        prompt = fresh_prompt()

        async def body():
            a = Replica(own.url(**SMALL), key_file, timeout_ms=2000)
            await a.run(prompt)
            await a.flush()
            own.kill()
            b = Replica(own.url(**SMALL), key_file, timeout_ms=2000)
            got = await b.run(prompt)  # the master is gone: b computes it all
            assert (got.cached_tokens, got.cached_tokens_remote) == (0, 0)
            assert b.remote.counters.errors == 1 and b.remote.down()
            again = await a.run(fresh_prompt())  # a's writes are dropped, its Lease served
            assert again.cached_tokens == 0
            a.close()
            b.close()

        asyncio.run(body())


@needs_mooncake
def test_a_store_with_no_room_drops_writes_and_counts_them(master, key_file):
    prompt = fresh_prompt()

    async def body():
        # A pure client on a master no node gives memory to: every write is refused.
        replica = Replica(master.url(segment=0, buffer=16 << 20), key_file)
        await replica.run(prompt)
        await replica.flush()
        assert replica.remote.remote.dropped_store_full == 3
        assert replica.remote.counters.demotions == 0 and not replica.remote.down()
        assert (await replica.run(prompt)).cached_tokens == FULL  # from its own pool, as ever
        replica.close()

    asyncio.run(body())


@needs_mooncake
def test_a_replica_serves_a_prefix_another_computed_with_the_same_greedy_output(tmp_path, master, key_file):
    prompt = [4 + (index * 41) % 240 for index in range(100)]  # six full blocks a second request may reuse
    url = master.url(**SMALL)
    with remote_service(tmp_path, url, key_file) as cache_a, remote_service(tmp_path, url, key_file) as cache_b, \
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


@pytest.mark.parametrize(("url", "message"), [
    ("mooncake://127.0.0.1", "host and RPC port"),
    ("mooncake://127.0.0.1:50051/path", "no user, password, path"),
    ("mooncake://u:p@127.0.0.1:50051", "no user, password, path"),
    ("mooncake://127.0.0.1:50051?segment=-1", "segment is a number of bytes"),
    ("mooncake://127.0.0.1:50051?buffer=0", "buffer must be more than 0"),
    ("mooncake://127.0.0.1:50051?segment=1&segment=2", "each once"),
    ("mooncake://127.0.0.1:50051?color=red", "the query takes segment=BYTES"),
    ("mooncake://127.0.0.1:50051?host=", "host is the address"),
    ("mooncake://127.0.0.1:50051?%zz", "the query takes"),
])
def test_a_bad_mooncake_url_is_refused_saying_what_is_understood(url, message):
    with pytest.raises(RemoteKvRefused, match=message):
        parse_remote_url(url)


def test_a_good_mooncake_url_is_understood_where_the_library_loads():
    url = "mooncake://10.0.0.5:50051?segment=0&host=10.0.0.9"
    if LOAD_ERROR is not None:
        with pytest.raises(RemoteKvRefused, match="libibverbs"):
            parse_remote_url(url)
        return
    address = parse_remote_url(url)
    assert str(address) == "mooncake://10.0.0.5:50051"
    assert (address.options.segment_bytes, address.options.host) == (0, "10.0.0.9")
