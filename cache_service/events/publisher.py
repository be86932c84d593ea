"""Publishes KV event batches on a ZMQ PUB socket, as vLLM's ZmqEventPublisher does.

Each message is three frames: ``[topic, seq, payload]``, the topic ``""`` (vllm-router
reads no other), ``seq`` an 8-byte big-endian counter from 0, the payload one msgpack
``EventBatch`` (``kv_events.py``) of at most MAX_MESSAGE_BYTES: a larger batch goes out
as several, each with its own seq. PUB drops a subscriber's messages past its high-water
mark rather than block the service, and that mark is set from a byte budget
(``EventSettings.subscriber_buffer_bytes``), so an idle or slow subscriber costs the
service a bounded amount of memory; it recovers what it lost from the optional replay
socket (``replay.py``, served by a thread of its own).

Sending happens on the event loop that serves Lease: a PUB send never blocks and costs a
few µs. Both sockets bind (a server's sockets bind in pagedkv, whatever the address),
with CURVE when configured (``curve.py``). A publisher sends one channel's
batches (``model``: one served model name's blocks, None: every model's), with a seq and
a replay buffer of its own.
"""

from __future__ import annotations

import time

import zmq

from cache_service.events.curve import CurveServer
from cache_service.events.replay import ReplayBuffer, ReplayServer
from cache_service.events.settings import MAX_MESSAGE_BYTES, EventSettings
from cache_service.events.kv_events import KvEvent, encode_batches

# The kernel's send buffer per subscriber connection, so what a stalled subscriber holds
# outside the PUB queue is bounded too.
SEND_BUFFER_BYTES = 256 * 1024


class KvEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 data_parallel_rank: int = 0, settings: EventSettings | None = None,
                 model: str | None = None) -> None:
        settings = settings or EventSettings()
        self.model = model
        self.settings = settings
        self._context = zmq.Context()
        self._curve: CurveServer | None = None
        self._replay: ReplayServer | None = None
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(settings.send_hwm)
        self._pub.setsockopt(zmq.SNDBUF, SEND_BUFFER_BYTES)
        self._pub.setsockopt(zmq.LINGER, 0)
        replay_socket = None
        try:
            if settings.curve_secret_key:
                self._curve = CurveServer(self._context, settings)
                self._curve.serve(self._pub)
            self._pub.bind(endpoint)
            if replay_endpoint:
                replay_socket = self._context.socket(zmq.ROUTER)
                replay_socket.setsockopt(zmq.LINGER, 0)
                if self._curve is not None:
                    self._curve.serve(replay_socket)
                replay_socket.bind(replay_endpoint)
        except zmq.ZMQError as error:
            if replay_socket is not None:
                replay_socket.close(linger=0)
            self.close()
            for_model = f" of model {model!r}" if model is not None else ""
            raise ValueError(f"cannot bind the KV events socket{for_model} ({endpoint}, replay {replay_endpoint}): "
                             f"{error}; give tcp://HOST:PORT with a free port") from error
        except ValueError:
            self.close()
            raise
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = replay_socket.getsockopt(zmq.LAST_ENDPOINT).decode() if replay_socket else None
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._next_seq = 0
        self.buffer = ReplayBuffer(settings.replay_buffer_bytes)
        if replay_socket is not None:
            self._replay = ReplayServer(replay_socket, self.buffer, self._topic, settings, model)
            self._replay.start()

    @property
    def public_key(self) -> bytes | None:
        """The CURVE public key subscribers must be given (None: plain TCP)."""
        return self._curve.public_key if self._curve is not None else None

    def publish(self, events: list[KvEvent]) -> int:
        """Sends ``events`` (one batch, or several when large); returns the last seq."""
        for payload in encode_batches(events, time.time(), self._rank, MAX_MESSAGE_BYTES):
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # past the high-water mark: subscribers recover it by replay
            self.buffer.append(seq, payload)
        return self._next_seq - 1

    def close(self) -> None:
        if self._replay is not None:
            self._replay.close()
        self._pub.close(linger=0)
        if self._curve is not None:
            self._curve.close()
        self._context.term()
