"""A clock a test moves by hand (`clock.now += seconds`), for code that takes a `clock`
callable: nothing in such a test waits on the machine's time."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
