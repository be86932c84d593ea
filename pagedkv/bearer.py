"""The bearer token of an `authorization` header or metadata value, as both doors read it.

RFC 7235 makes the scheme case-insensitive ("bearer x" is "Bearer x"); the token itself is
compared in constant time, since it is a secret.
"""

from __future__ import annotations

import hmac


def presented_token(authorization: str | bytes | None) -> bytes:
    """The token after a `Bearer` scheme (any case, any spacing), or b"" when there is none."""
    if not authorization:
        return b""
    value = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return b""
    return token.strip()


def token_matches(presented: bytes, expected: bytes) -> bool:
    # Constant-time comparison: the token is a secret.
    return bool(presented) and hmac.compare_digest(presented, expected)
