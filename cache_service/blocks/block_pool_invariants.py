"""The block pool's invariants, checked whole (``BlockPool.check_invariants``: the ledger's
check, --check-invariants, and the tests): the free list is linked both ways, holds every
block of ref count 0 once and no other, and its counts match it; every registered block
is the one its hash names in the prefix cache and holds one full block of token ids; and
free + leased + cached is the pool.

Apart from block_pool.py because it is a second idea: the pool changes blocks in O(1)
steps on every Lease call, while this walks the whole pool to judge the result (tests
and soak runs only). It reads the pool's private state on purpose: it checks the
bookkeeping itself, not what the public calls report.
"""

from __future__ import annotations


def free_list(pool) -> list:
    """The free list of ``pool`` (a block_pool.BlockPool, which imports this module), head
    (next to be taken) first. For tests and invariant checks (it makes the objects of
    never-leased blocks: keep it to small pools)."""
    out = [pool.blocks[block_id] for block_id in range(pool._next_fresh, pool.num_blocks)]
    block = pool._head.next
    while block is not pool._tail:
        out.append(block)
        if len(out) > pool.num_blocks:
            raise AssertionError("free list has a cycle or more entries than the pool has blocks")
        block = block.next
    return out


def check_pool(pool) -> None:
    """Raise AssertionError naming the first broken invariant of ``pool`` (a BlockPool)."""
    blocks = free_list(pool)
    ids = [block.block_id for block in blocks]
    if len(set(ids)) != len(ids):
        raise AssertionError(f"free list holds a block twice: {sorted(ids)}")
    if len(blocks) != pool.num_free:
        raise AssertionError(f"free list has {len(blocks)} blocks but num_free is {pool.num_free}")
    previous = pool._head
    for block in blocks[pool.num_blocks - pool._next_fresh:]:
        if block.prev is not previous:
            raise AssertionError(f"{block!r}.prev does not point to the block before it in the free list")
        previous = block
    if pool._tail.prev is not previous:
        raise AssertionError("free-list tail sentinel does not point to the last free block")
    in_list = set(ids)
    for block in pool.blocks:
        if block.ref_count < 0:
            raise AssertionError(f"{block!r} has a negative ref count")
        if (block.ref_count == 0) != (block.block_id in in_list):
            raise AssertionError(f"{block!r}: in free list = {block.block_id in in_list}, ref_count = {block.ref_count}")
        if block.block_hash is not None and pool.cached.get(block.block_hash) is not block:
            raise AssertionError(f"{block!r} has a hash but is not the registered block for it")
    for block_hash, block in pool.cached.items():
        if block.block_hash != block_hash:
            raise AssertionError(f"prefix entry {block_hash} points to {block!r} whose hash is {block.block_hash}")
        if block.token_ids is None or len(block.token_ids) != pool.block_size:
            raise AssertionError(f"registered {block!r} does not hold one full block of token ids")
    num_cached = sum(1 for block in blocks if block.block_hash is not None)
    if num_cached != pool.num_cached:
        raise AssertionError(f"{num_cached} cached blocks in the free list but num_cached is {pool.num_cached}")
    plain_free = pool.num_free - pool.num_cached
    if plain_free + pool.num_leased + pool.num_cached != pool.num_blocks:
        raise AssertionError(
            f"free {plain_free} + leased {pool.num_leased} + cached {pool.num_cached} != total {pool.num_blocks}"
        )
