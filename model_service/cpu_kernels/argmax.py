"""Greedy sampling's argmax by the C kernel (csrc/argmax.c), in the logits' own dtype:
torch.argmax's answer (first index of the maximum, NaN largest) without a float32 copy.
Not on the serving path: sample/sampler.py's argmax_rows takes numpy's, which measured
faster (bench/kernels/argmax_paths.py compares them)."""

from __future__ import annotations

import ctypes

import torch

from model_service.cpu_kernels.build import DTYPE_CODES


def argmax_rows(library: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    # logits: [rows, cols > 0] on CPU, each row contiguous -> [rows] int64
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    library.argmax_rows(logits.data_ptr(), logits.stride(0), rows, cols, DTYPE_CODES[logits.dtype], out.data_ptr(),
                        torch.get_num_threads())
    return out
