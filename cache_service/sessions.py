"""Sessions: who holds leases, and when they are presumed dead.

A session is one attached model service. It stays alive by calling Heartbeat (or any
lease call) at least once per lease TTL; one that falls silent is reaped and its
leases go back to the pool, so a model service killed with -9 leaks nothing.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass


class UnknownSession(LookupError):
    """The session id was never issued, or the session was detached or expired."""


@dataclass(slots=True)
class Session:
    session_id: str
    client_name: str
    last_seen: float
    # Who holds a sequence, as the ledger sees it: error messages name it, so it must not
    # be the session id (a secret: whoever knows it can touch the session's blocks).
    owner: str = ""
    # The checkpoint the session serves (AttachRequest.model_fingerprint): its sequences
    # read and feed only that model's prefix cache.
    model_fingerprint: str = ""
    # The name its clients call the model by (AttachRequest.served_model_name), for logs and events.
    served_model_name: str = ""


class Sessions:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s} s")
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._opened = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, client_name: str, model_fingerprint: str = "", served_model_name: str = "") -> Session:
        # Unguessable: a session id is the capability to touch that session's blocks.
        session = Session(secrets.token_hex(16), client_name, self._clock(), f"{client_name}#{next(self._opened)}",
                          model_fingerprint, served_model_name)
        self._sessions[session.session_id] = session
        return session

    def touch(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise UnknownSession(
                f"unknown session {session_id[:8] + '…' if session_id else '(empty)'}: it was never opened, "
                "detached, or expired after missing its heartbeats; Attach again"
            )
        session.last_seen = self._clock()
        return session

    def close(self, session_id: str) -> Session:
        session = self.touch(session_id)
        del self._sessions[session_id]
        return session

    def expire(self) -> list[Session]:
        """Removes and returns the sessions silent for longer than the TTL."""
        deadline = self._clock() - self.ttl_s
        expired = [s for s in self._sessions.values() if s.last_seen < deadline]
        for session in expired:
            del self._sessions[session.session_id]
        return expired
