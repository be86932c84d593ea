"""The ledger with many models, tenants and sessions: namespaces, per-session limits,
fork copy-on-write from the written length, release in chunks, and the pool's
reclaim grace and chunked detach (KvPool, no gRPC)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cache_service.core.ledger import InvalidLease, Ledger, LimitExceeded, SessionLimits
from cache_service.core.pool import KvPool, PoolSettings
from cache_service.core.reclaim import RELEASE_CHUNK_BLOCKS
from pagedkv.kv_geometry import KvGeometry
from fake_clock import Clock

BS = 4
MODEL_A = ("xxh3_128:aaaa", "")
MODEL_B = ("xxh3_128:bbbb", "")


def prompt(n: int, start: int = 1) -> list[int]:
    return [start + i for i in range(n)]


def cache(ledger: Ledger, owner: str, tokens: list[int], namespace) -> None:
    allocation = ledger.allocate(owner, len(tokens), tokens, namespace)
    ledger.release(owner, allocation.sequence_id, cache_prefix=True, token_ids=tokens)


@pytest.mark.parametrize("hash_fn", [hash, lambda key: hash(key[1])], ids=["python-hash", "namespace-blind-hash"])
def test_namespaces_share_the_pool_but_never_a_prefix(hash_fn):
    ledger = Ledger(32, BS, hash_fn=hash_fn)
    tokens = prompt(3 * BS + 1)
    cache(ledger, "a", tokens, MODEL_A)
    assert ledger.stats().blocks_cached == 3
    # Another model, another salt of the same model, the unnamed default: all miss.
    for namespace in (MODEL_B, (MODEL_A[0], "tenant-1"), ("", "")):
        allocation = ledger.allocate("b", len(tokens), tokens, namespace)
        assert allocation.cached_tokens == 0, namespace
        ledger.release("b", allocation.sequence_id)
    # The same model and salt (a restarted model service, another session) hits.
    allocation = ledger.allocate("c", len(tokens), tokens, MODEL_A)
    assert allocation.cached_tokens == 3 * BS
    ledger.check_invariants()


def test_a_fork_inherits_its_parents_namespace():
    ledger = Ledger(32, BS)
    tokens = prompt(2 * BS + 1)
    salted = (MODEL_A[0], "tenant-1")
    parent = ledger.allocate("a", len(tokens), tokens, salted)
    child = ledger.fork("a", parent.sequence_id)
    ledger.release("a", parent.sequence_id)
    ledger.release("a", child.sequence_id, cache_prefix=True, token_ids=tokens)
    assert ledger.allocate("b", len(tokens), tokens, MODEL_A).cached_tokens == 0
    assert ledger.allocate("b", len(tokens), tokens, salted).cached_tokens == 2 * BS


def test_fork_decides_copy_on_write_from_the_written_length():
    ledger = Ledger(16, BS)
    # Reserved 2 full blocks, written 6 tokens: block 1 is partial and both will write it.
    parent = ledger.allocate("a", 2 * BS)
    child = ledger.fork("a", parent.sequence_id, num_tokens=BS + 2)
    assert child.copy == (parent.block_ids[1], child.block_ids[1])
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    ledger.check_invariants()
    # Written up to a block boundary: nothing to copy, the unwritten tail is not shared.
    reserved = ledger.allocate("a", 3 * BS - 1)
    child = ledger.fork("a", reserved.sequence_id, num_tokens=2 * BS)
    assert child.copy is None and child.block_ids == reserved.block_ids[:2]
    ledger.check_invariants()
    # 0: the reserved length, as before.
    child = ledger.fork("a", reserved.sequence_id)
    assert child.copy == (reserved.block_ids[2], child.block_ids[2])
    with pytest.raises(InvalidLease, match="hold at most"):
        ledger.fork("a", reserved.sequence_id, num_tokens=3 * BS + 1)
    ledger.check_invariants()


def test_limits_refuse_one_op_and_change_nothing():
    ledger = Ledger(64, BS, limits=SessionLimits(max_sequences=3, max_blocks=6))
    first = ledger.allocate("a", 2 * BS)
    ledger.allocate("a", BS)
    before = ledger.stats()
    with pytest.raises(LimitExceeded, match="--max-session-blocks") as info:
        ledger.allocate("a", 4 * BS)
    assert info.value.code == "LIMIT_EXCEEDED"
    with pytest.raises(LimitExceeded, match="--max-session-blocks"):
        ledger.extend("a", first.sequence_id, 6 * BS)
    assert ledger.stats() == before
    ledger.fork("a", first.sequence_id)  # 2 more table entries: 5 of 6, 3 sequences of 3
    with pytest.raises(LimitExceeded, match="--max-session-sequences"):
        ledger.fork("a", first.sequence_id)
    with pytest.raises(LimitExceeded, match="--max-session-sequences"):
        ledger.allocate("a", 1)
    # Another session is not limited by a's usage.
    for _ in range(3):
        ledger.allocate("b", BS)
    assert ledger.sequences.owner_usage("a") == (3, 5) and ledger.sequences.owner_usage("b") == (3, 3)
    ledger.check_invariants()


def test_a_fork_storm_of_full_blocks_stops_at_the_limit():
    """Forks of a sequence whose length is a multiple of the block size need no free
    block: only the per-session limit stops them."""
    ledger = Ledger(8, BS, limits=SessionLimits(max_sequences=100, max_blocks=10_000))
    parent = ledger.allocate("a", 2 * BS)
    forks = 0
    with pytest.raises(LimitExceeded, match="100"):
        while True:
            ledger.fork("a", parent.sequence_id)
            forks += 1
    assert forks == 99
    assert ledger.stats().blocks_leased == 2
    assert ledger.release_owner("a") == 200
    ledger.check_invariants()


def test_release_owner_some_releases_in_chunks_and_stays_consistent():
    ledger = Ledger(64, BS)
    parent = ledger.allocate("a", 2 * BS)
    for _ in range(20):
        ledger.fork("a", parent.sequence_id)
    ledger.allocate("b", BS)
    chunks = 0
    done = False
    released = 0
    while not done:
        count, done = ledger.release_owner_some("a", 5)
        released += count
        chunks += 1
        ledger.check_invariants()
    assert released == 42 and chunks == 7  # whole sequences of 2 until at least 5: 6 a chunk
    assert ledger.sequences.owner_usage("a") == (0, 0) and ledger.sequences.owner_usage("b") == (1, 1)
    assert ledger.release_owner_some("a", 5) == (0, True)


# ------------------------------------------------------------------ KvPool: grace and chunked detach

GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")


def test_expired_sessions_blocks_wait_out_the_grace(tmp_path):
    clock = Clock()
    pool = KvPool(PoolSettings(block_size=BS, kv_cache_bytes=1 << 20, max_blocks=8, lease_ttl_ms=1000,
                               reclaim_grace_ms=2000, shm_dir=str(tmp_path)), clock=clock)
    try:
        stalled = pool.attach("stalled", GEOMETRY, 0, 0).session
        other = pool.attach("other", GEOMETRY, 0, 0).session
        pool.ledger.allocate(stalled.owner, 6 * BS)
        clock.now += 1.5
        pool.heartbeat(other.session_id)
        assert pool.reclaims.expire_sessions() == 1
        assert asyncio.run(pool.reclaims.reclaim_expired()) == 0
        # Gone as a session (its calls fail), but its blocks are nobody else's yet.
        assert pool.ledger.stats().blocks_leased == 6
        assert pool.ledger.blocks_available() == 2
        clock.now += 2.0
        assert asyncio.run(pool.reclaims.reclaim_expired()) == 6
        assert pool.ledger.stats().blocks_leased == 0
    finally:
        pool.close()


def test_attach_without_max_model_len_needs_one_block(tmp_path):
    pool = KvPool(PoolSettings(block_size=BS, kv_cache_bytes=1 << 20, max_blocks=8, shm_dir=str(tmp_path)))
    try:
        attachment = pool.attach("old-client", GEOMETRY, 0, 0)
        assert attachment.sizing.max_model_len == BS and attachment.sizing.num_blocks == 8
        pool.attach("another", GEOMETRY, 0, 0)
    finally:
        pool.close()


def test_detaching_a_huge_session_yields_to_the_event_loop(tmp_path):
    pool = KvPool(PoolSettings(block_size=BS, kv_cache_bytes=64 << 20, max_blocks=4096, shm_dir=str(tmp_path)))
    try:
        session = pool.attach("huge", GEOMETRY, 0, 0).session
        parent = pool.ledger.allocate(session.owner, 64 * BS)
        for _ in range(999):
            pool.ledger.fork(session.owner, parent.sequence_id)
        references = 1000 * 64

        async def detach_while_ticking() -> tuple[int, int]:
            ticks = 0
            done = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not done.is_set():
                    ticks += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            released = await pool.reclaims.detach(session.session_id)
            done.set()
            await task
            return released, ticks

        released, ticks = asyncio.run(detach_while_ticking())
        assert released == references
        # Other coroutines ran between the chunks: one turn at least per chunk.
        assert ticks >= references // RELEASE_CHUNK_BLOCKS
        assert pool.ledger.stats().blocks_leased == 0
        pool.ledger.check_invariants()
    finally:
        pool.close()
