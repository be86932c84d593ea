"""`--quantization int8`: a Hugging Face checkpoint's linears and embedding quantized to
8 bits at load, held as GGUF Q8_0 blocks on CPU and multiplied by the integer kernels of
cpu_kernels/quant_matmul.py (the ones `--weights native` uses for a GGUF file).

Q8_0 is one float16 scale per 32 consecutive weights of a row (amax / 127) and 32 int8
values: a scale per block of 32 rather than one per output channel, which the kernels
take as they are and which is finer (a row of 4,096 weights has 128 scales), at 34 bytes
per 32 weights (1.0625 bytes a weight: 27 % of float32, 53 % of bfloat16). The blocks
are gguf's quantizer's (llama.cpp's reference one, to the bit), so the kernels' tests on
gguf's blocks cover them.

Each tensor is read from the safetensors file and quantized into its rows of the
module's blocks, a chunk of rows at a time: no float copy of a whole module is kept.
A module whose input width is not a multiple of 32 stays in floats (logged). Norms and
biases stay in --dtype. CPU only: the kernels are CPU code (server.py refuses CUDA).
"""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors import safe_open
from torch import nn

from model_service.cpu_kernels import quant_matmul
from model_service.errors import ModelLoadError
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from model_service.loading.hf_weights import expected_tensors

QUANTIZATIONS = ("none", "int8")
Q8_0 = 8  # ggml's type code
BLOCK = 32
# Rows quantized at once: bounds the float32 temporaries (a 128k-row embedding would be 2 GB).
CHUNK_ROWS = 1024


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """weight [rows, cols] (cols a multiple of 32, any float dtype) -> Q8_0 blocks, uint8
    [rows, cols / 32 × 34], by gguf's quantizer (llama.cpp's quantize_row_q8_0_ref), a
    chunk of rows at a time."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"Q8_0 needs a multiple of {BLOCK} columns, got {cols}")
    out = torch.empty((rows, cols // BLOCK * 34), dtype=torch.uint8)
    for start in range(0, rows, CHUNK_ROWS):
        values = weight[start:start + CHUNK_ROWS].to(torch.float32).numpy()
        out[start:start + CHUNK_ROWS] = torch.from_numpy(quantize(values, GGMLQuantizationType.Q8_0))
    return out


def _quantizable(module: nn.Module) -> int | None:
    """The input width of a linear or embedding the kernels can take, else None."""
    if isinstance(module, nn.Linear):
        width = module.in_features
    elif isinstance(module, nn.Embedding):
        width = module.embedding_dim
    else:
        return None
    return width if width % BLOCK == 0 else None


def install_int8(model: nn.Module, files: dict[str, Path], dtype: torch.dtype) -> set[str]:
    """Swaps the linears and the embedding of `model` (still on the meta device) for Q8_0
    twins filled from the checkpoint; returns the checkpoint tensor names now loaded, for
    load_weights to skip. Biases stay parameters (on meta) for load_weights to fill."""
    if quant_matmul.load() is None:
        raise ModelLoadError("--quantization int8 needs the CPU kernel library, which did not build "
                             "(a C compiler and OpenMP; see the log's cpu_kernels lines)")
    config = model.config
    targets = {name: target for name, target in expected_tensors(config).items()
               if target.param_name.endswith(".weight")}
    modules: dict[str, tuple[nn.Module, int, torch.Tensor]] = {}  # path -> (module, width, blocks)
    skipped: list[str] = []
    for target in targets.values():
        path = target.param_name.removesuffix(".weight")
        if path in modules or path in skipped:
            continue
        module = model.get_submodule(path)
        width = _quantizable(module)
        if width is None:
            skipped.append(path)
            continue
        rows = module.weight.shape[0]
        modules[path] = (module, width, torch.empty((rows, quant_matmul.row_bytes(Q8_0, width)), dtype=torch.uint8))

    loaded: set[str] = set()
    by_file: dict[Path, list[str]] = {}
    for name, target in targets.items():
        # A tensor the checkpoint lacks is left to load_weights, which names every one.
        if target.param_name.removesuffix(".weight") in modules and name in files:
            by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for name in names:
                target = targets[name]
                _, width, blocks = modules[target.param_name.removesuffix(".weight")]
                tensor = handle.get_tensor(name)
                expected = (target.row_end - target.row_start, width)
                if tuple(tensor.shape) != expected:
                    raise ModelLoadError(f"{name} in {path.name} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {expected}")
                blocks[target.row_start:target.row_end] = quantize_q8_0(tensor)
                loaded.add(name)

    for path, (module, width, blocks) in modules.items():
        if isinstance(module, nn.Embedding):
            twin = QuantizedEmbedding(Q8_0, blocks, width, dtype)
        else:
            bias = None if module.bias is None else torch.empty(module.bias.shape, device="meta")
            twin = QuantizedLinear(width, [(Q8_0, blocks)], bias=bias)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, twin)
    if config.tie_word_embeddings and isinstance(model.embed_tokens, QuantizedEmbedding):
        model.lm_head = model.embed_tokens.tied_linear()
    structlog.get_logger().info("int8 weights", quantized_modules=len(modules),
                                held_bytes=sum(blocks.numel() for _, _, blocks in modules.values()),
                                kept_in_floats=skipped or None,
                                **({"why_kept": f"input width not a multiple of {BLOCK}"} if skipped else {}))
    return loaded
