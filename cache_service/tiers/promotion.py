"""Promotion, inside the Lease calls: prefix blocks found in a tier copied back into the pool.

Promotion happens inside the Lease call, bounded by PROMOTE_MAX_BLOCKS per allocate
(the rest of the prompt is recomputed). Why not asynchronously: the reply's
``cached_tokens`` may count a block only once its bytes are in the pool, and doing the copy
before the reply keeps that true with no new state in the model service (a sequence
waiting on a copy, a second round trip); a host block is one memcpy (tens of µs), far
less than prefilling its tokens again. On CPU the copy is made inline; on CUDA it is
queued to the tiers' copy thread (``copy_queue.py``: batched, through pinned staging)
and the Lease call awaits it after applying its ops (``settled``), so the event loop
never waits on the device.

Disk blocks are read before that, in a reader thread while the event loop serves other
calls (``read_ahead``): the Lease call awaits the reads, then applies its ops with the
blocks in hand (``reading_ahead``); a disk block a call did not read ahead ends its hit
there (recomputed), so the loop never reads a file. Reads are checked (MACs, header)
before the ledger changes anything, so a bad file shortens the hit and never fails the
call. The remote tier shared by replicas indexes nothing here: ``read_ahead`` asks the
store for the rest of each prompt's chain past its local hit, beside the disk reads, and
``lookup`` continues a chain with the blocks read that way (``_remote_hits``: entries in
no tier, promoted as disk blocks are, or forgotten).

The tiers themselves (the index, the host slots, the disk folder, the counters) are
``KvTiers``'s; demotion, the way down, is ``demotion.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog
import torch

from cache_service.blocks.block_pool import Block, BlockPool
from cache_service.blocks.prefix_hash import Namespace, namespace_root
from cache_service.tiers.copy_queue import CopyQueue
from cache_service.tiers.counters import TierCounters
from cache_service.tiers.device_copies import BlockMover
from cache_service.tiers.disk_tier import BadBlockFile, BlockRecord, DiskTier
from cache_service.tiers.host_tier import HostTier
from cache_service.tiers.remote_tier import REMOTE, RemoteTier
from cache_service.tiers.remote_values import chain_digests
from cache_service.tiers.tier_index import DISK, HOST, ROOT_PARENT, TierEntry, TierIndex

log = structlog.get_logger()

# Blocks one allocate may promote; past it the prompt's remaining tokens are recomputed.
PROMOTE_MAX_BLOCKS = 256


@dataclass(slots=True)
class ReadAhead:
    """The blocks one Lease call read before applying its ops, by chain digest: from disk
    (a BadBlockFile for a bad file) and from the remote tier (checked already)."""

    disk: dict[bytes, torch.Tensor | BadBlockFile] = field(default_factory=dict)
    remote: dict[bytes, torch.Tensor] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.disk or self.remote)


class Promotions:
    def __init__(self, *, pool: BlockPool, pool_tensor: torch.Tensor, index: TierIndex, host: HostTier | None,
                 disk: DiskTier | None, remote: RemoteTier | None, mover: BlockMover | None,
                 copies: CopyQueue | None, counters: dict[str, TierCounters], bytes_per_block: int,
                 clock: Callable[[], float], forget_disk: Callable[[TierEntry], None]) -> None:
        """``forget_disk``: drops an entry's disk copy (a file found bad on promotion)."""
        self.pool = pool
        self.pool_tensor = pool_tensor
        self.index = index
        self.host = host
        self.disk = disk
        self.remote = remote
        self.mover = mover
        self.copies = copies
        self.counters = counters
        self.bytes_per_block = bytes_per_block
        self.clock = clock
        self.forget_disk = forget_disk
        # Promotions' disk reads, at the service's priority: a Lease call waits on them.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers-read")
        # The blocks the Lease call applying its ops read ahead (None: no call is; a
        # direct user of the ledger, whose disk reads happen inline and who gets no remote block).
        self._read_ahead: ReadAhead | None = None

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

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
                        self.forget_disk(hit)
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

    def _record(self, entry: TierEntry) -> BlockRecord:
        return BlockRecord(entry.digest, entry.parent_digest, entry.namespace, entry.token_ids,
                           self.disk.sizes[entry.digest])
