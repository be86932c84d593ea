"""Unit tests of the block pool and the lease ledger: each operation and each error."""

from __future__ import annotations

import pytest

from cache_service.blocks.block_pool import BlockPool
from cache_service.blocks.block_pool_invariants import free_list
from cache_service.core.ledger import (
    Allocation,
    Fork,
    InvalidLease,
    LeaseError,
    Ledger,
    NoFreeBlocks,
    NotOwner,
    UnknownSequence,
)
from cache_service.blocks.prefix_hash import ROOT_HASH, block_hashes, chain_hash

BS = 4  # small blocks keep the token lists readable


def tokens(count: int, start: int = 100) -> list[int]:
    return list(range(start, start + count))


def free_ids(ledger: Ledger) -> list[int]:
    return [block.block_id for block in free_list(ledger.pool)]


# ------------------------------------------------------------------ prefix_hash


def test_block_hashes_are_chained_and_skip_partial_block():
    hashes = block_hashes(tokens(10), BS)
    assert len(hashes) == 2
    assert hashes[0] == chain_hash(ROOT_HASH, tuple(tokens(4)))
    assert hashes[1] == chain_hash(hashes[0], tuple(tokens(4, 104)))
    # Same block contents after a different prefix hash differently.
    other = block_hashes([1, 2, 3, 4] + tokens(4, 104), BS)
    assert other[1] != hashes[1]


# ------------------------------------------------------------------ BlockPool


def test_pool_starts_all_free_in_id_order():
    pool = BlockPool(5, BS)
    assert [b.block_id for b in free_list(pool)] == [0, 1, 2, 3, 4]
    assert (pool.num_free, pool.num_cached, pool.num_leased) == (5, 0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 16), (4, 0)])
def test_pool_rejects_bad_geometry(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_take_pops_head_and_free_appends_tail_first():
    pool = BlockPool(6, BS)
    taken = pool.take(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in taken)
    assert pool.num_free == 3
    assert pool.free(taken) == 3
    # Tail first: the sequence's last block is freed first, so it is evicted first.
    assert [b.block_id for b in free_list(pool)] == [3, 4, 5, 2, 1, 0]
    pool.check_invariants()


def test_take_more_than_free_is_refused():
    pool = BlockPool(2, BS)
    with pytest.raises(AssertionError):
        pool.take(3)
    pool.check_invariants()


def test_free_below_zero_is_refused_and_pool_stays_consistent():
    pool = BlockPool(3, BS)
    blocks = pool.take(2)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="below zero"):
        pool.free(blocks)
    pool.check_invariants()


def test_shared_block_is_freed_only_at_last_reference():
    pool = BlockPool(3, BS)
    (block,) = pool.take(1)
    pool.register([block], tokens(BS))
    pool.acquire([block])
    assert block.ref_count == 2
    assert pool.free([block]) == 0
    assert pool.free([block]) == 1
    assert pool.num_cached == 1
    pool.check_invariants()


def test_revive_cached_block_from_middle_of_free_list():
    pool = BlockPool(5, BS)
    blocks = pool.take(3)
    pool.register(blocks, tokens(3 * BS))
    pool.free(blocks)
    assert [b.block_id for b in free_list(pool)] == [3, 4, 2, 1, 0]
    assert pool.num_cached == 3
    hits = pool.lookup(tokens(3 * BS), 2)
    assert [b.block_id for b in hits] == [0, 1]
    pool.acquire(hits)
    assert [b.block_id for b in free_list(pool)] == [3, 4, 2]
    assert (pool.num_free, pool.num_cached) == (3, 1)
    pool.check_invariants()


def test_eviction_is_lazy_and_drops_hash_only_on_reuse():
    pool = BlockPool(2, BS)
    blocks = pool.take(2)
    pool.register(blocks, tokens(2 * BS))
    pool.free(blocks)
    # Still cached after release.
    assert len(pool.lookup(tokens(2 * BS), 2)) == 2
    # Taking one block evicts the head of the free list: the sequence's last block.
    (reused,) = pool.take(1)
    assert reused.block_id == 1
    assert reused.block_hash is None and reused.token_ids is None
    assert [b.block_id for b in pool.lookup(tokens(2 * BS), 2)] == [0]
    assert pool.num_cached == 1
    pool.check_invariants()


