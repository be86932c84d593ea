"""8-bit K/V in the pool: per-layer scales, saturating writes, and what a scale set is called.

An fp8 pool (--kv-cache-dtype fp8_e4m3 or fp8_e5m2) stores K / k_scale and V / v_scale of
each layer, rounded to nearest; attention multiplies the scales back in, folded into the
score scale (K) and the softmax's normalization (V), so reading dequantizes nothing but the
type. Values past the type's largest finite number are clamped to it: e4m3 has no
infinity (torch's conversion happens to saturate there) but e5m2 does, and one inf in K
turns a whole softmax row into NaN.

Scales come in two kinds (--kv-cache-scales, model service):
  - "one": 1.0 for every layer, vLLM's default without a calibrated checkpoint.
  - "warmup": the absolute maxima of K and V in the warmup pass, divided by 200 (K) and
    100 (V) as vLLM's calculate_kv_scales does, so the largest value seen lands well
    inside e4m3's 448 and unseen larger ones have headroom before they saturate.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.kv_geometry import dtype_name, is_fp8

SCALE_KINDS = ("one", "warmup")
DEFAULT_SCALES = "one"
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT (calculate_kv_scales).
K_SCALE_DIVISOR, V_SCALE_DIVISOR = 200.0, 100.0


@dataclass(frozen=True, slots=True)
class KvScales:
    """Per layer (k_scale, v_scale), float32 values kept as Python floats."""

    layers: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        for index, (k_scale, v_scale) in enumerate(self.layers):
            for value in (k_scale, v_scale):
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"layer {index}: KV scales must be finite and positive, got {k_scale}, {v_scale}")

    @classmethod
    def ones(cls, num_layers: int) -> KvScales:
        return cls(((1.0, 1.0),) * num_layers)

    @classmethod
    def from_absmax(cls, k_absmax: Sequence[float], v_absmax: Sequence[float]) -> KvScales:
        """vLLM's calculate_kv_scales: absmax / 200 for K, / 100 for V; a layer whose K or V
        was all zeros keeps 1.0 (nothing to scale, and a zero scale would divide by zero)."""
        def scale(absmax: float, divisor: float) -> float:
            value = float(torch.tensor(absmax / divisor, dtype=torch.float32))  # a float32 value
            return value if math.isfinite(value) and value > 0 else 1.0
        return cls(tuple((scale(k, K_SCALE_DIVISOR), scale(v, V_SCALE_DIVISOR))
                         for k, v in zip(k_absmax, v_absmax, strict=True)))

    def digest(self) -> str:
        """16 hex digits naming these exact float32 values."""
        data = torch.tensor(self.layers, dtype=torch.float32).numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:16]


def pool_absmax(pool: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer, the largest |K| and |V| in a [num_layers, 2, ...] pool of a 16- or 32-bit type."""
    absmax = pool.flatten(2).abs().amax(dim=2).float()  # [num_layers, 2]
    return absmax[:, 0].tolist(), absmax[:, 1].tolist()


def namespace_tag(kv_dtype: torch.dtype, scales: KvScales | None) -> str:
    """What is folded into the prefix namespace besides the checkpoint's fingerprint: empty
    for a 16- or 32-bit pool (its K/V are the model's own), else the dtype and the scales'
    digest, so a service with other scales never reads these blocks as its own."""
    if not is_fp8(kv_dtype):
        return ""
    if scales is None:
        raise ValueError("an fp8 pool needs KV scales")
    return f"kv={dtype_name(kv_dtype)}:{scales.digest()}"


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype`, clamped to its finite range (never inf, never e4m3's NaN)."""
    limit = torch.finfo(dtype).max
    scaled = x.float() if scale == 1.0 else x.float() / scale
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit tensor back in `dtype`, times its scale (for references and tests; attention
    folds the scale in elsewhere)."""
    out = x.to(torch.float32)
    if scale != 1.0:
        out = out * scale
    return out.to(dtype)
