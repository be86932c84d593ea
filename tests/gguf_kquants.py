"""Quantizers for llama.cpp's K types (Q4_K, Q5_K, Q6_K) in numpy, for writing test GGUF
files: gguf's Python package dequantizes these types but cannot quantize them.

Plain round-to-nearest with per-sub-block ranges, not llama.cpp's searched scales: the
blocks are valid, and gguf's dequantizer (the reference) reads them back to within a
quantization step, which tests/test_quant_kernels.py does not rely on and
test_kquant_writer_round_trips checks.
"""

from __future__ import annotations

import numpy as np


def _half(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _pack_scale_min(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (quant_blocks.h's k_scale_min, inverted)."""
    packed = np.zeros((scales.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (scales[:, 0:4] & 63) | ((scales[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mins[:, 0:4] & 63) | ((mins[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (scales[:, 4:8] & 15) | ((mins[:, 4:8] & 15) << 4)
    return packed


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    top = (1 << bits) - 1
    rows, cols = x.shape
    sub = x.reshape(-1, 8, 32).astype(np.float64)  # [superblocks, 8, 32]
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / top
    d = np.maximum(step.max(axis=-1), 1e-12) / 63
    dmin = np.maximum((-low).max(axis=-1), 1e-12) / 63
    scales = np.clip(np.rint(step / d[:, None]), 1, 63).astype(np.uint8)
    mins = np.clip(np.rint(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    d, dmin = d.astype(np.float16).astype(np.float64), dmin.astype(np.float16).astype(np.float64)
    q = np.rint((sub + (dmin[:, None] * mins)[..., None]) / (d[:, None] * scales)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8)  # [n, 8, 32]
    low4 = q & 15
    qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)  # sub-block 2i low, 2i+1 high nibbles
    parts = [_half(d).reshape(-1, 2), _half(dmin).reshape(-1, 2), _pack_scale_min(scales, mins)]
    if bits == 5:
        high = (q >> 4) & 1  # bit j of qh[l] is sub-block j's fifth bit of weight l
        qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
        for j in range(8):
            qh |= high[:, j] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    rows, cols = x.shape
    groups = x.reshape(-1, 16, 16).astype(np.float64)  # [superblocks, 16 groups, 16]
    step = np.abs(groups).max(axis=-1) / 31
    d = np.maximum(np.abs(step).max(axis=-1), 1e-12) / 127
    d = d.astype(np.float16).astype(np.float64)
    scales = np.clip(np.rint(step / d[:, None]), 1, 127).astype(np.int8)
    q = np.rint(groups / (d[:, None] * scales)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [n, half, k, l]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                         (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1).reshape(-1, 128)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, scales.view(np.uint8), _half(d).reshape(-1, 2)], axis=1)
    return blocks.reshape(rows, -1)


def quantize_k(x: np.ndarray, type_name: str) -> np.ndarray:
    """[rows, cols] float (cols a multiple of 256) -> [rows, bytes a row] uint8 blocks."""
    if x.shape[-1] % 256:
        raise ValueError(f"K types need rows of a multiple of 256 values, not {x.shape[-1]}")
    if type_name == "Q4_K":
        return _q45_k(x, 4)
    if type_name == "Q5_K":
        return _q45_k(x, 5)
    if type_name == "Q6_K":
        return _q6_k(x)
    raise ValueError(type_name)