def test_lookup_needs_full_blocks_and_respects_max_blocks():
    pool = BlockPool(4, BS)
    blocks = pool.take(3)
    pool.register(blocks, tokens(3 * BS))
    assert len(pool.lookup(tokens(3 * BS), 10)) == 3
    assert len(pool.lookup(tokens(3 * BS), 1)) == 1
    assert len(pool.lookup(tokens(2 * BS + 1), 10)) == 2
    assert pool.lookup(tokens(BS - 1), 10) == []
    assert pool.lookup([9] + tokens(3 * BS - 1, 101), 10) == []


def test_register_keeps_the_existing_identical_block():
    pool = BlockPool(4, BS)
    first = pool.take(1)
    second = pool.take(1)
    assert pool.register(first, tokens(BS)) == 1
    assert pool.register(second, tokens(BS)) == 0
    assert second[0].block_hash is None
    pool.free(second)
    assert (pool.num_cached, pool.num_plain_free) == (0, 3)
    pool.free(first)
    assert pool.num_cached == 1
    pool.check_invariants()


def test_constant_hash_never_returns_wrong_blocks():
    # Every block hashes alike: all hits must still be verified against the tokens.
    pool = BlockPool(8, BS, hash_fn=lambda key: 7)
    blocks = pool.take(2)
    registered = pool.register(blocks, tokens(2 * BS))
    assert registered == 1  # the second block collides with the first and is skipped
    assert pool.lookup([1, 2, 3, 4] + tokens(BS, 104), 2) == []
    assert [b.block_id for b in pool.lookup(tokens(2 * BS), 2)] == [0]
    pool.check_invariants()


def test_hit_must_follow_the_block_it_was_registered_after():
    # A hash that ignores the parent makes block contents alone the key; the pool must
    # still refuse a registered second block as someone's first block (other positions).
    pool = BlockPool(8, BS, hash_fn=lambda key: hash(key[1]))
    blocks = pool.take(2)
    assert pool.register(blocks, tokens(2 * BS)) == 2
    second_block_tokens = tokens(BS, 104)
    assert pool.lookup(second_block_tokens + tokens(BS), 2) == []
    # And a different first block followed by the same second block is no hit either.
    assert pool.lookup([1, 2, 3, 4] + second_block_tokens, 2) == []


def test_pool_check_invariants_catches_corruption():
    pool = BlockPool(4, BS)
    blocks = pool.take(2)
    blocks[0].ref_count = 0  # leased block that claims to be free but is not in the free list
    with pytest.raises(AssertionError, match="free list"):
        pool.check_invariants()
    pool = BlockPool(4, BS)
    pool.num_cached = 1
    with pytest.raises(AssertionError, match="num_cached"):
        pool.check_invariants()


# ------------------------------------------------------------------ Ledger: allocate


def test_allocate_rounds_up_to_blocks():
    ledger = Ledger(10, BS)
    allocation = ledger.allocate("a", 9)
    assert isinstance(allocation, Allocation)
    assert len(allocation.block_ids) == 3
    assert allocation.cached_tokens == 0
    stats = ledger.stats()
    assert (stats.blocks_leased, stats.blocks_free, stats.blocks_cached, stats.sequences) == (3, 7, 0, 1)
    ledger.check_invariants()


def test_sequence_ids_are_never_reused():
    ledger = Ledger(4, BS)
    seen = set()
    for _ in range(20):
        allocation = ledger.allocate("a", 1)
        assert allocation.sequence_id not in seen
        seen.add(allocation.sequence_id)
        ledger.release("a", allocation.sequence_id)


