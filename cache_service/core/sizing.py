"""How many KV blocks fit, and why: the one sizing formula of docs/sizing.md.

    bytes_per_block = 2 (K and V) × num_layers × block_size × num_kv_heads × head_dim × dtype_bytes
    CUDA:  budget = total × memory_fraction − (total − free_now), capped by kv_cache_bytes
           (free_now is read after the model service loaded its weights and kept its
           warmup workspace, so both are inside "total − free_now")
    CPU:   budget = kv_cache_bytes if given, else memory_fraction × available RAM
    num_blocks = floor(budget × (1 − headroom) / bytes_per_block), capped at max_blocks
    max_total_tokens = num_blocks × block_size

`size_pool` is pure (numbers in, report out); `measure_device_memory` reads the numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from pagedkv.kv_geometry import KvGeometry, is_fp8
from pagedkv.units import format_bytes

# 16 tokens a block: small enough that the last, partly filled block of a sequence wastes
# at most 15 tokens of KV (under 1% of a 2k-token sequence), large enough that block
# tables stay short (8k tokens = 512 entries) and attention kernels loop over few blocks.
DEFAULT_BLOCK_SIZE = 16
# 5% of the budget is left unallocated: the caching allocator's fragmentation and
# rounding, allocations that the warmup pass did not see (a longer prefill, a sampler
# buffer, a CUDA graph pool, NCCL), so the first unusual batch does not run out of memory.
DEFAULT_HEADROOM = 0.05
# The share of device memory the whole process set (weights, workspace, pool) may use;
# the last 10% is left to the driver, the CUDA contexts and other tenants of the device.
DEFAULT_MEMORY_FRACTION = 0.90

LIMITED_BY_MEMORY_FRACTION = "memory_fraction"
LIMITED_BY_KV_CACHE_BYTES = "kv_cache_bytes"
LIMITED_BY_MAX_BLOCKS = "max_blocks"


class SizingError(ValueError):
    """The memory given cannot hold what was asked for; the message names the numbers."""


@dataclass(slots=True)
class SizingReport:
    """Every term of the sizing, as in cache.proto's SizingReport (dtype by name, e.g. "bfloat16")."""

    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_total_tokens: int
    device: str
    dtype: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_fraction: float
    workspace_bytes: int
    headroom: float
    limited_by: str
    budget_bytes: int
    pool_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_model_len: int
    max_full_length_sequences: float
    explanation: list[str] = field(default_factory=list)
    # The KV tiers beyond the pool (cache_service/tiers), outside its budget; 0: none.
    host_cache_bytes: int = 0
    host_blocks: int = 0
    disk_cache_bytes: int = 0
    disk_blocks: int = 0
    # The model's weights as held (AttachRequest's, or the calculator's), by dtype or GGUF
    # block type: reported, never subtracted (they are out of the free memory measured).
    weights_bytes: int = 0
    weights_bytes_by_type: dict[str, int] = field(default_factory=dict)
    # LoRA adapter slots (AttachRequest's), and what of them is loaded already.
    lora_slot_bytes: int = 0
    lora_resident_bytes: int = 0

    def add_tiers(self, host_cache_bytes: int, disk_cache_bytes: int, disk_file_bytes: int) -> None:
        """Sizes the host and disk tiers in whole blocks and says how, after the pool's terms."""
        self.host_cache_bytes = host_cache_bytes
        self.host_blocks = host_cache_bytes // self.bytes_per_block
        self.disk_cache_bytes = disk_cache_bytes
        self.disk_blocks = disk_cache_bytes // disk_file_bytes if disk_file_bytes else 0
        if host_cache_bytes:
            self.explanation.append(
                f"host tier = floor(host_cache_bytes {format_bytes(host_cache_bytes)} / bytes_per_block) = "
                f"{self.host_blocks:,} blocks (--host-cache-bytes; host memory apart from the pool's budget)")
        if disk_cache_bytes:
            self.explanation.append(
                f"disk tier = floor(disk_cache_bytes {format_bytes(disk_cache_bytes)} / {disk_file_bytes:,} bytes a "
                f"block file (the block and its header)) = {self.disk_blocks:,} blocks (--disk-cache-bytes)")

    def to_dict(self) -> dict:
        return asdict(self)

    def format_table(self) -> str:
        """The terms as an aligned table, then the explanation, for a terminal or a log."""
        rows = [
            ("device", self.device, ""),
            ("dtype", self.dtype, f"{self.dtype_bytes} bytes"),
            ("num_layers", str(self.num_layers), ""),
            ("num_kv_heads", str(self.num_kv_heads), ""),
            ("head_dim", str(self.head_dim), ""),
            ("block_size", str(self.block_size), "tokens a block"),
            ("bytes_per_block", f"{self.bytes_per_block:,}", format_bytes(self.bytes_per_block)),
            ("memory_total_bytes", f"{self.memory_total_bytes:,}", format_bytes(self.memory_total_bytes)),
            ("memory_free_bytes", f"{self.memory_free_bytes:,}", format_bytes(self.memory_free_bytes)),
            ("memory_fraction", f"{self.memory_fraction:g}", ""),
            ("weights_bytes", f"{self.weights_bytes:,}", format_bytes(self.weights_bytes)),
            ("workspace_bytes", f"{self.workspace_bytes:,}", format_bytes(self.workspace_bytes)),
            *([("lora_slot_bytes", f"{self.lora_slot_bytes:,}",
                f"{format_bytes(self.lora_slot_bytes)}, {format_bytes(self.lora_resident_bytes)} loaded")]
              if self.lora_slot_bytes else []),
            ("headroom", f"{self.headroom:g}", ""),
            ("budget_bytes", f"{self.budget_bytes:,}", format_bytes(self.budget_bytes)),
            ("num_blocks", f"{self.num_blocks:,}", ""),
            ("pool_bytes", f"{self.pool_bytes:,}", format_bytes(self.pool_bytes)),
            ("max_total_tokens", f"{self.max_total_tokens:,}", "tokens, all running sequences together"),
            ("max_model_len", f"{self.max_model_len:,}", "tokens"),
            ("max_full_length_sequences", f"{self.max_full_length_sequences:.2f}", ""),
            ("limited_by", self.limited_by, ""),
        ]
        if self.host_cache_bytes:
            rows.append(("host_blocks", f"{self.host_blocks:,}", format_bytes(self.host_cache_bytes)))
        if self.disk_cache_bytes:
            rows.append(("disk_blocks", f"{self.disk_blocks:,}", format_bytes(self.disk_cache_bytes)))
        name_width = max(len(name) for name, _, _ in rows)
        value_width = max(len(value) for _, value, _ in rows)
        lines = [f"{name:<{name_width}}  {value:>{value_width}}  {note}".rstrip() for name, value, note in rows]
        return "\n".join(lines + [""] + self.explanation)


