"""Reclaim: how the leases of a session that ended come back to the pool.

A session ends three ways. One that detaches writes no more, so its blocks come back at
once. One that missed its TTL (the reaper's ``expire_sessions``), or whose hold's
connection closed (``holder_gone``), may still have a forward pass in flight on its
model service: its calls fail from then on, but its blocks stay quarantined for the
reclaim grace before anyone else can get them (docs/tenants-and-security.md, "Fenced
writes"). Either way the ledger gives them back a chunk at a time, yielding to the event
loop between chunks, so releasing a session of any size never stalls other RPCs for long.

Apart from pool.py because it is a policy of its own, over the pool's sessions and
ledger: KvPool makes the pool and serves the calls of live sessions; this decides when
the blocks of ended ones return. Callers use ``pool.reclaims``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from cache_service.core.ledger import Ledger
from cache_service.core.sessions import Session, Sessions

log = structlog.get_logger()

# Block references released between two yields to the event loop when a session goes:
# small enough a piece of ledger work that no RPC waits long behind a huge session.
RELEASE_CHUNK_BLOCKS = 8192


class Reclaims:
    """``pool.reclaims``: the ends of the pool's sessions and the return of their leases."""

    def __init__(self, sessions: Sessions, ledger: Callable[[], Ledger | None], check_invariants: Callable[[str], None],
                 lease_ttl_ms: int, reclaim_grace_ms: int, clock: Callable[[], float]) -> None:
        """``ledger``: the pool's ledger now (None before the first Attach);
        ``check_invariants``: KvPool.check_invariants, after each session released."""
        self._sessions = sessions
        self._ledger = ledger
        self._check_invariants = check_invariants
        self._lease_ttl_ms = lease_ttl_ms
        self._reclaim_grace_ms = reclaim_grace_ms
        self._clock = clock
        self._tasks: set[asyncio.Task] = set()  # a task the loop holds only weakly could be collected
        # Expired sessions whose blocks wait out the reclaim grace: (release at, session).
        self.quarantined: list[tuple[float, Session]] = []

    async def detach(self, session_id: str) -> int:
        """Ends a session at its own request: it writes no more, so its blocks come back at once."""
        session = self._sessions.close(session_id)
        released = await self._release(session)
        log.info("session_detached", session=session.owner, blocks_reclaimed=released)
        self._check_invariants("detach")
        return released

    def expire_sessions(self) -> int:
        """Drops the sessions that missed their TTL (their calls get NOT_FOUND from now on)
        and queues their leases for reclaim once the grace has passed; returns how many."""
        now = self._clock()
        expired = self._sessions.expire()
        for session in expired:
            log.warning("session_expired", session=session.owner, client=session.client_name,
                        ttl_ms=self._lease_ttl_ms, reclaim_in_ms=self._reclaim_grace_ms)
            self.quarantined.append((now + self._reclaim_grace_ms / 1000, session))
        return len(expired)

    def holder_gone(self, session: Session) -> int:
        """Ends a session whose hold's connection closed, as a TTL expiry does (its leases
        wait out the reclaim grace), without waiting for the TTL; returns the sessions
        expired (0 when it had ended already: detached or expired)."""
        if self._sessions.lapse(session.session_id) is None:
            return 0
        log.warning("session_holder_gone", session=session.owner, client=session.client_name,
                    reclaim_in_ms=self._reclaim_grace_ms)
        expired = self.expire_sessions()
        # The reaper looks only every quarter TTL: this reclaim runs when the grace ends.
        task = asyncio.get_running_loop().create_task(self._reclaim_after(self._reclaim_grace_ms / 1000))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return expired

    async def _reclaim_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self.reclaim_expired()

    async def reclaim_expired(self) -> int:
        """Releases the leases of expired sessions whose grace has passed; returns blocks freed."""
        released = 0
        while self.quarantined and self.quarantined[0][0] <= self._clock():
            _, session = self.quarantined.pop(0)
            blocks = await self._release(session)
            released += blocks
            log.info("expired_session_reclaimed", session=session.owner, blocks_reclaimed=blocks)
            self._check_invariants("reclaim")
        return released

    async def _release(self, session: Session) -> int:
        """Every lease of a session, a chunk at a time, yielding to the event loop between
        chunks: detaching a session of any size never stalls other RPCs for long."""
        ledger = self._ledger()
        if ledger is None:
            return 0
        total = 0
        while True:
            released, done = ledger.release_owner_some(session.owner, RELEASE_CHUNK_BLOCKS)
            total += released
            if done:
                return total
            await asyncio.sleep(0)
