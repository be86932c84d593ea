"""The Triton attention backend (CUDA; the tests run it interpreted on CPU): the write and
split-context decode in Triton (triton_kernels.py), prefill on torch's SDPA, whose fused
kernels serve long causal chunks well and which runs once per prompt."""

from __future__ import annotations

from types import ModuleType

import torch

from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_backend import TorchBackend


class TritonBackend(TorchBackend):
    name = "triton"

    def __init__(self, kernels: ModuleType) -> None:
        self.kernels = kernels  # model_service.attention.triton_kernels, imported lazily (backend.py says why)

    def write(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
              kv_scales: tuple[float, float]) -> None:
        self.kernels.write_kv_triton(k, v, kv_layer, meta.slot_mapping, kv_scales=kv_scales)

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
               sliding_window: int | None, kv_scales: tuple[float, float]) -> torch.Tensor:
        num_decode = meta.num_decode_seqs
        # Context lengths stay runtime values: no recompiles as sequences grow.
        return self.kernels.decode_attention_triton(
            q, kv_layer, meta.block_tables[:num_decode], meta.context_lens[:num_decode], scale,
            sliding_window=sliding_window, kv_scales=kv_scales,
        )
