"""A stand-in for the CUDA event the runner records behind each step's writes (runner.new_event),
for tests on CPU that check what waits for what."""

from __future__ import annotations

import itertools


class RecordedEvent:
    """A CUDA event as the runner uses it, writing what happens to it into a shared log."""

    def __init__(self, log: list, numbers) -> None:
        self.log = log
        self.number = next(numbers)

    def record(self, stream=None) -> None:
        self.log.append(("record", self.number))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.number))


def recording_events(log: list):
    """A new_event for a runner: events numbered from 0, each writing into ``log``."""
    numbers = itertools.count()
    return lambda: RecordedEvent(log, numbers)
