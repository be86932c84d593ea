"""The remote KV tier: a store every replica's cache service reads and writes (``--remote-kv``).

Blocks are keyed by chain digest and pool geometry and sealed with an HMAC under the
key the cluster's cache services share (``remote_values.py``), so two models, tenants
or layouts never meet: a value of the wrong length, forged, or copied under another key
is dropped and counted (``rejected``), never promoted.

Writes are write-behind: a sequence's committed blocks (at commit, while it decodes, and
at release) are offered (``offer``) to a bounded queue, copied out of the pool and checked to be still registered (as demotions
are, ``demotion.py``), then sent in batches from a worker thread; a full queue, a full
store or a store that is down drops them, counted. Reads happen before a Lease call
applies its ops (``fetch``, from ``Promotions.read_ahead``): one batch per call, in a worker
thread, awaited at most ``--remote-kv-timeout-ms``, after which the call goes on without
them (its prompts' blocks are recomputed). A failed call to the store marks it down for a
backoff that doubles up to BACKOFF_MAX_S; meanwhile nothing is asked of it, and the next
call after the backoff is the reconnection.

The store never says what it evicts, so the blocks this service vouches for (told as KV
events of medium "REMOTE" through ``tell``) are the ones it wrote lately: the last
KNOWN_DIGESTS, all forgotten (told removed) when the store fails, as it may come back empty.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog
import torch

from cache_service.blocks.block_pool import Block
from cache_service.tiers.counters import TierCounters
from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.remote_store import RemoteStore, StoreDown, StoreFull
from cache_service.tiers.remote_values import RemoteValues
from cache_service.tiers.tier_index import ROOT_PARENT, chain_digest

log = structlog.get_logger()

REMOTE = "remote"
# Blocks sent to the store in one round trip.
WRITE_BATCH_BLOCKS = 16
# The first wait before asking a store that failed again, doubled per failure up to the most.
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
# A read's wait grows past --remote-kv-timeout-ms by the time its bytes take at this rate:
# a model with large blocks reads tens of MB for one prompt, which a healthy store moves
# in more than the bound meant for its round trip, and prefilling them again costs far more.
READ_FLOOR_BYTES_PER_S = 256 * 1024 * 1024
# A read of at least this many blocks goes as two halves at once, on two connections: one
# half's replies are parsed while the other's are still on the wire.
SPLIT_READ_BLOCKS = 8
# Digests this service wrote or read lately: a block promoted from the store, or written
# once, is not sent again when its sequence is released; those it wrote are its KV events.
KNOWN_DIGESTS = 65536

# A block written (True) or forgotten (False): its KV-event key (None: events never saw
# it) and token ids; KvTiers makes it a "REMOTE" KV event.
Tell = Callable[[object, tuple[int, ...], bool], None]
EventKeyOf = Callable[[int], object]


@dataclass(slots=True)
class RemoteCounters:
    """What only the remote tier counts (its TierCounters count the traffic)."""

    dropped_queue_full: int = 0  # blocks offered while the write queue was full
    dropped_store_down: int = 0  # blocks not written: the store did not answer, or was backing off
    dropped_store_full: int = 0  # blocks the store refused for want of memory
    rejected: int = 0  # values read that failed their checks (length, magic, MAC): never promoted
    read_timeouts: int = 0  # reads a Lease call stopped waiting for
    reconnects: int = 0  # calls that succeeded after the store had failed


class _Rejected:
    """A value read that failed its checks (length, magic, MAC)."""


REJECTED = _Rejected()


@dataclass(slots=True)
class _Write:
    """A block on its way to the store, copied out of the pool."""

    digest: bytes
    payload: torch.Tensor
    event_key: object
    token_ids: tuple[int, ...]


class RemoteTier:
    def __init__(self, store: RemoteStore, key: bytes, geometry: DiskGeometry, queue_blocks: int, timeout_s: float,
                 clock=time.monotonic, tell: Tell | None = None) -> None:
        self.store = store
        self.geometry = geometry
        self.timeout_s = timeout_s
        self.clock = clock
        self.counters = TierCounters()
        self.remote = RemoteCounters()
        self.values = RemoteValues(key, geometry)
        self.tell = tell
        # (block id, reg_id, digest, KV-event key, token ids)
        self.queue: deque[tuple[int, int, bytes, object, tuple[int, ...]]] = deque()
        self.queue_blocks = queue_blocks
        self.writing = 0
        # digest -> (KV-event key, token ids) of a block this service wrote, None for one read or queued
        self._known: OrderedDict[bytes, tuple[object, tuple[int, ...]] | None] = OrderedDict()
        self._down_until = 0.0
        self._backoff = 0.0  # 0: the last call succeeded
        self._wake = asyncio.Event()
        # Reads and writes in threads of their own: a slow write never holds up a Lease call's read.
        self._reader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-remote-read")
        # The second half of a split read: a pool of its own, so a reader never waits on a
        # worker of the pool it runs in.
        self._half_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-remote-read-half")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-remote-write")

    # -- health -----------------------------------------------------------------------

    def down(self) -> bool:
        return self.clock() < self._down_until

    def _failed(self, error: Exception, doing: str) -> None:
        if not self._backoff:
            for digest in list(self._known):
                self._forget(digest)  # a store that fails may come back empty
        self._backoff = min(max(self._backoff * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
        self._down_until = self.clock() + self._backoff
        self.counters.errors += 1
        log.warning("remote_kv_unavailable", doing=doing, error=str(error), error_type=type(error).__name__,
                    retry_in_s=self._backoff)

    def _answered(self) -> None:
        if self._backoff:
            self.remote.reconnects += 1
            log.info("remote_kv_reconnected", after_backoff_s=self._backoff)
        self._backoff = 0.0

    def _know(self, digest: bytes, written: tuple[object, tuple[int, ...]] | None = None) -> None:
        if written is not None and written[0] is not None and self.tell is not None:
            self.tell(written[0], written[1], True)
        self._known[digest] = written or self._known.get(digest)
        self._known.move_to_end(digest)
        if len(self._known) > KNOWN_DIGESTS:
            self._forget(next(iter(self._known)))

    def _forget(self, digest: bytes) -> None:
        written = self._known.pop(digest, None)
        if written is not None and written[0] is not None and self.tell is not None:
            self.tell(written[0], written[1], False)

    # -- reads ------------------------------------------------------------------------

    async def fetch(self, chains: list[list[bytes]]) -> dict[bytes, torch.Tensor]:
        """The blocks of each chain of digests that the store has, from each chain's start
        up to its first block it lacks (or that fails its checks); {} when the store is
        down or does not answer within the timeout."""
        if not chains or self.down():
            return {}
        started = self.clock()
        digests = list(dict.fromkeys(digest for chain in chains for digest in chain))
        bound = self.read_bound(len(digests))
        future = asyncio.get_running_loop().run_in_executor(self._reader, self._read, chains, digests)
        try:
            blocks, rejected = await asyncio.wait_for(future, bound)
        except (TimeoutError, asyncio.TimeoutError) as error:
            # A store this slow is treated as down for a while, so reads do not pile up behind it.
            self.remote.read_timeouts += 1
            self._failed(error, f"read (no answer within {bound:.3g} s)")
            return {}
        except StoreDown as error:
            self._failed(error, "read")
            return {}
        except Exception as error:  # a backend's bug: the call goes on without the store
            self.counters.errors += 1
            log.warning("remote_kv_read_failed", error=str(error), error_type=type(error).__name__)
            return {}
        self._answered()
        self.counters.seconds_out += self.clock() - started
        if rejected:
            self.remote.rejected += rejected
            log.warning("remote_kv_values_rejected", values=rejected,
                        reason="wrong length, magic or MAC: not written by a cache service with this key")
        for digest in blocks:
            self._know(digest)
        return blocks

    def read_bound(self, blocks: int) -> float:
        """Seconds a read of `blocks` blocks is waited for: the timeout, and its bytes' time
        at READ_FLOOR_BYTES_PER_S."""
        return self.timeout_s + blocks * self.values.value_bytes / READ_FLOOR_BYTES_PER_S

    def _fetch(self, digests: list[bytes]) -> list[torch.Tensor | None | _Rejected]:
        """(a reader thread) Each digest's block as the store holds it, checked: None where
        the store has none, REJECTED where its value fails the checks. A read of
        SPLIT_READ_BLOCKS or more goes as two halves at once, each read and checked in a
        thread of its own (the MACs of one half are computed while the other's replies
        come); a half's failure is the read's."""
        if len(digests) < SPLIT_READ_BLOCKS:
            return self._fetch_checked(digests)
        half = len(digests) // 2
        second = self._half_reader.submit(self._fetch_checked, digests[half:])
        first = self._fetch_checked(digests[:half])
        return first + second.result()

    def _fetch_checked(self, digests: list[bytes]) -> list[torch.Tensor | None | _Rejected]:
        codec = self.values
        values = self.store.get_many([codec.key_of(digest) for digest in digests], codec.value_bytes)
        out: list[torch.Tensor | None | _Rejected] = []
        for digest, value in zip(digests, values):
            block = codec.decode(digest, value) if value is not None else None
            out.append(REJECTED if value is not None and block is None else block)
        return out

    def _read(self, chains: list[list[bytes]], digests: list[bytes]) -> tuple[dict[bytes, torch.Tensor], int]:
        """(a reader thread) The chains' blocks, and how many values were rejected; `digests`
        are the chains' own, each once, in order."""
        fetched = dict(zip(digests, self._fetch(digests)))
        blocks: dict[bytes, torch.Tensor] = {}
        rejected = 0
        for chain in chains:
            for digest in chain:
                if digest in blocks:
                    continue
                block = fetched[digest]
                if block is None:
                    break
                if block is REJECTED:
                    rejected += 1
                    fetched[digest] = None  # another chain through it stops there too, counted once
                    break
                blocks[digest] = block
        return blocks, rejected

    # -- writes -----------------------------------------------------------------------

    def offer(self, blocks: Sequence[Block], event_key_of: EventKeyOf | None = None) -> None:
        """A release left ``blocks`` (a sequence's full blocks from its first) in the prefix
        cache: queue those the store may lack for writing, or count them dropped.
        ``event_key_of``: a block id's KV-event key (None: events are off)."""
        parent = ROOT_PARENT
        for block in blocks:
            if block.block_hash is None or block.token_ids is None:
                return  # the chain ends here: a child without its parent could never be found
            parent = chain_digest(parent, block.namespace, block.token_ids)
            if parent in self._known:
                continue
            if self.down():
                self.remote.dropped_store_down += 1
            elif len(self.queue) >= self.queue_blocks:
                self.remote.dropped_queue_full += 1
            else:
                self._know(parent)  # queued once; forgotten again if its write is dropped
                key = event_key_of(block.block_id) if event_key_of is not None else None
                self.queue.append((block.block_id, block.reg_id, parent, key, block.token_ids))
        self._wake.set()

    async def run(self, copy_out: Callable[[list[int]], list[torch.Tensor]],
                  still_registered: Callable[[int, int], bool], after_step: Callable[[], None] | None = None) -> None:
        """The writer: takes a batch off the queue, copies it out of the pool (a worker
        thread; ``copy_out``), keeps what is still registered as it was queued, writes it;
        then ``after_step`` (the pool's KV-event publishing)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
            batch = []
            while self.queue and len(batch) < WRITE_BATCH_BLOCKS:
                item = self.queue.popleft()
                if still_registered(item[0], item[1]):
                    batch.append(item)
                else:
                    self._forget(item[2])
            if not batch:
                continue
            self.writing = len(batch)
            try:
                payloads = await loop.run_in_executor(self._writer, copy_out, [item[0] for item in batch])
                kept = []
                for (block_id, reg_id, digest, key, token_ids), payload in zip(batch, payloads):
                    if still_registered(block_id, reg_id):
                        kept.append(_Write(digest, payload, key, token_ids))
                    else:
                        self._forget(digest)
                await self._write(kept)
            except Exception:
                self.counters.errors += 1
                for item in batch:
                    self._forget(item[2])
                log.exception("remote_kv_write_step_failed")
            finally:
                self.writing = 0
            if after_step is not None:
                after_step()

    async def _write(self, kept: list[_Write]) -> None:
        if not kept:
            return
        if self.down():
            self._dropped(kept, "dropped_store_down")
            return
        started = self.clock()
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, self._put, kept)
        except StoreDown as error:
            self._failed(error, "write")
            self._dropped(kept, "dropped_store_down")
            return
        except StoreFull as error:
            self._answered()
            self.counters.errors += 1
            self._dropped(kept, "dropped_store_full")
            log.warning("remote_kv_full", error=str(error), dropped=len(kept))
            return
        self._answered()
        self.counters.seconds_in += self.clock() - started
        self.counters.demotions += len(kept)
        self.counters.bytes_in += len(kept) * self.geometry.payload_bytes
        for write in kept:
            self._know(write.digest, (write.event_key, write.token_ids))

    def _put(self, kept: list[_Write]) -> None:
        """(the writer thread) Encodes and sends one batch."""
        codec = self.values
        self.store.put_many([(codec.key_of(write.digest), codec.encode(write.digest, write.payload)) for write in kept])

    def _dropped(self, kept: list[_Write], why: str) -> None:
        setattr(self.remote, why, getattr(self.remote, why) + len(kept))
        for write in kept:
            self._forget(write.digest)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._half_reader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self.store.close()