@pytest.mark.parametrize(
    "num_tokens, prompt, match",
    [(0, (), "num_tokens must be >= 1"), (-3, (), ">= 1"), (3, tokens(5), "cover the prompt")],
)
def test_allocate_invalid_arguments(num_tokens, prompt, match):
    ledger = Ledger(4, BS)
    with pytest.raises(InvalidLease, match=match) as info:
        ledger.allocate("a", num_tokens, prompt)
    assert info.value.code == "INVALID_ARGUMENT"
    assert ledger.stats().sequences == 0


def test_allocate_no_free_blocks_names_numbers_and_takes_nothing():
    ledger = Ledger(4, BS)
    ledger.allocate("a", 2 * BS)
    before = ledger.stats()
    with pytest.raises(NoFreeBlocks) as info:
        ledger.allocate("a", 3 * BS)
    assert info.value.code == "NO_FREE_BLOCKS"
    assert "needs 3" in str(info.value) and "only 2 of 4" in str(info.value)
    assert ledger.stats() == before
    ledger.check_invariants()


def test_allocate_no_free_blocks_with_prefix_hit_changes_no_ref_count():
    ledger = Ledger(4, BS)
    prompt = tokens(2 * BS + 1)
    first = ledger.allocate("a", len(prompt), prompt)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt[: 2 * BS])
    filler = ledger.allocate("a", BS)  # takes the plain-free block 3 from the free-list head
    assert filler.block_ids == [3]
    before = ledger.stats()
    refs_before = [b.ref_count for b in ledger.pool.blocks]
    free_before = free_ids(ledger)
    with pytest.raises(NoFreeBlocks):
        # 2 cached blocks to revive + 2 fresh > 3 in the free list
        ledger.allocate("a", 4 * BS, prompt)
    assert ledger.stats() == before
    assert [b.ref_count for b in ledger.pool.blocks] == refs_before
    assert free_ids(ledger) == free_before
    ledger.check_invariants()


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    ledger = Ledger(16, BS)
    prompt = tokens(3 * BS + 2)
    first = ledger.allocate("a", len(prompt) + 5, prompt)
    assert first.cached_tokens == 0
    assert ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt) == 5
    assert ledger.stats().blocks_cached == 3
    second = ledger.allocate("b", len(prompt), prompt)
    assert second.cached_tokens == 3 * BS
    assert second.block_ids[:3] == first.block_ids[:3]
    assert second.block_ids[3] not in first.block_ids[:3]
    stats = ledger.stats()
    assert stats.prefix_queries == 2 * len(prompt)
    assert stats.prefix_hits == 3 * BS
    assert stats.blocks_cached == 0
    ledger.check_invariants()


def test_prefix_hit_is_capped_so_the_last_prompt_token_is_computed():
    ledger = Ledger(16, BS)
    prompt = tokens(2 * BS)  # exactly two full blocks
    first = ledger.allocate("a", len(prompt), prompt)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt)
    second = ledger.allocate("a", len(prompt) + 1, prompt)
    assert second.cached_tokens == BS  # the block with the last prompt token is recomputed
    assert second.block_ids[0] == first.block_ids[0]
    assert first.block_ids[1] not in second.block_ids  # a matched block past the cap is not shared
    assert ledger.pool.blocks[first.block_ids[1]].ref_count == 0
    ledger.check_invariants()


def test_prompt_of_one_block_or_less_never_hits():
    ledger = Ledger(8, BS)
    prompt = tokens(BS)
    first = ledger.allocate("a", BS, prompt)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt)
    assert ledger.allocate("a", BS, prompt).cached_tokens == 0
    assert ledger.allocate("a", 2, prompt[:2]).cached_tokens == 0


def test_prefix_hit_on_a_block_still_leased_by_another_sequence():
    ledger = Ledger(8, BS)
    prompt = tokens(2 * BS + 1)
    first = ledger.allocate("a", len(prompt), prompt)
    second_prompt = prompt[: 2 * BS] + [7]
    # First release with cache_prefix while a fork still holds the blocks.
    child = ledger.fork("a", first.sequence_id)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt)
    hit = ledger.allocate("b", len(second_prompt), second_prompt)
    assert hit.cached_tokens == 2 * BS
    assert hit.block_ids[:2] == first.block_ids[:2]
    assert ledger.pool.blocks[first.block_ids[0]].ref_count == 2  # child + hit
    ledger.release("a", child.sequence_id)
    ledger.release("b", hit.sequence_id)
    # Still registered (by the first release): cached, not plain free.
    assert ledger.stats().blocks_cached == 2
    ledger.check_invariants()


