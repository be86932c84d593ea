"""The KV tiers beyond the device pool: the host-memory, disk and remote tiers, the index
of what each holds, and the two ways between them and the pool.

Demotion is write-behind (``demotion.py``): a release that registers blocks in the
prefix cache queues them, and a background task copies them down the tiers. A Lease call
never waits for a demotion. Promotion happens inside the Lease calls (``promotion.py``):
a prompt's prefix found in a tier is copied back into the pool before the reply counts it.

The remote tier shared by replicas (``remote_tier.py``, with --remote-kv) indexes
nothing here: a block registered or released is offered to its writer (``committed``,
``registered``), and promotion asks the store for the rest of each prompt's chain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
import torch

from cache_service.events.block_event_log import BlockEventLog
from cache_service.blocks.block_pool import Block, BlockPool
from cache_service.events.kv_events import MEDIUM_REMOTE, MEDIUM_STORAGE
from cache_service.tiers.copy_queue import CopyQueue
from cache_service.tiers.counters import TierCounters
from cache_service.tiers.demotion import Demotions
from cache_service.tiers.promotion import Promotions
from cache_service.tiers.device_copies import BlockMover
from cache_service.tiers.disk_folder import DiskFolder
from cache_service.tiers.disk_tier import DiskGeometry, DiskTier
from cache_service.tiers.host_tier import HostTier
from cache_service.tiers.remote_backends import open_store, parse_remote_url
from cache_service.tiers.remote_store import load_remote_key
from cache_service.tiers.remote_tier import REMOTE, RemoteTier
from cache_service.tiers.restore import restore_disk_index
from cache_service.tiers.settings import TierSettings
from cache_service.tiers.tier_index import DISK, HOST, TierEntry, TierIndex

log = structlog.get_logger()


class KvTiers:
    def __init__(self, pool: BlockPool, pool_tensor: torch.Tensor, settings: TierSettings,
                 bytes_per_block: int, geometry: DiskGeometry, clock=time.monotonic,
                 events: BlockEventLog | None = None, disk_folder: DiskFolder | None = None,
                 remote_key: bytes | None = None) -> None:
        """``disk_folder``: the opened --disk-cache-dir (the service opens it at start-up);
        None with a disk tier: opened here, and closed by ``close``. ``remote_key``: the
        --remote-kv-key-file's key (the service reads it at start-up); None: read here."""
        self.pool = pool
        self.pool_tensor = pool_tensor
        self.settings = settings
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self.events = events  # told of tier copies stored and removed, for KV events (None: off)
        self.index = TierIndex()
        self._own_folder = None
        self.disk = None
        self.mover = self.copies = self.host = self.remote = None
        try:
            if settings.disk_cache_dir:
                if disk_folder is None:
                    disk_folder = self._own_folder = DiskFolder(settings.disk_cache_dir, settings.disk_cache_key_file)
                self.disk = DiskTier(disk_folder, settings.disk_cache_bytes, geometry)
            # A CUDA pool's copies: batched through pinned staging, in a thread of their own (device_copies.py).
            if pool_tensor.is_cuda:
                self.mover = BlockMover(pool_tensor, pool_tensor[:, :, 0].nbytes)
                self.copies = CopyQueue(pool_tensor.device)
            host_slots = settings.host_cache_bytes // bytes_per_block
            self.host = HostTier(pool_tensor, host_slots, self.mover) if host_slots else None
            if settings.remote_kv:
                key = remote_key if remote_key is not None else load_remote_key(settings.remote_kv_key_file)
                store = open_store(parse_remote_url(settings.remote_kv), settings.remote_kv_timeout_ms / 1000)
                self.remote = RemoteTier(store, key, geometry, settings.remote_kv_queue_blocks,
                                         settings.remote_kv_timeout_ms / 1000, clock, self._tell_remote)
        except BaseException:
            if self.mover is not None:
                self.mover.close()
            if self._own_folder is not None:
                self._own_folder.close()
            raise
        if self.mover is not None:
            device_bytes, pinned_bytes = self.mover.staging_bytes
            log.info("kv_tiers_cuda_staging", device_bytes=device_bytes, pinned_host_bytes=pinned_bytes,
                     pinned_host_tier_bytes=self.host.tensor.nbytes if self.host is not None else 0)
        self.counters = {HOST: TierCounters(), DISK: TierCounters(),
                         REMOTE: self.remote.counters if self.remote is not None else TierCounters()}
        self.demotions = Demotions(pool=pool, pool_tensor=pool_tensor, index=self.index, host=self.host,
                                   disk=self.disk, mover=self.mover, copies=self.copies, counters=self.counters,
                                   bytes_per_block=bytes_per_block, clock=clock,
                                   event_key_of=self._event_key_of, tell=self._event)
        self.promotions = Promotions(pool=pool, pool_tensor=pool_tensor, index=self.index, host=self.host,
                                     disk=self.disk, remote=self.remote, mover=self.mover, copies=self.copies,
                                     counters=self.counters, bytes_per_block=bytes_per_block, clock=clock,
                                     forget_disk=self.demotions.forget_disk)
        if self.disk is not None:
            restore_disk_index(self.disk, self.index, pool)
            if events is not None:
                self._tell_restored()

    # -- hooks the ledger calls (promotion's are ``promotions``') ------------------------

    def committed(self, blocks: list[Block]) -> None:
        """A live sequence registered ``blocks`` (its full blocks from its first) in the
        prefix cache: offer them to the remote tier now, so that another replica finds them
        while this one still decodes (the local tiers take blocks only once released)."""
        if self.remote is not None:
            self.remote.offer(blocks, self.events.key_of if self.events is not None else None)

    def registered(self, blocks: list[Block]) -> None:
        """A release left ``blocks`` (a sequence's full blocks) in the prefix cache: queue the
        registered ones for demotion, parents before children."""
        self.committed(blocks)  # the remote tier skips the blocks it was offered before
        if self.host is not None or self.disk is not None:
            self.demotions.enqueue(blocks)

    # -- off the Lease path ------------------------------------------------------------

    async def run(self, after_step: Callable[[], None] | None = None) -> None:
        """The background task: demotions (``Demotions.run``), and the remote tier's writer
        beside them, as long as they run; ``after_step`` (the pool's KV-event publishing)
        runs after each step of either."""
        writer = None
        if self.remote is not None:
            writer = asyncio.get_running_loop().create_task(
                self.remote.run(self._copy_out, self._still_registered, after_step))
        try:
            await self.demotions.run(after_step)
        finally:
            if writer is not None:
                writer.cancel()

    def _still_registered(self, block_id: int, reg_id: int) -> bool:
        block = self.pool.blocks[block_id]
        return block.block_hash is not None and block.reg_id == reg_id

    def _copy_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        """(a worker thread) The blocks' bytes, copied into host memory, for the remote tier."""
        if self.mover is None:
            return [self.pool_tensor[:, :, block_id].clone() for block_id in block_ids]
        out: list[torch.Tensor] = []
        self.copies.submit(self.mover.to_host, block_ids, lambda _, block: out.append(block.clone())).result()
        return out

    def close(self) -> None:
        """Stops the worker threads (after what they are doing) and unlocks a folder opened here."""
        if self.remote is not None:
            self.remote.close()
        self.demotions.close()
        self.promotions.close()
        if self.copies is not None:
            self.copies.close()  # the copies in flight finish before their pinned memory is released
            if self.host is not None:
                self.host.close()
            self.mover.close()
        if self._own_folder is not None:
            self._own_folder.close()

    # -- accounting ----------------------------------------------------------------------

    def blocks_total(self, tier: str) -> int:
        if tier == REMOTE:
            return 0  # the store's, shared with every replica: not known here
        if tier == HOST:
            return self.host.num_slots if self.host is not None else 0
        return self.disk.capacity_blocks if self.disk is not None else 0

    def blocks_queued(self, tier: str) -> int:
        """Blocks on their way into ``tier``: queued or being copied (or written)."""
        if tier == REMOTE:
            return len(self.remote.queue) + self.remote.writing if self.remote is not None else 0
        return self.demotions.blocks_queued(tier)

    def check_invariants(self) -> None:
        host_slots = self.host.num_slots if self.host is not None else 0
        self.index.check_invariants(self.pool.block_size, host_slots)
        if self.host is not None:
            used = {entry.host_slot for entry in self.index.lru[HOST].values()}
            free = set(self.host.free_slots)
            if used & free or len(used) + len(free) + self.demotions.reserved_slots != host_slots \
                    or len(free) != len(self.host.free_slots):
                raise AssertionError(f"host tier: {len(used)} used and {len(free)} free slots of {host_slots}")
        for block_hash, entry in self.index.entries.items():
            block = self.pool.cached.get(block_hash)
            if block is not None and block.reg_id != entry.reg_id:
                raise AssertionError(f"hash {block_hash} has reg_id {block.reg_id} in the pool, {entry.reg_id} in a tier")
        if self.disk is not None:
            on_disk = {entry.digest for entry in self.index.lru[DISK].values()}
            if on_disk != set(self.disk.sizes) or self.disk.used_bytes != sum(self.disk.sizes.values()):
                raise AssertionError("disk tier: the files counted differ from the entries indexed on disk")
            if self.disk.used_bytes > self.disk.capacity_bytes:
                raise AssertionError(f"disk tier holds {self.disk.used_bytes} bytes, past {self.disk.capacity_bytes}")

    # -- internals -----------------------------------------------------------------------

    def _tell_restored(self) -> None:
        """The blocks found on disk at start-up as KV events ("STORAGE"): their keys are
        computed down each chain (the index holds parents before children, as restored)."""
        by_reg = self.index.by_reg
        for entry in list(self.index.entries.values()):
            parent = by_reg.get(entry.parent_reg) if entry.parent_reg else None
            if entry.parent_reg and (parent is None or parent.event_key is None):
                continue
            fingerprint, salt = entry.namespace
            entry.event_key = self.events.chain_key(fingerprint, salt, parent.event_key if parent else None,
                                                    entry.token_ids)
            self._event(entry, MEDIUM_STORAGE, stored=True)

    def _event_key_of(self, block_id: int) -> object:
        return self.events.key_of(block_id) if self.events is not None else None

    def _event(self, entry: TierEntry, medium: str, stored: bool) -> None:
        """Tells the KV events of a tier copy of ``entry`` stored or removed."""
        self._tell(entry.event_key, entry.token_ids, medium, stored)

    def _tell_remote(self, key, token_ids: tuple[int, ...], stored: bool) -> None:
        self._tell(key, token_ids, MEDIUM_REMOTE, stored)

    def _tell(self, key, token_ids: tuple[int, ...], medium: str, stored: bool) -> None:
        if self.events is None or key is None:
            return  # events off, or a copy of a block whose registration events never saw
        if stored:
            self.events.tier_stored(key, token_ids, medium)
        else:
            self.events.tier_removed(key, medium)
