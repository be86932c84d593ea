"""The lease ledger: sequences and their owners on top of the block pool.

The gRPC servicer calls only this. Every public method is atomic: it validates and
checks that enough blocks are available before it changes anything, so a refused call
leaves the ledger exactly as it was.

An owner is the session a sequence was leased to; the ledger only compares owner
strings and names them in error messages, so pass an id that is not a secret.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache_service.block_pool import Block, BlockPool
from cache_service.prefix_hash import HashFn


class LeaseError(Exception):
    """A request the ledger refuses; ``code`` is the gRPC status code name to return."""

    code = "UNKNOWN"


class NoFreeBlocks(LeaseError):
    code = "NO_FREE_BLOCKS"


class UnknownSequence(LeaseError):
    code = "NOT_FOUND"


class NotOwner(LeaseError):
    code = "PERMISSION_DENIED"


class InvalidLease(LeaseError):
    code = "INVALID_ARGUMENT"


@dataclass(frozen=True, slots=True)
class Allocation:
    sequence_id: int
    block_ids: list[int]
    cached_tokens: int  # leading prompt tokens whose K/V the reused blocks already hold


@dataclass(frozen=True, slots=True)
class Fork:
    sequence_id: int
    block_ids: list[int]
    copy: tuple[int, int] | None  # (src_block, dst_block): copy the parent's partial last block


@dataclass(frozen=True, slots=True)
class LedgerStats:
    blocks_total: int
    blocks_free: int
    blocks_leased: int
    blocks_cached: int
    sequences: int
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # prompt tokens found cached


class _Sequence:
    __slots__ = ("owner", "num_tokens", "blocks")

    def __init__(self, owner: str, num_tokens: int, blocks: list[Block]) -> None:
        self.owner = owner
        self.num_tokens = num_tokens
        self.blocks = blocks


class Ledger:
    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = hash) -> None:
        self.pool = BlockPool(num_blocks, block_size, hash_fn)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._sequences: dict[int, _Sequence] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._last_sequence_id = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    # ---------------------------------------------------------------- leasing

    def allocate(self, owner: str, num_tokens: int, prompt_token_ids: Sequence[int] = ()) -> Allocation:
        """Lease blocks for a new sequence of ``num_tokens`` tokens.

        With ``prompt_token_ids``, the longest cached chain of the prompt's full blocks is
        reused, but never the block holding the last prompt token: the model must compute
        that token's logits, and it must not write into a shared block.
        """
        pool = self.pool
        block_size = self.block_size
        prompt_len = len(prompt_token_ids)
        if num_tokens < 1:
            raise InvalidLease(f"num_tokens must be >= 1, got {num_tokens}")
        if num_tokens < prompt_len:
            raise InvalidLease(
                f"num_tokens ({num_tokens}) must cover the prompt ({prompt_len} token ids); "
                "lease at least as many tokens as the prompt has"
            )
        needed = (num_tokens + block_size - 1) // block_size
        hits: list[Block] = []
        if prompt_len > block_size:
            hits = pool.lookup(prompt_token_ids, (prompt_len - 1) // block_size)
        fresh = needed - len(hits)
        revived = 0
        for block in hits:
            if block.ref_count == 0:
                revived += 1
        if fresh + revived > pool.num_free:
            raise NoFreeBlocks(
                f"sequence of {num_tokens} tokens needs {fresh + revived} free blocks "
                f"({needed} in all, {len(hits) - revived} already leased and shared); "
                f"only {pool.num_free} of {self.num_blocks} are free or evictable"
            )
        if hits:
            pool.acquire(hits)
            blocks = hits + pool.take(fresh)
        else:
            blocks = pool.take(fresh)
        cached_tokens = len(hits) * block_size
        self._prefix_queries += prompt_len
        self._prefix_hits += cached_tokens
        self._last_sequence_id += 1
        sequence_id = self._last_sequence_id
        self._sequences[sequence_id] = _Sequence(owner, num_tokens, blocks)
        owned = self._by_owner.get(owner)
        if owned is None:
            self._by_owner[owner] = {sequence_id}
        else:
            owned.add(sequence_id)
        return Allocation(sequence_id, [block.block_id for block in blocks], cached_tokens)

    def extend(self, owner: str, sequence_id: int, num_tokens: int) -> list[int]:
        """Grow a sequence to ``num_tokens`` tokens; returns only the newly appended block ids."""
        sequence = self._owned(owner, sequence_id)
        if num_tokens < sequence.num_tokens:
            raise InvalidLease(
                f"extend cannot shrink sequence {sequence_id} from {sequence.num_tokens} to {num_tokens} tokens"
            )
        block_size = self.block_size
        more = (num_tokens + block_size - 1) // block_size - len(sequence.blocks)
        if more > self.pool.num_free:
            raise NoFreeBlocks(
                f"extending sequence {sequence_id} to {num_tokens} tokens needs {more} more blocks; "
                f"only {self.pool.num_free} of {self.num_blocks} are free or evictable"
            )
        new_blocks = self.pool.take(more)
        sequence.blocks += new_blocks
        sequence.num_tokens = num_tokens
        return [block.block_id for block in new_blocks]

    def fork(self, owner: str, sequence_id: int) -> Fork:
        """A child sequence sharing the parent's full blocks; its partial last block is copied."""
        parent = self._owned(owner, sequence_id)
        pool = self.pool
        partial = parent.num_tokens % self.block_size != 0
        if partial and pool.num_free < 1:
            raise NoFreeBlocks(
                f"forking sequence {sequence_id} needs 1 free block for its partial last block; "
                f"0 of {self.num_blocks} are free or evictable"
            )
        shared = parent.blocks[:-1] if partial else parent.blocks[:]
        pool.acquire(shared)
        copy = None
        if partial:
            new_block = pool.take(1)[0]
            copy = (parent.blocks[-1].block_id, new_block.block_id)
            blocks = shared + [new_block]
        else:
            blocks = shared
        self._last_sequence_id += 1
        child_id = self._last_sequence_id
        self._sequences[child_id] = _Sequence(owner, parent.num_tokens, blocks)
        self._by_owner[owner].add(child_id)
        return Fork(child_id, [block.block_id for block in blocks], copy)

    def release(self, owner: str, sequence_id: int, cache_prefix: bool = False, token_ids: Sequence[int] = ()) -> int:
        """End a sequence; returns how many block references it gave back (its table length).

        With ``cache_prefix`` and the sequence's ``token_ids``, its full blocks stay in the
        pool as evictable prefix cache instead of becoming plain free.
        """
        sequence = self._owned(owner, sequence_id)
        # The holder writes K/V into any slot of its blocks, not only the num_tokens it
        # asked for last (it extends only when it crosses a block boundary).
        capacity = len(sequence.blocks) * self.block_size
        if cache_prefix and len(token_ids) > capacity:
            raise InvalidLease(
                f"release of sequence {sequence_id}: {len(token_ids)} token ids given but its "
                f"{len(sequence.blocks)} blocks hold at most {capacity} tokens"
            )
        if cache_prefix and token_ids:
            self.pool.register(sequence.blocks, token_ids)
        self._forget(owner, sequence_id)
        self.pool.free(sequence.blocks)
        return len(sequence.blocks)

    def release_owner(self, owner: str) -> int:
        """Release every sequence of a dead or detached session; returns block references released."""
        sequence_ids = self._by_owner.pop(owner, None)
        if not sequence_ids:
            return 0
        released = 0
        # Newest first, so that forks give back their references before their parents.
        for sequence_id in sorted(sequence_ids, reverse=True):
            sequence = self._sequences.pop(sequence_id)
            self.pool.free(sequence.blocks)
            released += len(sequence.blocks)
        return released

    # ---------------------------------------------------------------- queries

    def blocks_available(self) -> int:
        """Free plus evictable cached blocks: the most an allocation could take now."""
        return self.pool.num_free

    def stats(self) -> LedgerStats:
        pool = self.pool
        return LedgerStats(
            blocks_total=self.num_blocks,
            blocks_free=pool.num_free - pool.num_cached,
            blocks_leased=self.num_blocks - pool.num_free,
            blocks_cached=pool.num_cached,
            sequences=len(self._sequences),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
        )

    def sequence_blocks(self, sequence_id: int) -> list[int]:
        """The block table of a live sequence (for tests and debugging)."""
        sequence = self._sequences.get(sequence_id)
        if sequence is None:
            raise UnknownSequence(f"sequence {sequence_id} is not leased (never allocated or already released)")
        return [block.block_id for block in sequence.blocks]

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the ledger or the pool."""
        self.pool.check_invariants()
        block_size = self.block_size
        table_count = [0] * self.num_blocks
        for sequence_id, sequence in self._sequences.items():
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
            if sequence_id not in self._by_owner.get(sequence.owner, ()):
                raise AssertionError(f"sequence {sequence_id} is missing from its owner's index")
            if sequence.num_tokens % block_size and sequence.blocks[-1].ref_count != 1:
                raise AssertionError(
                    f"sequence {sequence_id}'s partial last block {sequence.blocks[-1]!r} is shared; "
                    "writes into it would corrupt another sequence"
                )
        for block in self.pool.blocks:
            if block.ref_count != table_count[block.block_id]:
                raise AssertionError(
                    f"{block!r} is listed in {table_count[block.block_id]} block tables "
                    f"but has ref_count {block.ref_count}"
                )
        indexed = sum(len(ids) for ids in self._by_owner.values())
        if indexed != len(self._sequences):
            raise AssertionError(f"owner index lists {indexed} sequences, ledger holds {len(self._sequences)}")
        stats = self.stats()
        if stats.blocks_free + stats.blocks_leased + stats.blocks_cached != stats.blocks_total:
            raise AssertionError(f"free + leased + cached != total in {stats}")

    # ---------------------------------------------------------------- internals

    def _owned(self, owner: str, sequence_id: int) -> _Sequence:
        sequence = self._sequences.get(sequence_id)
        if sequence is None:
            raise UnknownSequence(f"sequence {sequence_id} is not leased (never allocated or already released)")
        if sequence.owner != owner:
            raise NotOwner(f"sequence {sequence_id} belongs to session {sequence.owner!r}, not {owner!r}")
        return sequence

    def _forget(self, owner: str, sequence_id: int) -> None:
        del self._sequences[sequence_id]
        owned = self._by_owner[owner]
        owned.discard(sequence_id)
        if not owned:
            del self._by_owner[owner]
