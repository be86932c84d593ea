"""Tiny random checkpoints in Hugging Face format, written with transformers (no download).

    from harness.hf_checkpoints import write_checkpoint
    path = write_checkpoint("llama", tmp_path / "llama")   # config.json, model.safetensors,
                                                           # tokenizer.json, generation_config.json

Kinds (CHECKPOINT_KINDS):
- "llama": GQA (4 heads, 2 KV heads), llama3 rope scaling whose original context (64) is
  short enough that the scaling changes the frequencies; generation_config eos is a list.
- "llama-sharded": the same model saved in several safetensors shards with an index.
- "llama-mha-bias": full multi-head attention (4 KV heads for 4 heads) and attention_bias,
  which in transformers' Llama puts a bias on q/k/v and on o_proj; plain RoPE.
- "mistral": head_dim (32) != hidden / heads (16), sliding_window 7 on every layer: shorter
  than the test sequences and not a multiple of any block size the tests use.
- "qwen2": tied embeddings, q/k/v bias, one KV head (MQA); generation_config eos is an int.
- "qwen2-window": qwen2 with use_sliding_window, window 6, max_window_layers 1: layer 0
  attends to everything, layer 1 to its window (as transformers applies Qwen2's flags).

Weights are redrawn at a larger scale than transformers' init (std 0.02 gives near-uniform
logits): logits are then peaked and greedy comparisons are far from ties.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

CHECKPOINT_KINDS = ("llama", "llama-sharded", "llama-mha-bias", "mistral", "qwen2", "qwen2-window")
MISTRAL_WINDOW, QWEN2_WINDOW = 7, 6
VOCAB_SIZE = 384  # the tokenizer uses fewer ids; checkpoints often pad their vocab
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|extra|>"]
UNK_ID, BOS_ID, EOS_ID, EXTRA_ID = 0, 1, 2, 3
MAX_POSITION_EMBEDDINGS = 512

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "A block table maps logical token positions to physical blocks.",
    "Continuous batching mixes prefill chunks with decode steps.",
    "Grüße aus München, naïve café, 日本語のテキスト, emoji 🙂.",
]


def write_tokenizer(directory: Path, *, add_bos: bool = True) -> Path:
    """A byte-level BPE trained in-process on a few sentences; returns tokenizer.json's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return path


def _hf_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-5,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if kind in ("llama", "llama-sharded"):
        return LlamaConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **common,
        )
    if kind == "llama-mha-bias":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, attention_bias=True, **common)
    if kind == "mistral":
        return MistralConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=MISTRAL_WINDOW, **common
        )
    if kind in ("qwen2", "qwen2-window"):
        window = dict(use_sliding_window=True, sliding_window=QWEN2_WINDOW, max_window_layers=1)
        return Qwen2Config(
            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1000000.0,
            **(window if kind == "qwen2-window" else {}), **common,
        )
    raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {CHECKPOINT_KINDS}")


def _randomize(model: torch.nn.Module, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                gain = 4.0 if name.startswith("lm_head") else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * (gain / math.sqrt(param.shape[-1])))


def write_checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    """Write a checkpoint of `kind` into `directory` (created); returns the directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _hf_config(kind)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    _randomize(model, torch.Generator().manual_seed(seed))
    shard = "40KB" if kind == "llama-sharded" else "50GB"
    model.save_pretrained(directory, max_shard_size=shard)
    eos = [EOS_ID, EXTRA_ID] if kind.startswith("llama") else EOS_ID
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=eos).save_pretrained(directory)
    write_tokenizer(directory, add_bos=not kind.startswith("qwen2"))
    return directory
