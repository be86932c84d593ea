"""What `--dtype auto` means: the dtype this machine computes the model fastest in, with
why (the model service logs both at start).

- CUDA: bfloat16.
- CPU, a Hugging Face checkpoint whose weights are stored in bfloat16 (what most ship as):
  bfloat16, kept as the file has them (half float32's memory, and half the bytes a decode
  step reads), wherever a kernel multiplies bfloat16 linears on this CPU: the C kernel at
  a SIMD level (AVX2 or AVX-512 BF16; cpu_kernels/bf16_matmul.py) or oneDNN's packed
  product where this CPU's oneDNN has bfloat16. Elsewhere float32: torch's own bfloat16
  product widens element by element.
- CPU, anything else (float32 or float16 checkpoints, GGUF files, whose floats are
  dequantized to --dtype, the tiny model, --quantization int8): float32, as before.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from model_service.cpu_kernels import bf16_matmul
from model_service.loading.gguf_file import is_gguf_spec
from model_service.loading.hf_weights import checkpoint_files
from model_service.models.packed_linear import packing_supported

# safetensors' dtype names
_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def stored_dtype(directory: Path) -> torch.dtype | None:
    """The float dtype most of a Hugging Face checkpoint's tensors are stored in (by
    count, read from the safetensors headers), or None where it holds none."""
    by_file: dict[Path, list[str]] = {}
    for name, path in checkpoint_files(directory).items():
        by_file.setdefault(path, []).append(name)
    counts: Counter[torch.dtype] = Counter()
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for name in names:
                stored = _STORED.get(handle.get_slice(name).get_dtype())
                if stored is not None:
                    counts[stored] += 1
    return counts.most_common(1)[0][0] if counts else None


def bf16_linears_on_cpu() -> str | None:
    """Who multiplies bfloat16 linears on this CPU at speed ("the C kernel at avx2", ...),
    or None where nothing would but torch's element-by-element path."""
    level = bf16_matmul.chosen_level()
    if level is not None and level > 0:
        return f"the C kernel at {bf16_matmul.LEVELS[level]}"
    if packing_supported("cpu", torch.bfloat16):
        return "oneDNN's packed bfloat16 product"
    return None


def auto_dtype(spec: str, device: torch.device, quantization: str = "none") -> tuple[torch.dtype, str]:
    """(dtype, why) for `--dtype auto`: see the module's doc."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA computes in bfloat16"
    directory = Path(spec).expanduser()
    if quantization != "none" or is_gguf_spec(spec) or not directory.is_dir():
        return torch.float32, "not a Hugging Face checkpoint of floats: float32 activations"
    stored = stored_dtype(directory)
    if stored != torch.bfloat16:
        return torch.float32, f"the checkpoint stores {str(stored).removeprefix('torch.')}"
    who = bf16_linears_on_cpu()
    if who is None:
        return torch.float32, "the checkpoint stores bfloat16, but this CPU has no bfloat16 product faster than float32"
    return torch.bfloat16, f"the checkpoint stores bfloat16, kept so: {who} multiplies it"


__all__ = ["auto_dtype", "bf16_linears_on_cpu", "stored_dtype"]
