"""`--weights native`: a GGUF file's quantized linears kept in their blocks on CPU.

Which linears stay quantized is planned per fused linear (QKV, gate/up, ...): all of its
tensors must have a kernel (cpu_kernels/quant_matmul.py's KERNEL_TYPES) for it to; any
other (F32 norms, F16 tensors, a type without a kernel) is dequantized at load as before
(gguf_weights.py). CUDA always dequantizes: the kernels are CPU code. The plan is logged
per type, so a person sees what is held how.

The blocks are copied out of the file's memory map (rows of Q and K put back into
Hugging Face's order, as gguf_weights does with floats) into one uint8 tensor per
segment of consecutive same-type rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import structlog
import torch
from torch import nn

from model_service.cpu_kernels import quant_matmul
from model_service.models.config import ModelConfig
from model_service.loading.gguf_file import GGUFFile
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

WEIGHTS_MODES = ("native", "dequantize")
EMBEDDING = "embed_tokens"


@dataclass(frozen=True, slots=True)
class NativeGroup:
    """One module held quantized: its path in the model and its GGUF tensors in row order,
    each with the head count whose RoPE row permutation to undo (0: none)."""

    module: str
    tensors: tuple[tuple[str, int], ...]


def linear_groups(config: ModelConfig) -> list[NativeGroup]:
    """Every module of LlamaForCausalLM that can hold blocks, with its GGUF tensors."""
    groups = [NativeGroup(EMBEDDING, (("token_embd.weight", 0),))]
    if not config.tie_word_embeddings:
        groups.append(NativeGroup("lm_head", (("output.weight", 0),)))
    for layer in range(config.num_layers):
        blk, ours = f"blk.{layer}", f"layers.{layer}"
        groups += [
            NativeGroup(f"{ours}.self_attn.qkv_proj", ((f"{blk}.attn_q.weight", config.num_heads),
                                                       (f"{blk}.attn_k.weight", config.num_kv_heads),
                                                       (f"{blk}.attn_v.weight", 0))),
            NativeGroup(f"{ours}.self_attn.o_proj", ((f"{blk}.attn_output.weight", 0),)),
            NativeGroup(f"{ours}.mlp.gate_up_proj", ((f"{blk}.ffn_gate.weight", 0), (f"{blk}.ffn_up.weight", 0))),
            NativeGroup(f"{ours}.mlp.down_proj", ((f"{blk}.ffn_down.weight", 0),)),
        ]
    return groups


def plan_native(file: GGUFFile, config: ModelConfig, mode: str, device: torch.device | str) -> list[NativeGroup]:
    """The groups to hold quantized (none for dequantize, CUDA, or no kernel library), and
    one log line saying which tensor types are held natively and which are dequantized."""
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"weights mode {mode!r}: expected one of {', '.join(WEIGHTS_MODES)}")
    log = structlog.get_logger()
    why = None
    if mode == "dequantize":
        why = "--weights dequantize"
    elif torch.device(device).type != "cpu":
        why = f"{torch.device(device).type} dequantizes at load (the quantized kernels are CPU code)"
    elif quant_matmul.load() is None:
        why = "the CPU kernel library did not build"
    planned = [] if why else [
        group for group in linear_groups(config)
        if all(int(file.tensors[name].tensor_type) in quant_matmul.KERNEL_TYPES for name, _ in group.tensors)
    ]
    native_names = {name for group in planned for name, _ in group.tensors}
    native = Counter(file.tensors[name].tensor_type.name for name in native_names)
    dequantized = Counter(tensor.tensor_type.name for name, tensor in file.tensors.items() if name not in native_names)
    log.info("gguf weights", native=dict(native), dequantized=dict(dequantized),
             **({"why_dequantized": why} if why else {}))
    return planned


def _segments(file: GGUFFile, group: NativeGroup) -> list[tuple[int, torch.Tensor]]:
    """The group's tensors as (type, blocks) segments, consecutive tensors of one type in
    one segment. Rows are copied straight from the memory map into the segment's tensor
    (Q and K rows through a permuted view): no temporary copy, which glibc would keep."""
    runs: list[tuple[int, list[tuple[str, int]]]] = []
    for name, heads in group.tensors:
        type_code = int(file.tensors[name].tensor_type)
        if runs and runs[-1][0] == type_code:
            runs[-1][1].append((name, heads))
        else:
            runs.append((type_code, [(name, heads)]))
    segments = []
    for type_code, members in runs:
        arrays = [file.tensors[name].data for name, _ in members]  # [rows, bytes a row] uint8 views
        blocks = torch.empty((sum(array.shape[0] for array in arrays), arrays[0].shape[1]), dtype=torch.uint8)
        destination, start = blocks.numpy(), 0
        for array, (_, heads) in zip(arrays, members, strict=True):
            rows, width = array.shape
            target = destination[start:start + rows]
            if heads:  # gguf_weights.unpermute_rope_rows, as a copy between views
                np.copyto(target.reshape(heads, 2, rows // heads // 2, width),
                          array.reshape(heads, rows // heads // 2, 2, width).transpose(0, 2, 1, 3))
            else:
                np.copyto(target, array)
            start += rows
        segments.append((type_code, blocks))
    return segments


def install_native(model: nn.Module, file: GGUFFile, groups: list[NativeGroup], dtype: torch.dtype) -> None:
    """Swaps each planned module for its quantized twin, holding the file's blocks. Call
    on the model still on the meta device: the modules it replaces never get memory."""
    config = model.config
    for group in groups:
        parts = _segments(file, group)
        if group.module == EMBEDDING:
            module = QuantizedEmbedding(parts[0][0], parts[0][1], config.hidden_size, dtype)
        else:
            module = QuantizedLinear(int(file.tensors[group.tensors[0][0]].shape[0]), parts)
        parent_name, _, child = group.module.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
    if config.tie_word_embeddings and isinstance(model.embed_tokens, QuantizedEmbedding):
        model.lm_head = model.embed_tokens.tied_linear()


def native_tensor_names(groups: list[NativeGroup]) -> set[str]:
    return {name for group in groups for name, _ in group.tensors}