def test_revived_block_released_without_cache_prefix_stays_cached():
    ledger = Ledger(8, BS)
    prompt = tokens(2 * BS + 1)
    first = ledger.allocate("a", len(prompt), prompt)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt)
    second = ledger.allocate("a", len(prompt), prompt)
    ledger.release("a", second.sequence_id)
    assert ledger.stats().blocks_cached == 2
    assert ledger.allocate("a", len(prompt), prompt).cached_tokens == 2 * BS


def test_identical_prefix_released_twice_keeps_one_cached_copy():
    ledger = Ledger(8, BS)
    prompt = tokens(BS)
    one = ledger.allocate("a", BS, prompt)
    two = ledger.allocate("a", BS, prompt)  # no hit: one is still leased and unregistered
    assert two.cached_tokens == 0
    ledger.release("a", one.sequence_id, cache_prefix=True, token_ids=prompt)
    ledger.release("a", two.sequence_id, cache_prefix=True, token_ids=prompt)
    stats = ledger.stats()
    assert (stats.blocks_cached, stats.blocks_free) == (1, 7)
    ledger.check_invariants()


def test_cached_blocks_are_evicted_tail_first_and_lru():
    ledger = Ledger(4, BS)
    prompt = tokens(4 * BS)
    first = ledger.allocate("a", len(prompt), prompt)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=prompt)
    assert ledger.blocks_available() == 4
    # Needing one fresh block evicts the sequence's last block, keeping the prefix.
    other = ledger.allocate("a", 1)
    assert other.block_ids == [first.block_ids[3]]
    ledger.release("a", other.sequence_id)
    hit = ledger.allocate("a", len(prompt), prompt)
    assert hit.cached_tokens == 3 * BS
    ledger.check_invariants()


# ------------------------------------------------------------------ Ledger: extend


def test_extend_returns_only_new_blocks():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 3)
    assert ledger.extend("a", allocation.sequence_id, 4) == []
    assert ledger.extend("a", allocation.sequence_id, 4) == []
    new = ledger.extend("a", allocation.sequence_id, 3 * BS + 1)
    assert len(new) == 3
    assert ledger.sequences.sequence_blocks(allocation.sequence_id) == allocation.block_ids + new
    ledger.check_invariants()


def test_extend_cannot_shrink():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 6)
    with pytest.raises(InvalidLease, match="shrink") as info:
        ledger.extend("a", allocation.sequence_id, 5)
    assert info.value.code == "INVALID_ARGUMENT"


def test_extend_no_free_blocks_is_atomic():
    ledger = Ledger(3, BS)
    allocation = ledger.allocate("a", BS)
    before = ledger.stats()
    with pytest.raises(NoFreeBlocks, match="needs 3 more blocks; only 2 of 3"):
        ledger.extend("a", allocation.sequence_id, 4 * BS)
    assert ledger.stats() == before
    assert ledger.sequences.sequence_blocks(allocation.sequence_id) == allocation.block_ids
    # The sequence's length did not change either: extending to what fits still works.
    assert len(ledger.extend("a", allocation.sequence_id, 3 * BS)) == 2
    ledger.check_invariants()


# ------------------------------------------------------------------ Ledger: fork


def test_fork_of_full_blocks_shares_everything():
    ledger = Ledger(8, BS)
    parent = ledger.allocate("a", 2 * BS)
    child = ledger.fork("a", parent.sequence_id)
    assert isinstance(child, Fork)
    assert child.block_ids == parent.block_ids
    assert child.copy is None
    assert child.sequence_id != parent.sequence_id
    assert all(ledger.pool.blocks[i].ref_count == 2 for i in parent.block_ids)
    assert ledger.stats().blocks_leased == 2
    # The child grows on its own blocks.
    new = ledger.extend("a", child.sequence_id, 2 * BS + 1)
    assert new[0] not in parent.block_ids
    ledger.check_invariants()


