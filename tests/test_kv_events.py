"""KV events in vLLM's format: block hashes, what the ledger reports, and the cache service's sockets.

Events are read as a router reads them: msgpack decoded with msgspec (cache_service.events.kv_events.decode_batch
is a plain msgspec decoder) and, for the wire, the raw ZMQ frames of a SUB socket and a replay request.
"""

from __future__ import annotations

import itertools
import random
import time

import grpc
import msgspec
import pytest
import zmq

from harness.cache_helpers import allocate, attach, cache_stub, lease, release, stats, wait_for
from harness.processes import free_port, start_cache_service
from kv_replay import replay
from cache_service.events.block_event_log import BlockEventLog
from cache_service.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cache_service.core.ledger import Ledger
from cache_service.api.server import build_parser, kv_event_publishers
from cache_service.events.vllm_block_hash import DEFAULT_SEED, chain, external, none_hash, sha256_cbor
from pagedkv.cache.v1 import cache_pb2

BS = 16
# Computed by vLLM 0.32's own code (its sha256_cbor block hashes, seed "vllm-none-hash").
NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
TOKENS_1_16 = ("cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682", 8866452693264111234)
TOKENS_17_32 = ("2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf", 807986237951177663)
SALTED_1_16 = ("d4fdd9f3dab139eafd01550f43781481256e9531b59b55ea4656df8f49124fcf", 5068484237151326159)
ROOT = none_hash(DEFAULT_SEED)


def test_block_hashes_are_vllms(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash().hex() == NONE_HASH
    first, second = chain(range(1, 33), BS)
    assert (first.hex(), external(first)) == TOKENS_1_16
    assert (second.hex(), external(second)) == TOKENS_17_32
    salted = chain(range(1, 17), BS, cache_salt="tenant-a")[0]
    assert (salted.hex(), external(salted)) == SALTED_1_16
    # The salt enters the first block only, and every later block through the chain.
    assert chain(range(1, 33), BS, cache_salt="tenant-a")[1] != second
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash() == sha256_cbor("0") != ROOT


def ledger_with_events(num_blocks: int) -> tuple[Ledger, BlockEventLog]:
    events = BlockEventLog(BS, root=ROOT)
    return Ledger(num_blocks, BS, events=events), events


def cache(ledger: Ledger, tokens, namespace=("", ""), num_tokens: int | None = None) -> int:
    """Allocates a sequence for ``tokens`` and releases it into the prefix cache; returns its cached tokens."""
    allocation = ledger.allocate("owner", num_tokens or len(tokens), tokens, namespace)
    ledger.release("owner", allocation.sequence_id, cache_prefix=True, token_ids=tokens)
    return allocation.cached_tokens


def as_consumer(events) -> list:
    """The events after a msgpack round trip, as a router decodes them."""
    return decode_batch(msgspec.msgpack.encode([0.0, events, 0])).events


def test_registration_stores_the_chain_and_extension_names_its_parent():
    ledger, events = ledger_with_events(16)
    tokens = list(range(1, 41))  # two full blocks and a partial one
    cache(ledger, tokens)
    [stored] = as_consumer(events.drain())
    hashes = [external(digest) for digest in chain(tokens, BS, root=ROOT)]
    assert stored == BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:32], block_size=BS,
                                 extra_keys=[None, None])
    assert hashes[:2] == [TOKENS_1_16[1], TOKENS_17_32[1]]
    # A longer prompt reuses both blocks and stores only its two new ones, chained to the second.
    longer = list(range(1, 65))
    assert cache(ledger, longer) == 32
    [stored] = as_consumer(events.drain())
    longer_hashes = [external(digest) for digest in chain(longer, BS, root=ROOT)]
    assert stored.block_hashes == longer_hashes[2:]
    assert stored.parent_block_hash == hashes[1]
    assert stored.token_ids == longer[32:64]
    # Caching the same prompt again stores nothing: no duplicate event.
    cache(ledger, longer)
    assert events.drain() == []


