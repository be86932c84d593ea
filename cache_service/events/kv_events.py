"""vLLM's KV event wire format: the events a router reads to learn what each worker caches.

A batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event is a msgpack
map tagged ``"type"`` with the event's name (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), with the fields of vLLM 0.32's ``vllm/distributed/kv_events.py``.
Every field is written, None included, so a consumer that expects a key finds it.
Hashes are the low 64 bits of vLLM's block digests (``vllm_block_hash.external``).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's names for where a block lives: the device pool is "GPU" on any device; the
# host and disk tiers will be "CPU" and "STORAGE". "REMOTE" is pagedkv's: the store shared
# by replicas (--remote-kv), holding a block this service wrote there.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUM_REMOTE = "REMOTE"
# pagedkv's pool is one KV cache group of full attention (vLLM's spec kind for it).
FULL_ATTENTION = "full_attention"


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    """Blocks newly in the cache, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # One entry per block: the extra keys its hash covered (the cache_salt, first block only).
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = FULL_ATTENTION


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    """Blocks no longer in the cache (evicted for reuse)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    """Forget everything this worker reported before (a new pool starts empty)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """As a consumer decodes a payload frame (tests and tools)."""
    return _decoder.decode(payload)


def encode_batches(events: list[KvEvent], ts: float, data_parallel_rank: int | None, max_bytes: int) -> list[bytes]:
    """``events`` as one payload, or as several in order when one would pass ``max_bytes``:
    the list is halved, and a BlockStored or BlockRemoved of many blocks is cut into runs
    (each run names the block before it as its parent, so a consumer's chain is the same).
    A single block's event is never cut; it is far under any ``max_bytes`` the service uses."""
    payload = encode_batch(EventBatch(ts=ts, events=events, data_parallel_rank=data_parallel_rank))
    if len(payload) <= max_bytes:
        return [payload]
    if len(events) > 1:
        half = len(events) // 2
        return (encode_batches(events[:half], ts, data_parallel_rank, max_bytes)
                + encode_batches(events[half:], ts, data_parallel_rank, max_bytes))
    halves = _halves(events[0])
    if halves is None:
        return [payload]
    return [part for half in halves for part in encode_batches([half], ts, data_parallel_rank, max_bytes)]


def _halves(event: KvEvent) -> tuple[KvEvent, KvEvent] | None:
    count = len(getattr(event, "block_hashes", ()))
    if count < 2:
        return None
    half = count // 2
    if isinstance(event, BlockRemoved):
        return (msgspec.structs.replace(event, block_hashes=event.block_hashes[:half]),
                msgspec.structs.replace(event, block_hashes=event.block_hashes[half:]))
    cut = half * event.block_size
    extra = event.extra_keys
    return (
        msgspec.structs.replace(event, block_hashes=event.block_hashes[:half], token_ids=event.token_ids[:cut],
                                extra_keys=extra[:half] if extra is not None else None),
        msgspec.structs.replace(event, block_hashes=event.block_hashes[half:], token_ids=event.token_ids[cut:],
                                parent_block_hash=event.block_hashes[half - 1],
                                extra_keys=extra[half:] if extra is not None else None),
    )
