"""Whether speculating pays at a batch size, by what it brought: the tokens a second of the
decode steps that speculated against those of the steps that did not, each timed whole on
the engine thread (the proposals looked up, the step scheduled and run, every row sampled
and verified).

step_costs.py weighs each proposed row against the forward pass's measured cost, which is
what decides how many rows a step verifies. It cannot see what speculating costs besides:
looking up proposals for every decoding sequence, sampling and verifying more rows, putting
rejected tails back. Where little of what is proposed is kept (free text, many streams)
those costs outweigh the tokens gained even when the rows alone look worth it, and the
only way to know is to compare the two kinds of step. So at each batch size (decoding
sequences, exact up to EXACT_UP_TO, then by powers of two) the steps go the way that has
measured faster, and one step in PROBE_EVERY goes the other way, so that both rates stay
current as the requests change; until each way has MIN_STEPS steps, one in LEARN_EVERY,
and meanwhile the steps go the way the nearest batch size that has both measured found
faster (speculating, before any has).

Each way's rate is a `Rate`: an estimate that grows less sure with every step of its
bucket that did not measure it, and trusts a sample by how much that way's samples scatter.
The way taken seldom (one step in PROBE_EVERY) is measured as the requests are now, not as
they were when it last led: a step's time moves with the contexts' lengths and what the
proposals hit, and a stale plain rate held against a fresh speculating one kept a server
speculating through a whole round of free text after a round of documents. And one lucky
speculating probe does not turn the way: what a speculating step appends swings with what
its proposals hit, where a plain step's hardly moves.

Plain bookkeeping: no tensors, no clock of its own (the engine times its steps).
"""

from __future__ import annotations

import collections
import dataclasses

# How much less sure of a rate (its relative variance) each step of its bucket that did not
# measure it leaves the estimate: about 3 % a step, 18 % over PROBE_EVERY steps.
DRIFT = 1e-3
# A way's samples' scatter (relative variance) before it has two of its own, and how far
# each sample moves the running figure.
FIRST_SCATTER = 1e-2
SCATTER_WEIGHT = 0.1
MIN_STEPS = 8
LEARN_EVERY = 4
PROBE_EVERY = 32
EXACT_UP_TO = 16


def bucket(decodes: int) -> int:
    """The batch sizes measured together: exact up to EXACT_UP_TO, then each power of two's range."""
    if decodes <= EXACT_UP_TO:
        return decodes
    return 1 << (decodes - 1).bit_length()


@dataclasses.dataclass(slots=True)
class Rate:
    """One way's tokens a second at one batch size: a one-state Kalman filter on the rate,
    in relative terms (variances are of the rate's fraction). `unsure` is the estimate's
    variance, `scatter` the samples' about it."""

    value: float
    measured_at: int  # the bucket's step count at the last sample
    steps: int = 1
    unsure: float = FIRST_SCATTER
    scatter: float = FIRST_SCATTER

    def add(self, rate: float, now: int) -> None:
        self.unsure += DRIFT * max(now - self.measured_at, 1)
        surprise = (rate - self.value) / self.value
        gain = self.unsure / (self.unsure + self.scatter)
        self.value += gain * (rate - self.value)
        self.unsure *= 1.0 - gain
        self.scatter += SCATTER_WEIGHT * (surprise * surprise - self.scatter)
        self.steps += 1
        self.measured_at = now


class SpeculationPays:
    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], Rate] = {}  # (bucket, speculated) -> its rate
        self._steps: collections.Counter[int] = collections.Counter()

    def speculate(self, decodes: int) -> bool:
        """Whether a step with `decodes` decoding sequences looks up proposals at all."""
        size = bucket(decodes)
        self._steps[size] += 1
        learning = not self._learned(size)
        other_way = self._steps[size] % (LEARN_EVERY if learning else PROBE_EVERY) == 0
        if learning:  # as the nearest batch size that has both ways measured
            size = min((known for known, _ in self._rates if self._learned(known)),
                       key=lambda known: abs(known - size), default=size)
        speculated, plain = self._rates.get((size, True)), self._rates.get((size, False))
        # Speculating is the way until plain steps have measured faster.
        faster = speculated is None or plain is None or speculated.value >= plain.value
        return faster != other_way

    def _learned(self, size: int) -> bool:
        speculated, plain = self._rates.get((size, True)), self._rates.get((size, False))
        return speculated is not None and plain is not None and min(speculated.steps, plain.steps) >= MIN_STEPS

    def record(self, decodes: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step with `decodes` decoding sequences appended `tokens` in `seconds`,
        having looked up proposals (`speculated`) or not."""
        if tokens <= 0 or seconds <= 0:
            return
        size = bucket(decodes)
        known = self._rates.get((size, speculated))
        if known is None:
            self._rates[(size, speculated)] = Rate(tokens / seconds, self._steps[size])
        else:
            known.add(tokens / seconds, self._steps[size])

    def rate(self, decodes: int, speculated: bool) -> float | None:
        """The measured tokens a second of that way at that batch size, if any."""
        known = self._rates.get((bucket(decodes), speculated))
        return None if known is None else known.value