def test_blocks_of_an_adapter_carry_its_name_and_forks_inherit_it():
    ledger, events = ledger_with_events(16)
    base, adapted = list(range(1, 33)), list(range(200, 232))
    cache(ledger, base)
    allocation = ledger.allocate("owner", 40, adapted, ("", "lora:d/s"), "sql")
    child = ledger.fork("owner", allocation.sequence_id, 32)
    ledger.release("owner", allocation.sequence_id)
    ledger.release("owner", child.sequence_id, cache_prefix=True, token_ids=adapted)
    stored_base, stored_adapted = as_consumer(events.drain())
    assert stored_base.lora_name is None and stored_adapted.lora_name == "sql"
    assert stored_adapted.token_ids == adapted and stored_adapted.lora_id is None
    # A tier's copies of an adapter block say the name too, kept while the pool or a tier holds the block.
    first = ("", chain(adapted, BS, "lora:d/s", root=ROOT)[0])
    events.tier_stored(first, tuple(adapted[:16]), "CPU")
    events.tier_stored(("", chain(base, BS, root=ROOT)[0]), tuple(base[:16]), "CPU")
    ledger.allocate("owner", 16 * BS)  # evicts every cached block from the pool
    events.tier_stored(first, tuple(adapted[:16]), "STORAGE")
    assert [(event.medium, event.lora_name) for event in as_consumer(events.drain())
            if isinstance(event, BlockStored)] == [("CPU", "sql"), ("CPU", None), ("STORAGE", "sql")]
    events.tier_removed(first, "CPU")
    events.tier_removed(first, "STORAGE")
    events.tier_stored(first, tuple(adapted[:16]), "CPU")  # no copy held it meanwhile: the name is gone
    assert as_consumer(events.drain())[-1].lora_name is None


def test_eviction_removes_and_a_new_pool_clears():
    ledger, events = ledger_with_events(4)
    tokens = list(range(100, 132))
    cache(ledger, tokens)
    [stored] = events.drain()
    # Four fresh blocks: the two cached ones are evicted for it.
    ledger.allocate("owner", 4 * BS)
    [removed] = as_consumer(events.drain())
    assert isinstance(removed, BlockRemoved)
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes)
    assert (removed.medium, removed.group_idx) == ("GPU", 0)
    events.cleared()
    assert as_consumer(events.drain()) == [AllBlocksCleared()]


def test_salted_chain_carries_the_salt_in_its_first_block():
    ledger, events = ledger_with_events(16)
    tokens = list(range(1, 33))
    cache(ledger, tokens, namespace=("", "tenant-a"))
    cache(ledger, tokens)
    salted, plain = as_consumer(events.drain())
    assert salted.block_hashes[0] == SALTED_1_16[1]
    assert salted.block_hashes[1] == external(chain(tokens, BS, "tenant-a", root=ROOT)[1])
    assert salted.extra_keys == [[["cache_salt", "tenant-a"]], None]
    assert plain.block_hashes == [TOKENS_1_16[1], TOKENS_17_32[1]]


def test_one_hash_for_two_models_until_the_last_copy_goes():
    # Two models of one pool cache the same tokens: one hash for the router, removed with the last copy.
    ledger, events = ledger_with_events(4)
    tokens = list(range(1, 17))
    cache(ledger, tokens, namespace=("model-a", ""))
    cache(ledger, tokens, namespace=("model-b", ""))
    [stored] = events.drain()
    assert stored.block_hashes == [TOKENS_1_16[1]]
    held = ledger.allocate("owner", 3 * BS)  # takes the two plain free blocks and one copy
    assert events.drain() == []
    ledger.allocate("owner", BS)  # takes the other copy
    assert events.drain() == [BlockRemoved(block_hashes=[TOKENS_1_16[1]])]
    assert len(held.block_ids) == 3


