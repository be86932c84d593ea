"""The KV tiers beyond the device pool: demotion behind the Lease calls, promotion inside them.

Demotion is write-behind. A release that registers blocks in the prefix cache queues
them; a background task copies queued blocks into the host tier a chunk at a time in a
worker thread (or, without a host tier, copies them out for the disk), and host blocks
pushed out for room are written to disk in a worker thread too. A registered block's K/V
never changes while it stays registered (only full blocks are registered, and nobody
writes into a full block), so a copy made any time before eviction is the block. The
task checks on the event loop, before and after the copy, that the block still has the
registration it was queued with: a block taken for reuse loses it for good (a new
registration gets a new reg_id), so a copy that passes the second check was made before
anyone could write into the block. Eviction in the
pool (``BlockPool.take``) then needs no copy and no hook: the pool drops its entry and
the tier's stays. A Lease call never waits for a demotion.

Promotion happens inside the Lease call, bounded by PROMOTE_MAX_BLOCKS per allocate
(the rest of the prompt is recomputed). Why not asynchronously: the reply's
``cached_tokens`` may count a block only once its bytes are in the pool, and doing the copy
before the reply keeps that true with no new state in the model service (a sequence
waiting on a copy, a second round trip); a host block is one memcpy (tens of µs), far
less than prefilling its tokens again. On CPU the copy is made inline; on CUDA it is
queued to the tiers' copy thread (``copy_queue.py``: batched, through pinned staging)
and the Lease call awaits it after applying its ops (``settled``), so the event loop
never waits on the device. Disk blocks are read before that, in a reader
thread while the event loop serves other calls (``read_ahead``): the Lease call awaits
the reads, then applies its ops with the blocks in hand (``reading_ahead``); a disk block
a call did not read ahead ends its hit there (recomputed), so the loop never reads a
file. Reads are checked (MACs, header) before the ledger changes anything, so a bad file
shortens the hit and never fails the call.

The remote tier shared by replicas (``remote_tier.py``, with --remote-kv) indexes
nothing here: a release offers its blocks to the remote writer (``registered``), and
``read_ahead`` asks the store for the rest of each prompt's chain past its local hit,
beside the disk reads. ``lookup`` continues a chain with the blocks read that way
(``_remote_hits``: entries in no tier, promoted as disk blocks are, or forgotten).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from pagedkv.thread_priority import lower_this_thread
from cache_service.events.block_event_log import BlockEventLog
from cache_service.blocks.block_pool import Block, BlockPool
from cache_service.events.kv_events import MEDIUM_CPU, MEDIUM_REMOTE, MEDIUM_STORAGE
from cache_service.blocks.prefix_hash import Namespace, namespace_root
from cache_service.tiers.copy_queue import CopyQueue
from cache_service.tiers.counters import TierCounters
from cache_service.tiers.device_copies import BlockMover
from cache_service.tiers.disk_folder import DiskFolder
from cache_service.tiers.disk_tier import BadBlockFile, BlockRecord, DiskFull, DiskGeometry, DiskTier, file_bytes
from cache_service.tiers.host_tier import HostTier
from cache_service.tiers.remote_backends import open_store, parse_remote_url
from cache_service.tiers.remote_store import load_remote_key
from cache_service.tiers.remote_tier import REMOTE, RemoteTier
from cache_service.tiers.remote_values import chain_digests
from cache_service.tiers.restore import restore_disk_index
from cache_service.tiers.settings import TierSettings
from cache_service.tiers.tier_index import DISK, HOST, ROOT_PARENT, TierEntry, TierIndex, chain_digest

log = structlog.get_logger()

# Blocks one allocate may promote; past it the prompt's remaining tokens are recomputed.
PROMOTE_MAX_BLOCKS = 256
# Blocks copied to the host tier per event-loop turn: a Lease call waits behind at most one chunk.
DEMOTE_CHUNK_BLOCKS = 16
# Blocks staged in host memory for the disk writer at most (plus one demotion's worth):
# past it, demotions wait for the writes, so a slow disk cannot fill the host with copies.
MAX_STAGED_BLOCKS = 64
# A full disk is retried after this long; demotions to disk stop meanwhile.
DISK_FULL_BACKOFF_S = 30.0
# Digests of recently demoted blocks, so a child finds its parent's while the parent is still on its way to disk.
RECENT_DIGESTS = 65536


# Nice value of the tiers' worker thread (Linux: per thread), relative to the service's.
WORKER_NICENESS = 10


def _lower_priority() -> None:
    lower_this_thread(WORKER_NICENESS)


@dataclass(slots=True)
class ReadAhead:
    """The blocks one Lease call read before applying its ops, by chain digest: from disk
    (a BadBlockFile for a bad file) and from the remote tier (checked already)."""

    disk: dict[bytes, torch.Tensor | BadBlockFile] = field(default_factory=dict)
    remote: dict[bytes, torch.Tensor] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.disk or self.remote)


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
        # Promotions' disk reads, at the service's priority: a Lease call waits on them.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers-read")
        # The blocks the Lease call applying its ops read ahead (None: no call is; a
        # direct user of the ledger, whose disk reads happen inline and who gets no remote block).
        self._read_ahead: ReadAhead | None = None
        if self.disk is not None:
            restore_disk_index(self.disk, self.index, pool)
            if events is not None:
                self._tell_restored()

    # -- hooks the ledger calls ----------------------------------------------------------

    def lookup(self, token_ids, max_blocks: int, namespace: Namespace) -> list[Block | TierEntry]:
        """The longest chain of ``token_ids``'s full blocks in the pool or a tier, up to
        ``max_blocks``, under the pool's exact-hit rules (see ``BlockPool.lookup``)."""
        pool = self.pool
        block_size = pool.block_size
        max_blocks = min(max_blocks, len(token_ids) // block_size)
        tokens = token_ids if type(token_ids) is tuple else tuple(token_ids)
        hash_fn = pool.hash_fn
        device_get, tier_get = pool.cached.get, self.index.entries.get
        parent_hash = namespace_root(namespace, hash_fn)
        parent_reg = 0
        hits: list[Block | TierEntry] = []
        for index in range(max(max_blocks, 0)):
            chunk = tokens[index * block_size : (index + 1) * block_size]
            parent_hash = hash_fn((parent_hash, chunk))
            hit = device_get(parent_hash)
            if hit is None or hit.parent_reg != parent_reg or hit.token_ids != chunk or (
                    parent_reg == 0 and hit.namespace != namespace):
                hit = tier_get(parent_hash)
                if hit is None or not hit.matches(parent_reg, chunk, namespace):
                    if self._read_ahead is not None and self._read_ahead.remote:
                        hits.extend(self._remote_hits(tokens, index, max_blocks, parent_hash, parent_reg, namespace))
                    break
            hits.append(hit)
            parent_reg = hit.reg_id
        return hits

    async def read_ahead(self, prompts: Sequence[tuple[Sequence[int], Namespace]]) -> ReadAhead:
        """Reads, in worker threads, the blocks that allocating each (prompt, namespace) of
        ``prompts`` now would promote from disk, and those of the rest of each chain the
        remote tier has (its wait bounded by --remote-kv-timeout-ms). At most
        PROMOTE_MAX_BLOCKS of each, as one allocate's promotion held before: the allocates
        of a call past it promote less and recompute the rest."""
        if self.disk is None and self.remote is None:
            return ReadAhead()
        block_size = self.pool.block_size
        records: dict[bytes, BlockRecord] = {}
        chains: list[list[bytes]] = []
        remote_budget = PROMOTE_MAX_BLOCKS
        for prompt, namespace in prompts:
            if len(prompt) <= block_size:
                continue
            max_blocks = (len(prompt) - 1) // block_size
            hits = self.lookup(prompt, max_blocks, namespace)
            if self.disk is not None:
                for entry in [hit for hit in hits if type(hit) is TierEntry][:PROMOTE_MAX_BLOCKS]:
                    if len(records) == PROMOTE_MAX_BLOCKS:
                        break
                    if entry.host_slot is None and entry.digest in self.disk.sizes:
                        records[entry.digest] = self._record(entry)
            if self.remote is not None and len(hits) < max_blocks and remote_budget > 0:
                last = min(max_blocks, len(hits) + remote_budget)
                chain = chain_digests(prompt, block_size, last, namespace)[len(hits):]
                chains.append(chain)
                remote_budget -= len(chain)
        loop = asyncio.get_running_loop()
        disk = loop.run_in_executor(self._reader, self._read_all, list(records.values())) if records else None
        remote = await self.remote.fetch(chains) if chains else {}
        return ReadAhead(await disk if disk is not None else {}, remote)

    def _read_all(self, records: list[BlockRecord]) -> dict[bytes, torch.Tensor | BadBlockFile]:
        """(the reader thread) Each record's block, or why it cannot be served."""
        out: dict[bytes, torch.Tensor | BadBlockFile] = {}
        for record in records:
            try:
                out[record.digest] = self.disk.read(record)
            except BadBlockFile as error:
                out[record.digest] = error
        return out

    @contextlib.contextmanager
    def reading_ahead(self, blocks: ReadAhead) -> Iterator[None]:
        """While the ops of one Lease call are applied (no await in between): promotions take
        their disk and remote blocks from ``blocks`` and read none."""
        self._read_ahead = blocks
        try:
            yield
        finally:
            self._read_ahead = None

    def prepare(self, hits: list[Block | TierEntry]) -> tuple[list[Block | TierEntry], list[int | torch.Tensor]]:
        """Cuts ``hits`` to what can be promoted now and reads the disk blocks among them.

        Returns the hits kept and, per tier entry kept, its host slot or its K/V read from
        disk. Changes no ledger state: the caller may still refuse the allocation.
        """
        kept: list[Block | TierEntry] = []
        payloads: list[int | torch.Tensor] = []
        for hit in hits:
            if type(hit) is TierEntry:
                if len(payloads) == PROMOTE_MAX_BLOCKS:
                    break
                if hit.host_slot is not None:
                    payloads.append(hit.host_slot)
                elif hit.remote:
                    payloads.append(self._read_ahead.remote[hit.digest])
                else:
                    started = self.clock()
                    payload = self._disk_block(hit)
                    if payload is None:
                        break
                    if not isinstance(payload, torch.Tensor):
                        log.warning("disk_cache_file_skipped", path=str(self.disk.path(hit.digest)), reason=str(payload))
                        self.counters[DISK].errors += 1
                        self._forget_disk(hit)
                        break
                    payloads.append(payload)
                    self.counters[DISK].seconds_out += self.clock() - started
            kept.append(hit)
        return kept, payloads

    def _disk_block(self, entry: TierEntry) -> torch.Tensor | BadBlockFile | None:
        """``entry``'s block as read ahead (None: not read ahead), or read now without a Lease call."""
        if self._read_ahead is not None:
            return self._read_ahead.disk.get(entry.digest)
        try:
            return self.disk.read(self._record(entry))
        except BadBlockFile as error:
            return error

    def promote(self, entries: list[TierEntry], payloads: list[int | torch.Tensor], blocks: list[Block]
                ) -> tuple[int, int, int]:
        """Copies promoted entries into their new device blocks and registers them under
        the entries' identity; returns (host, disk, remote tokens) the allocate got."""
        pool = self.pool
        host_count = sum(1 for payload in payloads if type(payload) is int)
        remote_count = sum(1 for entry in entries if entry.remote)
        disk_count = len(blocks) - host_count - remote_count
        block_ids = [block.block_id for block in blocks]
        if block_ids and self.copies is not None:
            # Queued, not done: the Lease call awaits ``settled`` before it replies.
            self.copies.promote(self._load, list(payloads), block_ids, host_count)
        elif block_ids:
            self._load(payloads, block_ids, host_count)
        for entry, block in zip(entries, blocks):
            if entry.block_hash not in pool.cached:
                pool.adopt(block, entry.block_hash, entry.token_ids, entry.parent_reg, entry.reg_id, entry.namespace)
            self.index.touch(entry)
        block_size = pool.block_size
        for tier, count in ((HOST, host_count), (DISK, disk_count), (REMOTE, remote_count)):
            if count:
                counters = self.counters[tier]
                counters.promotions += count
                counters.hit_tokens += count * block_size
                counters.bytes_out += count * self.bytes_per_block
        return host_count * block_size, disk_count * block_size, remote_count * block_size

    def _load(self, payloads: list[int | torch.Tensor], block_ids: list[int], host_count: int) -> None:
        """Copies promoted blocks (a host slot or a block read from disk each) into the pool
        (inline on CPU; in the copy thread on CUDA)."""
        started = self.clock()
        if self.mover is not None:
            host = self.host

            def fill(position: int, staged: torch.Tensor) -> None:
                payload = payloads[position]
                staged.copy_(host.tensor[:, :, payload] if type(payload) is int else payload)

            try:
                self.mover.from_host(block_ids, fill)
            except Exception:
                log.exception("kv_tier_promotion_copy_failed", blocks=len(block_ids))
                self.counters[HOST if host_count else DISK].errors += 1
                raise
        else:
            host_slots, host_ids = [], []
            for payload, block_id in zip(payloads, block_ids):
                if type(payload) is int:
                    host_slots.append(payload)
                    host_ids.append(block_id)
                else:
                    self.pool_tensor[:, :, block_id].copy_(payload)
            if host_slots:
                self.host.load(host_slots, self.pool_tensor, host_ids)
        if host_count:
            self.counters[HOST].seconds_out += (self.clock() - started) * host_count / len(block_ids)

    async def settled(self) -> None:
        """Returns once the promotions' copies made so far are in the pool (at once on CPU,
        where they are made inline); a Lease call awaits it before it replies."""
        if self.copies is not None:
            await self.copies.settled()

    def settle(self) -> None:
        """``settled`` for a direct user of the ledger, without an event loop."""
        if self.copies is not None:
            self.copies.settle()

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
        if self.host is None and self.disk is None:
            return
        queue = self.queue
        for block in blocks:
            if block.block_hash is not None:
                queue.append((block.block_id, block.reg_id))
        if queue:
            self._wake.set()

    # -- demotion, off the Lease path ----------------------------------------------------

    async def run(self, after_step: Callable[[], None] | None = None) -> None:
        """The background task: demote a chunk, write a block to disk, yield; sleep when idle.

        ``after_step`` (the pool's KV-event publishing) runs after each step, so that the
        tier copies made between Lease calls reach subscribers without waiting for one.
        The remote tier's writer runs beside it, as long as it does.
        """
        writer = None
        if self.remote is not None:
            writer = asyncio.get_running_loop().create_task(
                self.remote.run(self._copy_out, self._still_registered, after_step))
        try:
            await self._run_local(after_step)
        finally:
            if writer is not None:
                writer.cancel()

    async def _run_local(self, after_step: Callable[[], None] | None) -> None:
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
            if self.events is not None:
                entry.event_key = self.events.key_of(block_id)
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
                self._event(entry, MEDIUM_CPU, stored=True)
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
            self._forget_disk(victim)
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
        self._event(known, MEDIUM_STORAGE, stored=True)

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

    def _remote_hits(self, tokens: tuple[int, ...], start: int, max_blocks: int, block_hash: int, parent_reg: int,
                     namespace: Namespace) -> list[TierEntry]:
        """The chain's blocks from ``start`` on that this Lease call read from the remote
        tier, as entries in no tier (``block_hash``: block ``start``'s hash)."""
        pool = self.pool
        block_size = pool.block_size
        max_blocks = min(max_blocks, start + PROMOTE_MAX_BLOCKS)
        digests = chain_digests(tokens, block_size, max_blocks, namespace)
        remote = self._read_ahead.remote
        out: list[TierEntry] = []
        for index in range(start, max_blocks):
            chunk = tokens[index * block_size : (index + 1) * block_size]
            if index > start:
                block_hash = pool.hash_fn((block_hash, chunk))
            if digests[index] not in remote or block_hash in pool.cached or self.index.get(block_hash) is not None:
                break  # not read, or the hash has another identity here (a collision): recomputed
            entry = TierEntry(block_hash, chunk, parent_reg, pool.new_reg_id(), namespace, digests[index],
                              digests[index - 1] if index else ROOT_PARENT, remote=True)
            out.append(entry)
            parent_reg = entry.reg_id
        return out

    def close(self) -> None:
        """Stops the worker threads (after what they are doing) and unlocks a folder opened here."""
        if self.remote is not None:
            self.remote.close()
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
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
        from_pool = len(self.queue) + self.copying
        if tier == HOST:
            return from_pool if self.host is not None else 0
        if self.disk is None:
            return 0
        return len(self.disk_queue) + self.writing + (from_pool if self.host is None else 0)

    def check_invariants(self) -> None:
        host_slots = self.host.num_slots if self.host is not None else 0
        self.index.check_invariants(self.pool.block_size, host_slots)
        if self.host is not None:
            used = {entry.host_slot for entry in self.index.lru[HOST].values()}
            free = set(self.host.free_slots)
            if used & free or len(used) + len(free) + self.reserved_slots != host_slots \
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
        self._event(victim, MEDIUM_CPU, stored=False)
        return slot

    def _stage_for_disk(self, entry: TierEntry, payload: torch.Tensor) -> None:
        if entry.digest is None or self.clock() < self.disk_full_until:
            self.counters[DISK].evictions += 1  # its chain's start is gone: a file of it could never be found
            return
        self.disk_queue.append((entry, payload))

    def _forget_disk(self, entry: TierEntry) -> None:
        self.disk.remove(entry.digest)
        self.index.drop(entry, DISK)
        self._event(entry, MEDIUM_STORAGE, stored=False)

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

    def _event(self, entry: TierEntry, medium: str, stored: bool) -> None:
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

    def _record(self, entry: TierEntry) -> BlockRecord:
        return BlockRecord(entry.digest, entry.parent_digest, entry.namespace, entry.token_ids,
                           self.disk.sizes[entry.digest])

    def _digest_of(self, reg_id: int) -> bytes | None:
        entry = self.index.by_reg.get(reg_id)
        if entry is not None:
            return entry.digest
        return self._recent.get(reg_id)

    def _remember(self, reg_id: int, digest: bytes | None) -> None:
        self._recent[reg_id] = digest
        if len(self._recent) > RECENT_DIGESTS:
            self._recent.popitem(last=False)
