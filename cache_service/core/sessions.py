"""Sessions: who holds leases, and when they are presumed dead.

A session is one attached model service. It stays alive by calling Heartbeat (or any
lease call) at least once per lease TTL; one that falls silent is reaped and its
leases go back to the pool, so a model service killed with -9 leaks nothing. One whose
held connection closes (HoldSession) lapses at once instead of at its TTL.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class UnknownSession(LookupError):
    """The session id was never issued, or the session was detached or expired."""


class AttachKeyMismatch(ValueError):
    """An Attach named the key of a live session but another client, model or name."""


# AttachRequest.attach_key: long enough to be picked at random, short enough to keep.
MIN_ATTACH_KEY_CHARS = 16
MAX_ATTACH_KEY_CHARS = 128


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
    # AttachRequest.attach_key: a retry of the Attach that opened it gets it back.
    attach_key: str = ""
    # Set when the session ends, and why ("detached" or "expired"): its holds end with it.
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    ended_by: str = ""


class Sessions:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s} s")
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._by_attach_key: dict[str, Session] = {}
        self._opened = itertools.count(1)

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def open(self, client_name: str, model_fingerprint: str = "", served_model_name: str = "",
             attach_key: str = "") -> Session:
        # Unguessable: a session id is the capability to touch that session's blocks.
        session = Session(secrets.token_hex(16), client_name, self._clock(), f"{client_name}#{next(self._opened)}",
                          model_fingerprint, served_model_name, attach_key)
        self._sessions[session.session_id] = session
        if attach_key:
            self._by_attach_key[attach_key] = session
        return session

    def opened_by(self, attach_key: str, client_name: str, model_fingerprint: str,
                  served_model_name: str) -> Session | None:
        """The live session an earlier Attach with this key opened (touched: the client is
        alive), or None. A client whose Attach deadline passed while the session was being
        opened retries with the same key and gets it, instead of leaving it to expire."""
        session = self._by_attach_key.get(attach_key) if attach_key else None
        if session is None:
            return None
        asked = (client_name, model_fingerprint, served_model_name)
        if asked != (session.client_name, session.model_fingerprint, session.served_model_name):
            raise AttachKeyMismatch(
                "attach_key names a live session of another client, model fingerprint or served model name; "
                "pick a new random key for each attaching client (and keep it only across retries of one Attach)"
            )
        session.last_seen = self._clock()
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
        self._forget(session, "detached")
        return session

    def lapse(self, session_id: str) -> Session | None:
        """Counts the session as silent past its TTL, so the next expire() takes it (its
        holder's connection closed: no heartbeat will come); None when it already ended."""
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_seen = float("-inf")
        return session

    def expire(self) -> list[Session]:
        """Removes and returns the sessions silent for longer than the TTL."""
        deadline = self._clock() - self.ttl_s
        expired = [s for s in self._sessions.values() if s.last_seen < deadline]
        for session in expired:
            self._forget(session, "expired")
        return expired

    def _forget(self, session: Session, why: str) -> None:
        del self._sessions[session.session_id]
        session.ended_by = why
        session.ended.set()
        if session.attach_key:
            del self._by_attach_key[session.attach_key]
