"""Rebuilding the disk tier's index at start-up from the block files of this KV geometry.

Each file names its parent by digest; chains are rebuilt from their first blocks down,
so an entry is indexed only if every block before it is. reg_ids are new (they are per
process); hashes are recomputed with this process's hash function (a namespace's str
hash changes between processes). A file whose digest does not follow from its parent,
namespace and tokens, or whose namespace differs from its parent's, is skipped with a
warning; files no chain reaches (their parent was evicted or skipped) are removed.
"""

from __future__ import annotations

from collections import defaultdict

import structlog

from cache_service.blocks.block_pool import BlockPool
from cache_service.blocks.prefix_hash import namespace_root
from cache_service.tiers.disk_tier import BlockRecord, DiskTier
from cache_service.tiers.tier_index import DISK, ROOT_PARENT, TierEntry, TierIndex, chain_digest

log = structlog.get_logger()


def restore_disk_index(disk: DiskTier, index: TierIndex, pool: BlockPool) -> int:
    """Indexes the disk tier's files; returns how many blocks it holds."""
    children: dict[bytes, list[BlockRecord]] = defaultdict(list)
    records = disk.scan()
    for record in records:
        if chain_digest(record.parent_digest, record.namespace, record.token_ids) != record.digest:
            log.warning("disk_cache_file_skipped", path=str(disk.path(record.digest)),
                        reason="its digest does not follow from its parent, namespace and tokens")
            continue
        children[record.parent_digest].append(record)
    loaded = 0
    # (parent digest, parent entry or None for a chain's first block)
    frontier: list[tuple[bytes, TierEntry | None]] = [(ROOT_PARENT, None)]
    while frontier:
        parent_digest, parent = frontier.pop()
        for record in children.pop(parent_digest, ()):
            if parent is not None and record.namespace != parent.namespace:
                log.warning("disk_cache_file_skipped", path=str(disk.path(record.digest)),
                            reason="its namespace differs from its parent's")
                continue
            if disk.used_bytes + record.size > disk.capacity_bytes:
                disk.path(record.digest).unlink(missing_ok=True)  # --disk-cache-bytes was lowered
                continue
            parent_hash = namespace_root(record.namespace, pool.hash_fn) if parent is None else parent.block_hash
            block_hash = pool.hash_fn((parent_hash, record.token_ids))
            if index.get(block_hash) is not None:
                continue  # a hash collision between two files: the first one keeps the hash
            entry = TierEntry(block_hash, record.token_ids, 0 if parent is None else parent.reg_id, pool.new_reg_id(),
                              record.namespace, record.digest, record.parent_digest, on_disk=True)
            entry.on_disk = True
            index.put(entry, DISK)
            disk.added(record.digest, record.size)
            loaded += 1
            frontier.append((record.digest, entry))
    orphans = [record for group in children.values() for record in group]
    for record in orphans:
        disk.path(record.digest).unlink(missing_ok=True)
    log.info("disk_cache_restored", folder=str(disk.folder), blocks=loaded, bytes=disk.used_bytes,
             unreachable_removed=len(orphans))
    return loaded