def test_what_a_consumer_knows_mirrors_the_prefix_cache():
    # Random prompts over few tokens (shared prefixes, evictions, re-registrations) on a small pool.
    rng = random.Random(24)
    ledger, events = ledger_with_events(12)
    known: set[int] = set()
    for step in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 80))]
        salt = rng.choice(["", "", "s"])
        cache(ledger, tokens, namespace=("", salt), num_tokens=len(tokens) + rng.randrange(0, 40))
        for event in as_consumer(events.drain()):
            if isinstance(event, BlockStored):
                assert known.isdisjoint(event.block_hashes), f"step {step}: stored twice"
                known.update(event.block_hashes)
            else:
                assert known.issuperset(event.block_hashes), f"step {step}: removed what was never stored"
                known.difference_update(event.block_hashes)
        registered = sum(block.block_hash is not None for block in ledger.pool.blocks)
        assert len(known) == registered == events.registered_blocks(), f"step {step}"
        ledger.check_invariants()


def fold(known: set[int], events, medium: str = "GPU") -> set[int]:
    """What a consumer knows after ``events`` (of one medium), checking that each makes sense."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            known.clear()
        elif event.medium != medium:
            continue
        elif isinstance(event, BlockStored):
            assert known.isdisjoint(event.block_hashes), "stored twice"
            known.update(event.block_hashes)
        else:
            assert known.issuperset(event.block_hashes), "removed what was never stored"
            known.difference_update(event.block_hashes)
    return known


def hashes(tokens, salt: str = "") -> set[int]:
    return {external(digest) for digest in chain(tokens, BS, salt, root=ROOT)}


def test_a_model_channel_tells_only_of_the_blocks_of_the_checkpoints_served_under_its_name():
    events = BlockEventLog(BS, root=ROOT, models=[None, "alpha", "beta", "alpha-chat"])
    ledger = Ledger(16, BS, events=events)
    events.serves("fp-alpha", "alpha")
    events.serves("fp-beta", "beta")
    alpha_tokens, beta_tokens, shared = list(range(1, 33)), list(range(100, 132)), list(range(500, 516))
    cache(ledger, alpha_tokens, ("fp-alpha", ""))
    cache(ledger, beta_tokens, ("fp-beta", "tenant"))
    cache(ledger, shared, ("fp-alpha", ""))
    cache(ledger, shared, ("fp-beta", ""))  # the same tokens, so the same hash, from the other model
    told = {model: fold(set(), as_consumer(events.drain(model))) for model in (None, "alpha", "beta", "alpha-chat")}
    assert told["alpha"] == hashes(alpha_tokens) | hashes(shared)
    assert told["beta"] == hashes(beta_tokens, "tenant") | hashes(shared)
    assert told[None] == told["alpha"] | told["beta"]
    assert told["alpha-chat"] == set()  # nobody serves that name yet

    # A copy of alpha's first block in the host tier is told on alpha's endpoints only.
    first, second = chain(alpha_tokens, BS, root=ROOT)
    events.tier_stored(("fp-alpha", first), tuple(alpha_tokens[:16]), "CPU")
    assert [fold(set(), as_consumer(events.drain(model)), "CPU") for model in ("alpha", "beta", None)] == [
        {external(first)}, set(), {external(first)}]

    # A second name for the alpha checkpoint shares its prefix cache: its endpoint catches
    # up on the blocks alpha already holds (pool and tiers), each with its parent, and nothing of beta's.
    events.serves("fp-alpha", "alpha-chat")
    caught_up = as_consumer(events.drain("alpha-chat"))
    assert fold(set(), caught_up) == told["alpha"]
    assert fold(set(), caught_up, "CPU") == {external(first)}
    [second_stored] = [event for event in caught_up if event.block_hashes == [external(second)]]
    assert second_stored.parent_block_hash == external(first) and second_stored.token_ids == alpha_tokens[16:]
    assert all(events.drain(model) == [] for model in (None, "alpha", "beta"))
    told["alpha-chat"] = set(told["alpha"])

    # Every block is evicted: each endpoint takes back exactly what it told.
    ledger.allocate("owner", 16 * BS)
    for model, known in told.items():
        assert fold(known, as_consumer(events.drain(model))) == set(), model


def test_a_reset_takes_back_what_it_dropped_and_clears_an_endpoint_left_with_nothing():
    events = BlockEventLog(BS, root=ROOT, models=[None, "alpha", "beta"])
    ledger = Ledger(16, BS, events=events)
    events.serves("fp-alpha", "alpha")
    events.serves("fp-beta", "beta")
    alpha_tokens, held_tokens, beta_tokens = list(range(1, 33)), list(range(40, 56)), list(range(100, 132))
    cache(ledger, alpha_tokens, ("fp-alpha", ""))
    held = ledger.allocate("owner", len(held_tokens) + 1, held_tokens, ("fp-alpha", ""))
    ledger.commit("owner", held.sequence_id, held_tokens)  # cached while its sequence holds it
    cache(ledger, beta_tokens, ("fp-beta", ""))
    for model in (None, "alpha", "beta"):
        events.drain(model)

    assert ledger.reset_prefix_cache("fp-alpha") == (2, 1)
    [removed] = as_consumer(events.drain("alpha"))
    assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == hashes(alpha_tokens)
    assert as_consumer(events.drain(None)) == [removed]
    assert events.drain("beta") == []

    # Its sequence ends, the held block stays cached; a second reset leaves alpha nothing:
    # AllBlocksCleared on alpha's endpoint, a removal on the one that still has beta's.
    ledger.release("owner", held.sequence_id)
    assert ledger.reset_prefix_cache("fp-alpha") == (1, 0)
    assert as_consumer(events.drain("alpha")) == [AllBlocksCleared()]
    assert as_consumer(events.drain(None)) == [BlockRemoved(block_hashes=list(hashes(held_tokens)))]

    # A copy of beta's first block in the host tier stays: no endpoint may say it holds nothing.
    first_beta = chain(beta_tokens, BS, root=ROOT)[0]
    events.tier_stored(("fp-beta", first_beta), tuple(beta_tokens[:16]), "CPU")
    events.drain("beta"), events.drain(None)
    assert ledger.reset_prefix_cache(None) == (2, 0)
    for model in ("beta", None):
        [removed] = as_consumer(events.drain(model))
        assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == hashes(beta_tokens), model
    events.tier_removed(("fp-beta", first_beta), "CPU")
    assert as_consumer(events.drain("beta")) == [BlockRemoved(block_hashes=[external(first_beta)], medium="CPU")]
    ledger.check_invariants()


# ---------------------------------------------------------------- the cache service's sockets


def test_cache_service_publishes_and_replays(tmp_path):
    pub, rep = free_port(), free_port()
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    with start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--max-blocks", "4",
                             "--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay_endpoint,
                             env={"PYTHONHASHSEED": "0"}) as service:
        # A context of its own: the worker's shared one carries other tests' sockets. The
        # monitor's events go into the message if nothing ever arrives.
        context = zmq.Context()
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = subscriber.get_monitor_socket()
        subscriber.connect(endpoint)
        stub = cache_stub(service.address)
        session = attach(stub).session_id  # creates the pool: AllBlocksCleared
        tokens = list(range(1, 41))
        [allocated] = lease(stub, session, allocate(48, tokens)).results
        lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=tokens))
        lease(stub, session, allocate(64))  # evicts both cached blocks

        batches = replay(replay_endpoint, 0)
        assert [seq for seq, _ in batches] == [0, 1, 2]
        decoded = [decode_batch(payload) for _, payload in batches]
        assert decoded[0].events == [AllBlocksCleared()]
        [stored] = decoded[1].events
        root = sha256_cbor("0")  # the service's PYTHONHASHSEED
        hashes = [external(digest) for digest in chain(tokens, BS, root=root)]
        assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (hashes, None, tokens[:32])
        [removed] = decoded[2].events
        assert isinstance(removed, BlockRemoved) and sorted(removed.block_hashes) == sorted(hashes)
        assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in decoded)
        assert [seq for seq, _ in replay(replay_endpoint, 2)] == [2]
        assert replay(replay_endpoint, 3) == []

        # The live stream: the subscription may join after the first batches (ZMQ's slow
        # joiner), so keep caching new prompts until one arrives, then check its frames.
        poller = zmq.Poller()
        poller.register(subscriber, zmq.POLLIN)
        frames = None
        deadline = time.monotonic() + 60  # a bound on a loaded machine, not a pace: it ends at the first batch
        for attempt in itertools.count():
            if time.monotonic() > deadline:
                break
            prompt = [1000 + attempt % 4000] * BS
            [allocated] = lease(stub, session, allocate(BS, prompt)).results
            lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=prompt))
            if poller.poll(200):
                frames = subscriber.recv_multipart()
                break
        assert frames is not None, (f"the SUB socket received nothing in {attempt} attempts; its connection's "
                                    f"events: {socket_events(monitor)}; the service's log:\n{service.logs()}")
        topic, seq_bytes, payload = frames
        assert topic == b"" and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        assert dict(replay(replay_endpoint, seq))[seq] == payload  # the same batch on both sockets
        subscriber.disable_monitor()
        context.destroy(linger=0)


def socket_events(monitor: zmq.Socket) -> list[str]:
    """What a socket monitor has queued: the connection's life as ZMQ saw it."""
    from zmq.utils.monitor import recv_monitor_message

    events = []
    while monitor.poll(0):
        message = recv_monitor_message(monitor)
        events.append(f"{zmq.Event(message['event']).name} {message['value']} {message['endpoint']!r}")
    return events


