"""Test LoRA adapters: harness/lora_adapters.py writes them with peft over a Hugging Face Llama
of a given shape (hf_llama_of); run_paged runs sequences under them through the paged model."""

from __future__ import annotations

import torch

from harness.lora_adapters import ALL_TARGETS, write_adapter  # noqa: F401 - the tests import them from here
from harness.paged_runner import PagedRunner
from model_service.models.config import ModelConfig


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
