"""The torch attention backend: index_copy_ writes, gather + SDPA decode, SDPA prefill a
sequence at a time (torch_paged.py). Runs on any device; the other backends inherit the
parts they do not replace (Triton's prefill, the C kernels' 8-bit prefill)."""

from __future__ import annotations

import torch

from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_paged import (
    DecodePlan,
    decode_attention_torch,
    decode_plan,
    prefill_attention_torch,
    write_kv_torch,
)


class TorchBackend:
    name = "torch"

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
              kv_scales: tuple[float, float]) -> None:
        write_kv_torch(k, v, kv_layer, meta.slot_mapping, kv_scales=kv_scales)

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, kv_scales: tuple[float, float]) -> torch.Tensor:
        """q: the step's decode rows (one a sequence) -> [rows, q_heads, head_dim]."""
        num_decode = meta.num_decode_seqs
        plan = _decode_plan(meta, kv_layer.device, sliding_window)
        return decode_attention_torch(q, kv_layer, meta.block_tables[:num_decode], meta.context_lens[:num_decode],
                                      scale, plan=plan, kv_scales=kv_scales)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None,
                kv_scales: tuple[float, float], out: torch.Tensor) -> None:
        """q, k, v: the step's prefill rows; writes their attention into out (same rows).
        SDPA's fused kernels handle long causal chunks well, and an 8-bit pool attends over
        this step's K/V unquantized (k_new, v_new), as vLLM's prefill does."""
        num_decode = meta.num_decode_seqs
        out.copy_(prefill_attention_torch(
            q,
            kv_layer,
            meta.block_tables[num_decode:],
            meta.query_lens[num_decode:],
            meta.context_lens_host[num_decode:],
            scale,
            k_new=k,
            v_new=v,
            sliding_window=sliding_window,
            kv_scales=kv_scales,
        ))


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