def test_fork_copies_partial_last_block():
    ledger = Ledger(8, BS)
    parent = ledger.allocate("a", 2 * BS + 1)
    child = ledger.fork("a", parent.sequence_id)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert child.block_ids[2] != parent.block_ids[2]
    assert child.copy == (parent.block_ids[2], child.block_ids[2])
    # The child has the parent's length: extending to it adds nothing.
    assert ledger.extend("a", child.sequence_id, 2 * BS + 1) == []
    ledger.release("a", parent.sequence_id)
    assert ledger.stats().blocks_leased == 3
    ledger.check_invariants()


def test_fork_no_free_blocks_is_atomic():
    ledger = Ledger(2, BS)
    parent = ledger.allocate("a", BS + 1)
    before = ledger.stats()
    with pytest.raises(NoFreeBlocks, match="partial last block"):
        ledger.fork("a", parent.sequence_id)
    assert ledger.stats() == before
    assert [b.ref_count for b in ledger.pool.blocks] == [1, 1]
    ledger.check_invariants()


def test_fork_of_full_sequence_needs_no_free_block():
    ledger = Ledger(2, BS)
    parent = ledger.allocate("a", 2 * BS)
    assert ledger.fork("a", parent.sequence_id).copy is None


# ------------------------------------------------------------------ Ledger: release and owners


def test_release_returns_blocks_and_frees_them():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 3 * BS)
    assert ledger.release("a", allocation.sequence_id) == 3
    stats = ledger.stats()
    assert (stats.blocks_free, stats.blocks_leased, stats.blocks_cached, stats.sequences) == (8, 0, 0, 0)
    ledger.check_invariants()


def test_double_release_and_unknown_sequence():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 3)
    ledger.release("a", allocation.sequence_id)
    for call in (
        lambda: ledger.release("a", allocation.sequence_id),
        lambda: ledger.extend("a", allocation.sequence_id, 9),
        lambda: ledger.fork("a", allocation.sequence_id),
        lambda: ledger.release("a", 12345),
    ):
        with pytest.raises(UnknownSequence, match="not leased") as info:
            call()
        assert info.value.code == "NOT_FOUND"
    ledger.check_invariants()


def test_other_owner_is_refused_and_named():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("session-a", 3)
    for call in (
        lambda: ledger.release("session-b", allocation.sequence_id),
        lambda: ledger.extend("session-b", allocation.sequence_id, 9),
        lambda: ledger.fork("session-b", allocation.sequence_id),
    ):
        with pytest.raises(NotOwner) as info:
            call()
        assert info.value.code == "PERMISSION_DENIED"
        assert "session-a" in str(info.value)
    assert ledger.stats().sequences == 1
    assert ledger.stats().blocks_leased == 1
    ledger.check_invariants()


def test_release_with_more_token_ids_than_blocks_hold_is_refused_atomically():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", BS + 1)
    with pytest.raises(InvalidLease, match="hold at most 8 tokens") as info:
        ledger.release("a", allocation.sequence_id, cache_prefix=True, token_ids=tokens(2 * BS + 1))
    assert info.value.code == "INVALID_ARGUMENT"
    assert ledger.stats().sequences == 1
    # Up to the table's capacity is accepted: the holder writes slots past num_tokens
    # before it extends (it extends only when it crosses a block boundary).
    assert ledger.release("a", allocation.sequence_id, cache_prefix=True, token_ids=tokens(2 * BS)) == 2
    assert ledger.stats().blocks_cached == 2
    ledger.check_invariants()


def test_release_with_partial_token_ids_caches_only_full_blocks():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 3 * BS)
    ledger.release("a", allocation.sequence_id, cache_prefix=True, token_ids=tokens(2 * BS - 1))
    assert ledger.stats().blocks_cached == 1
    ledger.check_invariants()


