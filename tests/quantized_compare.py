"""Greedy decoding through the paged forward, and the near-tie rule by which tests of
quantized weights (test_quantized_model.py, test_int8_weights.py) compare greedy tokens:
equal, up to the first step where the reference's top two logits are within the stated
tolerance of each other (a near tie, which a quantization may flip)."""

from __future__ import annotations

import torch

from harness.paged_runner import PagedRunner


def greedy(model, config, tokenizer, prompt: str, steps: int) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """(prefill logits [len, vocab], greedy tokens, each step's logits [vocab])."""
    runner = PagedRunner(model, config)
    (prefill,) = runner.step([("a", tokenizer.encode(prompt))], num_decode_seqs=0)
    tokens, logits = [int(prefill[-1].argmax())], [prefill[-1]]
    for _ in range(steps - 1):
        (step,) = runner.step([("a", [tokens[-1]])], num_decode_seqs=1)
        tokens.append(int(step[-1].argmax()))
        logits.append(step[-1])
    return prefill, tokens, logits


def assert_equal_up_to_a_near_tie(tokens: list[int], reference: list[int], reference_logits: list[torch.Tensor],
                                  tolerance: float) -> None:
    for step, (ours, theirs) in enumerate(zip(tokens, reference, strict=True)):
        if ours != theirs:
            top2 = reference_logits[step].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin <= tolerance, (f"greedy tokens diverge at step {step} ({ours} != {theirs}) where the "
                                         f"reference's top-2 margin {margin:.4f} exceeds the tolerance {tolerance:.4f}")
            return
