"""The cache salt of a request that runs with a LoRA adapter: K/V computed under an adapter
is not the base's nor another adapter's, so the adapter's identity (its weights' digest,
not its name) joins the salt every block of the request is hashed under."""

from __future__ import annotations

import hashlib

# Short and of fixed length, so that `lora:<digest>/<hash>` cannot be read two ways and fits
# the cache service's 256 characters whatever the salt.
_DIGEST_CHARS = 32


def adapter_salt(digest: str, cache_salt: str) -> str:
    """The salt for a request of salt `cache_salt` (possibly empty) under the adapter of `digest`."""
    salt = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"lora:{digest[:_DIGEST_CHARS]}/{salt}"
