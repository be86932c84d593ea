"""Test LoRA adapters written by peft itself (get_peft_model + save_pretrained) over a Hugging
Face Llama of a given shape, with random factors: peft starts lora_B at zero, which would
make every adapter a no-op, so both factors are drawn here."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.paged_runner import PagedRunner
from model_service.models.config import ModelConfig

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_llama_of(config: ModelConfig):
    """A transformers Llama of `config`'s shapes (weights do not matter to an adapter file)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings)
    return LlamaForCausalLM(hf_config).eval()


def write_adapter(directory: Path, base, *, rank: int = 8, alpha: float = 16, targets=None, seed: int = 0,
                  use_rslora: bool = False, scale: float = 0.1) -> Path:
    """Saves a rank-`rank` adapter over `base` (a transformers model) into `directory`."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets or ALL_TARGETS), lora_dropout=0.0,
                      use_rslora=use_rslora)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, lora)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape) * scale)
    model.save_pretrained(str(directory))
    model.unload()  # the base goes back to its own modules for the next adapter
    return directory


def run_paged(loaded, sequences: dict[str, tuple[list[int], object]], steps: int):
    """Prefills every sequence in one step, then decodes them together: {seq: (tokens, logits)}."""
    runner = PagedRunner(loaded.model, loaded.config, seed=3)
    adapters = {seq: adapter for seq, (_, adapter) in sequences.items() if adapter is not None}
    outputs = runner.step([(seq, prompt) for seq, (prompt, _) in sequences.items()], 0, adapters)
    logits = {seq: [out] for seq, out in zip(sequences, outputs)}
    tokens = {seq: [int(out[-1].argmax())] for seq, out in zip(sequences, outputs)}
    for _ in range(steps - 1):
        outputs = runner.step([(seq, [tokens[seq][-1]]) for seq in sequences], len(sequences), adapters)
        for seq, out in zip(sequences, outputs):
            logits[seq].append(out)
            tokens[seq].append(int(out[-1].argmax()))
    return {seq: (tokens[seq], torch.cat(logits[seq])) for seq in sequences}
