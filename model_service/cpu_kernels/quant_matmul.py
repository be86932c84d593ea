"""Products with weights held in GGUF's quantized blocks, by the C kernels of
csrc/quant_matmul.c: which instruction-set level runs, the linear (integer dot products;
for many tokens of rows not interleaved, bfloat16 on dequantized tiles: float_product),
and rows dequantized (an embedding lookup).

The level is the best this CPU has (`quant_best_level`), or a lower one named by
PAGEDKV_QUANT_KERNELS (portable, avx2, avx512_vnni): so a test, or a person comparing,
can run each. A level above what the CPU has runs the CPU's best instead (one setting
serves a fleet of mixed CPUs) rather than crashing on an illegal instruction. levels.py
chooses, once per process, and logs why.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from model_service.cpu_kernels import levels
from model_service.cpu_kernels.build import DTYPE_CODES, load

LEVELS = ("portable", "avx2", "avx512_vnni")
LEVEL_ENV = "PAGEDKV_QUANT_KERNELS"
# ggml type code -> name, the types the kernels take (gguf.GGMLQuantizationType's values)
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
# type -> (weights, bytes) per block
BLOCK_SIZES = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
               14: (256, 210)}
# A type's code with this bit: its blocks with eight rows interleaved (csrc/quant_x8.h),
# the layout Q4_0, Q4_1 and Q8_0 rows are held in when their count is a multiple of 8.
X8 = 0x100
X8_TYPES = (2, 3, 8)
REPACK_ENV = "PAGEDKV_QUANT_REPACK"  # 0: hold every type as the file has it (to compare)

FAMILY = levels.register(levels.Family(
    name="quantized products", env=LEVEL_ENV, levels=LEVELS, best="quant_best_level",
    requires={"avx2": "AVX2 and FMA", "avx512_vnni": "AVX-512 VNNI, BW and VL"}, clamp=True))


def base_type(type_code: int) -> int:
    return type_code & ~X8


def type_name(type_code: int) -> str:
    """The file's name of the type (Q4_1), whatever layout its blocks are held in."""
    return KERNEL_TYPES[base_type(type_code)]


def row_bytes(type_code: int, cols: int) -> int:
    weights, size = BLOCK_SIZES[base_type(type_code)]
    return cols // weights * size


def repack(library: ctypes.CDLL, type_code: int, blocks: torch.Tensor) -> int:
    """The type code to hold `blocks` under: Q4_0, Q4_1 and Q8_0 rows in eights are
    rearranged in place into interleaved groups (what their kernels read fastest) and get
    that layout's code; other blocks stay as they are, under their own code."""
    if (type_code not in X8_TYPES or blocks.shape[0] % 8 != 0 or not blocks.is_contiguous()
            or os.environ.get(REPACK_ENV, "1").strip() == "0"):
        return type_code
    cols = blocks.shape[1] // BLOCK_SIZES[type_code][1] * BLOCK_SIZES[type_code][0]
    code = library.quant_repack_x8(blocks.data_ptr(), type_code, blocks.shape[0], cols)
    if code < 0:
        raise RuntimeError(f"quant_repack_x8 failed ({code}) for {KERNEL_TYPES[type_code]} {tuple(blocks.shape)}")
    return code


def best_level(library: ctypes.CDLL | None = None) -> int:
    return levels.best(FAMILY.name)


def chosen_level(library: ctypes.CDLL | None = None) -> int:
    """The level the model's linears use: the CPU's best, or PAGEDKV_QUANT_KERNELS's if lower."""
    return LEVELS.index(levels.choose(FAMILY.name))


class Segments:
    """The rows of one linear as the C call takes them: (type, blocks) runs, stacked. The
    blocks tensors are held here, so the pointers stay valid."""

    def __init__(self, parts: Sequence[tuple[int, torch.Tensor]], cols: int) -> None:
        self.parts = [(type_code, blocks.contiguous()) for type_code, blocks in parts]
        for type_code, blocks in self.parts:
            if base_type(type_code) not in KERNEL_TYPES or (type_code & X8 and base_type(type_code) not in X8_TYPES):
                raise ValueError(f"ggml type {type_code} has no kernel")
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(type_code, cols):
                raise ValueError(f"blocks of type {type_name(type_code)} for {cols} columns must be uint8 "
                                 f"[rows, {row_bytes(type_code, cols)}], got {blocks.dtype} {tuple(blocks.shape)}")
            if type_code & X8 and blocks.shape[0] % 8:
                raise ValueError(f"interleaved {type_name(type_code)} blocks come in groups of 8 rows, "
                                 f"got {blocks.shape[0]}")
        self.cols = cols
        self.rows = sum(blocks.shape[0] for _, blocks in self.parts)
        # Interleaved rows multiply in integers at every token count (FLOAT_PRODUCT_TOKENS).
        self.interleaved = all(type_code & X8 for type_code, _ in self.parts)
        count = len(self.parts)
        self.pointers = (ctypes.c_int64 * count)(*(blocks.data_ptr() for _, blocks in self.parts))
        self.types = (ctypes.c_int32 * count)(*(type_code for type_code, _ in self.parts))
        self.row_counts = (ctypes.c_int32 * count)(*(blocks.shape[0] for _, blocks in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(blocks.numel() for _, blocks in self.parts)


# From this many tokens on, a product of rows held as the file's blocks is faster in
# bfloat16 on weights dequantized a tile at a time (oneDNN, AMX where the CPU has it) than
# by the integer kernel, whose time grows with every token (BENCHMARKS.md, "One call a
# decode step, and the kernels again": even at 16 tokens, 2.7x faster at 48 for a 3072 x
# 576 projection). Interleaved rows (X8) are not: their kernel unpacks a sub-block once
# for a tile of tokens, and at the AVX-512 level takes sixteen rows a vector, which
# measured 2.1-4.9x faster than the float product at 48 tokens and 1.4-4.3x at 256
# (BENCHMARKS.md, "Token tiles").
FLOAT_PRODUCT_TOKENS = 16
# Rows dequantized at a time: a tile of at most this many bytes of bfloat16 weights.
FLOAT_TILE_BYTES = 4 << 20
_FLOAT_PRODUCT_DTYPES = (torch.float32, torch.bfloat16)


def linear(library: ctypes.CDLL, x: torch.Tensor, segments: Segments, level: int,
           float_from: int | None = FLOAT_PRODUCT_TOKENS) -> torch.Tensor:
    """x [T, cols] (float32, bfloat16 or float16 on CPU, rows any distance apart) -> [T, rows].
    From `float_from` tokens on (None: never), a float32 or bfloat16 x at a SIMD level is
    multiplied by float_product instead of the integer kernel, unless every row is
    interleaved."""
    tokens = x.shape[0]
    if (float_from is not None and tokens >= float_from and x.dtype in _FLOAT_PRODUCT_DTYPES and level > 0
            and not segments.interleaved):
        return float_product(library, x, segments, level)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, segments.rows), dtype=x.dtype)
    if tokens == 0:
        return out
    status = library.quant_linear(x.data_ptr(), x.stride(0), tokens, segments.cols, DTYPE_CODES[x.dtype],
                                  len(segments.parts), segments.pointers, segments.types, segments.row_counts,
                                  out.data_ptr(), out.stride(0), level, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"quant_linear failed ({status}) for {segments.cols} columns")
    return out


