"""`--model tiny`: a small Llama built deterministically in-process, with a byte tokenizer.

Meaningless text, real machinery: the same code path as a checkpoint from disk (GQA, RoPE,
paged attention), so the whole stack runs and is tested with nothing on disk. Weights are
drawn from a fixed-seed CPU generator, so every process (and every test) gets the same
model bit for bit, and greedy outputs are reproducible across restarts.
"""

from __future__ import annotations

import math

import torch

from model_service.models.config import ModelConfig
from model_service.models.llama import AttentionFn, LlamaForCausalLM
from model_service.text.tokenizer import ByteTokenizer

TINY_SEED = 20240601


def tiny_config() -> ModelConfig:
    tokenizer = ByteTokenizer()
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tokenizer.vocab_size,  # 256 bytes + <s>, </s>, <pad>, <unk>
        hidden_size=64,
        intermediate_size=172,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        eos_token_ids=tokenizer.eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
    )


def build_tiny_model(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    attention: AttentionFn | None = None,
    attention_backend: str = "auto",
) -> LlamaForCausalLM:
    config = tiny_config()
    model = LlamaForCausalLM(config, attention=attention, attention_backend=attention_backend)
    generator = torch.Generator(device="cpu").manual_seed(TINY_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm gains near one so no layer is silenced.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name == "embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                # Scaled so activations keep their size through the layers and the logits
                # are peaked: greedy choices are then far from ties, robust to the
                # reduction order of different attention kernels and batch shapes.
                fan_in = param.shape[-1]
                gain = 4.0 if name == "lm_head.weight" else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * (gain / math.sqrt(fan_in)))
    model.rotary.reset_cache(dtype=dtype)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
