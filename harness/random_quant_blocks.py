"""Random blocks of GGUF's quantized types for the kernels' tests and benchmarks
(tests/test_quant_kernels.py, bench/kernels/quant_product.py): random bytes, but finite float16
scales (and mins of either sign), where random bytes could be NaN."""

from __future__ import annotations

import numpy as np

from model_service.cpu_kernels import quant_matmul

# Byte offsets of each type's float16 fields in a block.
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def random_blocks(type_code: int, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, row bytes] of random blocks with finite scales (and mins of either sign)."""
    generator = np.random.default_rng(seed)
    weights, size = quant_matmul.BLOCK_SIZES[type_code]
    blocks = generator.integers(0, 256, size=(rows, cols // weights, size), dtype=np.uint8)
    for offset in HALF_FIELDS[type_code]:
        halves = (generator.standard_normal((rows, cols // weights)) * 0.02).astype(np.float16)
        blocks[:, :, offset:offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)
