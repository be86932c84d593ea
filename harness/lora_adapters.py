"""LoRA adapters written by peft itself (get_peft_model + save_pretrained) over a Hugging Face
model, with random factors: peft starts lora_B at zero, which would make every adapter a
no-op, so both factors are drawn here. Tests (tests/lora_adapters.py) and the LoRA
benchmark (bench/serve/bench_lora.py) write theirs with it."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
