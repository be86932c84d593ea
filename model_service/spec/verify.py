"""A step's verification: the tokens each speculating sequence keeps, merged into the
step's sampled rows so that the scheduler and the output see them as decoded tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq

import torch

from model_service.device_copies import to_host
from model_service.sample.params import SamplingOptions
from model_service.sample.sampler import draw_uniform, sample
from model_service.spec.accept import accept_matching


def verify(token: int, proposal: Seq[int], rows: torch.Tensor, options: SamplingOptions,
           generator: torch.Generator | None) -> list[int]:
    """The tokens a speculating completion appends: `token` (drawn by the step sampler
    from its last token's row), then each proposed token while it equals the draw of the
    row before it, then the first draw that differs (accept.py). `rows` [K, vocab] are the
    logits of the proposal's K positions.

    Each row is drawn by the step's own sampler with the completion's generator, one
    uniform a row in order, as one-token steps draw them; the uniforms of rows past the
    first mismatch are given back (the generator goes back to where one-token steps would
    have left it), so a seeded completion's tokens do not depend on what was proposed."""
    k = len(proposal)
    state = None if generator is None or options.greedy else generator.get_state()
    targets = to_host(sample(rows, [options] * k, [generator] * k))[0].tolist()
    kept = accept_matching(proposal, [token, *targets])
    if state is not None:
        generator.set_state(state)
        for _ in range(len(kept) - 1):  # the rows whose draws were kept
            draw_uniform(generator, rows.device)
    return kept


def keep_verified(chosen: list, tokens: list[int], logprobs: list, proposals: Mapping[object, Seq[int]],
                  verified: Mapping[object, torch.Tensor]) -> tuple[list, list[int], list]:
    """(completions, tokens, logprobs) in row order, each speculating completion's row
    followed by the proposed tokens it keeps and the draw after them."""
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
        kept = verify(token, proposal, verified[completion.seq], completion.seq.options, completion.generator)
        for extra in kept[1:]:
            out_chosen.append(completion)
            out_tokens.append(extra)
            out_logprobs.append(None)
    return out_chosen, out_tokens, out_logprobs
