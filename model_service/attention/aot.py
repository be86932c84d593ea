"""Compile the Triton kernels ahead of time for a GPU architecture, with no GPU present.

Triton compiles for any `GPUTarget` with its bundled ptxas; `cuobjdump -res-usage` on the
cubin then gives the registers a thread, its stack frame and its local memory. The kernels
call no functions and keep no local arrays, so a stack frame or local memory is registers
spilled (ptxas -v on the same PTX says "N bytes stack frame, N bytes spill stores"). The configurations are the launchers'
own (`decode_config`, `write_kv_config`, `reduce_config` in triton_kernels.py; LoRA's
`shrink_config` and `expand_config` in models/lora_triton.py), so what is compiled here is
what the backend and the model would launch. Used by tests/test_kernels_compile.py (a
representative set) and scripts/compile_kernels.py (the whole matrix).

Pointers are declared 16-byte aligned (as torch's allocations are) and every other integer
a plain int32: launch-time specialisation on a stride's divisibility can only simplify
address arithmetic, never add registers.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model_service.attention import triton_kernels
from model_service.models import lora_triton

# (name, capability): what pagedkv targets. sm_80 is A100, sm_90 is H100/H200.
ARCHITECTURES = {"sm_80": 80, "sm_90": 90}
TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 # An 8-bit pool's bytes: write_kv_triton stores K/V quantized in torch before
                 # the kernel, as uint8 (triton_kernels.py), so its write kernel is a u8 one.
                 torch.uint8: "u8"}
# Pointers not of the model's dtype: the decode kernel's tables, lengths and split partials,
# LoRA's segment bounds, factor tables (addresses and ranks), scalings and shrunk rows.
_INT32_POINTERS = {"tables_ptr", "lens_ptr", "bounds_ptr"}
_INT64_POINTERS = {"slot_ptr", "factors_ptr"}
_FP32_POINTERS = {"part_acc_ptr", "part_max_ptr", "part_sum_ptr", "scaling_ptr", "shrunk_ptr"}


@dataclass(frozen=True)
class CompiledReport:
    kernel: str
    arch: str
    dtype: str
    config: dict
    registers: int
    local_bytes: int
    stack_bytes: int  # where ptxas puts spilled registers
    seconds: float

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0 or self.stack_bytes > 0

    def row(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.config.items() if k not in ("num_warps",))
        return (f"{self.kernel:<16} {self.arch} {self.dtype:<4} {shown:<80} regs {self.registers:>3} "
                f"local {self.local_bytes:>5} B stack {self.stack_bytes:>4} B  {self.seconds:5.1f} s")


def decode_config(dtype: torch.dtype, group: int, head_dim: int, block_size: int, split: bool,
                  fp8_kind: int = 0) -> tuple:
    """dtype: the model's (q, out); fp8_kind (triton_kernels.FP8_KINDS): an 8-bit pool's
    K/V, read as bytes and widened in the kernel."""
    config = triton_kernels.decode_config(group, head_dim, block_size, fp8_kind)
    return "decode", triton_kernels._decode_kernel, dtype, {**config, "SPLIT": split}


def reduce_config(dtype: torch.dtype, head_dim: int, num_splits: int) -> tuple:
    return "reduce", triton_kernels._reduce_kernel, dtype, triton_kernels.reduce_config(head_dim, num_splits)


def write_kv_config(dtype: torch.dtype, kv_heads: int, head_dim: int, block_size: int) -> tuple:
    return "write_kv", triton_kernels._write_kv_kernel, dtype, triton_kernels.write_kv_config(kv_heads, head_dim, block_size)


def lora_shrink_config(dtype: torch.dtype, max_rank: int, longest: int) -> tuple:
    """dtype: the activations' and factors'; max_rank: the largest of a projection's ranks
    in a step; longest: the step's longest run of rows (decode runs or prefill ones)."""
    return "lora_shrink", lora_triton._shrink_kernel, dtype, lora_triton.shrink_config(max_rank, longest)


def lora_expand_config(dtype: torch.dtype, longest: int) -> tuple:
    return "lora_expand", lora_triton._expand_kernel, dtype, lora_triton.expand_config(longest)


def compile_kernel(kernel: str, fn, dtype: torch.dtype, config: dict, arch: str) -> CompiledReport:
    """Compile one kernel at one configuration for one architecture; raises on a compile error."""
    constants = {name: value for name, value in config.items() if name != "num_warps"}
    signature = {name: _argument_type(name, dtype, constants) if name not in constants else "constexpr"
                 for name in fn.arg_names}
    aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    started = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature, constants, aligned),
        target=GPUTarget("cuda", ARCHITECTURES[arch], 32),
        options={"num_warps": config.get("num_warps", 4)},
    )
    seconds = time.perf_counter() - started
    registers, local_bytes, stack_bytes = resource_usage(compiled.asm["cubin"])
    return CompiledReport(kernel, arch, TRITON_DTYPES[dtype], config, registers, local_bytes, stack_bytes, seconds)


def _argument_type(name: str, dtype: torch.dtype, constants: dict) -> str:
    if name == "kv_ptr" and constants.get("FP8_KIND"):
        return "*u8"  # decode_attention_triton hands an 8-bit pool over as its bytes
    if name in _INT32_POINTERS:
        return "*i32"
    if name in _FP32_POINTERS:
        return "*fp32"
    if name in _INT64_POINTERS:
        return "*i64"
    if name.endswith("_ptr"):
        return "*" + TRITON_DTYPES[dtype]
    if name in ("scale_log2", "out_scale"):
        return "fp32"
    return "i32"


def resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers, local bytes, stack bytes) of the cubin's one kernel, from cuobjdump."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.cubin"
        path.write_bytes(cubin)
        dump = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", str(path)],
                              check=True, capture_output=True, text=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", dump)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{dump}")
    registers, stack, local = (int(group) for group in match.groups())
    return registers, local, stack
