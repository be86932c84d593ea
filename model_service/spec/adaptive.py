"""A sequence's proposal length when it adapts (--speculative-max-tokens), and the chance
that each proposed position is kept, which decides whose rows a step verifies.

A fixed K caps a step at K + 1 tokens where a long match would give more, and proposes K
where the text has just left the match and the first guess fails. transformers' assisted
generation moves the length with what is kept: up by 2 when a whole proposal was kept,
down by 1 otherwise; this does the same, between 1 and the longest allowed.

The chance that position i of a proposal is kept: each proposed token is kept only when
every one before it was, so with q the chance that a token is kept given that the one
before it was, position i is kept with chance q^i. q is counted per sequence (tokens kept
over tokens kept plus proposals cut short, the estimate for a run length that ends at each
token with the same chance), leaning on the server's q until the sequence has some
verifications of its own. A proposer that counts what it saw (the suffix tries) also says
how sure it is of each position, and that share scales the chance (`row_chances`).

Plain bookkeeping over counts, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

# Steps up and down (transformers' assisted generation: +2 when all were kept, -1 otherwise).
GROW = 2
SHRINK = 1
# Verifications' worth of the server's q a sequence's own estimate starts from.
PRIOR_WEIGHT = 2.0


@dataclass(slots=True)
class ProposalState:
    """One sequence's proposal length and its counts of kept tokens and cut proposals."""

    length: int
    kept: int = 0
    cut: int = 0  # verifications that rejected a proposed token

    def settle(self, proposed: int, accepted: int, longest: int) -> None:
        self.kept += accepted
        if accepted < proposed:
            self.cut += 1
            self.length = max(1, self.length - SHRINK)
        else:
            self.length = min(longest, self.length + GROW)

    def continuation(self, prior: float) -> float:
        """The chance that a proposed token is kept given that the one before it was."""
        return (self.kept + PRIOR_WEIGHT * prior) / (self.kept + self.cut + PRIOR_WEIGHT)


def row_chances(proposals: dict, chance: dict, shares: dict | None = None) -> list[tuple[float, object, int]]:
    """(chance kept, sequence, position from 1) of every proposed row, likeliest first;
    `chance[seq]` is its q, and `shares[seq]` (where given) each position's share of the
    occurrences the proposer matched that went on that way up to it: a position past a
    fork the proposer saw go two ways is that much less likely than q alone says. Both
    fall along a proposal, so each sequence's rows come in order, and any leading part of
    the list is a leading part of each proposal."""
    shares = shares or {}
    rows = [(chance[seq] ** i * (shares[seq][i - 1] if seq in shares else 1.0), seq, i)
            for seq, proposal in proposals.items() for i in range(1, len(proposal) + 1)]
    # Ties (q of 1 or 0) keep each sequence's positions in order.
    rows.sort(key=lambda row: (-row[0], row[2]))
    return rows
