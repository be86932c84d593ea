"""What other threads tell the engine thread: one typed message each, through one queue.

Callers' threads (submit, cancel, abort), the heartbeat thread (a failed session), a
keys reload (compute budgets) and stop() post here; the engine thread alone takes messages out, between steps.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass

from model_service.engine.output import RequestOutput


@dataclass(frozen=True, slots=True)
class Submit:
    request: RequestOutput


@dataclass(frozen=True, slots=True)
class Cancel:
    """The client went away."""

    key: int


@dataclass(frozen=True, slots=True)
class Abort:
    """AbortRequest named these live requests."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SessionFailed:
    """The heartbeat of session `session_id` failed with `error`."""

    session_id: str
    error: BaseException


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do but look again (stop() posts it)."""


@dataclass(frozen=True, slots=True)
class ComputeBudgets:
    """The tenants' compute budgets of a reloaded keys file: (tenant, max_tokens_per_s, burst_tokens)."""

    budgets: tuple[tuple[str, int, int], ...]


Message = Submit | Cancel | Abort | SessionFailed | Wake | ComputeBudgets


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def put(self, message: Message) -> None:
        self._queue.put(message)

    def drain(self, block: bool, timeout_s: float = 0.5) -> Iterator[Message]:
        """The messages waiting now, one at a time (with block, waiting up to timeout_s for
        the first): taken as they are handled, so that a handler that raises leaves the
        rest queued for whoever drains next."""
        try:
            yield self._queue.get(timeout=timeout_s) if block else self._queue.get_nowait()
            while True:
                yield self._queue.get_nowait()
        except queue.Empty:
            return
