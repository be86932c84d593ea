"""The prefix cache's changes as vLLM KV events, kept until the servicer publishes them.

The ledger reports two things and knows nothing of events: which blocks a release
registered (``registered``) and which blocks an allocation took from the free list
(``taken``: a registered block taken is evicted); a ResetPrefixCache reports the blocks
it dropped (``reset``). This log mirrors the prefix cache in vLLM's hashes
(``vllm_block_hash.py``), keyed by (model fingerprint, digest), so it needs nothing from
the block pool's internals:

- A release's newly registered blocks are the first ``count`` of its full blocks that
  were not registered before, in chain order: ``BlockPool.register`` registers a run of
  blocks after those already cached and stops at the first it cannot register.
- Only those are hashed; a block registered earlier keeps its digest here, so a
  release that extends a cached prefix hashes its new blocks only (sha256 over CBOR, far
  dearer than the pool's own hash, so never twice for one block).
- The KV tiers (``cache_service/tiers``) report their copies with ``tier_stored`` and
  ``tier_removed`` under the key the pool block had: a demotion is a ``BlockStored`` with
  medium "CPU" (host) or "STORAGE" (disk), the pool's eviction its usual "GPU" removal.
  A promotion registers pool blocks without a release (``adopted``): they are stored on
  "GPU" again at once, and known here, so the release that follows does not count them
  among its new blocks. The tier keeps its copy, so no tier removal goes with it.

Each endpoint is a channel (``channel.py``): every model's blocks, or one served
model name's. A router takes one event source per worker and a worker serves one name,
so a block belongs to a name's channel when its model fingerprint is served under that
name by some session, now or earlier (``serves``, at Attach). The fingerprint, not the
session that registered the block, is the key: sessions of one checkpoint share its
prefix cache, so a block registered under one name is a hit for every name of that
checkpoint, and each of their channels tells of it. A name newly seen for a fingerprint
catches up: its channel is told of every block that fingerprint already holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cache_service.events.channel import EventChannel
from cache_service.events.kv_events import MEDIUM_CPU, MEDIUM_REMOTE, MEDIUM_STORAGE, KvEvent
from cache_service.events.vllm_block_hash import block_hash, none_hash, salt_extra_keys

Key = tuple[str, bytes]  # (model fingerprint, vLLM digest of the block's chain)


@dataclass(slots=True)
class _Registered:
    """A registered pool block as its channels were told of it."""

    key: Key
    token_ids: Sequence[int]
    parent: bytes | None  # the digest before it in its chain (None: the chain's first block)
    cache_salt: str
    lora_name: str | None = None  # the adapter of the sequence that registered it (None: the base)


class BlockEventLog:
    def __init__(self, block_size: int, root: bytes | None = None, models: Iterable[str | None] = (None,)) -> None:
        """``models``: one channel per entry, None for every model's blocks."""
        self.block_size = block_size
        self.root = none_hash() if root is None else root
        self.channels = {model: EventChannel(model, block_size) for model in models}
        self._by_block: dict[int, _Registered] = {}  # registered block id -> what was told of it
        self._keys: set[Key] = set()
        self._tier: dict[tuple[Key, str], tuple[Sequence[int], int]] = {}  # (key, medium) -> (token ids, copies)
        self._served: dict[str, set[str]] = {}  # fingerprint -> the names sessions served it under
        self._routes: dict[str, list[EventChannel]] = {}  # fingerprint -> the channels that see its blocks
        # Key -> the LoRA adapter whose sequence registered it, for the tiers' events of its
        # copies; kept while the pool or a tier holds the key.
        self._lora_names: dict[Key, str] = {}

    def serves(self, fingerprint: str, served_model_name: str) -> None:
        """A session serves the checkpoint ``fingerprint`` under ``served_model_name`` (Attach)."""
        names = self._served.setdefault(fingerprint, set())
        if not served_model_name or served_model_name in names:
            return
        names.add(served_model_name)
        self._routes.pop(fingerprint, None)
        channel = self.channels.get(served_model_name)
        if channel is None:
            return
        for entry in self._by_block.values():  # registration order: parents before children
            if entry.key[0] == fingerprint:
                channel.stored_block(entry.key[1], entry.parent, entry.token_ids, entry.cache_salt, entry.lora_name)
        for (key, medium), (token_ids, copies) in self._tier.items():
            if key[0] == fingerprint:
                for _ in range(copies):
                    channel.tier_stored(key[1], token_ids, medium, self._lora_names.get(key))

    def cleared(self) -> None:
        """A new, empty pool: consumers drop what they knew of this worker."""
        self._by_block.clear()
        self._keys.clear()
        self._tier.clear()
        self._lora_names.clear()
        for channel in self.channels.values():
            channel.cleared()

    def registered(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], blocks: Sequence,
                   count: int, lora_name: str | None = None) -> None:
        """``count`` blocks of ``blocks`` (block objects holding ``token_ids`` in order) were
        newly registered in the prefix cache of namespace (``fingerprint``, ``cache_salt``),
        by a sequence of the LoRA adapter ``lora_name`` (None: the base model)."""
        if count <= 0:
            return
        full = min(len(token_ids) // self.block_size, len(blocks))
        digests: list[bytes] = []
        new_indices: list[int] = []
        for index in range(full):
            digest, known = self._digest(blocks[index], index, digests, token_ids, cache_salt)
            # A block not known is the new copy unless its key was cached before.
            if not known and self._note(fingerprint, digest, blocks[index], index, digests, token_ids, cache_salt,
                                        lora_name):
                new_indices.append(index)
            digests.append(digest)
            if len(new_indices) == count:
                break  # nothing after the registered run was registered
        self._tell_stored(fingerprint, new_indices, digests, token_ids, cache_salt, lora_name)

    def adopted(self, fingerprint: str, cache_salt: str, token_ids: Sequence[int], blocks: Sequence,
                adopted: Sequence, lora_name: str | None = None) -> list[Key]:
        """A promotion registered ``adopted`` (some of ``blocks``, the chain of
        ``token_ids``'s first full blocks, in order) with K/V copied in from a KV tier.
        Returns their keys, in order."""
        adopted_ids = {block.block_id for block in adopted}
        digests: list[bytes] = []
        new_indices: list[int] = []
        out: list[Key] = []
        for index, block in enumerate(blocks):
            if len(out) == len(adopted_ids):
                break
            digest, known = self._digest(block, index, digests, token_ids, cache_salt)
            if block.block_id in adopted_ids:
                out.append((fingerprint, digest))
                if not known and self._note(fingerprint, digest, block, index, digests, token_ids, cache_salt,
                                            lora_name):
                    new_indices.append(index)
            digests.append(digest)
        self._tell_stored(fingerprint, new_indices, digests, token_ids, cache_salt, lora_name)
        return out

    def _digest(self, block, index: int, digests: list[bytes], token_ids: Sequence[int],
                cache_salt: str) -> tuple[bytes, bool]:
        """(the digest of the chain's block ``index``, whether this log knows the block):
        a known block's digest is its registration's; another is hashed from its tokens
        after ``digests``, the chain's digests so far."""
        known = self._by_block.get(block.block_id)
        if known is not None:
            return known.key[1], True
        chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
        parent = digests[-1] if index else self.root
        return block_hash(parent, chunk, salt_extra_keys(cache_salt) if index == 0 else None), False

    def _note(self, fingerprint: str, digest: bytes, block, index: int, digests: list[bytes],
              token_ids: Sequence[int], cache_salt: str, lora_name: str | None = None) -> bool:
        """Records ``block`` as the registered copy of its key, unless the key was cached
        before (then another block is its copy); returns whether it was recorded."""
        key = (fingerprint, digest)
        if key in self._keys:
            return False
        # The pool's own tuple of the block's tokens: nothing copied per block.
        tokens = block.token_ids if block.token_ids is not None else tuple(
            token_ids[index * self.block_size : (index + 1) * self.block_size])
        self._by_block[block.block_id] = _Registered(key, tokens, digests[-1] if index else None, cache_salt,
                                                     lora_name)
        self._keys.add(key)
        if lora_name:
            self._lora_names[key] = lora_name
        return True

    def _tell_stored(self, fingerprint: str, new_indices: list[int], digests: list[bytes],
                     token_ids: Sequence[int], cache_salt: str, lora_name: str | None = None) -> None:
        if new_indices:
            for channel in self._route(fingerprint):
                channel.stored_chain(new_indices, digests, token_ids, cache_salt, lora_name)

    def chain_key(self, fingerprint: str, cache_salt: str, parent: Key | None, token_ids: Sequence[int]) -> Key:
        """The key of a block of ``token_ids`` after the block of ``parent`` (None: a chain's
        first block), for copies the pool never registered (the disk tier's after a restart)."""
        if parent is None:
            return fingerprint, block_hash(self.root, token_ids, salt_extra_keys(cache_salt))
        return fingerprint, block_hash(parent[1], token_ids)

    def taken(self, blocks: Sequence) -> None:
        """``blocks`` left the free list for new leases: the registered ones are evicted."""
        for channel, gone in self._lose(blocks):
            channel.removed(gone)

    def reset(self, blocks: Sequence) -> None:
        """ResetPrefixCache dropped ``blocks`` from the prefix cache. A channel left with
        nothing cached in any medium says AllBlocksCleared (exactly true there), any
        other a BlockRemoved."""
        for channel, gone in self._lose(blocks):
            if channel.empty():
                channel.cleared()
            else:
                channel.removed(gone)

    def key_of(self, block_id: int) -> Key | None:
        """The key of a registered pool block (None if events never saw it registered)."""
        entry = self._by_block.get(block_id)
        return entry.key if entry is not None else None

    def tier_stored(self, key: Key, token_ids: Sequence[int], medium: str) -> None:
        """A copy of the block of ``key`` is now in a KV tier (``medium`` "CPU" or "STORAGE")."""
        told, copies = self._tier.get((key, medium), (token_ids, 0))
        self._tier[(key, medium)] = (told, copies + 1)
        for channel in self._route(key[0]):
            channel.tier_stored(key[1], token_ids, medium, self._lora_names.get(key))

    def tier_removed(self, key: Key, medium: str) -> None:
        """The KV tier ``medium`` no longer holds the block of ``key``."""
        told = self._tier.get((key, medium))
        if told is None:
            return  # never told of: nothing to take back
        if told[1] > 1:
            self._tier[(key, medium)] = (told[0], told[1] - 1)
        else:
            del self._tier[(key, medium)]
            self._forget_name(key)
        for channel in self._route(key[0]):
            channel.tier_removed(key[1], medium)

    def drain(self, model: str | None = None) -> list[KvEvent]:
        """The events of ``model``'s channel (None: every model's) since its last drain, oldest first."""
        channel = self.channels.get(model)
        return channel.drain() if channel is not None else []

    def drain_all(self) -> dict[str | None, list[KvEvent]]:
        """Every channel's events since the last drain, for the channels that have some."""
        out = {}
        for model, channel in self.channels.items():
            if channel.pending:
                out[model] = channel.drain()
        return out

    def registered_blocks(self) -> int:
        return len(self._by_block)

    def _route(self, fingerprint: str) -> list[EventChannel]:
        route = self._routes.get(fingerprint)
        if route is None:
            names = self._served.get(fingerprint, ())
            route = [channel for model, channel in self.channels.items() if model is None or model in names]
            self._routes[fingerprint] = route
        return route

    def _forget_name(self, key: Key) -> None:
        """Drops the adapter name of ``key`` once neither the pool nor any tier holds it."""
        if key in self._lora_names and key not in self._keys and not any(
                (key, medium) in self._tier for medium in (MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_REMOTE)):
            del self._lora_names[key]

    def _lose(self, blocks: Sequence) -> list[tuple[EventChannel, list[int]]]:
        """Forgets the registered ones among ``blocks``; per channel, the hashes whose last copy went."""
        by_block = self._by_block
        if not by_block:
            return []
        lost: dict[str, list[bytes]] = {}
        for block in blocks:
            entry = by_block.pop(block.block_id, None)
            if entry is None:
                continue
            self._keys.discard(entry.key)
            self._forget_name(entry.key)
            lost.setdefault(entry.key[0], []).append(entry.key[1])
        per_channel: dict[EventChannel, list[bytes]] = {}
        for fingerprint, digests in lost.items():
            for channel in self._route(fingerprint):
                per_channel.setdefault(channel, []).extend(digests)
        return [(channel, gone) for channel, digests in per_channel.items() if (gone := channel.lost(digests))]
