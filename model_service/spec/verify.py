"""A step's verification: the tokens each speculating sequence keeps, merged into the
step's sampled rows so that the scheduler and the output see them as decoded tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq

import torch

from model_service.device_copies import to_host
from model_service.sample.sampler import sample
from model_service.spec.accept import accept_greedy


def keep_verified(chosen: list, tokens: list[int], logprobs: list, proposals: Mapping[object, Seq[int]],
                  verified: Mapping[object, torch.Tensor]) -> tuple[list, list[int], list]:
    """(completions, tokens, logprobs) in row order, each speculating completion's row
    followed by the proposed tokens it keeps and the target's token after them.

    The first token of a speculating row was sampled by the step sampler as for any
    sequence; each proposed position's target is taken by the same sampler (greedy rows:
    the same argmax), so the kept tokens are those one-token steps would have produced."""
    if not proposals:
        return chosen, tokens, logprobs
    out_chosen, out_tokens, out_logprobs = [], [], []
    for completion, token, logprob in zip(chosen, tokens, logprobs):
        out_chosen.append(completion)
        out_tokens.append(token)
        out_logprobs.append(logprob)
        proposal = proposals.get(completion.seq)
        if not proposal:
            continue
        options = completion.seq.options
        rows = verified[completion.seq]
        targets = to_host(sample(rows, [options] * len(proposal), [None] * len(proposal)))[0].tolist()
        kept = accept_greedy(proposal, [token, *targets])
        for extra in kept[1:]:
            out_chosen.append(completion)
            out_tokens.append(extra)
            out_logprobs.append(None)
    return out_chosen, out_tokens, out_logprobs
