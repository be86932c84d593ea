"""When verifying proposals pays: decode steps' measured seconds by their rows, and the
number of proposed rows that makes a step's tokens a second the highest.

A step with B plain decode rows and K proposed rows appends B + a·K tokens, a being the
share of proposed tokens kept, and takes T(B + K) seconds. Where reading the weights sets
a step's time (one stream, few streams) T barely grows with K and speculating pays; where
the products set it (many streams, or a CPU at its FMA peak) T grows in step with the rows
and every rejected token costs as much as a kept one. T is not guessed: the engine records
every decode-only step's seconds by its rows (`record`), and a row count never measured is
tried once (an allowance that reaches it), so it is measured from then on.

Plain bookkeeping: no tensors, no clock of its own (the engine times its steps).
"""

from __future__ import annotations

import bisect

# Each new measurement of a row count moves its estimate this far: steps vary with the
# machine's other work, and one slow step must not turn speculation off for good.
EMA_WEIGHT = 0.25
# The share of proposed tokens kept, assumed before any verification has been counted,
# and the weight it keeps after (in proposed tokens): a server whose first verifications
# all failed must not read its share as 0, or no row would ever be worth verifying again
# and nothing would ever move the share.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
# Candidate allowances looked at a step: every row count up to this many, then evenly spread.
CANDIDATES = 32


class StepCosts:
    def __init__(self) -> None:
        self._rows: list[int] = []  # sorted row counts with an estimate
        self._seconds: dict[int, float] = {}
        self._proposed = 0.0
        self._accepted = 0.0
        self._cut = 0.0  # verifications that rejected a proposed token (decayed as the others)

    def record(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` query rows took `seconds`."""
        if rows <= 0 or seconds <= 0:
            return
        known = self._seconds.get(rows)
        if known is None:
            bisect.insort(self._rows, rows)
            self._seconds[rows] = seconds
        else:
            self._seconds[rows] = known + EMA_WEIGHT * (seconds - known)

    def settle(self, proposed: int, accepted: int) -> None:
        """A verification kept `accepted` of `proposed` tokens (the server's share, decayed)."""
        self._proposed = self._proposed * (1 - EMA_WEIGHT / 8) + proposed
        self._accepted = self._accepted * (1 - EMA_WEIGHT / 8) + accepted
        self._cut = self._cut * (1 - EMA_WEIGHT / 8) + (accepted < proposed)

    @property
    def acceptance(self) -> float:
        """The server's share of proposed tokens kept (leaning on the prior)."""
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self._proposed + PRIOR_WEIGHT)

    @property
    def continuation(self) -> float:
        """The server's chance that a proposed token is kept given that the one before it
        was (spec/adaptive.py): kept tokens over kept tokens plus cut proposals (leaning
        on the prior)."""
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self._accepted + self._cut + PRIOR_WEIGHT)

    def estimate(self, rows: int) -> float | None:
        """Seconds a decode-only step of `rows` rows takes: measured, or read between the
        nearest measured counts on either side; None above the largest measured."""
        if rows in self._seconds:
            return self._seconds[rows]
        at = bisect.bisect_left(self._rows, rows)
        if at == len(self._rows):
            return None
        above = self._rows[at]
        if at == 0:
            return self._seconds[above]  # fewer rows than any measured step: no cheaper than the least
        below = self._rows[at - 1]
        share = (rows - below) / (above - below)
        return self._seconds[below] + share * (self._seconds[above] - self._seconds[below])

    def allowance(self, decodes: int, most: int) -> int:
        """How many proposed rows, of at most `most`, to verify beside `decodes` plain decode
        rows, each worth the server's share of proposed tokens kept (see `rows_worth`)."""
        return self.rows_worth(decodes, [self.acceptance] * most)

    def rows_worth(self, decodes: int, chances: list[float]) -> int:
        """How many of the proposed rows whose chances of being kept are `chances` (likeliest
        first) to verify beside `decodes` plain decode rows: the leading count whose step
        appends the most tokens a second by the estimates; a count past the largest
        measured is taken, so that it gets measured."""
        most = len(chances)
        if most <= 0:
            return 0
        base = self.estimate(decodes)
        if base is None:
            return most
        gained = [0.0]
        for chance in chances:
            gained.append(gained[-1] + chance)
        best, best_rate = 0, decodes / base
        stride = max(1, most // CANDIDATES)
        for proposed in sorted({*range(stride, most + 1, stride), most}):
            seconds = self.estimate(decodes + proposed)
            if seconds is None:
                return proposed
            rate = (decodes + gained[proposed]) / seconds
            if rate > best_rate:
                best, best_rate = proposed, rate
        return best