def test_an_endpoint_per_model_carries_only_that_models_blocks_through_a_reset(tmp_path):
    # Endpoints from the env twin (whitespace between them), replay sockets from the flags.
    endpoints = {model: f"tcp://127.0.0.1:{free_port()}" for model in (None, "alpha", "beta")}
    replays = {model: f"tcp://127.0.0.1:{free_port()}" for model in endpoints}
    twin = " ".join(endpoint if model is None else f"{model}={endpoint}" for model, endpoint in endpoints.items())
    flags = [argument for model, endpoint in replays.items()
             for argument in ("--kv-events-replay-endpoint", endpoint if model is None else f"{model}={endpoint}")]
    with start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", *flags,
                             env={"PYTHONHASHSEED": "0", "PAGEDKV_KV_EVENTS_ENDPOINT": twin}) as service:
        stub = cache_stub(service.address)
        sessions = {name: attach(stub, name, model_fingerprint=f"fp-{name}", served_model_name=name).session_id
                    for name in ("alpha", "beta")}
        prompts = {"alpha": list(range(1, 33)), "beta": list(range(200, 248))}
        for name, tokens in prompts.items():
            [allocated] = lease(stub, sessions[name], allocate(len(tokens), tokens)).results
            lease(stub, sessions[name], release(allocated.sequence_id, cache_prefix=True, token_ids=tokens))

        root = sha256_cbor("0")  # the service's PYTHONHASHSEED
        expected = {name: {external(digest) for digest in chain(tokens, BS, root=root)}
                    for name, tokens in prompts.items()}
        expected[None] = expected["alpha"] | expected["beta"]
        seen = {}
        for model, endpoint in replays.items():
            batches = [decode_batch(payload) for _, payload in replay(endpoint, 0)]
            assert batches[0].events == [AllBlocksCleared()], model  # the new pool, on every endpoint
            assert fold(set(), [event for batch in batches for event in batch.events]) == expected[model], model
            seen[model] = len(batches)

        # alpha's session resets its model's prefix cache: alpha's endpoint is left with
        # nothing (AllBlocksCleared), the every-model one removes alpha's blocks, beta's hears nothing.
        reply = stub.ResetPrefixCache(cache_pb2.ResetPrefixCacheRequest(session_id=sessions["alpha"]), timeout=10)
        assert (reply.blocks_dropped, reply.blocks_kept) == (2, 0)
        assert stats(stub).blocks_cached == 3
        after = {model: [decode_batch(payload).events for _, payload in replay(endpoint, seen[model])]
                 for model, endpoint in replays.items()}
        assert after["alpha"] == [[AllBlocksCleared()]] and after["beta"] == []
        [[removed]] = after[None]
        assert isinstance(removed, BlockRemoved) and set(removed.block_hashes) == expected["alpha"]
        with pytest.raises(grpc.RpcError) as refused:
            stub.ResetPrefixCache(cache_pb2.ResetPrefixCacheRequest(session_id="0" * 32), timeout=10)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "Attach again" in refused.value.details()


