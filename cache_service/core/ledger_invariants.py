"""The ledger's invariants, checked whole (--check-invariants, and the stateful tests):
every block's reference count equals the block tables that list it, sequences hold the
blocks their tokens need and never share a partial block, the per-owner and per-model
counts equal what the sequences hold, and the pool's and the tiers' own invariants hold.

Reads the ledger's private state on purpose: it checks the bookkeeping itself, not what
the public calls report."""

from __future__ import annotations


def check_ledger(ledger) -> None:
    """Raise AssertionError naming the first broken invariant of `ledger` (a ledger.Ledger,
    which imports this module), its pool or its tiers."""
    ledger.pool.check_invariants()
    if ledger.tiers is not None:
        ledger.tiers.check_invariants()
    block_size = ledger.block_size
    table_count = [0] * ledger.num_blocks
    for sequence_id, sequence in ledger._sequences.items():
        expected = (sequence.num_tokens + block_size - 1) // block_size
        if len(sequence.blocks) != expected:
            raise AssertionError(
                f"sequence {sequence_id} of {sequence.num_tokens} tokens holds {len(sequence.blocks)} "
                f"blocks, expected {expected}"
            )
        ids = [block.block_id for block in sequence.blocks]
        if len(set(ids)) != len(ids):
            raise AssertionError(f"sequence {sequence_id} lists a block twice: {ids}")
        for block_id in ids:
            table_count[block_id] += 1
        if sequence_id not in ledger._by_owner.get(sequence.owner, ()):
            raise AssertionError(f"sequence {sequence_id} is missing from its owner's index")
        if sequence.num_tokens % block_size and sequence.blocks[-1].ref_count != 1:
            raise AssertionError(
                f"sequence {sequence_id}'s partial last block {sequence.blocks[-1]!r} is shared; "
                "writes into it would corrupt another sequence"
            )
    for block in ledger.pool.blocks:
        if block.ref_count != table_count[block.block_id]:
            raise AssertionError(
                f"{block!r} is listed in {table_count[block.block_id]} block tables "
                f"but has ref_count {block.ref_count}"
            )
    indexed = sum(len(ids) for ids in ledger._by_owner.values())
    if indexed != len(ledger._sequences):
        raise AssertionError(f"owner index lists {indexed} sequences, ledger holds {len(ledger._sequences)}")
    for owner, ids in ledger._by_owner.items():
        entries = sum(len(ledger._sequences[sequence_id].blocks) for sequence_id in ids)
        if ledger._owner_blocks.get(owner) != entries:
            raise AssertionError(f"owner {owner!r} holds {entries} block-table entries, counted {ledger._owner_blocks.get(owner)}")
        if len(ids) > ledger.limits.max_sequences or entries > ledger.limits.max_blocks:
            raise AssertionError(f"owner {owner!r} holds {len(ids)} sequences and {entries} blocks, past {ledger.limits}")
    if set(ledger._owner_blocks) != set(ledger._by_owner):
        raise AssertionError("the per-owner block counts name other owners than the owner index")
    stats = ledger.stats()
    if stats.blocks_free + stats.blocks_leased + stats.blocks_cached != stats.blocks_total:
        raise AssertionError(f"free + leased + cached != total in {stats}")
    by_model: dict[str, tuple[int, set[int]]] = {}
    for sequence in ledger._sequences.values():
        count, blocks = by_model.get(sequence.namespace[0], (0, set()))
        by_model[sequence.namespace[0]] = (count + 1, blocks | {block.block_id for block in sequence.blocks})
    for fingerprint, usage in ledger._models.items():
        count, blocks = by_model.pop(fingerprint, (0, set()))
        if (usage.sequences, usage.blocks_leased) != (count, len(blocks)):
            raise AssertionError(f"model {fingerprint!r} counted {usage.sequences} sequences and "
                                 f"{usage.blocks_leased} blocks, holds {count} and {len(blocks)}")
    if by_model:
        raise AssertionError(f"models {sorted(by_model)} hold sequences but have no usage")
