"""Block hashes as vLLM computes them, for the KV events that routers read.

pagedkv's own prefix index (``blocks/prefix_hash.py``) keys blocks by a fast in-process hash
and verifies every hit exactly; it stays as it is. Routers that consume vLLM's KV events
(vllm-router's ``kv_aware``, llm-d, Dynamo) recompute vLLM's hashes from the token ids
of a request and look them up in what each worker reported, so the events must carry
those same hashes: ``sha256`` of the canonical CBOR encoding of
``(parent hash, block token ids, extra keys)``, chained from a root hash of the seed.

The seed is ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``, as vLLM does for its
sha256 hash algorithms; a router configured with another seed finds nothing. A
request's ``cache_salt`` enters only its first block, as ``(("cache_salt", salt),)``,
and the salt then reaches every later block through the chain. The events carry the
low 64 bits of each digest as an int (vLLM's default external form).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import cbor2

DEFAULT_SEED = "vllm-none-hash"
_LOW_64_BITS = (1 << 64) - 1


def sha256_cbor(value: object) -> bytes:
    """The 32-byte sha256 digest of ``value``'s canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """The parent hash of every chain's first block (vLLM's ``NONE_HASH``)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED
    return sha256_cbor(seed)


def salt_extra_keys(cache_salt: str) -> tuple[tuple[str, str], ...] | None:
    """The extra keys of a chain's first block: the salt, or nothing."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def block_hash(parent: bytes, block_token_ids: Sequence[int], extra_keys: object = None) -> bytes:
    """One full block's digest, chained from ``parent`` (``none_hash()`` for a first block)."""
    return sha256_cbor((parent, tuple(block_token_ids), extra_keys))


def chain(token_ids: Sequence[int], block_size: int, cache_salt: str = "", root: bytes | None = None) -> list[bytes]:
    """The digests of every full block of ``token_ids`` (a trailing partial block has none)."""
    parent = none_hash() if root is None else root
    digests = []
    for index, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        extra = salt_extra_keys(cache_salt) if index == 0 else None
        parent = block_hash(parent, token_ids[start : start + block_size], extra)
        digests.append(parent)
    return digests


def external(digest: bytes) -> int:
    """The int an event carries for a digest: its low 64 bits, read big-endian."""
    return int.from_bytes(digest, "big") & _LOW_64_BITS
