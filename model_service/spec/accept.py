"""Which proposed tokens a verification pass keeps (lossless: the output follows the
target model's distribution exactly, as if it had decoded one token per step).

A sequence that proposed t_1..t_K runs K + 1 positions; row i holds the target's
next-token distribution after t_1..t_i. The proposers here are deterministic, so the
draft distribution is a point mass on t_{i+1}, and the rejection rule of Leviathan et al.
and Chen et al. (accept with min(1, p/q), else draw from the residual max(0, p - q)
renormalised) becomes: accept t with probability p(t); on rejection draw from p with t
removed, renormalised. If every proposal is accepted the last row gives a bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(proposed: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to append: the longest prefix of `proposed` equal to the targets'
    argmax rows, then the target's own token at the first mismatch (or the bonus row)."""
    if len(targets) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} target rows, got {len(targets)}")
    kept: list[int] = []
    for token, target in zip(proposed, targets):
        if token != target:
            break
        kept.append(token)
    kept.append(targets[len(kept)])
    return kept


def accept_sampled(proposed: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """The tokens to append, given `probs` [K + 1, V]: the target's distribution at each
    verified position, after the request's temperature, top-k/p and the like. Draws come
    from the request's own generator, one uniform per examined proposal and one draw for
    the final token, so a seeded request repeats itself."""
    k = len(proposed)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposed tokens need {k + 1} probability rows, got shape {tuple(probs.shape)}")
    kept: list[int] = []
    if k:
        index = torch.tensor(proposed, dtype=torch.int64, device=probs.device)
        p_proposed = probs[:k].gather(1, index[:, None]).squeeze(1)
        uniform = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)
        accepted = (uniform < p_proposed).tolist()
        for token, ok in zip(proposed, accepted):
            if not ok:
                residual = probs[len(kept)].clone()
                residual[token] = 0.0
                total = residual.sum()
                if total <= 0:  # p was a point mass on the rejected token: cannot happen, but never divide by 0
                    kept.append(token)
                    continue
                kept.append(int(torch.multinomial(residual / total, 1, generator=generator)))
                return kept
            kept.append(token)
    kept.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return kept
