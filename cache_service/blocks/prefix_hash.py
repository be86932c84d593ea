"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its own token ids and, through the parent's hash, every token
before it, so equal hashes mean equal prefixes (up to collisions, which the pool
resolves by comparing stored token ids and parent identity on every hit).

The chain starts from a namespace: the model's fingerprint and the request's
cache_salt. The same token ids under another model (other weights give other K/V) or
another tenant's salt hash differently and are never found (the pool also compares the
namespace itself on the first block, so not even a collision crosses it).

Python's built-in ``hash`` of an ``(int, tuple[int, ...])`` is used because it is the
fastest option measured here, small beside a block's prefill; int and
tuple hashes do not depend on PYTHONHASHSEED, but they are only ever compared inside
one process, so nothing relies on that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Parent hash of a sequence's first block in the default namespace.
ROOT_HASH = 0

# (model fingerprint, cache_salt). Empty strings: the unnamed model and no salt, which
# older clients share as before.
Namespace = tuple[str, str]
DEFAULT_NAMESPACE: Namespace = ("", "")

# Signature of a hash function: called on (parent_hash, block_token_ids_tuple).
HashFn = Callable[[tuple[int, tuple[int, ...]]], int]


def namespace_root(namespace: Namespace, hash_fn: HashFn = hash) -> int:
    """The parent hash of the first block of every sequence in ``namespace``."""
    if namespace == DEFAULT_NAMESPACE:
        return ROOT_HASH
    return hash_fn((ROOT_HASH, namespace))  # a tuple of two str: never a block's (int, tuple[int, ...])


def chain_hash(parent_hash: int, block_token_ids: tuple[int, ...], hash_fn: HashFn = hash) -> int:
    """Hash of one full block, chained from its parent's hash."""
    return hash_fn((parent_hash, block_token_ids))


def block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: HashFn = hash,
                 namespace: Namespace = DEFAULT_NAMESPACE) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    tokens = tuple(token_ids)
    hashes = []
    parent = namespace_root(namespace, hash_fn)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_fn((parent, tokens[start : start + block_size]))
        hashes.append(parent)
    return hashes
