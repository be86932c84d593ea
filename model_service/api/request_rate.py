"""Each tenant's request rate (--api-keys `max_requests_per_s`), checked by both front doors
before a request costs anything: on the HTTP door in the gate, after the token and before
a byte of the body is read or parsed; on the gRPC door before Generate's checks.

A tenant's compute budget (sched/tenant_budgets.py) bounds what its admitted requests
compute; it cannot bound what its refused ones cost. A body is read and parsed before any
limit that depends on it can refuse it (a grammar past the depth limit, a tenant past its
open requests), so a tenant that sends many large refused bodies takes the event loop and
the GIL from every other tenant's streams. This bounds how many it may send.

The bucket (pagedkv/token_bucket.py) holds one second's worth (at least one request) and
starts full; it lives on the Tenant, and a SIGHUP that changes the rate starts a new one
at the next request.

A refusal is answered only once the bucket would hold a request again, or after
MAX_HOLD_S, whichever is first, as a limiter with a delay does: a client that sends its
next request when the last is answered (every SDK's loop, and an attacker's) is slowed to
the rate, instead of taking the event loop for refusals as fast as they come back. A held
refusal costs a sleeping coroutine, no more; how many there can be is bounded by the
connections the server accepts.
"""

from __future__ import annotations

import asyncio
import time

from model_service import metrics
from pagedkv.token_bucket import TokenBucket

MAX_HOLD_S = 1.0


def take_request(tenant, clock=time.monotonic) -> float:
    """0.0 when the tenant may make one more request now (it is counted), else the seconds
    until it may. Tenants without a rate always may."""
    rate = tenant.max_requests_per_s
    if not rate:
        return 0.0
    bucket = tenant.request_bucket
    if bucket is None or bucket.rate != rate:  # its first request, or a SIGHUP changed the rate
        bucket = tenant.request_bucket = TokenBucket(rate, max(1.0, float(rate)), clock)
    return bucket.take(1)


def refusal(tenant, wait_s: float) -> str:
    return (f"tenant {tenant.name!r} sends more than its max_requests_per_s {tenant.max_requests_per_s} "
            f"(--api-keys); retry in {wait_s:.2f} s")


async def throttled(tenant) -> str | None:
    """None when the tenant may make this request (counted), else, after the hold, why not:
    both doors' check (counted in pagedkv_model_requests_rejected_total as RESOURCE_EXHAUSTED)."""
    wait_s = take_request(tenant)
    if not wait_s:
        return None
    metrics.REJECTED.labels("RESOURCE_EXHAUSTED").inc()
    await asyncio.sleep(min(wait_s, MAX_HOLD_S))
    return refusal(tenant, wait_s)
