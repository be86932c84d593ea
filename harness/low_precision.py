"""Comparing 16-bit outputs with transformers': a tolerance fit for the dtype, and greedy
generations compared up to the first near tie (vLLM's check_logprobs_close idea).

Two outputs computed in a 16-bit dtype by different (both correct) code differ by rounding,
so logits are compared within `dtype_tolerance`: ULPS units of the dtype's rounding at the
scale of the logits. Greedy generations must agree token for token until the first
position where transformers' own top-2 logits are within that tolerance (a near tie that
rounding may break either way); there our token must be one of those transformers scores
within the tolerance of its best (its runner-up, or any of three or more tied in bfloat16's
coarse steps), and the comparison stops, since the two continuations then differ.

Used by tests/test_low_precision_vs_transformers.py and checks/gpu_check.py.
"""

from __future__ import annotations

import torch
from harness.reference_generate import reference_output

ULPS = 4


def dtype_tolerance(dtype: torch.dtype, reference_logits: torch.Tensor) -> float:
    """ULPS units of the dtype's rounding (its eps) at the largest logit's magnitude."""
    return ULPS * torch.finfo(dtype).eps * float(reference_logits.abs().max())


def assert_close_in_dtype(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    tolerance = dtype_tolerance(dtype, expected)
    error = float((ours - expected).abs().max())
    assert error <= tolerance, f"{where}: logits differ by {error:.4f} > {tolerance:.4f} ({ULPS} ulps of {dtype})"
    # The argmax agrees wherever transformers' top two are further apart than the tolerance.
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tolerance
    assert torch.equal(ours.argmax(-1)[clear], expected.argmax(-1)[clear]), f"{where}: argmax differs"


def agreeing_prefix(ours: list[int], theirs: list[int], logits: torch.Tensor, dtype: torch.dtype, where: str) -> int:
    """How many tokens agree; fails unless the first disagreement is at a near tie."""
    assert len(ours) == len(theirs), where
    for position, (mine, expected) in enumerate(zip(ours, theirs)):
        if mine != expected:
            tolerance = dtype_tolerance(dtype, logits[position])
            best = float(logits[position].max())
            gap = best - float(logits[position][mine])
            assert gap <= tolerance, (
                f"{where}: token {position} is {mine}, transformers' is {expected}; transformers scores ours "
                f"{gap:.4f} below its best (tolerance {tolerance:.4f}); ours {ours}, theirs {theirs}"
            )
            return position
    return len(ours)


def reference_greedy_with_logits(reference, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate (eos ignored) and its raw logits at each step [n, vocab] (on CPU)."""
    output = reference_output(reference, prompt, max_new_tokens, output_logits=True, return_dict_in_generate=True)
    return output.sequences[0, len(prompt):].tolist(), torch.cat(output.logits).float().cpu()