def test_release_owner_reclaims_only_that_owner():
    ledger = Ledger(16, BS)
    a1 = ledger.allocate("a", 2 * BS + 1)
    a2 = ledger.fork("a", a1.sequence_id)
    b1 = ledger.allocate("b", BS)
    assert ledger.release_owner("a") == 6  # block references: 3 + 3
    assert ledger.release_owner("a") == 0
    assert ledger.release_owner("nobody") == 0
    stats = ledger.stats()
    assert (stats.sequences, stats.blocks_leased) == (1, 1)
    for sequence_id in (a1.sequence_id, a2.sequence_id):
        with pytest.raises(UnknownSequence):
            ledger.release("a", sequence_id)
    assert ledger.release("b", b1.sequence_id) == 1
    ledger.check_invariants()


def test_blocks_available_counts_free_and_cached():
    ledger = Ledger(8, BS)
    prompt = tokens(2 * BS)
    allocation = ledger.allocate("a", len(prompt), prompt)
    ledger.allocate("a", BS)
    ledger.release("a", allocation.sequence_id, cache_prefix=True, token_ids=prompt)
    stats = ledger.stats()
    assert (stats.blocks_free, stats.blocks_cached, stats.blocks_leased) == (5, 2, 1)
    assert ledger.blocks_available() == 7


def test_reset_drops_one_models_cached_blocks_keeps_leased_ones_and_reuses_them_first():
    ledger = Ledger(10, BS)
    alpha, beta = ("fp-alpha", ""), ("fp-beta", "")
    cached_beta = tokens(2 * BS + 1, start=500)  # first, so its blocks lead the free list
    other = ledger.allocate("b", len(cached_beta), cached_beta, beta)
    ledger.release("b", other.sequence_id, cache_prefix=True, token_ids=cached_beta)
    cached_alpha = tokens(2 * BS + 1)
    first = ledger.allocate("a", len(cached_alpha), cached_alpha, alpha)
    ledger.release("a", first.sequence_id, cache_prefix=True, token_ids=cached_alpha)
    salted = ledger.allocate("a", len(cached_alpha), cached_alpha, ("fp-alpha", "tenant"))  # same model, other salt
    ledger.release("a", salted.sequence_id, cache_prefix=True, token_ids=cached_alpha)
    held_alpha = tokens(BS + 1, start=300)  # registered while its sequence still holds it
    held = ledger.allocate("a", len(held_alpha), held_alpha, alpha)
    assert ledger.commit("a", held.sequence_id, held_alpha) == 1
    assert ledger.stats().blocks_cached == 6

    assert ledger.reset_prefix_cache("fp-alpha") == (4, 1)  # both salts' chains dropped, the held block kept
    stats = ledger.stats()
    assert (stats.blocks_cached, stats.blocks_leased, stats.blocks_free) == (2, 2, 6)
    ledger.check_invariants()
    dropped = {*first.block_ids[:2], *salted.block_ids[:2]}
    assert set(free_ids(ledger)[:4]) == dropped  # taken before any block still cached
    taken = ledger.allocate("c", 4 * BS)
    assert set(taken.block_ids) == dropped
    assert len(ledger.pool.lookup(cached_beta, 2, beta)) == 2
    ledger.release("c", taken.sequence_id)
    assert ledger.allocate("a", len(cached_alpha), cached_alpha, alpha).cached_tokens == 0
    probe = held_alpha[:BS] + [7]
    assert ledger.allocate("a", len(probe), probe, alpha).cached_tokens == BS  # the held block still hits
    ledger.check_invariants()


def test_reset_of_every_model_leaves_no_cached_block():
    ledger = Ledger(8, BS)
    for namespace in (("fp-alpha", ""), ("fp-beta", "")):
        prompt = tokens(2 * BS + 1)
        allocation = ledger.allocate("a", len(prompt), prompt, namespace)
        ledger.release("a", allocation.sequence_id, cache_prefix=True, token_ids=prompt)
    assert ledger.reset_prefix_cache(None) == (4, 0)
    assert ledger.stats().blocks_cached == 0 and ledger.pool.cached == {}
    assert ledger.reset_prefix_cache(None) == (0, 0)
    ledger.check_invariants()


