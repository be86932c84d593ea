"""KV tiers on the ledger: demotion, promotion with exact contents, and the disk tier's files.

A small CPU "pool tensor" stands in for the device pool; every block a sequence writes
gets contents that depend on the whole prefix before it (as real K/V does), so a block
promoted from a tier with the wrong bytes, or for the wrong prefix, shows up as a
mismatch. Runs in milliseconds; the services are exercised in test_kv_tiers_stack.py.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import zlib

import pytest
import torch

from cache_service.core.ledger import Ledger
from cache_service.tiers import disk_tier
from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.kv_tiers import KvTiers
from cache_service.tiers.settings import TierSettings

BS = 4
NUM_BLOCKS = 8
GEOMETRY = DiskGeometry(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32)
BYTES_PER_BLOCK = GEOMETRY.payload_bytes
MODEL = ("model-1", "")


class Stack:
    """A ledger with tiers over a pool tensor, and what each sequence wrote."""

    def __init__(self, settings: TierSettings, geometry: DiskGeometry = GEOMETRY, hash_fn=hash, events=None,
                 device=lambda tensor: tensor, clock=time.monotonic) -> None:
        """``device``: puts the pool tensor on its device (tests/cuda_tier_fakes.py's stand-in for CUDA)."""
        self.pool_tensor = device(torch.zeros(geometry.num_layers, 2, NUM_BLOCKS, geometry.block_size,
                                              geometry.num_kv_heads, geometry.head_dim, dtype=geometry.dtype))
        self.ledger = Ledger(NUM_BLOCKS, BS, hash_fn=hash_fn, events=events)
        self.tiers = KvTiers(self.ledger.pool, self.pool_tensor, settings, geometry.payload_bytes, geometry,
                             clock=clock, events=events)
        self.ledger.tiers = self.tiers

    def expected(self, tokens: list[int], index: int, namespace=MODEL) -> torch.Tensor:
        # A function of the namespace and every token up to the end of block ``index``.
        value = float(hash((namespace, tuple(tokens[: (index + 1) * BS]))) % 100_003)
        return torch.full_like(self.pool_tensor[:, :, 0], value)

    def run(self, tokens: list[int], namespace=MODEL):
        """Allocate, check the cached blocks, write the rest, release into the prefix cache."""
        ledger = self.ledger
        allocation = ledger.allocate("owner", len(tokens), tokens, namespace)
        self.tiers.promotions.settle()  # a CUDA pool's promotions: the wait a Lease call makes before its reply
        cached_blocks = allocation.cached_tokens // BS
        for index, block_id in enumerate(allocation.block_ids):
            if index < cached_blocks:
                assert torch.equal(self.pool_tensor[:, :, block_id], self.expected(tokens, index, namespace)), \
                    f"block {index} of a hit does not hold this prefix's K/V"
            elif (index + 1) * BS <= len(tokens):
                self.pool_tensor[:, :, block_id] = self.expected(tokens, index, namespace)
        ledger.release("owner", allocation.sequence_id, cache_prefix=True, token_ids=tokens)
        ledger.check_invariants()
        return allocation

    def demote_all(self) -> None:
        while self.tiers.demotions.queue:
            self.tiers.demotions.demote_some(16)

    async def write_all(self) -> None:
        while self.tiers.demotions.disk_queue:
            await self.tiers.demotions.write_some()

    def evict_everything(self) -> None:
        """A sequence as large as the pool: every cached block is evicted."""
        allocation = self.ledger.allocate("owner", NUM_BLOCKS * BS)
        self.ledger.release("owner", allocation.sequence_id)
        assert self.ledger.pool.num_cached == 0


def tokens_of(seed: int, length: int = 13) -> list[int]:
    return [(seed * 31 + i * 7) % 50 + 1 for i in range(length)]


def test_a_block_evicted_from_the_pool_is_promoted_back_from_the_host_with_its_bytes():
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    tokens = tokens_of(1)
    assert stack.run(tokens).cached_tokens == 0
    stack.demote_all()
    stack.evict_everything()
    again = stack.run(tokens)
    assert (again.cached_tokens, again.cached_tokens_host, again.cached_tokens_disk) == (12, 12, 0)
    counters = stack.tiers.counters["host"]
    assert (counters.demotions, counters.promotions, counters.hit_tokens) == (3, 3, 12)
    assert stack.ledger.stats().blocks_leased == 0


def test_without_tiers_the_same_eviction_loses_the_prefix():
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    stack.ledger.tiers = None
    tokens = tokens_of(1)
    stack.run(tokens)
    stack.evict_everything()
    assert stack.run(tokens).cached_tokens == 0


def test_a_block_evicted_before_its_demotion_is_lost_not_wrong():
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    tokens = tokens_of(2)
    stack.run(tokens)
    stack.evict_everything()  # before the background copy ran
    stack.demote_all()
    assert stack.tiers.demotions.missed_demotions == 3
    assert stack.run(tokens).cached_tokens == 0


def test_a_full_host_tier_drops_its_coldest_and_chains_stay_exact():
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    prompts = [tokens_of(seed) for seed in range(4)]  # 12 full blocks for 4 host slots
    for tokens in prompts:
        stack.run(tokens)
        stack.demote_all()
    stack.evict_everything()
    hits = [stack.run(tokens).cached_tokens_host for tokens in reversed(prompts)]
    assert hits[0] == 12 and sum(hits) <= 4 * BS + 12
    assert stack.tiers.counters["host"].evictions >= 8


def test_models_and_salts_never_share_tier_blocks():
    stack = Stack(TierSettings(host_cache_bytes=8 * BYTES_PER_BLOCK))
    tokens = tokens_of(3)
    stack.run(tokens, ("model-1", ""))
    stack.demote_all()
    stack.evict_everything()
    assert stack.run(tokens, ("model-2", "")).cached_tokens == 0
    assert stack.run(tokens, ("model-1", "tenant")).cached_tokens == 0
    assert stack.run(tokens, ("model-1", "")).cached_tokens_host == 12


def two_hashes(key) -> int:
    """Every block hash is 0 or 1, the same in every run (hash() of a str is salted per process)."""
    return zlib.crc32(repr(key).encode()) & 1


def test_colliding_hashes_never_promote_another_prefix():
    stack = Stack(TierSettings(host_cache_bytes=8 * BYTES_PER_BLOCK), hash_fn=two_hashes)
    host_hits = []
    for seed in range(6):
        stack.run(tokens_of(seed))
        stack.demote_all()
        stack.evict_everything()
        host_hits.append(stack.run(tokens_of(seed)).cached_tokens_host)  # run() checks every hit's bytes
    # The first prefix's first two blocks take both hash values (its third hashes like one of
    # them, so it is not cached) and come back from the host tier with their bytes checked;
    # every later prefix's first block hashes like one of those entries and gets nothing.
    assert host_hits == [8, 0, 0, 0, 0, 0]


def test_the_disk_tier_survives_a_restart(tmp_path):
    settings = TierSettings(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    stack = Stack(settings)
    tokens = tokens_of(4)
    stack.run(tokens)
    stack.demote_all()
    import asyncio
    asyncio.run(stack.write_all())
    files = sorted((tmp_path / GEOMETRY.tag).iterdir())
    assert len(files) == 3
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in files)
    stack.tiers.close()  # the folder is locked while a tier has it open
    restarted = Stack(settings)
    again = restarted.run(tokens)
    assert (again.cached_tokens, again.cached_tokens_disk) == (12, 12)
    assert restarted.run(tokens, ("model-2", "")).cached_tokens == 0, "another model of one geometry hit the files"
    restarted.tiers.close()
    other_geometry = DiskGeometry(2, 1, 2, BS, torch.bfloat16)
    assert Stack(settings, other_geometry).tiers.index.count("disk") == 0


def written_disk_stack(tmp_path, seeds=(4,)) -> tuple[TierSettings, list[list[int]]]:
    import asyncio

    settings = TierSettings(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    stack = Stack(settings)
    prompts = [tokens_of(seed) for seed in seeds]
    for tokens in prompts:
        stack.run(tokens)
    stack.demote_all()
    asyncio.run(stack.write_all())
    stack.tiers.close()
    return settings, prompts


def chain_files(tmp_path, tokens) -> list:
    from cache_service.tiers.tier_index import ROOT_PARENT, chain_digest

    digests, parent = [], ROOT_PARENT
    for index in range(len(tokens) // BS):
        parent = chain_digest(parent, MODEL, tuple(tokens[index * BS : (index + 1) * BS]))
        digests.append(parent)
    return [tmp_path / GEOMETRY.tag / (digest.hex() + disk_tier.SUFFIX) for digest in digests]


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "foreign", "symlink"])
def test_a_damaged_file_is_skipped_and_its_chain_recomputed(tmp_path, damage, capsys):
    settings, [tokens] = written_disk_stack(tmp_path)
    first, second, third = chain_files(tmp_path, tokens)
    if damage == "corrupted":
        data = bytearray(second.read_bytes())
        data[len(data) // 2] ^= 0xFF
        second.write_bytes(bytes(data))
    elif damage == "truncated":
        second.write_bytes(second.read_bytes()[:100])
    elif damage == "foreign":
        second.write_bytes(b"not a block file at all" * 10)
    else:
        target = tmp_path / "elsewhere"
        target.write_bytes(second.read_bytes())
        second.unlink()
        second.symlink_to(target)
    restarted = Stack(settings)
    again = restarted.run(tokens)
    # The first block still hits; the damaged one and what follows it are recomputed.
    assert (again.cached_tokens, again.cached_tokens_disk) == (4, 4)
    assert "disk_cache_file_skipped" in capsys.readouterr().out
    restarted.ledger.check_invariants()


def test_a_full_disk_stops_demotions_and_fails_no_request(tmp_path, monkeypatch):
    import asyncio

    settings = TierSettings(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    stack = Stack(settings)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_tier.os, "write", full)
    tokens = tokens_of(5)
    stack.run(tokens)
    stack.demote_all()
    asyncio.run(stack.write_all())
    assert stack.tiers.counters["disk"].errors == 1
    assert stack.tiers.clock() < stack.tiers.demotions.disk_full_until
    assert list((tmp_path / GEOMETRY.tag).iterdir()) == []  # no temporary file left behind
    stack.evict_everything()
    assert stack.run(tokens).cached_tokens == 0
    stack.ledger.check_invariants()
    assert stack.ledger.stats().blocks_leased == 0


def test_a_host_tier_pushes_its_coldest_blocks_to_disk(tmp_path):
    import asyncio

    settings = TierSettings(host_cache_bytes=3 * BYTES_PER_BLOCK, disk_cache_dir=str(tmp_path),
                            disk_cache_bytes=1 << 20)
    stack = Stack(settings)
    tiers = stack.tiers
    first, second = tokens_of(6), tokens_of(7)
    stack.run(first)
    assert (tiers.blocks_queued("host"), tiers.blocks_queued("disk")) == (3, 0)
    stack.demote_all()
    stack.run(second)
    stack.demote_all()
    assert (tiers.blocks_queued("host"), tiers.blocks_queued("disk")) == (0, 3)  # the first prompt's, pushed out
    asyncio.run(stack.write_all())
    assert (tiers.blocks_queued("host"), tiers.blocks_queued("disk")) == (0, 0)
    assert stack.tiers.index.count("disk") == 3 and stack.tiers.index.count("host") == 3
    stack.evict_everything()
    assert stack.run(first).cached_tokens_disk == 12
    assert stack.run(second).cached_tokens_host == 12


def test_kv_events_say_a_demotion_stores_on_cpu_and_storage(tmp_path):
    import asyncio

    from cache_service.events.block_event_log import BlockEventLog
    from cache_service.events.kv_events import BlockRemoved, BlockStored

    events = BlockEventLog(BS)
    settings = TierSettings(host_cache_bytes=3 * BYTES_PER_BLOCK, disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)
    stack = Stack(settings)
    stack.ledger.events = events
    stack.tiers.events = events
    first, second = tokens_of(8), tokens_of(9)
    stack.run(first)
    [gpu_stored] = events.drain()
    stack.demote_all()
    cpu = events.drain()
    assert [event.medium for event in cpu] == ["CPU"] * 3
    assert [event.block_hashes[0] for event in cpu] == gpu_stored.block_hashes
    stack.run(second)
    events.drain()
    stack.demote_all()  # pushes the first prompt's blocks out of the host tier, to disk
    asyncio.run(stack.write_all())
    moved = events.drain()
    removed_cpu = [event for event in moved if isinstance(event, BlockRemoved) and event.medium == "CPU"]
    stored_disk = [event for event in moved if isinstance(event, BlockStored) and event.medium == "STORAGE"]
    assert [event.block_hashes[0] for event in removed_cpu] == gpu_stored.block_hashes
    assert [event.block_hashes[0] for event in stored_disk] == gpu_stored.block_hashes


def test_a_block_taken_while_its_copy_runs_is_not_indexed():
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    tokens = tokens_of(10)
    stack.run(tokens)
    tiers = stack.tiers
    batch = tiers.demotions._begin_demotion(16)  # chosen on the event loop; the copy would run in a thread
    stack.evict_everything()  # meanwhile a Lease call takes the blocks, and their new holder writes them
    tiers.demotions._copy(batch)
    assert tiers.demotions._finish_demotion(batch) == 0
    assert tiers.index.count("host") == 0 and tiers.demotions.missed_demotions == 3
    stack.ledger.check_invariants()
    assert stack.run(tokens).cached_tokens == 0


def test_the_background_copy_runs_in_a_thread_and_promotes_the_same_bytes():
    import asyncio

    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    tokens = tokens_of(11)
    stack.run(tokens)
    assert asyncio.run(stack.tiers.demotions.demote_some_async(16)) == 3
    stack.evict_everything()
    assert stack.run(tokens).cached_tokens_host == 12


def vllm_hashes_by_pool_hash(pool, prompts) -> dict[int, int]:
    """Each full block of ``prompts`` ((tokens, namespace) pairs): its pool hash -> the hash
    its KV events carry, both computed from the tokens (not from the event log)."""
    from cache_service.blocks.prefix_hash import namespace_root
    from cache_service.events.vllm_block_hash import chain, external

    out = {}
    for tokens, namespace in prompts:
        parent = namespace_root(namespace, pool.hash_fn)
        for index, digest in enumerate(chain(tokens, BS, namespace[1])):
            parent = pool.hash_fn((parent, tuple(tokens[index * BS : (index + 1) * BS])))
            out[parent] = external(digest)
    return out


def test_kv_events_follow_every_block_between_the_pool_and_the_tiers(tmp_path):
    """Random prompts, demotions, disk writes and evictions; after each step a consumer of
    the events knows, per medium, exactly the blocks the pool ("GPU"), the host tier ("CPU")
    and the disk tier ("STORAGE") hold. A promotion is a store on "GPU" again (the tier
    keeps its copy); a restart over the same disk tells of the files it found."""
    import asyncio
    import random

    from cache_service.events.block_event_log import BlockEventLog
    from cache_service.tiers.disk_tier import file_bytes
    from test_kv_events import fold

    rng = random.Random(23)
    settings = TierSettings(host_cache_bytes=3 * BYTES_PER_BLOCK, disk_cache_dir=str(tmp_path),
                            disk_cache_bytes=5 * file_bytes(GEOMETRY, MODEL))
    namespaces = [MODEL, ("model-1", "salt"), ("model-2", "")]
    prompts: list[tuple[list[int], tuple[str, str]]] = []
    promoted = {"host": 0, "disk": 0}
    bases = [[rng.randrange(1, 50) for _ in range(18)] for _ in range(4)]

    def check(stack, events, known, step) -> None:
        batch = events.drain()
        for medium in known:
            fold(known[medium], batch, medium)
        by_pool_hash = vllm_hashes_by_pool_hash(stack.ledger.pool, prompts)
        index = stack.tiers.index
        want = {"GPU": {by_pool_hash[h] for h in stack.ledger.pool.cached},
                "CPU": {by_pool_hash[h] for h in index.lru["host"]},
                "STORAGE": {by_pool_hash[h] for h in index.lru["disk"]}}
        assert known == want, f"step {step}"

    events = BlockEventLog(BS)
    stack = Stack(settings, events=events)
    known = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    for step in range(200):
        action = rng.random()
        if action < 0.5:
            base = bases[rng.randrange(len(bases))]  # shared prefixes, so that tiers get hits
            tokens = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(1, 4) for _ in range(rng.randrange(3))]
            namespace = rng.choice(namespaces)
            prompts.append((tokens, namespace))
            allocation = stack.run(tokens, namespace)
            promoted["host"] += allocation.cached_tokens_host
            promoted["disk"] += allocation.cached_tokens_disk
        elif action < 0.75:
            stack.tiers.demotions.demote_some(rng.randrange(1, 4))
        elif action < 0.9:
            asyncio.run(stack.write_all())
        else:
            stack.evict_everything()
        check(stack, events, known, step)
        if step == 150:  # a restart over the same disk: a new event log, a new consumer view
            asyncio.run(stack.write_all())
            events = BlockEventLog(BS)
            events.cleared()
            stack.tiers.close()
            stack = Stack(settings, events=events)
            known = {"GPU": {0}, "CPU": {0}, "STORAGE": {0}}  # the AllBlocksCleared empties them
            check(stack, events, known, step)
            assert known["STORAGE"] and stack.tiers.index.count("disk") == len(known["STORAGE"])
    assert promoted["host"] and promoted["disk"], f"the walk promoted too little to test: {promoted}"
