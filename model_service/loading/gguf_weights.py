"""Load a GGUF file's tensors into the fused layout of LlamaForCausalLM.

Each tensor is dequantized by gguf's own dequantizer (llama.cpp's block formats, in numpy)
to float32 and copied into its parameter, which converts it to --dtype: quantized files are
served at the precision of --dtype, with the rounding the file's quantization made. Names,
shapes and tensor types are all checked before anything is copied, so a wrong file fails at
once and says why.

llama.cpp's converter reorders the rows of every Q and K projection, within each head, from
Hugging Face's rotate-half RoPE layout to the interleaved one its kernels use; the rows are
put back here (the inverse of its `permute`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from model_service.errors import ModelLoadError
from model_service.models.config import ModelConfig
from model_service.loading.gguf_file import GGUFFile
from model_service.models.llama import LlamaForCausalLM
from model_service.loading.hf_weights import describe_tensor_mismatch

# The tensor types accepted, each one gguf.quants dequantizes; a file with another is refused.
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
)


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one GGUF tensor goes: rows of a parameter, and the head count whose RoPE row
    permutation to undo (0: none)."""

    param_name: str
    row_start: int
    row_end: int
    # The tensor's shape as PyTorch writes it (rows, columns) or (n,).
    shape: tuple[int, ...]
    unpermute_heads: int = 0


def expected_gguf_tensors(config: ModelConfig) -> dict[str, _Target]:
    """llama.cpp tensor name -> where it lands in LlamaForCausalLM."""
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    vocab = config.vocab_size
    targets = {
        "token_embd.weight": _Target("embed_tokens.weight", 0, vocab, (vocab, hidden)),
        "output_norm.weight": _Target("norm.weight", 0, hidden, (hidden,)),
    }
    if not config.tie_word_embeddings:
        targets["output.weight"] = _Target("lm_head.weight", 0, vocab, (vocab, hidden))
    for layer in range(config.num_layers):
        blk, ours = f"blk.{layer}", f"layers.{layer}"
        qkv = f"{ours}.self_attn.qkv_proj.weight"
        gate_up = f"{ours}.mlp.gate_up_proj.weight"
        targets.update({
            f"{blk}.attn_norm.weight": _Target(f"{ours}.input_layernorm.weight", 0, hidden, (hidden,)),
            f"{blk}.ffn_norm.weight": _Target(f"{ours}.post_attention_layernorm.weight", 0, hidden, (hidden,)),
            f"{blk}.attn_q.weight": _Target(qkv, 0, q, (q, hidden), unpermute_heads=config.num_heads),
            f"{blk}.attn_k.weight": _Target(qkv, q, q + kv, (kv, hidden), unpermute_heads=config.num_kv_heads),
            f"{blk}.attn_v.weight": _Target(qkv, q + kv, q + 2 * kv, (kv, hidden)),
            f"{blk}.attn_output.weight": _Target(f"{ours}.self_attn.o_proj.weight", 0, hidden, (hidden, q)),
            f"{blk}.ffn_gate.weight": _Target(gate_up, 0, inter, (inter, hidden)),
            f"{blk}.ffn_up.weight": _Target(gate_up, inter, 2 * inter, (inter, hidden)),
            f"{blk}.ffn_down.weight": _Target(f"{ours}.mlp.down_proj.weight", 0, hidden, (hidden, inter)),
        })
    return targets


def check_gguf_tensors(file: GGUFFile, config: ModelConfig) -> dict[str, _Target]:
    """The name -> target map, once every expected tensor is present, no other is, and each
    has a type gguf can dequantize; ModelLoadError naming what is wrong otherwise."""
    targets = expected_gguf_tensors(config)
    missing = sorted(set(targets) - set(file.tensors))
    unexpected = sorted(set(file.tensors) - set(targets))
    if missing or unexpected:
        raise ModelLoadError(f"{file.path} does not match its {config.architecture} metadata: "
                             + describe_tensor_mismatch(missing, unexpected))
    unsupported = sorted(
        (name, tensor.tensor_type.name) for name, tensor in file.tensors.items()
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES
    )
    if unsupported:
        shown = ", ".join(f"{name} ({kind})" for name, kind in unsupported[:5])
        raise ModelLoadError(
            f"{file.path}: {len(unsupported)} tensors have a type pagedkv cannot dequantize: {shown}; "
            f"supported: {', '.join(kind.name for kind in SUPPORTED_TENSOR_TYPES)}"
        )
    # Before the model is allocated: the metadata's sizes are what it allocates, and a small
    # file may claim any (embedding 65,536 and vocab 1M: 262 GB); the tensors' own shapes
    # must agree with them, and the reader has checked that the tensors' bytes are in the file.
    wrong = [(name, tuple(reversed([int(n) for n in file.tensors[name].shape])), target.shape)
             for name, target in targets.items()
             if tuple(reversed([int(n) for n in file.tensors[name].shape])) != target.shape]
    if wrong:
        shown = "; ".join(f"{name} is {found}, the metadata implies {implied}" for name, found, implied in wrong[:3])
        raise ModelLoadError(f"{file.path}: {len(wrong)} tensors do not have the shapes its metadata implies: "
                             f"{shown}")
    return targets


def load_gguf_weights(model: LlamaForCausalLM, file: GGUFFile, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """Copy (dequantized, un-permuted) every tensor of `file` but those in `skip` (held in
    their blocks, gguf_native.py) into `model`'s parameters."""
    targets = check_gguf_tensors(file, model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, target in targets.items():
            if name in skip:
                continue
            tensor = file.tensors[name]
            destination = params[target.param_name][target.row_start : target.row_end]
            values = dequantize(tensor.data, tensor.tensor_type)  # float32, [rows, columns] or [n]
            if tuple(values.shape) != tuple(destination.shape):
                raise ModelLoadError(
                    f"{file.path}: {name} has shape {tuple(values.shape)}, its metadata implies "
                    f"{tuple(destination.shape)}"
                )
            weights = torch.from_numpy(values if values.flags.writeable else np.array(values))
            if target.unpermute_heads:
                weights = unpermute_rope_rows(weights, target.unpermute_heads)
            destination.copy_(weights)


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: within each head it wrote row 2i + j from Hugging
    Face's row j * head_dim/2 + i (j in {0, 1}: the two halves RoPE rotates together)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
