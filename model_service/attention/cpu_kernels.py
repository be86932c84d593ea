"""C kernels for the CPU hot path, built with the machine's compiler at first use.

Why C and not torch ops: decode attention over a paged pool in torch needs a gathered,
padded copy of every sequence's K/V and a masked SDPA over it (csrc/paged_decode.c says
what that cost). Why ctypes and not a torch C++ extension: the kernel needs no torch
headers, so it builds in about a second instead of a minute, which every fresh machine,
container and CI run pays once.

The shared object is cached under $PAGEDKV_KERNEL_CACHE (default ~/.cache/pagedkv/kernels),
named by a hash of the source, the compiler, its flags and this CPU's feature flags
(-march=native code must not run on another CPU that shares the cache directory). Where
no compiler works, or PAGEDKV_CPU_KERNELS=0, `load()` returns None once, with a warning,
and the torch path serves.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import structlog
import torch

log = structlog.get_logger()

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# The C side's fixed buffer limits (paged_decode.c); wider shapes take the torch path.
MAX_HEAD_DIM, MAX_GROUP, MAX_BLOCK_SIZE = 256, 64, 256
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def cache_dir() -> Path:
    configured = os.environ.get("PAGEDKV_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pagedkv" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    target = cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: a concurrent start never loads half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    log.info("cpu kernels built", path=str(target), compiler=compiler)
    return target


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None (with one warning) where it cannot be."""
    global _library, _load_error
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        if os.environ.get("PAGEDKV_CPU_KERNELS", "1") == "0":
            _load_error = "PAGEDKV_CPU_KERNELS=0"
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        try:
            if compiler is None:
                raise RuntimeError("no C compiler (cc or gcc) on PATH and CC unset")
            library = ctypes.CDLL(str(_build(compiler)))
        except Exception as error:  # a failed build must leave the service on the torch path
            _load_error = str(error)
            log.warning("cpu kernels unavailable; decode attention takes the slower torch path",
                        reason=_load_error)
            return None
        library.paged_decode_attention.restype = ctypes.c_int
        library.paged_decode_attention.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ]
        _library = library
        return library


def load_error() -> str | None:
    return _load_error


def supports(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes this call (else the caller uses the torch path)."""
    _, _, block_size, kv_heads, head_dim = kv_layer.shape
    return (kv_layer.device.type == "cpu" and kv_layer.dtype in DTYPE_CODES and kv_layer.is_contiguous()
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE
            and q.shape[1] % kv_heads == 0 and q.shape[1] // kv_heads <= MAX_GROUP)


def paged_decode_attention(
    library: ctypes.CDLL,
    q: torch.Tensor,  # [num_seqs, q_heads, head_dim]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim], contiguous, CPU
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks]
    context_lens: torch.Tensor,  # int32 [num_seqs]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, q_heads, head_dim], kv_layer's dtype
    """Same contract as torch_paged.decode_attention_torch, reading K/V in place."""
    num_seqs, q_heads, head_dim = q.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    q = q.to(kv_layer.dtype)
    if q.stride(2) != 1 or q.stride(1) != head_dim:
        q = q.contiguous()  # rows may stay apart (q is a view of the fused q/k/v output)
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty((num_seqs, q_heads, head_dim), dtype=kv_layer.dtype)
    status = library.paged_decode_attention(
        q.data_ptr(), q.stride(0), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        num_seqs, q_heads, kv_heads, head_dim, block_size,
        scale, sliding_window or 0, DTYPE_CODES[kv_layer.dtype], out.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"paged_decode_attention refused shape q={tuple(q.shape)} kv={tuple(kv_layer.shape)}")
    return out
