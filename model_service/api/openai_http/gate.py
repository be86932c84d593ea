"""The HTTP door's gate, in front of FastAPI: the token, the tenant's request rate, then the
body's size, before any byte of the body is read.

FastAPI reads and parses a body before it runs a route's dependencies, so a check there
comes after the cost: a huge body without a token was read and parsed whole, in time and
memory in proportion to it, before being refused, stalling every stream sharing the event loop. Here a request without a valid
token gets 401, one past its tenant's max_requests_per_s 429 (request_rate.py), and one
whose Content-Length is over --max-request-bytes 413, all three
without reading the body (and with `connection: close`, so the unread body goes nowhere);
a body without a length is read up to the limit and no further. Only /health is open.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model_service.api.openai_http.errors import ApiError
from pagedkv.bearer import presented_token

OPEN_PATHS = frozenset({"/health"})


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
                             scope, receive, send)
                return
            scope[PRINCIPAL] = principal
            refused = await self.throttle(principal) if self.throttle is not None else None
            if refused is not None:
                await refuse(ApiError(429, refused, code="rate_limit_exceeded"), scope, receive, send)
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
                await refuse(self.too_large(f"{length:,} bytes"), scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops reading at Content-Length
            return
        body = await self.read_body(receive)
        if body is None:
            await refuse(self.too_large(f"more than {self.max_request_bytes:,} bytes"), scope, receive, send)
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


async def refuse(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response = error.response()
    # The body was not read: the connection cannot carry another request after it.
    response.headers["connection"] = "close"
    await response(scope, receive, send)
