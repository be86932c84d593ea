"""The prefix cache's changes as vLLM KV events, kept until the servicer publishes them.

The ledger reports two things and knows nothing of events: which blocks a release
registered (``registered``) and which blocks an allocation took from the free list
(``taken``: a registered block taken is evicted). This log mirrors the prefix cache in
vLLM's hashes (``vllm_block_hash.py``), keyed by (model fingerprint, digest), so it
needs nothing from the block pool's internals:

- A release's newly registered blocks are the first ``count`` of its full blocks that
  were not registered before, in chain order: ``BlockPool.register`` registers a run of
  blocks after those already cached and stops at the first it cannot register.
- Only those are hashed; a block registered earlier keeps its digest here, so a
  release that extends a cached prefix hashes its new blocks only (~11 µs each).
- The KV tiers (``cache_service/tiers``) report their copies with ``tier_stored`` and
  ``tier_removed`` under the key the pool block had: a demotion is a ``BlockStored`` with
  medium "CPU" (host) or "STORAGE" (disk), the pool's eviction its usual "GPU" removal.

The router sees one set of hashes per worker, without the model: two models of one
pool caching the same tokens store one hash, so a hash is published when its first copy
is stored and removed when its last copy goes.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from cache_service.vllm_block_hash import block_hash, external, none_hash, salt_extra_keys

Key = tuple[str, bytes]  # (model fingerprint, vLLM digest of the block's chain)


class BlockEventLog:
    def __init__(self, block_size: int, root: bytes | None = None) -> None:
        self.block_size = block_size
        self.root = none_hash() if root is None else root
        self._by_block: dict[int, Key] = {}  # registered block id -> its key
        self._keys: set[Key] = set()
        self._copies: dict[int, int] = {}  # published hash -> registered blocks holding it
        self._pending: list[KvEvent] = []

    def cleared(self) -> None:
        """A new, empty pool: consumers drop what they knew of this worker."""
        self._by_block.clear()
        self._keys.clear()
        self._copies.clear()
        self._pending.append(AllBlocksCleared())

    def registered(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], blocks: Sequence,
                   count: int) -> None:
        """``count`` blocks of ``blocks`` (block objects holding ``token_ids`` in order) were
        newly registered in the prefix cache of namespace (``fingerprint``, ``cache_salt``)."""
        if count <= 0:
            return
        block_size = self.block_size
        by_block = self._by_block
        keys = self._keys
        full = min(len(token_ids) // block_size, len(blocks))
        parent = self.root
        digests: list[bytes] = []
        new_indices: list[int] = []
        for index in range(full):
            block_id = blocks[index].block_id
            known = by_block.get(block_id)
            if known is not None:
                digest = known[1]  # this block is the cached copy: its digest is known
            else:
                chunk = token_ids[index * block_size : (index + 1) * block_size]
                digest = block_hash(parent, chunk, salt_extra_keys(cache_salt) if index == 0 else None)
                key = (fingerprint, digest)
                if key not in keys:  # not cached before, so this block is the new copy
                    by_block[block_id] = key
                    keys.add(key)
                    new_indices.append(index)
            digests.append(digest)
            parent = digest
            if len(new_indices) == count:
                break  # nothing after the registered run was registered
        self._stored(new_indices, digests, token_ids, cache_salt)

    def taken(self, blocks: Sequence) -> None:
        """``blocks`` left the free list for new leases: the registered ones are evicted."""
        by_block = self._by_block
        if not by_block:
            return
        removed = []
        for block in blocks:
            key = by_block.pop(block.block_id, None)
            if key is None:
                continue
            self._keys.discard(key)
            published = external(key[1])
            copies = self._copies[published] - 1
            if copies:
                self._copies[published] = copies
            else:
                del self._copies[published]
                removed.append(published)
        if removed:
            self._pending.append(BlockRemoved(block_hashes=removed))

    def key_of(self, block_id: int) -> Key | None:
        """The key of a registered pool block (None if events never saw it registered)."""
        return self._by_block.get(block_id)

    def tier_stored(self, key: Key, token_ids: Sequence[int], medium: str) -> None:
        """A copy of the block of ``key`` is now in a KV tier (``medium`` "CPU" or "STORAGE")."""
        self._pending.append(BlockStored(block_hashes=[external(key[1])], parent_block_hash=None,
                                         token_ids=list(token_ids), block_size=self.block_size, medium=medium))

    def tier_removed(self, key: Key, medium: str) -> None:
        """The KV tier ``medium`` no longer holds the block of ``key``."""
        self._pending.append(BlockRemoved(block_hashes=[external(key[1])], medium=medium))

    def drain(self) -> list[KvEvent]:
        """The events since the last drain, oldest first."""
        events, self._pending = self._pending, []
        return events

    def registered_blocks(self) -> int:
        return len(self._by_block)

    def _stored(self, new_indices: list[int], digests: list[bytes], token_ids: Sequence[int], cache_salt: str) -> None:
        # One BlockStored per run of consecutive blocks whose hash is new to consumers.
        copies = self._copies
        run: list[int] = []
        for index in new_indices:
            published = external(digests[index])
            seen = copies.get(published, 0)
            copies[published] = seen + 1
            if seen:
                self._flush(run, digests, token_ids, cache_salt)
                run = []
                continue
            if run and run[-1] != index - 1:
                self._flush(run, digests, token_ids, cache_salt)
                run = []
            run.append(index)
        self._flush(run, digests, token_ids, cache_salt)

    def _flush(self, run: list[int], digests: list[bytes], token_ids: Sequence[int], cache_salt: str) -> None:
        if not run:
            return
        block_size = self.block_size
        first, last = run[0], run[-1]
        self._pending.append(BlockStored(
            block_hashes=[external(digests[index]) for index in run],
            parent_block_hash=external(digests[first - 1]) if first else None,
            token_ids=list(token_ids[first * block_size : (last + 1) * block_size]),
            block_size=block_size,
            extra_keys=[salt_extra_keys(cache_salt) if index == 0 else None for index in run],
        ))
