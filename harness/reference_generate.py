"""transformers as the reference: its greedy generate from token ids, and the random
prompts the tests feed both it and the services."""

from __future__ import annotations

import torch


def reference_output(model, prompt: list[int], max_new_tokens: int, eos_token_id=None, **kwargs):
    """transformers' greedy `generate` on `model` (on its device), from one prompt of token
    ids. eos_token_id None: no end of sequence, so it runs to max_new_tokens. kwargs go to
    generate as they are (min_new_tokens, repetition_penalty, output_logits, ...)."""
    if eos_token_id is None:
        kwargs.setdefault("min_new_tokens", max_new_tokens)
    device = model.device
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos_token_id, pad_token_id=0,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device), **kwargs)


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos_token_id=None, **kwargs) -> list[int]:
    """The token ids transformers' greedy generate adds to `prompt` (see reference_output)."""
    return reference_output(model, prompt, max_new_tokens, eos_token_id, **kwargs)[0, len(prompt):].tolist()


def prompt_ids(length: int, seed: int, vocab: int = 300) -> list[int]:
    """`length` random token ids in [4, vocab), the same for a seed on every machine."""
    return torch.randint(4, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
