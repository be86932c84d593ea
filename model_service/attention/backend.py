"""PagedAttention: write this step's K/V into the pool, then attend (decode, then prefill),
through one backend chosen for the pool the first time it is seen, not at every layer:

- "triton" (triton_backend.py): CUDA; the tests run it interpreted on CPU;
- "cpu" (cpu_backend.py): the C kernels of model_service/cpu_kernels, reading blocks in place;
- "torch" (torch_backend.py): index_copy_, gather + SDPA; any device.

"auto" takes Triton on CUDA and the C kernels on CPU, each where it loads and takes the
pool's dtype and shapes, and torch otherwise; "cpu" and "triton" refuse to start where
their kernels do not load.

Triton is imported lazily, on the first call that needs it, for two reasons: a CPU-only
server never pays triton's import (about a second), and triton decides between compiled and
interpreted kernels (TRITON_INTERPRET) when the kernels module is first imported, so
importing this module must not fix that choice for the rest of the process.
"""

from __future__ import annotations

from types import ModuleType

import structlog
import torch

from model_service import cpu_kernels
from model_service.attention.cpu_backend import CpuBackend
from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_backend import TorchBackend
from model_service.attention.triton_backend import TritonBackend
from model_service.cpu_kernels import paged_decode

log = structlog.get_logger()

BACKENDS = ("auto", "torch", "triton", "cpu")

_triton_kernels: ModuleType | None = None
_triton_import_error: Exception | None = None


def load_triton_kernels() -> ModuleType | None:
    """The triton kernels module, or None when triton does not import here."""
    global _triton_kernels, _triton_import_error
    if _triton_kernels is None and _triton_import_error is None:
        try:
            from model_service.attention import triton_kernels
        except Exception as error:  # ImportError, or triton failing to find a backend
            _triton_import_error = error
        else:
            _triton_kernels = triton_kernels
    return _triton_kernels


class PagedAttention:
    """One callable shared by every layer; the metadata says where each sequence's K/V live."""

    def __init__(self, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
        if backend == "triton" and load_triton_kernels() is None:
            raise RuntimeError(f"attention backend 'triton' requested but triton does not import: {_triton_import_error}")
        if backend == "cpu" and cpu_kernels.load() is None:
            raise RuntimeError(f"attention backend 'cpu' requested but its C kernels did not build: "
                               f"{cpu_kernels.load_error()}")
        self.backend = backend  # as requested; `select` says which one serves a pool
        self._chosen: tuple[tuple, TorchBackend] | None = None

    def select(self, q: torch.Tensor, kv_layer: torch.Tensor) -> TorchBackend:
        """The backend serving calls with q's and this pool's dtypes and shapes: chosen at
        the first such call (every layer of a pool shares it), again only for another pool."""
        key = (kv_layer.device, kv_layer.dtype, tuple(kv_layer.shape[2:]), kv_layer.is_contiguous(),
               q.dtype, q.shape[1])
        if self._chosen is None or self._chosen[0] != key:
            chosen = self._choose(q, kv_layer)
            self._chosen = (key, chosen)
            log.info("attention backend", requested=self.backend, serving=chosen.name, device=str(kv_layer.device),
                     kv_dtype=str(kv_layer.dtype), prefill=getattr(chosen, "prefill_path", chosen.name))
        return self._chosen[1]

    def _choose(self, q: torch.Tensor, kv_layer: torch.Tensor) -> TorchBackend:
        if self.backend == "triton" or (self.backend == "auto" and kv_layer.is_cuda):
            kernels = load_triton_kernels()
            if kernels is not None:
                return TritonBackend(kernels)
        if self.backend in ("auto", "cpu") and paged_decode.supports(q, kv_layer):
            library = cpu_kernels.load()
            if library is not None:
                return CpuBackend(library, q, kv_layer)
        return TorchBackend()

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, q_heads, head_dim], decode tokens first
        k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim], a view into the pool
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # this layer's window (None: full attention)
        kv_scales: tuple[float, float] = (1.0, 1.0),  # an 8-bit pool's (k_scale, v_scale): attention/kv_quant.py
    ) -> torch.Tensor:  # [num_tokens, q_heads, head_dim]
        num_tokens, q_heads, _ = q.shape
        kv_heads = kv_layer.shape[3]
        if q_heads % kv_heads != 0:
            raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
        if kv_layer.shape[2] != meta.block_size:
            raise ValueError(f"pool block_size {kv_layer.shape[2]} != metadata block_size {meta.block_size}")

        backend = self.select(q, kv_layer)
        backend.write(k, v, kv_layer, meta, kv_scales)
        num_decode = meta.num_decode_seqs
        if num_tokens == num_decode > 0:
            # a decode-only step: no copy into a step-wide buffer
            return backend.decode(q, kv_layer, meta, scale, sliding_window, kv_scales)
        out = torch.empty_like(q)
        if num_decode > 0:
            out[:num_decode] = backend.decode(q[:num_decode], kv_layer, meta, scale, sliding_window, kv_scales)
        backend.prefill(q[num_decode:], k[num_decode:], v[num_decode:], kv_layer, meta, scale, sliding_window,
                        kv_scales, out[num_decode:])
        return out