def test_every_lease_error_has_a_code():
    for cls, code in [
        (NoFreeBlocks, "NO_FREE_BLOCKS"),
        (UnknownSequence, "NOT_FOUND"),
        (NotOwner, "PERMISSION_DENIED"),
        (InvalidLease, "INVALID_ARGUMENT"),
    ]:
        assert issubclass(cls, LeaseError)
        assert cls("x").code == code


def test_ledger_check_invariants_catches_ref_count_mismatch():
    ledger = Ledger(8, BS)
    allocation = ledger.allocate("a", 2 * BS)
    ledger.pool.blocks[allocation.block_ids[0]].ref_count = 2
    with pytest.raises(AssertionError, match="block tables"):
        ledger.check_invariants()


def test_ledger_check_invariants_catches_shared_partial_block():
    ledger = Ledger(8, BS)
    parent = ledger.allocate("a", BS + 1)
    child = ledger.fork("a", parent.sequence_id)
    # Simulate a buggy fork that shared the partial block instead of copying it.
    child_sequence = ledger.sequences.by_id[child.sequence_id]
    ledger.pool.free([child_sequence.blocks[-1]])
    child_sequence.blocks[-1] = ledger.sequences.by_id[parent.sequence_id].blocks[-1]
    child_sequence.blocks[-1].ref_count += 1
    with pytest.raises(AssertionError, match="partial last block"):
        ledger.check_invariants()


def test_a_pool_of_ten_million_blocks_costs_nothing_until_blocks_are_used():
    # A block object is made when a block is first leased (block_pool.py's docstring), so a
    # 10M-block pool is built without 10M objects (building them all eagerly took seconds and
    # gigabytes, past the model service's Attach deadline) and uses memory only for what is leased.
    import tracemalloc

    tracemalloc.start()
    try:
        pool = BlockPool(10_000_000, 16)
        assert tracemalloc.get_traced_memory()[0] < 100_000
        first = pool.take(3)
        assert [block.block_id for block in first] == [0, 1, 2] and pool.blocks.made == 3
        pool.free(first)  # to the tail: the never-leased ids stay ahead of them
        second = pool.take(2)
        assert [block.block_id for block in second] == [3, 4]
        middle = pool.blocks[7_654_321]
        assert middle.ref_count == 0 and len(pool.blocks) == 10_000_000 and pool.num_free == 9_999_998
        held = [pool.take(16) for _ in range(625)]  # 10,000 blocks
        assert pool.blocks.made == 3 + 2 + 1 + 10_000
        assert tracemalloc.get_traced_memory()[0] < 10_000 * 400  # ~130 bytes a Block, and the lists
    finally:
        tracemalloc.stop()
    for blocks in held:
        pool.free(blocks)
    pool.free(second)
    assert pool.num_free == 10_000_000


def test_the_lazy_free_list_keeps_the_eager_order():
    # The order blocks are handed out in: never-leased ids first (in id order), then blocks
    # freed since, least recently freed first, with cached blocks revived from the middle.
    pool = BlockPool(6, 4)
    a = pool.take(4)  # 0-3
    pool.free([a[0], a[1]])  # freed tail first: 1, 0
    assert [block.block_id for block in free_list(pool)] == [4, 5, 1, 0]
    pool.register(a[2:], list(range(8)))
    pool.free(a[2:])  # 3, 2 (cached)
    assert [block.block_id for block in free_list(pool)] == [4, 5, 1, 0, 3, 2]
    pool.acquire([a[2]])  # revive a cached block from the middle
    assert [block.block_id for block in pool.take(4)] == [4, 5, 1, 0]
    assert [block.block_id for block in free_list(pool)] == [3]
    pool.check_invariants()
    with pytest.raises(IndexError, match="block 6 is not in a pool of 6"):
        pool.blocks[6]