def _exact(value: float) -> Fraction:
    # Through the decimal text, so 0.9 means 9/10 and hand-computed numbers come out exact.
    return Fraction(repr(float(value)))


def _check_inputs(
    block_size: int,
    memory_total: int,
    memory_free: int,
    memory_fraction: float,
    headroom: float,
    workspace_bytes: int,
    max_model_len: int,
    kv_cache_bytes: int | None,
    max_blocks: int | None,
    weights_bytes: int = 0,
) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if memory_total < 0 or memory_free < 0 or memory_free > memory_total:
        raise ValueError(f"need 0 <= memory_free <= memory_total, got free {memory_free}, total {memory_total}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if workspace_bytes < 0:
        raise ValueError(f"workspace_bytes cannot be negative, got {workspace_bytes}")
    if weights_bytes < 0:
        raise ValueError(f"weights_bytes cannot be negative, got {weights_bytes}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    if kv_cache_bytes is not None and kv_cache_bytes <= 0:
        raise ValueError(f"kv_cache_bytes must be positive, got {kv_cache_bytes}")
    if max_blocks is not None and max_blocks <= 0:
        raise ValueError(f"max_blocks must be positive, got {max_blocks}")


def size_pool(
    geometry: KvGeometry,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    memory_total: int,
    memory_free: int,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    headroom: float = DEFAULT_HEADROOM,
    workspace_bytes: int = 0,
    max_model_len: int,
    kv_cache_bytes: int | None = None,
    max_blocks: int | None = None,
    weights_bytes: int = 0,
    weights_bytes_by_type: Mapping[str, int] | None = None,
    lora_slot_bytes: int = 0,
    lora_resident_bytes: int = 0,
) -> SizingReport:
    """Size the pool for `geometry` from measured memory; numbers in, report out.

    memory_total/memory_free: CUDA, the device's total and free bytes read after the
    model service's warmup (free already excludes weights and workspace); CPU, MemTotal
    and MemAvailable. workspace_bytes and weights_bytes (the model service's weights as
    held, by type in weights_bytes_by_type) are reported, not subtracted again; LoRA adapter
    slots not yet loaded (lora_slot_bytes − lora_resident_bytes) are, from a budget of
    measured memory, so that adapters loaded later fit beside the pool. On CUDA,
    kv_cache_bytes, when given, caps the device budget; on CPU it is the budget.
    Raises SizingError when not one block, or not one max_model_len sequence, fits;
    ValueError for inputs out of range.
    """
    _check_inputs(block_size, memory_total, memory_free, memory_fraction, headroom,
                  workspace_bytes, max_model_len, kv_cache_bytes, max_blocks, weights_bytes)
    weights_bytes_by_type = dict(weights_bytes_by_type or {})
    if lora_slot_bytes < 0 or not 0 <= lora_resident_bytes <= max(lora_slot_bytes, 0):
        raise ValueError(f"lora_resident_bytes {lora_resident_bytes:,} must be between 0 and "
                         f"lora_slot_bytes {lora_slot_bytes:,}")
    lora_reserved = lora_slot_bytes - lora_resident_bytes
    bytes_per_block = geometry.bytes_per_block(block_size)
    fraction = _exact(memory_fraction)
    in_use = memory_total - memory_free
    explanation = [
        f"bytes_per_block = 2 (K and V) × {geometry.num_layers} layers × {block_size} tokens × "
        f"{geometry.num_kv_heads} KV heads × {geometry.head_dim} head_dim × {geometry.dtype_bytes} bytes "
        f"({geometry.dtype_name}) = {format_bytes(bytes_per_block)} ({bytes_per_block:,} bytes)"
    ]
    if is_fp8(geometry.dtype):
        explanation.append(
            f"KV cache dtype {geometry.dtype_name}: K and V stored in 1 byte each, divided by a per-layer "
            f"scale, half the bytes (twice the tokens) of a 16-bit pool of the same memory")

    if weights_bytes_by_type:
        explanation.append(
            f"weights_bytes = {format_bytes(weights_bytes)} as the model service holds them ("
            + ", ".join(f"{kind} {format_bytes(size)}" for kind, size in weights_bytes_by_type.items())
            + "): loaded before free memory was measured, so not subtracted again")
    weights_note = f" {format_bytes(weights_bytes)}" if weights_bytes else ""
    if lora_slot_bytes:
        explanation.append(
            f"lora_slot_bytes = {format_bytes(lora_slot_bytes)} (--max-loras × the largest adapter --max-lora-rank "
            f"allows), {format_bytes(lora_resident_bytes)} of it loaded already (in use, like the weights): "
            f"{format_bytes(lora_reserved)} kept out of a budget of measured memory for adapters loaded later")
    lora_note = f" − {format_bytes(lora_reserved)} LoRA slots not yet loaded" if lora_reserved else ""
    if geometry.is_cuda:
        device_budget = math.floor(memory_total * fraction) - in_use - lora_reserved
        device_sentence = (
            f"{format_bytes(memory_total)} × {memory_fraction:g} memory_fraction − "
            f"{format_bytes(in_use)} in use after warmup (weights{weights_note}, "
            f"{format_bytes(workspace_bytes)} workspace, CUDA contexts, other processes){lora_note} "
            f"= {format_bytes(device_budget)}"
        )
        if kv_cache_bytes is not None and kv_cache_bytes < device_budget:
            budget, limited_by = kv_cache_bytes, LIMITED_BY_KV_CACHE_BYTES
            explanation.append(f"budget = kv_cache_bytes {format_bytes(budget)}, below the device budget {device_sentence}")
        else:
            budget, limited_by = device_budget, LIMITED_BY_MEMORY_FRACTION
            explanation.append(f"budget = {device_sentence}")
        raise_flag = "--kv-cache-bytes" if limited_by == LIMITED_BY_KV_CACHE_BYTES else "--memory-fraction (or free device memory)"
    elif kv_cache_bytes is not None:
        budget, limited_by = kv_cache_bytes, LIMITED_BY_KV_CACHE_BYTES
        explanation.append(f"budget = kv_cache_bytes = {format_bytes(budget)} (--kv-cache-bytes)")
        if kv_cache_bytes > memory_free:
            explanation.append(
                f"note: kv_cache_bytes {format_bytes(kv_cache_bytes)} is more than the "
                f"{format_bytes(memory_free)} of RAM available now"
            )
        raise_flag = "--kv-cache-bytes"
    else:
        budget, limited_by = math.floor(memory_free * fraction) - lora_reserved, LIMITED_BY_MEMORY_FRACTION
        explanation.append(
            f"budget = {format_bytes(memory_free)} RAM available (MemAvailable, of "
            f"{format_bytes(memory_total)}) × {memory_fraction:g} memory_fraction{lora_note} = {format_bytes(budget)}"
        )
        raise_flag = "--kv-cache-bytes (or --memory-fraction)"

    usable = math.floor(max(budget, 0) * (1 - _exact(headroom)))
    if usable < bytes_per_block:
        raise SizingError(
            f"KV budget too small for one block: budget {format_bytes(budget)} ({budget:,} bytes) × "
            f"(1 − {headroom:g} headroom) = {usable:,} bytes < bytes_per_block "
            f"{format_bytes(bytes_per_block)} ({bytes_per_block:,} bytes). {explanation[1]}. Raise {raise_flag}"
            + (", or use a device with more free memory" if geometry.is_cuda else "")
        )
    num_blocks = usable // bytes_per_block
    blocks_sentence = (
        f"num_blocks = floor(budget × (1 − {headroom:g} headroom) / bytes_per_block) = "
        f"floor({format_bytes(usable)} / {format_bytes(bytes_per_block)}) = {num_blocks:,}"
    )
    if max_blocks is not None and max_blocks < num_blocks:
        blocks_sentence += f", capped at max_blocks = {max_blocks:,}"
        num_blocks, limited_by, raise_flag = max_blocks, LIMITED_BY_MAX_BLOCKS, "--max-blocks"
    explanation.append(blocks_sentence)

    max_total_tokens = num_blocks * block_size
    pool_bytes = num_blocks * bytes_per_block
    blocks_per_sequence = -(-max_model_len // block_size)
    if num_blocks < blocks_per_sequence:
        raise SizingError(
            f"the pool cannot hold one sequence of max_model_len {max_model_len:,} tokens: it needs "
            f"{blocks_per_sequence:,} blocks of {block_size} tokens, but num_blocks is {num_blocks:,} "
            f"({max_total_tokens:,} tokens; bytes_per_block {format_bytes(bytes_per_block)}, budget "
            f"{format_bytes(budget)}, limited by {limited_by}). Raise {raise_flag}, or lower --max-model-len"
        )
    explanation += [
        f"max_total_tokens = num_blocks × block_size = {max_total_tokens:,} tokens: "
        f"prompt + generated tokens of all running sequences together",
        f"pool_bytes = num_blocks × bytes_per_block = {format_bytes(pool_bytes)}",
        f"a sequence of max_model_len {max_model_len:,} tokens needs {blocks_per_sequence:,} blocks; "
        f"{num_blocks // blocks_per_sequence:,} such sequences fit at once",
        f"limited_by = {limited_by}: raise {raise_flag} for more blocks",
    ]
    return SizingReport(
        block_size=block_size,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        max_total_tokens=max_total_tokens,
        device=geometry.device,
        dtype=geometry.dtype_name,
        memory_total_bytes=memory_total,
        memory_free_bytes=memory_free,
        memory_fraction=memory_fraction,
        workspace_bytes=workspace_bytes,
        headroom=headroom,
        limited_by=limited_by,
        budget_bytes=budget,
        pool_bytes=pool_bytes,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype_bytes=geometry.dtype_bytes,
        max_model_len=max_model_len,
        max_full_length_sequences=max_total_tokens / max_model_len,
        explanation=explanation,
        weights_bytes=weights_bytes,
        weights_bytes_by_type=weights_bytes_by_type,
        lora_slot_bytes=lora_slot_bytes,
        lora_resident_bytes=lora_resident_bytes,
    )


def measure_device_memory(device: str) -> tuple[int, int]:
    """(total, free) bytes now: CUDA from cudaMemGetInfo; CPU MemTotal and MemAvailable."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(device)
        return total, free
    return _read_meminfo()


def _read_meminfo(path: str = "/proc/meminfo") -> tuple[int, int]:
    try:
        with open(path) as meminfo:
            values = {}
            for line in meminfo:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        return values["MemTotal"], values["MemAvailable"]
    except (OSError, KeyError, ValueError):
        # Not Linux (or a kernel before 3.14, without MemAvailable): free pages undercount
        # what could be reclaimed, which errs on the small side.
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
