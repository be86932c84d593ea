"""Rotary position embeddings: a cos/sin table for every position, gathered by positions.

Positions come in as a tensor (not a Python range) so one compiled step serves every
sequence length. The table is computed in float32 exactly as transformers computes it
(including Llama-3 frequency scaling), then cast to the model's dtype as transformers
does before applying it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model_service.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """inv_freq: [head_dim // 2] float32 on the CPU, with Llama-3 scaling when configured."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.head_dim
        # cos_cache, sin_cache: [max_position_embeddings, head_dim // 2]; not saved with weights.
        self.register_buffer("cos_cache", torch.empty(0, device="cpu"), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0, device="cpu"), persistent=False)
        self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        """(Re)compute the table; the loader calls this after materializing a meta-built model.
        Computed on the CPU (explicitly, so a meta-device context does not apply), then moved."""
        device = device if device is not None else self.cos_cache.device
        if torch.device(device).type == "meta":
            device = "cpu"
        dtype = dtype or self.cos_cache.dtype
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inverse_frequencies(self.config))  # [P, D/2] float32
        self.cos_cache = freqs.cos().to(device=device, dtype=dtype)
        self.sin_cache = freqs.sin().to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 -> cos, sin: [T, 1, D/2] (broadcast over heads)
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation (transformers' rotate_half convention). x: [T, H, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
