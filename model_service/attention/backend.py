"""PagedAttention: write this step's K/V into the pool, then attend (decode, then prefill).

The write: Triton's kernel on CUDA, the C kernel on CPU (cpu_kernels/kv_write.py: one call
a layer, an 8-bit pool's quantization included), torch's index_copy_ elsewhere.

Decode attention by backend: "triton" (CUDA; the tests run it interpreted on CPU), "cpu"
(the C kernel of model_service/cpu_kernels, reading blocks in place), "torch" (gather + SDPA, any
device). "auto" takes Triton on CUDA and the C kernel on CPU, each where it loads, and
the torch path otherwise. Prefill: SDPA a sequence at a time, but where the C kernels
serve a pool of the model's own dtype: the prefill kernel (cpu_kernels/prefill_attention.py)
for float32 and bfloat16 pools, else each prompt token as a decode query.

Triton is imported lazily, on the first call that needs it, for two reasons: a CPU-only
server never pays triton's import (about a second), and triton decides between compiled and
interpreted kernels (TRITON_INTERPRET) when the kernels module is first imported, so
importing this module must not fix that choice for the rest of the process.
"""

from __future__ import annotations

from types import ModuleType

import torch

from model_service import cpu_kernels
from model_service.cpu_kernels import kv_write, paged_decode, prefill_attention
from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_paged import (
    DecodePlan,
    decode_attention_torch,
    decode_plan,
    prefill_attention_torch,
    write_kv_torch,
)
from pagedkv.kv_geometry import is_fp8

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
        self.backend = backend

    def uses_triton(self, kv_layer: torch.Tensor) -> bool:
        if self.backend == "auto":
            return kv_layer.is_cuda and load_triton_kernels() is not None
        return self.backend == "triton"

    def cpu_kernel_library(self, q: torch.Tensor, kv_layer: torch.Tensor):
        """The C kernel library where it serves this call, else None (torch path)."""
        if self.backend not in ("auto", "cpu") or not paged_decode.supports(q, kv_layer):
            return None
        return cpu_kernels.load()

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

        triton_kernels = load_triton_kernels() if self.uses_triton(kv_layer) else None
        # The C kernels serve both the write and decode attention, or neither.
        library = self.cpu_kernel_library(q, kv_layer) if triton_kernels is None else None
        if triton_kernels is not None:
            triton_kernels.write_kv_triton(k, v, kv_layer, meta.slot_mapping, kv_scales=kv_scales)
        elif library is not None and kv_write.supports(k, v, kv_layer):
            kv_write.write_kv(library, k, v, kv_layer, meta.slot_mapping, kv_scales)
        else:
            write_kv_torch(k, v, kv_layer, meta.slot_mapping, kv_scales=kv_scales)

        out = torch.empty_like(q)
        num_decode = meta.num_decode_seqs
        if num_decode > 0:
            tables = meta.block_tables[:num_decode]
            lens = meta.context_lens[:num_decode]
            if triton_kernels is not None:
                # Context lengths stay runtime values: no recompiles as sequences grow.
                out[:num_decode] = triton_kernels.decode_attention_triton(
                    q[:num_decode], kv_layer, tables, lens, scale, sliding_window=sliding_window,
                    kv_scales=kv_scales,
                )
            else:
                if library is not None:
                    decoded = paged_decode.paged_decode_attention(
                        library, q[:num_decode], kv_layer, tables, lens, scale, sliding_window, kv_scales)
                else:
                    plan = self._decode_plan(meta, kv_layer.device, sliding_window)
                    decoded = decode_attention_torch(q[:num_decode], kv_layer, tables, lens, scale, plan=plan,
                                                     kv_scales=kv_scales)
                if num_tokens == num_decode:
                    return decoded  # a decode-only step: no copy into a step-wide buffer
                out[:num_decode] = decoded
        if num_tokens > num_decode and library is not None and prefill_attention.supports(library, q, kv_layer):
            # A float32 or bfloat16 pool: a query head's queries a vector, a lane each (eight
            # at the portable and AVX2 levels, sixteen at AVX-512 BF16; bench/prefill_attention.py).
            sequences = meta.shared("prefill_sequences", lambda: prefill_attention.prefill_sequences(
                meta.block_tables[num_decode:], meta.query_lens[num_decode:], meta.context_lens_host[num_decode:]))
            prefill_attention.prefill_attention(library, q[num_decode:], kv_layer, sequences, scale, sliding_window,
                                                out[num_decode:])
        elif num_tokens > num_decode and library is not None and not is_fp8(kv_layer.dtype):
            # A float16 pool (or a head_dim the prefill kernel does not take): each prompt token
            # attends as a decode query over its own context (the keys up to its position, this
            # step's already in the pool), by the C kernel that decode steps use, faster than SDPA
            # a sequence at a time (BENCHMARKS.md, "Token tiles"), with a cached prefix and a window alike.
            tables, lens = self._prefill_queries(meta)
            out[num_decode:] = paged_decode.paged_decode_attention(
                library, q[num_decode:], kv_layer, tables, lens, scale, sliding_window, kv_scales)
        elif num_tokens > num_decode:
            # Prefill on CUDA (and where the C kernels do not serve) takes the torch path:
            # SDPA's fused kernels handle the long causal chunks well, and prefill runs once
            # per prompt. So does an 8-bit pool on CPU, to attend over this step's K/V
            # unquantized, as vLLM's prefill does.
            out[num_decode:] = prefill_attention_torch(
                q[num_decode:],
                kv_layer,
                meta.block_tables[num_decode:],
                meta.query_lens[num_decode:],
                meta.context_lens_host[num_decode:],
                scale,
                k_new=k[num_decode:],
                v_new=v[num_decode:],
                sliding_window=sliding_window,
                kv_scales=kv_scales,
            )
        return out

    @staticmethod
    def _prefill_queries(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefill token as a decode query: its sequence's block table row and its
        context length (position + 1), int32 [prefill tokens, ...]; built by the first layer
        and shared by the rest (meta.shared)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            num_decode = meta.num_decode_seqs
            query_lens = meta.query_lens[num_decode:]
            lens = torch.cat([torch.arange(context - length + 1, context + 1, dtype=torch.int32)
                              for length, context in zip(query_lens, meta.context_lens_host[num_decode:], strict=True)])
            rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
            tables = meta.block_tables[num_decode:].index_select(0, rows.to(meta.block_tables.device))
            return tables.to(torch.int32), lens

        return meta.shared("prefill_queries", build)

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, device: torch.device, sliding_window: int | None) -> DecodePlan:
        """The step's decode plan for this window: built by the first layer that needs it
        and shared by the rest (meta.shared; built every layer without a memo)."""

        def build() -> DecodePlan:
            num_decode = meta.num_decode_seqs
            return decode_plan(
                meta.block_tables[:num_decode], meta.context_lens[:num_decode], meta.block_size, device,
                max_context_len=max(meta.context_lens_host[:num_decode]), sliding_window=sliding_window,
            )

        return meta.shared(("decode_plan", sliding_window), build)
