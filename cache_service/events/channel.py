"""One KV events endpoint's view: the hashes its subscribers were told of, and the events not yet sent.

A router keeps one set of block hashes per worker and knows nothing of models: the same
tokens cached by two models of one pool are one hash to it. So a channel counts the
copies it sees of each hash, per medium, and tells its subscribers of a hash when its
first copy is stored and when its last copy goes. The device pool ("GPU") counts
registered pool blocks; the host and disk tiers ("CPU", "STORAGE") count their copies.

An endpoint serves every model (``model`` None) or one served model name; which copies a
channel sees is the event log's business (``block_event_log.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from cache_service.events.vllm_block_hash import external, salt_extra_keys


class EventChannel:
    def __init__(self, model: str | None, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.copies: dict[int, int] = {}  # published hash -> registered pool blocks holding it
        self.tier_copies: dict[tuple[int, str], int] = {}  # (published hash, medium) -> tier copies
        self.pending: list[KvEvent] = []

    def empty(self) -> bool:
        """Whether the subscribers were told of nothing still cached, in any medium."""
        return not self.copies and not self.tier_copies

    def cleared(self) -> None:
        self.copies.clear()
        self.tier_copies.clear()
        self.pending.append(AllBlocksCleared())

    def stored_chain(self, new_indices: Sequence[int], digests: Sequence[bytes], token_ids: Sequence[int],
                     cache_salt: str, lora_name: str | None = None) -> None:
        """Pool blocks ``new_indices`` of a chain (``digests``, one per full block of
        ``token_ids``) were registered, by a sequence of the LoRA adapter ``lora_name`` (None:
        the base): one BlockStored per run of consecutive blocks whose hash is new to the
        subscribers."""
        copies = self.copies
        run: list[int] = []
        for index in new_indices:
            published = external(digests[index])
            seen = copies.get(published, 0)
            copies[published] = seen + 1
            if seen:
                self._flush(run, digests, token_ids, cache_salt, lora_name)
                run = []
                continue
            if run and run[-1] != index - 1:
                self._flush(run, digests, token_ids, cache_salt, lora_name)
                run = []
            run.append(index)
        self._flush(run, digests, token_ids, cache_salt, lora_name)

    def stored_block(self, digest: bytes, parent: bytes | None, token_ids: Sequence[int], cache_salt: str,
                     lora_name: str | None = None) -> None:
        """One registered pool block (``parent`` None: the first of its chain), told on its own."""
        published = external(digest)
        seen = self.copies.get(published, 0)
        self.copies[published] = seen + 1
        if not seen:
            self.pending.append(BlockStored(
                block_hashes=[published], parent_block_hash=external(parent) if parent is not None else None,
                token_ids=list(token_ids), block_size=self.block_size, lora_name=lora_name,
                extra_keys=[salt_extra_keys(cache_salt) if parent is None else None],
            ))

    def lost(self, digests: Sequence[bytes]) -> list[int]:
        """Registered pool blocks of ``digests`` left the cache: the hashes whose last copy went."""
        copies = self.copies
        gone = []
        for digest in digests:
            published = external(digest)
            left = copies[published] - 1
            if left:
                copies[published] = left
            else:
                del copies[published]
                gone.append(published)
        return gone

    def removed(self, hashes: list[int]) -> None:
        if hashes:
            self.pending.append(BlockRemoved(block_hashes=hashes))

    def tier_stored(self, digest: bytes, token_ids: Sequence[int], medium: str, lora_name: str | None = None) -> None:
        key = (external(digest), medium)
        seen = self.tier_copies.get(key, 0)
        self.tier_copies[key] = seen + 1
        if not seen:
            self.pending.append(BlockStored(block_hashes=[key[0]], parent_block_hash=None, token_ids=list(token_ids),
                                            block_size=self.block_size, medium=medium, lora_name=lora_name))

    def tier_removed(self, digest: bytes, medium: str) -> None:
        key = (external(digest), medium)
        left = self.tier_copies[key] - 1
        if left:
            self.tier_copies[key] = left
        else:
            del self.tier_copies[key]
            self.pending.append(BlockRemoved(block_hashes=[key[0]], medium=medium))

    def drain(self) -> list[KvEvent]:
        events, self.pending = self.pending, []
        return events

    def _flush(self, run: list[int], digests: Sequence[bytes], token_ids: Sequence[int], cache_salt: str,
               lora_name: str | None) -> None:
        if not run:
            return
        block_size = self.block_size
        first, last = run[0], run[-1]
        self.pending.append(BlockStored(
            block_hashes=[external(digests[index]) for index in run],
            parent_block_hash=external(digests[first - 1]) if first else None,
            token_ids=list(token_ids[first * block_size : (last + 1) * block_size]),
            block_size=block_size, lora_name=lora_name,
            extra_keys=[salt_extra_keys(cache_salt) if index == 0 else None for index in run],
        ))
