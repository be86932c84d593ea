"""The remote KV tier's keys and values: what a block is called in the store, and how its
bytes are sealed there.

A key is ``pagedkv:kv:2:<geometry tag>:<chain digest>``: the digest
(``tier_index.chain_digest``) is rooted in the model fingerprint and the tenant's cache
salt and names the whole prefix in that namespace; the geometry tag (layers, KV heads,
head size, block size, KV dtype) keeps two layouts apart. A value is ``MAGIC | the
block's K/V | MAC``, the MAC keyed BLAKE3 under the key the cluster's cache services share
(32 bytes, BLAKE3's key size), over the store key and everything before the MAC, so a
value is used only under the key it was written for, by a service that holds the shared
key. Keyed BLAKE3 is a MAC by design, and a read checks every block's bytes before use,
on the path of the Lease call waiting for them: it runs several times faster than
HMAC-SHA256 there. (Values of the first format, sealed with HMAC-SHA256, sit under
``pagedkv:kv:1`` keys, which this one never reads.)
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import blake3
import torch

from cache_service.blocks.prefix_hash import Namespace
from cache_service.tiers.disk_tier import DiskGeometry
from cache_service.tiers.tier_index import ROOT_PARENT, chain_digest

MAGIC = b"PKVRMT02"
MAC_BYTES = 32
KEY_PREFIX = "pagedkv:kv:2"


def chain_digests(token_ids: Sequence[int], block_size: int, num_blocks: int, namespace: Namespace) -> list[bytes]:
    """The chain digests of ``token_ids``'s first ``num_blocks`` full blocks in ``namespace``."""
    out: list[bytes] = []
    parent = ROOT_PARENT
    for index in range(num_blocks):
        parent = chain_digest(parent, namespace, tuple(token_ids[index * block_size : (index + 1) * block_size]))
        out.append(parent)
    return out


class RemoteValues:
    def __init__(self, key: bytes, geometry: DiskGeometry) -> None:
        self.geometry = geometry
        self.value_bytes = len(MAGIC) + geometry.payload_bytes + MAC_BYTES
        self._key = key
        self._prefix = f"{KEY_PREFIX}:{geometry.tag}:"

    def key_of(self, digest: bytes) -> str:
        return self._prefix + digest.hex()

    def encode(self, digest: bytes, payload: torch.Tensor) -> bytes:
        body = MAGIC + payload.contiguous().view(torch.uint8).numpy().tobytes()
        return body + self._mac(digest, body)

    def decode(self, digest: bytes, value: bytes) -> torch.Tensor | None:
        """The block's K/V in ``value`` if it passes every check, else None."""
        if len(value) != self.value_bytes or not value.startswith(MAGIC):
            return None
        body = memoryview(value)[:-MAC_BYTES]
        if not hmac.compare_digest(self._mac(digest, body), value[-MAC_BYTES:]):
            return None
        payload = bytearray(body[len(MAGIC):])
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.geometry.dtype).reshape(self.geometry.block_shape)

    def _mac(self, digest: bytes, body) -> bytes:
        mac = blake3.blake3(self.key_of(digest).encode() + b"\0", key=self._key)
        mac.update(body)
        return mac.digest(MAC_BYTES)
