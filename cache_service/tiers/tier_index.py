"""The prefix index of the KV tiers: registered blocks kept in host memory or on disk.

An entry keeps the identity its block had in the device pool (hash, token ids, parent
``reg_id``, its own ``reg_id``, namespace), so a chain that leaves the pool and continues
in a tier is matched under exactly the pool's rules (``BlockPool.lookup``): equal stored
tokens, equal parent identity, equal namespace on a chain's first block. One entry per
hash; the same identity may be on the device too (a tier keeps a copy, the pool the
original), never another identity under the same hash.

``digest`` is the entry's identity across restarts: sha256 over the parent's digest and
the block's tokens, rooted in the namespace. Python's hash of a namespace (a str) changes
with each process, reg_ids are per process, the digest is not; only an entry with a
digest can go to disk.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from cache_service.blocks.prefix_hash import Namespace

HOST = "host"
DISK = "disk"
TIERS = (HOST, DISK)
ROOT_PARENT = b"\0" * 32  # parent digest of a chain's first block


def root_digest(namespace: Namespace) -> bytes:
    fingerprint, salt = namespace
    return hashlib.sha256(b"pagedkv-kv-root\0" + fingerprint.encode() + b"\0" + salt.encode()).digest()


def chain_digest(parent_digest: bytes, namespace: Namespace, token_ids: tuple[int, ...]) -> bytes:
    """The digest of a block after ``parent_digest`` (ROOT_PARENT: the first block of ``namespace``)."""
    parent = root_digest(namespace) if parent_digest == ROOT_PARENT else parent_digest
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


@dataclass(slots=True, eq=False)
class TierEntry:
    block_hash: int
    token_ids: tuple[int, ...]
    parent_reg: int
    reg_id: int
    namespace: Namespace
    digest: bytes | None = None
    parent_digest: bytes | None = None
    host_slot: int | None = None
    on_disk: bool = False
    event_key: tuple[str, bytes] | None = None  # the pool block's KV-event key, when events are on
    # A block read from the remote tier for one Lease call: in no tier of this index, promoted or forgotten.
    remote: bool = False

    @property
    def tier(self) -> str:
        """Where a promotion reads it from: host memory when it is there."""
        return HOST if self.host_slot is not None else DISK

    def matches(self, parent_reg: int, chunk: tuple[int, ...], namespace: Namespace) -> bool:
        return (self.parent_reg == parent_reg and self.token_ids == chunk
                and (parent_reg != 0 or self.namespace == namespace))


class TierIndex:
    def __init__(self) -> None:
        self.entries: dict[int, TierEntry] = {}  # block hash -> entry
        self.by_reg: dict[int, TierEntry] = {}
        # Least recently used first; a hit moves an entry to the end.
        self.lru: dict[str, OrderedDict[int, TierEntry]] = {HOST: OrderedDict(), DISK: OrderedDict()}

    def get(self, block_hash: int) -> TierEntry | None:
        return self.entries.get(block_hash)

    def count(self, tier: str) -> int:
        return len(self.lru[tier])

    def put(self, entry: TierEntry, tier: str) -> None:
        """Records that ``entry`` is now held in ``tier`` (adding it to the index if new)."""
        known = self.entries.get(entry.block_hash)
        if known is None:
            self.entries[entry.block_hash] = entry
            self.by_reg[entry.reg_id] = entry
        elif known is not entry:
            raise AssertionError(f"two tier entries for hash {entry.block_hash}")
        self.lru[tier][entry.block_hash] = entry

    def touch(self, entry: TierEntry) -> None:
        for tier in TIERS:
            lru = self.lru[tier]
            if entry.block_hash in lru:
                lru.move_to_end(entry.block_hash)

    def coldest(self, tier: str) -> TierEntry | None:
        lru = self.lru[tier]
        return next(iter(lru.values())) if lru else None

    def drop(self, entry: TierEntry, tier: str) -> None:
        """``entry`` is no longer in ``tier``; it leaves the index when no tier holds it."""
        self.lru[tier].pop(entry.block_hash, None)
        if tier == HOST:
            entry.host_slot = None
        else:
            entry.on_disk = False
        if entry.host_slot is None and not entry.on_disk and self.entries.get(entry.block_hash) is entry:
            del self.entries[entry.block_hash]
            del self.by_reg[entry.reg_id]

    def check_invariants(self, block_size: int, host_slots: int) -> None:
        slots = [entry.host_slot for entry in self.lru[HOST].values()]
        if None in slots or len(set(slots)) != len(slots) or any(not 0 <= slot < host_slots for slot in slots):
            raise AssertionError(f"host tier slots are not distinct slots of {host_slots}: {slots}")
        for tier in TIERS:
            for block_hash, entry in self.lru[tier].items():
                if self.entries.get(block_hash) is not entry:
                    raise AssertionError(f"{tier} tier holds hash {block_hash} that the index maps elsewhere")
        for block_hash, entry in self.entries.items():
            if entry.block_hash != block_hash or self.by_reg.get(entry.reg_id) is not entry:
                raise AssertionError(f"tier entry {entry} is indexed under another hash or reg_id")
            if len(entry.token_ids) != block_size:
                raise AssertionError(f"tier entry {entry} does not hold one full block of token ids")
            held = (entry.host_slot is not None) + entry.on_disk
            if not held or (entry.host_slot is not None) != (block_hash in self.lru[HOST]) \
                    or entry.on_disk != (block_hash in self.lru[DISK]):
                raise AssertionError(f"tier entry {entry} is in no tier or its tier lists disagree")
        if len(self.by_reg) != len(self.entries):
            raise AssertionError("tier reg_id index and hash index differ in size")
