"""TruncateOp in the ledger: a table cut short gives back exactly the blocks past the
cut, as free blocks (never prefix cache, never a KV event); refused, changing nothing,
when it would grow the sequence, drop or end within a committed or shared block, or name
an unknown or another session's sequence. (The stateful test in test_ledger_stateful.py
truncates among every other op with the invariant checker on; test_bad_input.py checks
the statuses over gRPC; test_speculative_stack.py a model service's truncates.)"""

from __future__ import annotations

import pytest

from cache_service.core.ledger import InvalidLease, Ledger, NotOwner, UnknownSequence
from cache_service.events.block_event_log import BlockEventLog
from cache_service.events.vllm_block_hash import DEFAULT_SEED, none_hash

BS = 4


def test_truncate_gives_back_the_blocks_past_the_cut_as_free_blocks():
    ledger = Ledger(16, BS)
    sequence = ledger.allocate("a", 14)  # 4 blocks, the last partial
    table = list(sequence.block_ids)
    before = ledger.stats()
    assert ledger.truncate("a", sequence.sequence_id, 5) == 2  # 5 tokens: 2 blocks, the second partial
    assert ledger.sequences.sequence_blocks(sequence.sequence_id) == table[:2]
    after = ledger.stats()
    assert (after.blocks_leased, after.blocks_free, after.blocks_cached) == (
        before.blocks_leased - 2, before.blocks_free + 2, before.blocks_cached)
    assert after.blocks_truncated == 2
    assert ledger.sequences.owner_usage("a") == (1, 2)
    assert ledger.truncate("a", sequence.sequence_id, 5) == 0  # already that short: nothing to give back
    ledger.check_invariants()
    # The sequence grows again from the cut, and ends as ever.
    assert len(ledger.extend("a", sequence.sequence_id, 12)) == 1
    ledger.check_invariants()
    assert ledger.release("a", sequence.sequence_id) == 3
    assert ledger.stats().blocks_leased == 0
    ledger.check_invariants()


def test_truncate_never_grows_nor_empties_a_sequence():
    ledger = Ledger(16, BS)
    sequence = ledger.allocate("a", 6).sequence_id
    before = ledger.stats()
    for tokens in (0, 7, 2**32 - 1):
        with pytest.raises(InvalidLease, match="must keep from 1 to its 6 tokens"):
            ledger.truncate("a", sequence, tokens)
    assert ledger.stats() == before


def test_truncate_stops_at_committed_tokens():
    ledger = Ledger(16, BS)
    tokens = list(range(1, 11))
    sequence = ledger.allocate("a", 16, tokens).sequence_id  # 4 blocks
    assert ledger.commit("a", sequence, tokens) == 2  # blocks 0 and 1 (tokens 0..7) in the prefix cache
    before = ledger.stats()
    for cut in (1, 4, 7):  # within or below block 1
        with pytest.raises(InvalidLease, match=r"in the prefix cache; truncate to 8 tokens or more"):
            ledger.truncate("a", sequence, cut)
    assert ledger.stats() == before
    assert ledger.truncate("a", sequence, 8) == 2
    ledger.check_invariants()


def test_truncate_stops_at_blocks_shared_with_a_fork():
    ledger = Ledger(16, BS)
    parent = ledger.allocate("a", 16).sequence_id
    ledger.fork("a", parent, 9)  # shares blocks 0 and 1, copies block 2
    with pytest.raises(InvalidLease, match="shared with another sequence; truncate to 8 tokens or more"):
        ledger.truncate("a", parent, 6)
    assert ledger.truncate("a", parent, 9) == 1
    ledger.check_invariants()


def test_truncate_of_an_unknown_or_foreign_sequence_is_refused():
    ledger = Ledger(16, BS)
    sequence = ledger.allocate("owner", 12).sequence_id
    with pytest.raises(UnknownSequence, match="not leased"):
        ledger.truncate("owner", 999, 1)
    with pytest.raises(NotOwner, match="belongs to session 'owner'"):
        ledger.truncate("intruder", sequence, 1)
    ledger.release("owner", sequence)
    with pytest.raises(UnknownSequence, match="already released"):
        ledger.truncate("owner", sequence, 1)
    assert ledger.stats().blocks_leased == 0


def test_truncated_blocks_are_never_published_nor_cached():
    events = BlockEventLog(BS, root=none_hash(DEFAULT_SEED))
    ledger = Ledger(16, BS, events=events)
    tokens = list(range(1, 21))
    sequence = ledger.allocate("a", 20, tokens[:6]).sequence_id  # 5 blocks: tokens 6.. were "proposed"
    ledger.commit("a", sequence, tokens[:4])
    events.drain()
    assert ledger.truncate("a", sequence, 7) == 3  # tokens 7.. rejected: blocks 2, 3 and 4 go
    assert events.drain() == []
    # Released with its kept tokens, only their full blocks become prefix cache.
    ledger.release("a", sequence, cache_prefix=True, token_ids=tokens[:7])
    assert ledger.stats().blocks_cached == 1
    assert sum(len(event.block_hashes) for event in events.drain()) == 0  # block 0 was published at its commit
    ledger.check_invariants()
