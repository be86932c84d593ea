"""The live KV pool: physical memory, its sizing, the block ledger and the sessions
(how an ended session's leases come back is reclaim.py's ``Reclaims``, ``pool.reclaims``).

Plain code, no gRPC and no protos: the servicer validates requests, calls this and maps
what it returns onto the wire (api/wire.py). The pool is
created by the first Attach, because only the model knows the KV geometry; every later
Attach must bring the same geometry (a model service that restarts gets the same pool,
and the prefix cache with it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from cache_service.events.block_event_log import BlockEventLog
from cache_service.events.publisher import KvEventPublisher
from cache_service.core.lease_ops import AllocateOp, LeaseOp, LeaseOutcome, apply_op
from cache_service.core.ledger import Ledger, SessionLimits
from cache_service.core.reclaim import Reclaims
from cache_service.core.sessions import Session, Sessions
from cache_service.core.sizing import SizingError, SizingReport, measure_device_memory, size_pool
from cache_service.core.stats import PoolStats, pool_stats
from cache_service.tiers.disk_folder import DiskFolder
from cache_service.tiers.disk_tier import DiskGeometry, file_bytes
from cache_service.tiers.kv_tiers import KvTiers
from cache_service.tiers.promotion import ReadAhead
from cache_service.tiers.settings import TierSettings
from pagedkv import pool_memory
from pagedkv.pool_memory.populate import populate_in_background
from pagedkv.kv_geometry import KvGeometry

log = structlog.get_logger()


# Block sizes a pool may have: the Triton decode kernel reads a block in power-of-two tiles
# (tl.arange), and every power of two up to 1024 compiles for sm_80 and sm_90 with no
# register spilled (scripts/compile_kernels.py; tests/test_kernels_compile.py checks the ends).
MAX_BLOCK_SIZE = 1024


def block_size_error(block_size: int) -> str | None:
    """Why block_size cannot be a pool's block size, or None when it can."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        return (f"--block-size must be a power of two from 1 to {MAX_BLOCK_SIZE} (the Triton decode kernel "
                f"reads blocks in power-of-two tiles), got {block_size}; 16 is the usual choice")
    return None


def parse_block_size(raw: str) -> int:
    """argparse type for --block-size: an error at parsing names the allowed values."""
    try:
        block_size = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--block-size must be an integer, got {raw!r}") from None
    error = block_size_error(block_size)
    if error is not None:
        raise argparse.ArgumentTypeError(error)
    return block_size


class GeometryMismatch(Exception):
    """An Attach whose geometry differs from the live pool's."""


