"""Which requests an engine holds, as the threads that submit them see it.

submit() and abort() run on the callers' threads while requests end on the engine
thread; this is the state both touch, under one lock: each live request's id (unique
among its tenant's live requests, since Abort names requests by id) and how many are queued or
running, against --max-queued-requests. Each admitted request gets a key, in arrival
order, that the engine knows it by.

Ids are unique per tenant (--api-keys), not across tenants: a tenant's Abort names only
its own requests, and one tenant's live id never refuses another's. An id is held from
admit() until release(), when its request ends on whatever path; nothing here outlives
a request.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable


class QueueFull(Exception):
    """More requests queued than --max-queued-requests."""


class DuplicateRequest(Exception):
    """A request id that a live request of the same tenant already has (Abort names
    requests by id)."""


class Admission:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._pending = 0  # admitted and not yet released
        self._ids: dict[tuple[str, str], int] = {}  # live requests' (tenant, id) to their keys

    @property
    def pending(self) -> int:
        return self._pending

    def __len__(self) -> int:
        """Live ids held (for the tests that check nothing outlives its request)."""
        return len(self._ids)

    def admit(self, request_id: str, tenant: str = "") -> int:
        """The new request's key; raises DuplicateRequest or QueueFull instead."""
        key = next(self._keys)
        with self._lock:
            if (tenant, request_id) in self._ids:
                raise DuplicateRequest(
                    f"request_id {request_id!r} is already queued or running; request ids must be unique "
                    "among your live requests (leave it empty to have one made)"
                )
            if self._pending >= self.max_queued:
                raise QueueFull(
                    f"{self._pending} requests are queued or running, the limit is "
                    f"--max-queued-requests {self.max_queued}; retry later"
                )
            self._pending += 1
            self._ids[tenant, request_id] = key
        return key

    def keys_of(self, request_ids: Iterable[str], tenant: str = "") -> list[int]:
        """The keys of `tenant`'s named requests that are live (each once)."""
        with self._lock:
            found = (self._ids.get((tenant, request_id)) for request_id in set(request_ids))
            return [key for key in found if key is not None]

    def release(self, request_id: str, key: int, tenant: str = "") -> None:
        """The request ended (or never reached the engine): its id is free again."""
        with self._lock:
            self._pending -= 1
            if self._ids.get((tenant, request_id)) == key:
                del self._ids[tenant, request_id]
