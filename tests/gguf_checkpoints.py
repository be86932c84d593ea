"""Tiny random Llama checkpoints as GGUF files, written with gguf.GGUFWriter (no download).

    from tests.gguf_checkpoints import write_gguf
    path, hf_model = write_gguf(tmp_path / "tiny-q8_0.gguf", "Q8_0")

What llama.cpp's converter would write for a Hugging Face Llama: its metadata keys, its
tensor names, Q and K rows permuted into the interleaved RoPE layout, 2-D weights in the
chosen type and norms in F32, and a byte-level BPE tokenizer (trained in-process, as in
hf_checkpoints) as tokens, merges and token types. The transformers model returned is the
one written, before quantization.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from gguf_kquants import quantize_k

from harness.hf_checkpoints import BOS_ID, EOS_ID, write_tokenizer

ROPE_THETA = 10000.0
QUANT_TYPES = ("F32", "F16", "Q8_0", "Q4_0")
# What write_gguf can write: gguf quantizes the 32-weight types, gguf_kquants the K types
# (which need hidden and intermediate sizes that are multiples of 256).
WRITABLE_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|extra|>' + message['role'] + '\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|extra|>assistant\n' }}{% endif %}"
)
CONTROL, NORMAL = 3, 1
_TENSOR_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def byte_level_vocab(directory: Path) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges "a b", token types) of the test BPE tokenizer."""
    raw = json.loads(write_tokenizer(directory, add_bos=False).read_text())
    vocab = raw["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in raw["model"]["merges"]]
    special = {added["id"] for added in raw["added_tokens"] if added["special"]}
    types = [CONTROL if index in special else NORMAL for index in range(len(tokens))]
    return tokens, merges, types


def tiny_llama(vocab_size: int, seed: int = 0, tie_word_embeddings: bool = False, hidden_size: int = 64,
               intermediate_size: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # peaked logits, as in hf_checkpoints: greedy far from ties
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                gain = 4.0 if name.startswith("lm_head") else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * (gain / math.sqrt(param.shape[-1])))
    return model


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: rotate-half rows -> interleaved rows."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_tensors(model) -> dict[str, np.ndarray]:
    config = model.config
    tensors = {}
    for name, param in model.state_dict().items():
        array = param.float().numpy()
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = array
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = array
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                tensors["output.weight"] = array
        else:
            _, _, layer, *rest = name.split(".")
            module = ".".join(rest[:-1])
            if module == "self_attn.q_proj":
                array = permute(array, config.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = permute(array, config.num_key_value_heads)
            tensors[f"blk.{layer}.{_TENSOR_NAMES[module]}.{rest[-1]}"] = array
    return tensors


def write_gguf(path: Path, quant_type: str = "F32", *, seed: int = 0, architecture: str = "llama",
               tokenizer_model: str = "gpt2", chat_template: str | None = CHAT_TEMPLATE,
               extra_tensors: dict[str, np.ndarray] | None = None, tie_word_embeddings: bool = False,
               metadata: dict[str, int] | None = None, hidden_size: int = 64, intermediate_size: int = 128):
    """Writes the file; returns (path, the transformers model it was made from).
    `metadata`: uint32 keys written over the true ones (a hostile or broken file)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = byte_level_vocab(path.parent / f"{path.stem}-tokenizer")
    model = tiny_llama(len(tokens), seed, tie_word_embeddings, hidden_size, intermediate_size)
    config = model.config
    qtype = gguf.GGMLQuantizationType[quant_type]

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("pagedkv tiny test llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)  # replaces the key's earlier value
    for name, array in {**gguf_tensors(model), **(extra_tensors or {})}.items():
        if array.ndim != 2 or array.dtype != np.float32 or quant_type == "F32":
            writer.add_tensor(name, array)  # norms stay F32, as llama.cpp keeps them
        elif quant_type == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        elif quant_type.endswith("_K"):
            writer.add_tensor(name, quantize_k(array, quant_type), raw_dtype=qtype)
        else:  # the bytes of llama.cpp's blocks; the writer derives the shape from them
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model