class NoPool(Exception):
    """Nothing has attached yet, so there is no pool to report on."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    # 16 tokens a block: the last, partial block of a sequence wastes at most 15 token
    # slots, while block tables and the kernels' per-block loops stay short.
    block_size: int = 16
    memory_fraction: float = 0.90
    headroom: float = 0.05
    kv_cache_bytes: int | None = None
    max_blocks: int | None = None
    lease_ttl_ms: int = 5000
    shm_dir: str = "/dev/shm"
    session_limits: SessionLimits = field(default_factory=SessionLimits)
    # An expired session's blocks stay leased this much longer before anyone else can
    # get them: its model service may still be finishing a forward pass it started
    # before its local lease deadline (docs/tenants-and-security.md, "Fenced writes").
    reclaim_grace_ms: int = 5000
    # The host and disk tiers beyond the pool (off by default).
    tiers: TierSettings = field(default_factory=TierSettings)
    # Check the ledger's, the pool's and the tiers' invariants after every change (tests
    # and soak runs: each check walks the whole pool).
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if block_size_error(self.block_size) is not None:
            raise ValueError(block_size_error(self.block_size))
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if not 0.0 <= self.headroom < 1.0:
            raise ValueError(f"--headroom must be in [0, 1), got {self.headroom}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"--kv-cache-bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_blocks is not None and self.max_blocks <= 0:
            raise ValueError(f"--max-blocks must be positive, got {self.max_blocks}")
        if self.lease_ttl_ms < 100:
            raise ValueError(f"--lease-ttl-ms must be at least 100, got {self.lease_ttl_ms}")
        if self.reclaim_grace_ms < 0:
            raise ValueError(f"--reclaim-grace-ms cannot be negative, got {self.reclaim_grace_ms}")


@dataclass(frozen=True, slots=True)
class Attachment:
    session: Session
    sizing: SizingReport
    # What the model service maps the pool from (api/wire.py makes it AttachResponse.pool).
    handle: pool_memory.SharedPoolHandle | pool_memory.CudaIpcInfo


class KvPool:
    def __init__(self, settings: PoolSettings, clock=time.monotonic,
                 kv_events: Sequence[KvEventPublisher] = (), disk_folder: DiskFolder | None = None,
                 remote_key: bytes | None = None) -> None:
        """``disk_folder``: --disk-cache-dir, opened (checked and locked) at start-up;
        ``remote_key``: --remote-kv-key-file's key, read at start-up."""
        self.settings = settings
        self.disk_folder = disk_folder
        self.remote_key = remote_key
        # One publisher per KV events endpoint, each for one served model name or (None) every model.
        self.kv_events = list(kv_events)
        self.sessions = Sessions(settings.lease_ttl_ms / 1000, clock)
        # How an ended session's leases come back (detach, TTL expiry, holder gone).
        self.reclaims = Reclaims(self.sessions, lambda: self.ledger, self.check_invariants, settings.lease_ttl_ms,
                                 settings.reclaim_grace_ms, clock)
        self.geometry: KvGeometry | None = None
        self.sizing: SizingReport | None = None
        self.ledger: Ledger | None = None
        self._memory: pool_memory.SharedPool | torch.Tensor | None = None
        self.tiers: KvTiers | None = None
        self._tier_task: asyncio.Task | None = None
        self.invariants_broken = 0  # checks failed (settings.check_invariants)

    # -- sessions -------------------------------------------------------------------

    def attach(self, client_name: str, geometry: KvGeometry, workspace_bytes: int, max_model_len: int,
               model_fingerprint: str = "", served_model_name: str = "", attach_key: str = "",
               weights_bytes: int = 0, weights_bytes_by_type: Mapping[str, int] | None = None,
               lora_slot_bytes: int = 0, lora_resident_bytes: int = 0) -> Attachment:
        # 0: the client did not say (Attach's max_model_len is optional); the pool
        # must then hold at least one block.
        max_model_len = max_model_len or self.settings.block_size
        if self.geometry is None:
            self._create(geometry, workspace_bytes, max_model_len, weights_bytes, weights_bytes_by_type or {},
                         lora_slot_bytes, lora_resident_bytes)
        elif geometry != self.geometry:
            raise GeometryMismatch(
                f"the live pool was made for {describe(self.geometry)}, this model needs {describe(geometry)}; "
                "a pool is never resized under its cached prefixes: restart the cache service to serve another model"
            )
        else:
            self._check_fits(max_model_len)
        session = self.sessions.opened_by(attach_key, client_name, model_fingerprint, served_model_name)
        if session is not None:
            log.info("session_attach_repeated", session=session.owner, client=client_name)
            return Attachment(session, self.sizing, self._handle_for_attach())
        session = self.sessions.open(client_name, model_fingerprint, served_model_name, attach_key)
        if self.ledger.events is not None:
            self.ledger.events.serves(model_fingerprint, served_model_name)
            self.publish_kv_events()  # a name's endpoint catches up on what its model already holds
        log.info("session_attached", session=session.owner, client=client_name, model_fingerprint=model_fingerprint,
                 served_model_name=served_model_name)
        return Attachment(session, self.sizing, self._handle_for_attach())

    def _handle_for_attach(self) -> pool_memory.SharedPoolHandle | pool_memory.CudaIpcInfo:
        if isinstance(self._memory, pool_memory.SharedPool):
            return self._memory.handle
        # Each CUDA IPC export takes its own reference-count slot: one per importer.
        return pool_memory.export_cuda_pool(self._memory)

    def heartbeat(self, session_id: str) -> Session:
        return self.sessions.touch(session_id)

    async def lease(self, session: Session, ops: Sequence[LeaseOp]) -> tuple[list[LeaseOutcome], int]:
        """Applies one Lease call's ops of ``session``'s in order; returns an outcome per op
        and the blocks available after them. The disk and remote blocks the allocations
        would promote are read first, off the event loop; raises UnknownSession if the
        session ended meanwhile, and NoPool before anything has attached."""
        ledger, _ = self.require_pool()
        fingerprint = session.model_fingerprint
        prompts = [(op.prompt_token_ids, (fingerprint, op.cache_salt)) for op in ops if type(op) is AllocateOp]
        blocks = await self.read_ahead(prompts)
        if blocks:
            self.heartbeat(session.session_id)
        with self.reading_ahead(blocks):
            outcomes = [apply_op(ledger, session.owner, op, fingerprint) for op in ops]
        if prompts:
            await self.promoted()  # the hits' bytes are in the pool before the reply counts them
        self.publish_kv_events()  # one batch per call at most
        self.check_invariants("lease")
        return outcomes, ledger.blocks_available()

    def stats(self) -> PoolStats:
        return pool_stats(self.sessions, self.ledger, self.sizing.pool_bytes if self.sizing else 0, self.tiers)

    def reset_prefix_cache(self, session: Session, all_models: bool = False) -> tuple[int, int]:
        """Drops the cached blocks of ``session``'s model (or of every model) nobody holds;
        returns (blocks dropped, blocks kept because leased). Tier copies stay."""
        ledger, _ = self.require_pool()
        fingerprint = None if all_models else session.model_fingerprint
        dropped, kept = ledger.reset_prefix_cache(fingerprint)
        self.publish_kv_events()
        log.info("prefix_cache_reset", session=session.owner, model_fingerprint=fingerprint,
                 served_model_name=session.served_model_name, all_models=all_models, blocks_dropped=dropped,
                 blocks_kept=kept)
        self.check_invariants("reset_prefix_cache")
        return dropped, kept

    def check_invariants(self, after: str) -> None:
        """With ``settings.check_invariants``: checks the ledger, the pool and the tiers
        after ``after`` (a call or a background step). A broken invariant is logged
        (invariant_broken) and counted, never raised: the service goes on serving and the
        test or soak run that asked for the checks reads the log."""
        if not self.settings.check_invariants or self.ledger is None:
            return
        try:
            self.ledger.check_invariants()
        except AssertionError as error:
            self.invariants_broken += 1
            log.error("invariant_broken", after=after, error=str(error))

    def require_pool(self) -> tuple[Ledger, SizingReport]:
        if self.ledger is None:
            raise NoPool("no pool yet: it is created when the first model service attaches")
        return self.ledger, self.sizing

    # -- the physical pool -----------------------------------------------------------

    def _create(self, geometry: KvGeometry, workspace_bytes: int, max_model_len: int,
                weights_bytes: int, weights_bytes_by_type: Mapping[str, int], lora_slot_bytes: int = 0,
                lora_resident_bytes: int = 0) -> None:
        memory_total, memory_free = measure_device_memory(geometry.device)
        if geometry.device == "cpu":
            # A /dev/shm file larger than the tmpfs would fail with SIGBUS on first
            # write, long after start-up: count its free space as free memory.
            memory_free = min(memory_free, shm_free_bytes(self.settings.shm_dir))
        sizing = size_pool(
            geometry,
            block_size=self.settings.block_size,
            memory_total=memory_total,
            memory_free=memory_free,
            memory_fraction=self.settings.memory_fraction,
            headroom=self.settings.headroom,
            workspace_bytes=workspace_bytes,
            max_model_len=max_model_len,
            kv_cache_bytes=self.settings.kv_cache_bytes,  # CUDA: caps the device budget; CPU: is the budget
            max_blocks=self.settings.max_blocks,
            weights_bytes=weights_bytes,
            weights_bytes_by_type=weights_bytes_by_type,
            lora_slot_bytes=lora_slot_bytes,
            lora_resident_bytes=lora_resident_bytes,
        )
        shape = geometry.pool_shape(sizing.num_blocks, sizing.block_size)
        if geometry.device == "cpu":
            self._memory = pool_memory.create_shared_pool(shape, geometry.dtype, directory=self.settings.shm_dir)
        else:
            self._memory = torch.zeros(shape, dtype=geometry.dtype, device=geometry.device)
        self.geometry = geometry
        self.sizing = sizing
        events = (BlockEventLog(sizing.block_size, models=[publisher.model for publisher in self.kv_events])
                  if self.kv_events else None)
        self.ledger = Ledger(sizing.num_blocks, sizing.block_size, limits=self.settings.session_limits, events=events)
        if events is not None:
            events.cleared()  # subscribers forget whatever an earlier pool of this endpoint held
        if self.settings.tiers.enabled:
            try:
                self._create_tiers(geometry, sizing)  # a disk tier's blocks are told of, after the clear
            except BaseException:
                self._unmake()  # no pool rather than one without its configured tiers
                raise
        if events is not None:
            self.publish_kv_events()
        log.info("pool_created", geometry=describe(geometry), num_blocks=sizing.num_blocks,
                 block_size=sizing.block_size, bytes_per_block=sizing.bytes_per_block,
                 max_total_tokens=sizing.max_total_tokens, limited_by=sizing.limited_by)

    def _create_tiers(self, geometry: KvGeometry, sizing: SizingReport) -> None:
        tier_settings = self.settings.tiers
        disk_geometry = DiskGeometry(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, sizing.block_size,
                                     geometry.dtype)
        sizing.add_tiers(tier_settings.host_cache_bytes, tier_settings.disk_cache_bytes,
                         file_bytes(disk_geometry, ("", "")) if tier_settings.disk_cache_dir else 0)
        tensor = self._memory
        if isinstance(self._memory, pool_memory.SharedPool):
            tensor = self._memory.tensor
            # Promotions copy into blocks this process never touched: their pages are mapped
            # now, off the Lease calls' path (pagedkv/pool_memory/populate.py says why). Without
            # tiers this process never touches the pool's bytes, and maps nothing.
            populate_in_background(tensor)
        self.tiers = KvTiers(self.ledger.pool, tensor, tier_settings, sizing.bytes_per_block, disk_geometry,
                             events=self.ledger.events, disk_folder=self.disk_folder, remote_key=self.remote_key)
        self.ledger.tiers = self.tiers
        try:
            self._tier_task = asyncio.get_running_loop().create_task(self.tiers.run(self._after_tier_step))
        except RuntimeError:
            self._tier_task = None  # no event loop (unit tests): the caller runs demotions itself
        log.info("kv_tiers_created", host_blocks=sizing.host_blocks, host_cache_bytes=sizing.host_cache_bytes,
                 disk_blocks=sizing.disk_blocks, disk_cache_dir=tier_settings.disk_cache_dir,
                 disk_blocks_restored=self.tiers.index.count("disk"), remote_kv=tier_settings.remote_kv)

    def _unmake(self) -> None:
        if isinstance(self._memory, pool_memory.SharedPool):
            self._memory.close()
        self._memory = self.geometry = self.sizing = self.ledger = None

    async def read_ahead(self, prompts) -> ReadAhead:
        """The disk and remote blocks that allocating ``prompts`` ((token ids, namespace)
        pairs) would promote, read in worker threads (``Promotions.read_ahead``)."""
        return await self.tiers.promotions.read_ahead(prompts) if self.tiers is not None else ReadAhead()

    def reading_ahead(self, blocks: ReadAhead):
        return self.tiers.promotions.reading_ahead(blocks) if self.tiers is not None else contextlib.nullcontext()

    async def promoted(self) -> None:
        """Returns once the promotions' copies made so far are in the pool (``Promotions.settled``)."""
        if self.tiers is not None:
            await self.tiers.promotions.settled()

    def _after_tier_step(self) -> None:
        self.publish_kv_events()
        self.check_invariants("tiers")

    def publish_kv_events(self) -> None:
        """Sends what the prefix cache gained and lost since the last call, as one batch per endpoint."""
        if not self.kv_events or self.ledger is None:
            return
        batches = self.ledger.events.drain_all()
        for publisher in self.kv_events:
            events = batches.get(publisher.model)
            if events:
                publisher.publish(events)

    def _check_fits(self, max_model_len: int) -> None:
        needed = -(-max_model_len // self.sizing.block_size)
        if needed > self.sizing.num_blocks:
            raise SizingError(
                f"a sequence of max_model_len {max_model_len} tokens needs {needed} blocks but the live pool "
                f"has {self.sizing.num_blocks}; lower --max-model-len or restart the cache service with more memory"
            )

    def close(self) -> None:
        """Unlinks the shared-memory file; the pool must never outlive the service."""
        if self._tier_task is not None:
            self._tier_task.cancel()
        if self.tiers is not None:
            self.tiers.close()
        if isinstance(self._memory, pool_memory.SharedPool):
            self._memory.close()
        self._memory = None


def shm_free_bytes(directory: str) -> int:
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def describe(geometry: KvGeometry) -> str:
    return (f"{geometry.num_layers} layers × {geometry.num_kv_heads} KV heads × head_dim {geometry.head_dim}, "
            f"{geometry.dtype_name} on {geometry.device}")