def float_product(library: ctypes.CDLL, x: torch.Tensor, segments: Segments, level: int) -> torch.Tensor:
    """x [T, cols] times the weights in bfloat16, dequantized a tile of rows at a time into
    one scratch tile (FLOAT_TILE_BYTES at most: a vocabulary's lm_head never has a whole
    float copy), each tile one F.linear. Rounding: x to bfloat16 (finer than the integer
    kernel's 8 bits per value), each weight's float value to bfloat16, and the product,
    summed in float32, to bfloat16 (what F.linear gives for bfloat16 operands)."""
    tokens, cols = x.shape
    rows = segments.rows
    tile_rows = max(16, min(rows, FLOAT_TILE_BYTES // (2 * cols)))
    tile_rows -= tile_rows % 8  # interleaved groups of 8 rows are dequantized whole
    tile = torch.empty((tile_rows, cols), dtype=torch.bfloat16)
    x16 = x.to(torch.bfloat16)
    out = torch.empty((tokens, rows), dtype=x.dtype)
    for begin in range(0, rows, tile_rows):
        end = min(rows, begin + tile_rows)
        weights = tile[:end - begin]
        status = library.quant_dequantize_linear(len(segments.parts), segments.pointers, segments.types,
                                                 segments.row_counts, cols, begin, end, weights.data_ptr(),
                                                 DTYPE_CODES[torch.bfloat16], level, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"quant_dequantize_linear failed ({status}) for {cols} columns")
        out[:, begin:end] = F.linear(x16, weights)
    return out


def quantize_activations(library: ctypes.CDLL, x: torch.Tensor, level: int) -> tuple[torch.Tensor, ...]:
    """x [T, cols] as quant_linear quantizes it at `level`: (q int8 [T, cols], d [T, cols/32],
    scaled half-block sums [T, cols/16], integer sums [T, cols/32])."""
    x = x.contiguous()
    tokens, cols = x.shape
    q = torch.empty((tokens, cols), dtype=torch.int8)
    d = torch.empty((tokens, cols // 32))
    sums = torch.empty((tokens, cols // 16))
    isums = torch.empty((tokens, cols // 32), dtype=torch.int32)
    status = library.quant_quantize_activations(x.data_ptr(), cols, tokens, cols, DTYPE_CODES[x.dtype], level,
                                                q.data_ptr(), d.data_ptr(), sums.data_ptr(), isums.data_ptr())
    if status != 0:
        raise RuntimeError(f"quant_quantize_activations failed ({status}) for {cols} columns")
    return q, d, sums, isums


def dequantize_rows(library: ctypes.CDLL, blocks: torch.Tensor, type_code: int, cols: int,
                    indices: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows `indices` (int64; None: all) of the blocks, dequantized to dtype: [n, cols]."""
    if indices is not None:
        indices = indices.to(torch.int64).contiguous()
    count = blocks.shape[0] if indices is None else indices.numel()
    out = torch.empty((count, cols), dtype=dtype)
    status = library.quant_dequantize_rows(blocks.data_ptr(), type_code, cols,
                                           None if indices is None else indices.data_ptr(), count,
                                           out.data_ptr(), DTYPE_CODES[dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"quant_dequantize_rows failed ({status}) for type {type_code}, {cols} columns")
    return out


__all__ = ["FAMILY", "FLOAT_PRODUCT_TOKENS", "KERNEL_TYPES", "LEVELS", "X8", "Segments", "base_type", "chosen_level",
           "dequantize_rows", "float_product", "linear", "load", "quantize_activations", "repack", "row_bytes",
           "type_name"]
