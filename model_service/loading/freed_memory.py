"""Handing the pages a load freed back to the kernel.

glibc serves allocations under its mmap threshold (which grows up to 32 MB as larger
blocks are freed) from its heaps, and keeps freed heap pages resident until trimmed.
A load frees many such blocks: a GGUF file's tensors dequantized before their copy into
the model, and a bfloat16 model's plain weights once packed (packed_linear.py), between
allocations that stay. Nothing else in the model service would reuse those pages, so
untrimmed they are resident memory a load leaves for nothing; trimmed, what a load grows
by (SmolLM2 in bfloat16, with neither gguf's parse of the metadata, gguf_file.py, nor
torch's Python meta kernels, meta_build.py, staying) is its weights, the tokenizer and
the RoPE tables."""

from __future__ import annotations

import ctypes

from pagedkv import libc


def return_freed_memory() -> None:
    """glibc's malloc_trim(0): every arena's free pages go back; a no-op without glibc."""
    trim = libc.function("malloc_trim", [ctypes.c_size_t])
    if trim is not None:
        trim(0)