@pytest.mark.parametrize("args, message", [
    (["--kv-events-replay-endpoint", "tcp://127.0.0.1:1"], "needs --kv-events-endpoint"),
    (["--kv-events-endpoint", "tcp://127.0.0.1:1", "--kv-events-replay-endpoint", "alpha=tcp://127.0.0.1:2"],
     "needs --kv-events-endpoint alpha="),
    (["--kv-events-endpoint", "nowhere"], "cannot bind the KV events socket"),
    (["--kv-events-endpoint", "alpha=tcp://127.0.0.1:1", "--kv-events-endpoint", "alpha=tcp://127.0.0.1:2"],
     "given twice for model 'alpha'"),
])
def test_bad_kv_event_flags_are_refused_with_a_message(args, message):
    # A ValueError at start-up: `python -m cache_service` prints it and exits 2 (run_server_main).
    with pytest.raises(ValueError, match=message):
        kv_event_publishers(build_parser().parse_args(args))


def test_endpoint_values_name_their_model_and_the_command_line_replaces_the_twin(monkeypatch):
    monkeypatch.setenv("PAGEDKV_KV_EVENTS_ENDPOINT", "tcp://*:5557 org/model=v2=tcp://*:5559")
    assert build_parser().parse_args([]).kv_events_endpoint == [(None, "tcp://*:5557"), ("org/model=v2", "tcp://*:5559")]
    args = build_parser().parse_args(["--kv-events-endpoint", "ipc:///run/a=b", "--kv-events-endpoint", "m=tcp://h:1"])
    assert args.kv_events_endpoint == [(None, "ipc:///run/a=b"), ("m", "tcp://h:1")]


