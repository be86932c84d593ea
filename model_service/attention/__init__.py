"""Paged attention over the shared KV pool: a PyTorch path (any device) and Triton kernels (CUDA).

Nothing here imports triton: backend.py loads the kernels on first CUDA use (see why there).
"""

from model_service.attention.backend import PagedAttention
from model_service.attention.metadata import AttentionMetadata
from model_service.attention.torch_paged import (
    decode_attention_torch,
    prefill_attention_torch,
    write_kv_torch,
)

__all__ = [
    "AttentionMetadata",
    "PagedAttention",
    "decode_attention_torch",
    "prefill_attention_torch",
    "write_kv_torch",
]
