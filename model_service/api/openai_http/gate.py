"""The HTTP door's gate, in front of FastAPI: the token, the tenant's request rate, then the
body's size, before any byte of the body is read.

FastAPI reads and parses a body before it runs a route's dependencies, so a check there
comes after the cost: a huge body without a token was read and parsed whole, in time and
memory in proportion to it, before being refused, stalling every stream sharing the event loop. Here a request without a valid
token gets 401, one past its tenant's max_requests_per_s 429 (request_rate.py), and one
whose Content-Length is over --max-request-bytes 413, all three
without reading the body into memory, and with `connection: close`; a body without a length
is read up to the limit and no further. Only /health is open.

A refused body is still drained, within bounds, after the answer has gone out: read and
dropped, never kept. A server that closes with bytes of the body unread makes its kernel
reset the connection, and a client still sending (an openai SDK's whole body goes out
before it reads anything) then sees the reset instead of the answer that says what to fix.
The drain stops at the body's end, at `DRAIN_MAX_BYTES` (a 413's; for a 401 or a 429, the
size a request may have), when the client sends nothing for `DRAIN_IDLE_S`, or after
`DRAIN_TOTAL_S`; a body announced larger than the bound, or one the client waits to be asked
for (`Expect: 100-continue`), is not drained at all. So nobody, with or without a token,
holds a connection or makes the server read more than a bound by sending slowly or forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_service.api.openai_http.errors import ApiError
from pagedkv.bearer import presented_token

OPEN_PATHS = frozenset({"/health"})

# How much of a refused body is read and dropped so that its answer arrives (module doc).
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_IDLE_S = 5.0
DRAIN_TOTAL_S = 20.0


# Where the gate leaves whose the key was (authenticate's answer) for the routes.
PRINCIPAL = "pagedkv.principal"


class Gate:
    """ASGI middleware. `authenticate(token)`: whose the token is (kept in the scope under
    PRINCIPAL), or None to refuse it; itself None when no token is required. `await
    throttle(principal)`: None to let the request in (counting it), else the reason to refuse
    it with 429."""

    def __init__(self, app: ASGIApp, *, max_request_bytes: int,
                 authenticate: Callable[[bytes], object | None] | None = None,
                 throttle: Callable[[object], Awaitable[str | None]] | None = None) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.authenticate = authenticate
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case names, as ASGI gives them
        if self.authenticate is not None and scope["path"] not in OPEN_PATHS:
            token = presented_token(headers.get(b"authorization"))
            principal = self.authenticate(token)
            if principal is None:
                reason = "wrong token" if token else "missing Authorization header"
                await refuse(ApiError(401, f"{reason}: send 'Authorization: Bearer <token>' matching the server's "
                                      "--auth-token or a key of its --api-keys (the openai client's api_key)", code="invalid_api_key"),
                             scope, receive, send, drain_bytes=self.max_request_bytes)
                return
            scope[PRINCIPAL] = principal
            refused = await self.throttle(principal) if self.throttle is not None else None
            if refused is not None:
                await refuse(ApiError(429, refused, code="rate_limit_exceeded"), scope, receive, send,
                             drain_bytes=self.max_request_bytes)
                return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await refuse(ApiError(400, f"Content-Length {declared[:40]!r} is not a number of bytes"),
                             scope, receive, send)
                return
            if length > self.max_request_bytes:
                await refuse(self.too_large(f"{length:,} bytes"), scope, receive, send, drain_bytes=DRAIN_MAX_BYTES)
                return
            await self.app(scope, receive, send)  # the server stops reading at Content-Length
            return
        body = await self.read_body(receive)
        if body is None:
            await refuse(self.too_large(f"more than {self.max_request_bytes:,} bytes"), scope, receive, send,
                         drain_bytes=DRAIN_MAX_BYTES)
            return
        await self.app(scope, replay(body, receive), send)

    def too_large(self, size: str) -> ApiError:
        return ApiError(413, f"the request body is {size}; this server accepts at most {self.max_request_bytes:,} "
                        "(--max-request-bytes): send a smaller request", code="request_too_large")

    async def read_body(self, receive: Receive) -> list[Message] | None:
        """The body's messages, or None once they pass the limit (the rest is not read)."""
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                return messages


def replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that gives `messages` first, then what the server sends (a disconnect)."""
    pending = list(messages)

    async def receive_again() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return receive_again


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send, drain_bytes: int = 0) -> None:
    """Answers with `error` and closes the connection; before closing, drains up to
    `drain_bytes` of the body the client may still be sending (module doc)."""
    response = error.response()
    # The body was not read: the connection cannot carry another request after it.
    response.headers["connection"] = "close"
    # The whole answer goes out first with the response left open (more_body), so the client
    # can read it while the rest of its body is dropped; the empty last part closes it.
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": True})
    headers = dict(scope["headers"])
    if drain_bytes and headers.get(b"expect", b"").lower() != b"100-continue":
        declared = headers.get(b"content-length")
        if declared is None or not declared.isdigit() or int(declared) <= drain_bytes:
            await drain(receive, drain_bytes)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def drain(receive: Receive, max_bytes: int, idle_s: float = DRAIN_IDLE_S, total_s: float = DRAIN_TOTAL_S) -> int:
    """Reads and drops the body's messages until its end, a disconnect, more than `max_bytes`,
    `idle_s` without a message or `total_s` in all; returns the bytes dropped."""
    dropped = 0
    deadline = time.monotonic() + total_s
    while dropped <= max_bytes:
        wait = min(idle_s, deadline - time.monotonic())
        if wait <= 0:
            break
        try:
            message = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            break
        if message["type"] != "http.request":
            break
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return dropped
