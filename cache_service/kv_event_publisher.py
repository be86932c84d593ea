"""Publishes KV event batches on a ZMQ PUB socket, as vLLM's ZmqEventPublisher does.

Each message is three frames: ``[topic, seq, payload]``, the topic ``""`` (vllm-router
reads no other), ``seq`` an 8-byte big-endian counter from 0, the payload one msgpack
``EventBatch`` (``kv_events.py``). A subscriber that joins late or drops messages (PUB
drops past its high-water mark rather than block the service) asks the optional
ROUTER replay socket for every batch from a seq on: it sends the seq as 8 bytes and
gets ``(topic, seq, payload)`` frames for each batch still buffered, then
``(b"", -1, b"")``: the frames a live batch has, as vLLM 0.32's publisher replays them
(vllm-router drops replies of any other shape).

Sending happens on the event loop that serves Lease: a PUB send never blocks and costs
a few µs, so no thread is needed; the replay socket is served by a task on that loop.
Both sockets bind (a server's sockets bind in pagedkv, whatever the address). A publisher
sends one channel's batches (``model``: one served model name's blocks, None: every
model's), with a seq and a replay buffer of its own.
"""

from __future__ import annotations

import asyncio
import collections
import time

import structlog
import zmq
import zmq.asyncio

from cache_service.kv_events import EventBatch, KvEvent, encode_batch

log = structlog.get_logger()

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Batches a replay can reach back: at one batch per Lease call, seconds to minutes of
# history, and at most this many payloads held in memory.
REPLAY_BUFFER_BATCHES = 10_000
# vLLM's high-water mark: past it a slow subscriber loses messages (and can replay them).
SEND_HWM = 100_000


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 data_parallel_rank: int = 0, buffer_batches: int = REPLAY_BUFFER_BATCHES,
                 model: str | None = None) -> None:
        self.model = model
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = zmq.asyncio.Context.shadow(self._context).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self.close()
            for_model = f" of model {model!r}" if model is not None else ""
            raise ValueError(f"cannot bind the KV events socket{for_model} ({endpoint}, replay {replay_endpoint}): "
                             f"{error}; give tcp://HOST:PORT with a free port") from error
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode() if self._replay else None
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._next_seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)

    def publish(self, events: list[KvEvent]) -> int:
        """Sends one batch of ``events``; returns its seq."""
        payload = encode_batch(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # past the high-water mark: subscribers recover it by replay
        self._buffer.append((seq, payload))
        return seq

    async def serve_replay(self) -> None:
        """Answers replay requests until cancelled (returns at once without a replay socket)."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            # A REQ client's request arrives as [identity, b"", seq]; a DEALER's may omit the delimiter.
            if len(frames) == 3 and frames[1] == b"":
                envelope = frames[:2]
            elif len(frames) == 2:
                envelope = frames[:1]
            else:
                log.warning("kv_events_bad_replay_request", frames=len(frames))
                continue
            if len(frames[-1]) != 8:
                log.warning("kv_events_bad_replay_request", seq_bytes=len(frames[-1]))
                continue
            start = int.from_bytes(frames[-1], "big", signed=True)
            # A snapshot: publish() may append while this coroutine waits on a send.
            for seq, payload in [entry for entry in self._buffer if entry[0] >= start]:
                await self._replay.send_multipart((*envelope, self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((*envelope, b"", END_SEQ, b""))

    def close(self) -> None:
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close(linger=0)
        self._context.term()


async def replay_forever(publisher: KvEventPublisher) -> None:
    try:
        await publisher.serve_replay()
    except asyncio.CancelledError:
        raise
    except Exception:  # a replay failure must not end the service's event publishing
        log.exception("kv_events_replay_failed", model=publisher.model)
