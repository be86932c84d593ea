"""The ledger's invariants, checked whole (--check-invariants, and the stateful tests):
every block's reference count equals the block tables that list it, sequences hold the
blocks their tokens need and never share a partial block, the per-owner and per-model
counts equal what the sequences hold, and the pool's and the tiers' own invariants hold.

Reads the ledger's bookkeeping (its ``Sequences``, sequences.py) directly on purpose: it
checks the bookkeeping itself, not what the public calls report."""

from __future__ import annotations


def check_ledger(ledger) -> None:
    """Raise AssertionError naming the first broken invariant of `ledger` (a ledger.Ledger,
    which imports this module), its pool or its tiers."""
    ledger.pool.check_invariants()
    if ledger.tiers is not None:
        ledger.tiers.check_invariants()
    held = ledger.sequences
    block_size = ledger.block_size
    table_count = [0] * ledger.num_blocks
    for sequence_id, sequence in held.by_id.items():
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
        if sequence_id not in held.by_owner.get(sequence.owner, ()):
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
    indexed = sum(len(ids) for ids in held.by_owner.values())
    if indexed != len(held.by_id):
        raise AssertionError(f"owner index lists {indexed} sequences, ledger holds {len(held.by_id)}")
    for owner, ids in held.by_owner.items():
        entries = sum(len(held.by_id[sequence_id].blocks) for sequence_id in ids)
        if held.owner_blocks.get(owner) != entries:
            raise AssertionError(f"owner {owner!r} holds {entries} block-table entries, counted {held.owner_blocks.get(owner)}")
        if len(ids) > held.limits.max_sequences or entries > held.limits.max_blocks:
            raise AssertionError(f"owner {owner!r} holds {len(ids)} sequences and {entries} blocks, past {held.limits}")
    if set(held.owner_blocks) != set(held.by_owner):
        raise AssertionError("the per-owner block counts name other owners than the owner index")
    stats = ledger.stats()
    if stats.blocks_free + stats.blocks_leased + stats.blocks_cached != stats.blocks_total:
        raise AssertionError(f"free + leased + cached != total in {stats}")
    by_model: dict[str, tuple[int, set[int]]] = {}
    for sequence in held.by_id.values():
        count, blocks = by_model.get(sequence.namespace[0], (0, set()))
        by_model[sequence.namespace[0]] = (count + 1, blocks | {block.block_id for block in sequence.blocks})
    for fingerprint, usage in held.models.items():
        count, blocks = by_model.pop(fingerprint, (0, set()))
        if (usage.sequences, usage.blocks_leased) != (count, len(blocks)):
            raise AssertionError(f"model {fingerprint!r} counted {usage.sequences} sequences and "
                                 f"{usage.blocks_leased} blocks, holds {count} and {len(blocks)}")
    if by_model:
        raise AssertionError(f"models {sorted(by_model)} hold sequences but have no usage")
