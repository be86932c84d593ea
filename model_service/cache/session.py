"""An engine's session with the cache service, from Attach to Detach.

One object holds what the engine loop needs of the cache service: the attachment
(session id, sizing, mapped pool, heartbeat, lease deadline), the one lease call in
flight (sent while a forward pass runs, collected at the next step), the fence that
stops K/V writes once the lease may have expired, and the two ways a session ends:
lost (the cache service failed or went away) and closed (shutdown: last releases, then
Detach). It knows no requests and no scheduler: the engine applies what a call answers.
Engine thread only, except the heartbeat's failure callback, which only posts a message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc
import structlog
import torch

from model_service import metrics
from model_service.cache.attachment import AttachSettings, Attachment, attach, detach_after_failure
from model_service.cache.client import CacheClient
from model_service.sched.lease_ops import LeaseAnswer, LeaseOps

log = structlog.get_logger()


class CacheFailed(Exception):
    """The heartbeat thread saw the cache service fail."""


class LeaseExpired(Exception):
    """The local lease deadline passed: the session may be gone at the cache service."""


def describe_error(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, CacheFailed) and error.args and isinstance(error.args[0], grpc.RpcError):
        return describe_error(error.args[0])
    return str(error)


class CacheSession:
    def __init__(self, cache: CacheClient, settings: AttachSettings, device: torch.device) -> None:
        self.cache = cache
        self.settings = settings
        self.device = device
        self.attachment: Attachment | None = None
        self._inflight: Future | None = None
        self._inflight_ops: LeaseOps | None = None
        self._inflight_sent_at = 0.0

    @property
    def session_id(self) -> str | None:
        return self.attachment.session_id if self.attachment is not None else None

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def open(self, *, stopping: threading.Event, on_unreachable: Callable[[], None],
             on_heartbeat_failure: Callable[[str, BaseException], None]) -> Attachment | None:
        """Attaches, retrying until the cache service answers; None once `stopping` is set."""
        self.attachment = attach(self.cache, self.settings, self.device, stopping=stopping,
                                 on_unreachable=on_unreachable, on_heartbeat_failure=on_heartbeat_failure)
        return self.attachment

    # -- the lease call of each step ----------------------------------------------------

    def send(self, ops: LeaseOps) -> None:
        """Sends a step's lease ops; the answer is collected at the next step."""
        self._inflight_sent_at = time.monotonic()
        self._inflight = self.cache.lease(self.attachment.session_id, ops)
        self._inflight_ops = ops
        metrics.LEASE_CALLS.inc()
        metrics.LEASE_TOP_UPS.inc(len(ops.top_ups))

    def collect(self) -> tuple[LeaseOps, LeaseAnswer] | None:
        """(ops, answer) of the call in flight, waiting for its answer;
        None when no call is in flight. Raises what the call raised."""
        if self._inflight is None:
            return None
        started = time.perf_counter()
        answer = self._inflight.result()
        self.attachment.lease_deadline.acked(self._inflight_sent_at)
        metrics.LEASE_WAIT_SECONDS.inc(time.perf_counter() - started)
        ops, self._inflight, self._inflight_ops = self._inflight_ops, None, None
        return ops, answer

    def check_lease_deadline(self) -> None:
        """Fenced writes: no forward pass (which writes K/V into leased blocks) once the
        session may have expired at the cache service, whose blocks may then be someone else's."""
        deadline = self.attachment.lease_deadline
        if deadline.expired():
            log.error("lease_deadline_passed", session=self.session_id[:8], ttl_s=deadline.ttl_s)
            raise LeaseExpired(
                f"no heartbeat or lease call answered for {deadline.ttl_s - deadline.margin_s:.2f} s "
                f"(lease TTL {deadline.ttl_s:g} s less a margin): the session may have expired, so "
                "this engine stopped writing into its blocks"
            )

    # -- how a session ends ---------------------------------------------------------------

    def lost(self, error: BaseException) -> None:
        """The cache service failed or went away: forget the session (giving it back now
        when the service can still be reached and the failure was not its going away)."""
        if self.attachment is None:
            return
        self._inflight = self._inflight_ops = None
        detach_after_failure(self.cache, self.attachment.session_id,
                             error.args[0] if isinstance(error, CacheFailed) and error.args else error)
        # After the Detach: stopping cancels the session's hold, which (were the session
        # still open) would leave its leases to wait out the reclaim grace.
        self.attachment.heartbeat.stop()
        self.attachment = None

    def close(self, final_ops: LeaseOps | None) -> None:
        """Shutdown: sends the last releases, then detaches. Raises grpc.RpcError when the
        cache service cannot be reached; the heartbeat stops either way."""
        try:
            if final_ops:
                self.cache.lease(self.attachment.session_id, final_ops).result()
            self.cache.detach(self.attachment.session_id)
            log.info("detached", session=self.attachment.session_id[:8])
        finally:
            self.attachment.heartbeat.stop()
