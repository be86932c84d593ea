"""Which proposed tokens a verification pass keeps (lossless: the output follows the
target model's distribution exactly, as if it had decoded one token per step).

A sequence that proposed t_1..t_K runs K + 1 positions; row i holds the target's
next-token distribution p_i after t_1..t_i. Each row is drawn from as the sampler draws
any row (x_i; greedy rows: the argmax), and the proposal is kept while x_i = t_{i+1}.

For sampled rows this is the rejection rule of Leviathan et al. and Chen et al. (accept
t with probability min(1, p/q), else draw from the residual max(0, p - q) renormalised)
in a coupled form. The proposers here are deterministic, so the draft q is a point mass
on t, and the rule reads: keep t with probability p(t); on rejection draw from p with t
removed, renormalised. A draw x ~ p does both at once: P(x = t) = p(t), and given x != t,
x is distributed as p without t, renormalised. Drawing x_i with the uniform that a
one-token step would have used for that position makes a seeded request's output the
same with and without speculation (spec/verify.py), which the uncoupled rule, with its
own uniforms for acceptance, would not.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_matching(proposed: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens to append: the longest prefix of `proposed` equal to the targets (each
    row's draw), then the target at the first mismatch (or the bonus row's)."""
    if len(targets) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposed tokens need {len(proposed) + 1} target rows, got {len(targets)}")
    kept: list[int] = []
    for token, target in zip(proposed, targets):
        if token != target:
            break
        kept.append(token)
    kept.append(targets[len(kept)])
    return kept
