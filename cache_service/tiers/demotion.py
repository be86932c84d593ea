"""Demotion, off the Lease path: registered blocks copied down the tiers, pool to host to disk.

Demotion is write-behind. A release that registers blocks in the prefix cache queues
them (``enqueue``); a background task copies queued blocks into the host tier a chunk at
a time in a worker thread (or, without a host tier, copies them out for the disk), and
host blocks pushed out for room are written to disk in a worker thread too. A registered
block's K/V never changes while it stays registered (only full blocks are registered, and
nobody writes into a full block), so a copy made any time before eviction is the block.
The task checks on the event loop, before and after the copy, that the block still has
the registration it was queued with: a block taken for reuse loses it for good (a new
registration gets a new reg_id), so a copy that passes the second check was made before
anyone could write into the block. Eviction in the pool (``BlockPool.take``) then needs
no copy and no hook: the pool drops its entry and the tier's stays. A Lease call never
waits for a demotion.

The tiers themselves (the index, the host slots, the disk folder, the counters) are
``KvTiers``'s; promotion, the way up, is ``promotion.py``'s; this holds what is on its way down.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
import torch

from pagedkv.thread_priority import lower_this_thread
from cache_service.blocks.block_pool import Block, BlockPool
from cache_service.events.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
from cache_service.tiers.copy_queue import CopyQueue
from cache_service.tiers.counters import TierCounters
from cache_service.tiers.device_copies import BlockMover
from cache_service.tiers.disk_tier import BlockRecord, DiskFull, DiskTier, file_bytes
from cache_service.tiers.host_tier import HostTier
from cache_service.tiers.tier_index import DISK, HOST, ROOT_PARENT, TierEntry, TierIndex, chain_digest

log = structlog.get_logger()

# Blocks copied to the host tier per event-loop turn: a Lease call waits behind at most one chunk.
DEMOTE_CHUNK_BLOCKS = 16
# Blocks staged in host memory for the disk writer at most (plus one demotion's worth):
# past it, demotions wait for the writes, so a slow disk cannot fill the host with copies.
MAX_STAGED_BLOCKS = 64
# A full disk is retried after this long; demotions to disk stop meanwhile.
DISK_FULL_BACKOFF_S = 30.0
# Digests of recently demoted blocks, so a child finds its parent's while the parent is still on its way to disk.
RECENT_DIGESTS = 65536
# Nice value of the demotions' worker thread (Linux: per thread), relative to the service's.
WORKER_NICENESS = 10

# A tier copy stored (True) or removed (False), told as a KV event of its medium.
TellEntry = Callable[[TierEntry, str, bool], None]


def _lower_priority() -> None:
    lower_this_thread(WORKER_NICENESS)


@dataclass(slots=True, eq=False)
class _Demotion:
    """One chunk of demotions, between choosing it on the event loop and indexing it there."""

    blocks: list[Block] = field(default_factory=list)
    entries: list[TierEntry] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    victims: list[tuple[TierEntry, int]] = field(default_factory=list)  # host entries pushed out, their slots
    victim_payloads: list[torch.Tensor] = field(default_factory=list)
    payloads: list[torch.Tensor] = field(default_factory=list)  # without a host tier: the blocks' bytes
    seconds: float = 0.0


class Demotions:
    def __init__(self, *, pool: BlockPool, pool_tensor: torch.Tensor, index: TierIndex, host: HostTier | None,
                 disk: DiskTier | None, mover: BlockMover | None, copies: CopyQueue | None,
                 counters: dict[str, TierCounters], bytes_per_block: int, clock: Callable[[], float],
                 event_key_of: Callable[[int], object], tell: TellEntry) -> None:
        """The tiers are KvTiers's (``mover`` and ``copies``: a CUDA pool's, else None);
        ``event_key_of``: a block id's KV-event key (None while events are off)."""
        self.pool, self.pool_tensor, self.index = pool, pool_tensor, index
        self.host, self.disk, self.mover, self.copies = host, disk, mover, copies
        self.counters, self.bytes_per_block, self.clock = counters, bytes_per_block, clock
        self.event_key_of, self.tell = event_key_of, tell
        self.failed_steps = 0  # steps of the background task that raised (logged, counted in errors too)
        self.missed_demotions = 0  # queued blocks evicted (or re-registered) before their copy
        self.queue: deque[tuple[int, int]] = deque(maxlen=max(pool.num_blocks, 1024))  # (block id, reg_id)
        self.disk_queue: deque[tuple[TierEntry, torch.Tensor]] = deque()
        self.disk_full_until = 0.0
        self.writing = 0  # disk writes in flight
        self.reserved_slots = 0  # host slots a demotion in flight is copying into
        self.copying = 0  # blocks of the demotion in flight
        self._recent: OrderedDict[int, bytes | None] = OrderedDict()
        self._wake = asyncio.Event()
        # One thread for the copies and the disk writes, at a lower CPU priority than the
        # event loop's: on a busy machine the Lease calls get the cores first.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers", initializer=_lower_priority)

    def enqueue(self, blocks: list[Block]) -> None:
        """Queues the registered ones of ``blocks`` (parents before children) for demotion."""
        queue = self.queue
        for block in blocks:
            if block.block_hash is not None:
                queue.append((block.block_id, block.reg_id))
        if queue:
            self._wake.set()

    def blocks_queued(self, tier: str) -> int:
        """Blocks on their way into ``tier`` (HOST or DISK): queued or being copied (or written)."""
        from_pool = len(self.queue) + self.copying
        if tier == HOST:
            return from_pool if self.host is not None else 0
        if self.disk is None:
            return 0
        return len(self.disk_queue) + self.writing + (from_pool if self.host is None else 0)

    def forget_disk(self, entry: TierEntry) -> None:
        """Removes ``entry``'s file and its place in the disk tier."""
        self.disk.remove(entry.digest)
        self.index.drop(entry, DISK)
        self.tell(entry, MEDIUM_STORAGE, False)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def run(self, after_step: Callable[[], None] | None) -> None:
        """The background task: demote a chunk, write a block to disk, yield; sleep when idle.
        ``after_step`` (the pool's KV-event publishing) runs after each step, so that the tier
        copies made between Lease calls reach subscribers without waiting for one."""
        while True:
            if not self.queue and not self.disk_queue:
                self._wake.clear()
                await self._wake.wait()
            try:
                if len(self.disk_queue) < MAX_STAGED_BLOCKS:
                    await self.demote_some_async(DEMOTE_CHUNK_BLOCKS)
                await self.write_some()
                if after_step is not None:
                    after_step()
            except Exception:
                # Never the end of the task: the blocks of this step are lost (counted), the rest go on.
                self.failed_steps += 1
                self.counters[HOST if self.host is not None else DISK].errors += 1
                log.exception("kv_tier_step_failed", failed_steps=self.failed_steps)
            await asyncio.sleep(0)

    def demote_some(self, limit: int) -> int:
        """Copies up to ``limit`` queued blocks to the next tier (host, or staged for disk), inline."""
        batch = self._begin_demotion(limit)
        if batch is None:
            return 0
        try:
            if self.copies is not None:
                self.copies.submit(self._copy, batch).result()
            else:
                self._copy(batch)
        except BaseException:
            self._abandon(batch)
            raise
        return self._finish_demotion(batch)

    async def demote_some_async(self, limit: int) -> int:
        """``demote_some`` with the copy in a worker thread, so Lease calls run meanwhile."""
        batch = self._begin_demotion(limit)
        if batch is None:
            return 0
        self.copying = len(batch.blocks)
        try:
            if self.copies is not None:
                await asyncio.wrap_future(self.copies.submit(self._copy, batch))
            else:
                await asyncio.get_running_loop().run_in_executor(self._worker, self._copy, batch)
        except BaseException:
            self._abandon(batch)
            raise
        finally:
            self.copying = 0
        return self._finish_demotion(batch)

    def _abandon(self, batch: _Demotion) -> None:
        """A demotion whose copy failed: its blocks stay where they are, its host slots are
        free again, and the host entries it pushed out are lost."""
        self.missed_demotions += len(batch.blocks)
        if batch.slots:
            self.host.free_slots.extend(batch.slots)
            self.reserved_slots -= len(batch.slots)
        if batch.victims and self.disk is not None:
            self.counters[DISK].evictions += len(batch.victims)

    def _begin_demotion(self, limit: int) -> _Demotion | None:
        """Picks queued blocks still registered as when queued, and host slots for them."""
        if self.host is not None:
            limit = min(limit, self.host.num_slots)
        pool, index = self.pool, self.index
        batch = _Demotion()
        while self.queue and len(batch.blocks) < limit:
            block_id, reg_id = self.queue.popleft()
            block = pool.blocks[block_id]
            if block.block_hash is None or block.reg_id != reg_id:
                self.missed_demotions += 1
                continue
            known = index.get(block.block_hash)
            if known is not None:
                if known.reg_id == reg_id:
                    index.touch(known)
                continue  # another identity under this hash (a collision): the tier keeps its own
            parent_digest = ROOT_PARENT if block.parent_reg == 0 else self._digest_of(block.parent_reg)
            digest = None if parent_digest is None else chain_digest(parent_digest, block.namespace, block.token_ids)
            self._remember(reg_id, digest)
            entry = TierEntry(block.block_hash, block.token_ids, block.parent_reg, reg_id, block.namespace, digest,
                              parent_digest)
            entry.event_key = self.event_key_of(block_id)
            batch.blocks.append(block)
            batch.entries.append(entry)
        if not batch.blocks:
            return None
        if self.host is not None:
            batch.slots = [self._host_slot(batch) for _ in batch.blocks]
            self.reserved_slots += len(batch.slots)
        return batch

    def _copy(self, batch: _Demotion) -> None:
        """The copies (any thread): host victims out first, then the pool blocks in."""
        started = self.clock()
        host = self.host
        batch.victim_payloads = [host.read(slot) for _, slot in batch.victims]
        block_ids = [block.block_id for block in batch.blocks]
        if host is not None:
            host.store(self.pool_tensor, block_ids, batch.slots)
        elif self.mover is not None:
            # Staged in host memory, whole when to_host returns: _finish_demotion's check of each
            # block's registration comes after its copy, and the disk writer gets bytes it can encode.
            batch.payloads = []
            self.mover.to_host(block_ids, lambda _, block: batch.payloads.append(block.clone()))
        else:
            batch.payloads = [self.pool_tensor[:, :, block_id].clone() for block_id in block_ids]
        batch.seconds = self.clock() - started

    def _finish_demotion(self, batch: _Demotion) -> int:
        """Indexes what was copied, unless its block was evicted (and maybe rewritten) meanwhile."""
        index = self.index
        for (victim, _), payload in zip(batch.victims, batch.victim_payloads):
            self._stage_for_disk(victim, payload)
        done = 0
        for position, (block, entry) in enumerate(zip(batch.blocks, batch.entries)):
            if block.block_hash != entry.block_hash or block.reg_id != entry.reg_id or index.get(entry.block_hash):
                self.missed_demotions += 1
                if batch.slots:
                    self.host.free_slots.append(batch.slots[position])
                continue
            done += 1
            if self.host is not None:
                entry.host_slot = batch.slots[position]
                index.put(entry, HOST)
                self.tell(entry, MEDIUM_CPU, True)
            elif self.disk is not None:
                self._stage_for_disk(entry, batch.payloads[position])
        if self.host is not None:
            self.reserved_slots -= len(batch.slots)
            counters = self.counters[HOST]
            counters.seconds_in += batch.seconds
            counters.demotions += done
            counters.bytes_in += done * self.bytes_per_block
        self._wake.set()
        return done

    async def write_some(self) -> None:
        """Writes one staged block to disk in a worker thread; the ledger is not touched meanwhile."""
        if not self.disk_queue:
            return
        entry, payload = self.disk_queue.popleft()
        disk, counters = self.disk, self.counters[DISK]
        size = file_bytes(disk.geometry, entry.namespace)
        if self.clock() < self.disk_full_until or size > disk.capacity_bytes:
            counters.evictions += 1
            return
        while disk.used_bytes + size > disk.capacity_bytes:
            victim = self.index.coldest(DISK)
            if victim is None:
                break
            self.forget_disk(victim)
            counters.evictions += 1
        record = BlockRecord(entry.digest, entry.parent_digest, entry.namespace, entry.token_ids, size)
        started = self.clock()
        self.writing += 1
        try:
            written = await asyncio.get_running_loop().run_in_executor(self._worker, disk.write, record, payload)
        except DiskFull as error:
            self.disk_full_until = self.clock() + DISK_FULL_BACKOFF_S
            counters.errors += 1
            log.warning("disk_cache_full", folder=str(disk.folder), error=str(error), retry_in_s=DISK_FULL_BACKOFF_S,
                        staged_dropped=len(self.disk_queue))
            self.disk_queue.clear()
            return
        except Exception as error:  # OSError, or anything else: this block is not written, the next ones are
            counters.errors += 1
            log.warning("disk_cache_write_failed", folder=str(disk.folder), error=str(error),
                        error_type=type(error).__name__)
            return
        finally:
            self.writing -= 1
        counters.seconds_in += self.clock() - started
        counters.demotions += 1
        counters.bytes_in += self.bytes_per_block
        # The identity the hash has now. While this copy was in no index (on its way from
        # the host tier, or staged from the pool), the pool may have computed the block
        # again and registered it under a new reg_id; a tier entry beside it under the old
        # one would break the one-identity-per-hash rule, so the pool's wins.
        known = self.index.get(entry.block_hash)
        in_pool = self.pool.cached.get(entry.block_hash)
        current_reg = known.reg_id if known is not None else in_pool.reg_id if in_pool is not None else entry.reg_id
        if current_reg != entry.reg_id:
            if entry.digest not in disk.sizes:
                disk.path(entry.digest).unlink(missing_ok=True)  # the hash went to another identity meanwhile
            return
        if known is None:
            known = entry
        elif known.on_disk:
            return  # written twice: the same bytes under the same name
        known.digest, known.parent_digest = entry.digest, entry.parent_digest
        known.event_key = known.event_key or entry.event_key
        known.on_disk = True
        self.index.put(known, DISK)
        disk.added(entry.digest, written)
        self.tell(known, MEDIUM_STORAGE, True)

    def _host_slot(self, batch: _Demotion) -> int:
        """A free host slot, pushing the coldest host entry out (to disk when it can go) if none is."""
        host = self.host
        if host.free_slots:
            return host.free_slots.pop()
        victim = self.index.coldest(HOST)
        slot = victim.host_slot
        self.counters[HOST].evictions += 1
        if self.disk is not None and not victim.on_disk:
            batch.victims.append((victim, slot))  # read out in _copy, before the slot is overwritten
        self.index.drop(victim, HOST)
        self.tell(victim, MEDIUM_CPU, False)
        return slot

    def _stage_for_disk(self, entry: TierEntry, payload: torch.Tensor) -> None:
        if entry.digest is None or self.clock() < self.disk_full_until:
            self.counters[DISK].evictions += 1  # its chain's start is gone: a file of it could never be found
            return
        self.disk_queue.append((entry, payload))

    def _digest_of(self, reg_id: int) -> bytes | None:
        entry = self.index.by_reg.get(reg_id)
        if entry is not None:
            return entry.digest
        return self._recent.get(reg_id)

    def _remember(self, reg_id: int, digest: bytes | None) -> None:
        self._recent[reg_id] = digest
        if len(self._recent) > RECENT_DIGESTS:
            self._recent.popitem(last=False)
