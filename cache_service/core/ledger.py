"""The lease ledger: sequences and their owners on top of the block pool.

The gRPC servicer calls only this. Every public method is atomic: it validates and
checks that enough blocks are available before it changes anything, so a refused call
leaves the ledger exactly as it was.

An owner is the session a sequence was leased to; the ledger only compares owner
strings and names them in error messages, so pass an id that is not a secret. Each
owner is bounded (SessionLimits): one session cannot grow the ledger until the process
dies, and an op past a limit fails alone.

A sequence's namespace (model fingerprint, cache_salt) picks the prefix cache it reads
and feeds: sequences of other models or salts never share a cached block.

Who holds what (the sequences by id, owner and model, and the limits) is sequences.py's
``Sequences``, ``ledger.sequences``: this module decides what each op does to the blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache_service.events.block_event_log import BlockEventLog
from cache_service.blocks.block_pool import Block, BlockPool
from cache_service.blocks.prefix_hash import DEFAULT_NAMESPACE, HashFn, Namespace
from cache_service.core.ledger_invariants import check_ledger
from cache_service.core.ledger_records import (
    DEFAULT_MAX_SESSION_BLOCKS, DEFAULT_MAX_SESSION_SEQUENCES, Allocation, Fork, InvalidLease, LeaseError,
    LedgerStats, LimitExceeded, ModelUsage, NoFreeBlocks, NotOwner, SessionLimits, UnknownSequence,
)
from cache_service.core.sequences import LeasedSequence, Sequences

if TYPE_CHECKING:
    from cache_service.tiers.kv_tiers import KvTiers
    from cache_service.tiers.tier_index import TierEntry

# The records and errors live in ledger_records.py; callers import them from here too.
__all__ = [
    "DEFAULT_MAX_SESSION_BLOCKS", "DEFAULT_MAX_SESSION_SEQUENCES", "Allocation", "Fork", "InvalidLease", "LeaseError",
    "Ledger", "LedgerStats", "LimitExceeded", "ModelUsage", "NoFreeBlocks", "NotOwner", "SessionLimits",
    "UnknownSequence",
]


class Ledger:
    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = hash,
                 limits: SessionLimits = SessionLimits(), events: BlockEventLog | None = None) -> None:
        self.pool = BlockPool(num_blocks, block_size, hash_fn)
        # Told what the prefix cache gains and loses, for KV events (None: events are off).
        self.events = events
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Who holds what (sequences by id, owner and model), within the per-session limits.
        self.sequences = Sequences(limits)
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._blocks_truncated = 0
        # The host and disk tiers (cache_service/tiers), when the service has them: set
        # once, right after construction, by the pool.
        self.tiers: KvTiers | None = None

    # ---------------------------------------------------------------- leasing

    def allocate(self, owner: str, num_tokens: int, prompt_token_ids: Sequence[int] = (),
                 namespace: Namespace = DEFAULT_NAMESPACE, lora_name: str = "") -> Allocation:
        """Lease blocks for a new sequence of ``num_tokens`` tokens.

        With ``prompt_token_ids``, the longest cached chain of the prompt's full blocks in
        ``namespace`` is reused, but never the block holding the last prompt token: the
        model must compute that token's logits, and it must not write into a shared block.
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
        tiers = self.tiers
        hits: list[Block] = []
        entries: list[TierEntry] = []
        if prompt_len > block_size:
            if tiers is None:
                hits = pool.lookup(prompt_token_ids, (prompt_len - 1) // block_size, namespace)
            else:
                chain, payloads = tiers.promotions.prepare(tiers.promotions.lookup(prompt_token_ids, (prompt_len - 1) // block_size, namespace))
                hits = [hit for hit in chain if type(hit) is Block]
                if len(hits) < len(chain):
                    entries = [hit for hit in chain if type(hit) is not Block]
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
        # After the pool's own check: what the pool cannot hold is NO_FREE_BLOCKS (the
        # engine waits), whatever the session holds.
        self.sequences.check_limits(owner, 1, needed, f"a sequence of {num_tokens} tokens")
        cached_host = cached_disk = cached_remote = 0
        if entries:
            # The chain interleaves pool blocks and tier entries: each entry gets a fresh
            # block in its place, with its K/V copied in before anyone can see it.
            pool.acquire(hits)
            taken = self._take(fresh)
            promoted = taken[:len(entries)]
            fresh_blocks = iter(promoted)
            blocks = [hit if type(hit) is Block else next(fresh_blocks) for hit in chain] + taken[len(entries):]
            cached_host, cached_disk, cached_remote = tiers.promotions.promote(entries, payloads, promoted)
            if self.events is not None:
                keys = self.events.adopted(namespace[0], namespace[1], prompt_token_ids, blocks[:len(chain)], promoted,
                                           lora_name or None)
                for entry, key in zip(entries, keys):
                    entry.event_key = entry.event_key or key  # a tier removal of it is told from now on
            hits = chain
        elif hits:
            pool.acquire(hits)
            blocks = hits + self._take(fresh)
        else:
            blocks = self._take(fresh)
        cached_tokens = len(hits) * block_size
        self._prefix_queries += prompt_len
        self._prefix_hits += cached_tokens
        model = self.sequences.model(namespace[0])
        model.blocks_leased += fresh + revived  # the hits already leased were counted already
        model.prefix_queries += prompt_len
        model.prefix_hits += cached_tokens
        sequence_id = self.sequences.add(LeasedSequence(owner, num_tokens, blocks, namespace, lora_name))
        return Allocation(sequence_id, [block.block_id for block in blocks], cached_tokens, cached_host, cached_disk,
                          cached_remote)

    def extend(self, owner: str, sequence_id: int, num_tokens: int) -> list[int]:
        """Grow a sequence to ``num_tokens`` tokens; returns only the newly appended block ids."""
        sequence = self.sequences.owned(owner, sequence_id)
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
        self.sequences.check_limits(owner, 0, more, f"extending sequence {sequence_id} to {num_tokens} tokens")
        new_blocks = self._take(more)
        sequence.blocks += new_blocks
        sequence.num_tokens = num_tokens
        self.sequences.resized(owner, len(new_blocks))
        self.sequences.model(sequence.namespace[0]).blocks_leased += len(new_blocks)
        return [block.block_id for block in new_blocks]

    def fork(self, owner: str, sequence_id: int, num_tokens: int = 0) -> Fork:
        """A child of the parent's first ``num_tokens`` tokens (0: all it reserved).

        ``num_tokens`` is what the parent has written, which decides copy-on-write: the
        child shares every full block of it, and gets a copy of the block holding the
        last written token when that block is partial, since both will write into it.
        Deciding from the reserved length instead would share a block the parent is
        still writing into whenever the reservation ends on a block boundary.
        """
        parent = self.sequences.owned(owner, sequence_id)
        pool = self.pool
        block_size = self.block_size
        written = num_tokens or parent.num_tokens
        capacity = len(parent.blocks) * block_size
        if written > capacity:
            raise InvalidLease(
                f"fork of sequence {sequence_id} at {written} tokens: its {len(parent.blocks)} blocks hold "
                f"at most {capacity}"
            )
        full, partial = divmod(written, block_size)
        table_len = full + (partial != 0)
        if partial and pool.num_free < 1:
            raise NoFreeBlocks(
                f"forking sequence {sequence_id} needs 1 free block for its partial last block; "
                f"0 of {self.num_blocks} are free or evictable"
            )
        self.sequences.check_limits(owner, 1, table_len, f"forking sequence {sequence_id}")
        shared = parent.blocks[:full]
        pool.acquire(shared)
        copy = None
        if partial:
            new_block = self._take(1)[0]
            copy = (parent.blocks[full].block_id, new_block.block_id)
            blocks = shared + [new_block]
            self.sequences.model(parent.namespace[0]).blocks_leased += 1
        else:
            blocks = shared
        child_id = self.sequences.add(LeasedSequence(owner, written, blocks, parent.namespace, parent.lora_name))
        return Fork(child_id, [block.block_id for block in blocks], copy)

    def truncate(self, owner: str, sequence_id: int, num_tokens: int) -> int:
        """Shrink a live sequence to ``num_tokens`` tokens; the blocks past them go back to
        the pool as free blocks (never as prefix cache). Returns how many.

        For blocks whose slots hold nothing the holder will keep (speculative decoding's
        rejected tokens). Refused when a block it would drop, or a partial block it would
        end in, is registered in the prefix cache or shared: their tokens are committed,
        and the holder would write over a shared block's slots.
        """
        sequence = self.sequences.owned(owner, sequence_id)
        if not 1 <= num_tokens <= sequence.num_tokens:
            raise InvalidLease(f"truncate of sequence {sequence_id} to {num_tokens} tokens: it must keep from 1 "
                               f"to its {sequence.num_tokens} tokens (extend grows a sequence)")
        block_size = self.block_size
        keep = (num_tokens + block_size - 1) // block_size
        # From the block the cut ends in when it ends within one, else from the first dropped.
        first_touched = keep - 1 if num_tokens % block_size else keep
        for index in range(len(sequence.blocks) - 1, first_touched - 1, -1):
            block = sequence.blocks[index]
            if block.block_hash is not None or block.ref_count > 1:
                raise InvalidLease(
                    f"truncate of sequence {sequence_id} to {num_tokens} tokens: its block {block.block_id} "
                    f"(tokens {index * block_size} to {(index + 1) * block_size - 1}) is "
                    f"{'in the prefix cache' if block.block_hash is not None else 'shared with another sequence'}; "
                    f"truncate to {(index + 1) * block_size} tokens or more")
        dropped = sequence.blocks[keep:]
        del sequence.blocks[keep:]
        sequence.num_tokens = num_tokens
        self.sequences.resized(owner, -len(dropped))
        self.sequences.model(sequence.namespace[0]).blocks_leased -= self.pool.free(dropped)
        self._blocks_truncated += len(dropped)
        return len(dropped)

    def release(self, owner: str, sequence_id: int, cache_prefix: bool = False, token_ids: Sequence[int] = ()) -> int:
        """End a sequence; returns how many block references it gave back (its table length).

        With ``cache_prefix`` and the sequence's ``token_ids``, its full blocks stay in the
        pool as evictable prefix cache instead of becoming plain free.
        """
        sequence = self.sequences.owned(owner, sequence_id)
        # The holder writes K/V into any slot of its blocks, not only the num_tokens it
        # asked for last (it extends only when it crosses a block boundary).
        capacity = len(sequence.blocks) * self.block_size
        if cache_prefix and len(token_ids) > capacity:
            raise InvalidLease(
                f"release of sequence {sequence_id}: {len(token_ids)} token ids given but its "
                f"{len(sequence.blocks)} blocks hold at most {capacity} tokens"
            )
        if cache_prefix and token_ids:
            self._register(sequence, token_ids)
            if self.tiers is not None:
                self.tiers.registered(sequence.blocks[:len(token_ids) // self.block_size])
        self.sequences.forget(owner, sequence_id)
        self._free(sequence)
        return len(sequence.blocks)

    def commit(self, owner: str, sequence_id: int, token_ids: Sequence[int]) -> int:
        """Register the full blocks of a live sequence holding ``token_ids`` in the prefix
        cache now, while it keeps them leased; returns how many were newly registered.

        The holder names only tokens whose K/V is written, so that a sequence allocated
        meanwhile with the same prefix shares the blocks instead of computing them again.
        The blocks stay leased; releasing the sequence later leaves them cached as usual.
        """
        sequence = self.sequences.owned(owner, sequence_id)
        capacity = len(sequence.blocks) * self.block_size
        if len(token_ids) > capacity:
            raise InvalidLease(
                f"commit of sequence {sequence_id}: {len(token_ids)} token ids given but its "
                f"{len(sequence.blocks)} blocks hold at most {capacity} tokens"
            )
        registered = self._register(sequence, token_ids)
        if self.tiers is not None:
            self.tiers.committed(sequence.blocks[:len(token_ids) // self.block_size])
        return registered

    def _register(self, sequence: LeasedSequence, token_ids: Sequence[int]) -> int:
        tiers = self.tiers
        registered = self.pool.register(sequence.blocks, token_ids, sequence.namespace,
                                        tiers.index.get if tiers is not None else None)
        if self.events is not None:
            fingerprint, salt = sequence.namespace
            self.events.registered(fingerprint, salt, token_ids, sequence.blocks, registered, sequence.lora_name or None)
        return registered

    def reset_prefix_cache(self, fingerprint: str | None = None) -> tuple[int, int]:
        """Drops the cached blocks (held by no sequence) of model ``fingerprint`` (None:
        every model) from the prefix cache; returns (blocks dropped, registered blocks kept
        because sequences hold them). Lookups of those prefixes miss from now on."""
        dropped, kept = self.pool.drop_cached(fingerprint)
        if self.events is not None:
            self.events.reset(dropped)
        return len(dropped), kept

    def release_owner(self, owner: str) -> int:
        """Release every sequence of a dead or detached session; returns block references released."""
        released, _ = self.release_owner_some(owner, None)
        return released

    def release_owner_some(self, owner: str, max_blocks: int | None) -> tuple[int, bool]:
        """Release whole sequences of ``owner`` until about ``max_blocks`` block references
        are given back (None: all). Returns (references released, whether none is left).

        For the event loop's sake: a session of millions of references is released a
        chunk per call, and the ledger is consistent between calls.
        """
        return self.sequences.drain(owner, max_blocks, self._free)

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
            sequences=len(self.sequences.by_id),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            blocks_truncated=self._blocks_truncated,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant of the ledger, the pool or the tiers."""
        check_ledger(self)

    # ---------------------------------------------------------------- internals

    def _take(self, count: int) -> list[Block]:
        taken = self.pool.take(count)
        if self.events is not None:
            self.events.taken(taken)  # the registered ones among them are evicted
        return taken

    def _free(self, sequence: LeasedSequence) -> None:
        """Gives back the block references of a sequence just forgotten."""
        self.sequences.model(sequence.namespace[0]).blocks_leased -= self.pool.free(sequence.blocks)