def test_a_restarted_cache_service_tells_of_its_disk_tier_and_of_promotions_back_to_the_pool(tmp_path):
    def events_of(replay_endpoint):
        return [event for _, payload in replay(replay_endpoint, 0) for event in decode_batch(payload).events]

    tokens = list(range(1, 41))  # two full blocks cached (the last block holds the prompt's last token)
    hashes = [external(digest) for digest in chain(tokens, BS, root=sha256_cbor("0"))]
    disk = ("--disk-cache-dir", tmp_path / "kv-disk", "--disk-cache-bytes", "1MiB")
    for restart in (False, True):
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        with start_cache_service(tmp_path, "--kv-cache-bytes", "1MiB", "--max-blocks", "4", *disk,
                                 "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
                                 "--kv-events-replay-endpoint", replay_endpoint,
                                 env={"PYTHONHASHSEED": "0"}) as service:
            stub = cache_stub(service.address)
            session = attach(stub).session_id  # creates the pool (and reads the disk tier)
            if not restart:
                [allocated] = lease(stub, session, allocate(48, tokens)).results
                lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=tokens))
                wait_for(lambda: next(t for t in stats(stub).tiers if t.tier == "disk").blocks_cached == 2, 30,
                         "both blocks written to disk")
                stored = [event for event in events_of(replay_endpoint) if isinstance(event, BlockStored)]
                assert [(event.medium, event.block_hashes) for event in stored] == [
                    ("GPU", hashes), ("STORAGE", hashes[:1]), ("STORAGE", hashes[1:])]
                continue
            # After the restart: the pool is new (AllBlocksCleared) and the disk's blocks are told of.
            assert [(type(event), event.block_hashes if isinstance(event, BlockStored) else None, getattr(
                event, "medium", None)) for event in events_of(replay_endpoint)] == [
                (AllBlocksCleared, None, None), (BlockStored, hashes[:1], "STORAGE"), (BlockStored, hashes[1:], "STORAGE")]
            # A promotion stores the blocks on "GPU" again, as one chain; the disk keeps its copies.
            [allocated] = lease(stub, session, allocate(48, tokens)).results
            assert (allocated.cached_tokens, allocated.cached_tokens_disk) == (32, 32)
            promoted = events_of(replay_endpoint)[3:]
            assert [(event.medium, event.block_hashes, event.parent_block_hash) for event in promoted] == [
                ("GPU", hashes, None)]
            lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=tokens))
            assert stats(stub).blocks_leased == 0
