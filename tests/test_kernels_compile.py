"""Every Triton kernel compiled ahead of time for sm_80 (A100) and sm_90 (H100/H200), no GPU.

The kernels otherwise run only under Triton's interpreter here, which accepts code that
the GPU compiler rejects or spills. This compiles a representative set of what the backend
can launch (model dtypes, head dims 64 and 128, GQA groups 1-8, the smallest, usual and
largest allowed block sizes, split and whole-context decode, an 8-bit pool; LoRA's shrink
and expand for decode and prefill runs) with Triton's
bundled ptxas,
and fails on a compile error or any spilled register. scripts/compile_kernels.py compiles
the whole matrix, each configuration a compile of its own, too many for the suite.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's @triton.jit cannot be compiled
    pytest.skip("compiled kernels need TRITON_INTERPRET unset", allow_module_level=True)

import torch

from cache_service.core.pool import MAX_BLOCK_SIZE
from model_service.attention import aot

# (dtype, group, head_dim, block_size, split): each group pad (1, 2, 4, 8) and each head dim
# appear, groups that are not a power of two (3, 5, 6) too, and both ends of the block sizes.
DECODE = [
    (torch.bfloat16, 8, 128, 16, True),
    (torch.bfloat16, 8, 128, 16, False),
    (torch.float16, 1, 64, 16, True),
    (torch.bfloat16, 4, 128, 32, True),
    (torch.float16, 2, 64, 64, False),
    (torch.bfloat16, 6, 64, MAX_BLOCK_SIZE, True),
    (torch.float32, 5, 128, 1, False),
    (torch.bfloat16, 3, 128, 8, True),
]
# An 8-bit pool (--kv-cache-dtype fp8_e4m3): decode reads bytes and widens them (FP8_KIND 1),
# the write stores bytes (uint8). e5m2 (FP8_KIND 2) differs only in a constexpr shift;
# scripts/compile_kernels.py compiles it with the rest of the matrix.
DECODE_FP8 = [(torch.bfloat16, 8, 128, 16, True, 1)]
WRITE_KV = [(torch.bfloat16, 8, 128, 16), (torch.float16, 1, 64, MAX_BLOCK_SIZE), (torch.uint8, 8, 128, 16)]
REDUCE = [(torch.bfloat16, 128, 32), (torch.float32, 64, 2)]
# LoRA (models/lora_triton.py): the largest rank block, for a decode run and a prefill run
# (16- and 64-row blocks), in the dtypes that take the most registers there.
LORA_SHRINK = [(torch.bfloat16, 64, 1), (torch.float32, 64, 512)]
LORA_EXPAND = [(torch.bfloat16, 1), (torch.bfloat16, 512)]

CONFIGS = (
    [aot.decode_config(*args) for args in DECODE]
    + [aot.decode_config(*args) for args in DECODE_FP8]
    + [aot.write_kv_config(*args) for args in WRITE_KV]
    + [aot.reduce_config(*args) for args in REDUCE]
    + [aot.lora_shrink_config(*args) for args in LORA_SHRINK]
    + [aot.lora_expand_config(*args) for args in LORA_EXPAND]
)


def config_id(config: tuple) -> str:
    kernel, _, dtype, constants = config
    shown = "-".join(f"{name.lower()}{value}" if name == "FP8_KIND" else f"{value}"
                     for name, value in constants.items()
                     if name not in ("num_warps",) and "PAD" not in name and (name != "FP8_KIND" or value))
    return f"{kernel}-{aot.TRITON_DTYPES[dtype]}-{shown}"


@pytest.mark.parametrize("arch", sorted(aot.ARCHITECTURES))
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_kernel_compiles_without_spills(config, arch):
    report = aot.compile_kernel(*config, arch)
    print(report.row())
    assert not report.spills, f"registers spilled: {report.row()}"
    assert 0 < report.registers <= 255


def test_resource_usage_reads_a_spilling_kernel():
    # The check above can fail: the same decode kernel with a tile 16 times the one
    # decode_config picks for a group of 8 at head_dim 128 spills on sm_90.
    kernel, fn, dtype, constants = aot.decode_config(torch.bfloat16, 8, 128, 64, True)
    report = aot.compile_kernel(kernel, fn, dtype, {**constants, "TILE": 64}, "sm_90")
    assert report.spills, report.row()
