"""A token bucket: `rate` tokens a second, at most `burst` banked. The limits that bound
what one caller may ask for a second (the replay socket's answers, a tenant's requests)
share it."""

from __future__ import annotations

import time


def refill(tokens: float, last: float, now: float, rate: float, burst: float) -> float:
    """A token bucket's tokens at ``now``: ``tokens`` at ``last``, plus ``rate`` a second, at most ``burst``."""
    return min(burst, tokens + (now - last) * rate)


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` banked; starts full."""

    def __init__(self, rate: float, burst: float, clock=time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()

    def take(self, count: int) -> float:
        """Takes ``count`` tokens and returns 0, or takes none and returns the seconds until
        they are there (``count`` at most ``burst``)."""
        now = self._clock()
        self._tokens = refill(self._tokens, self._last, now, self.rate, self.burst)
        self._last = now
        if self._tokens >= count:
            self._tokens -= count
            return 0.0
        return (count - self._tokens) / self.rate
