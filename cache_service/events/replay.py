"""The KV events replay socket, served by a thread of its own, never by the Lease loop.

A subscriber that missed batches sends a seq (8 bytes, big-endian) to the ROUTER socket
and gets ``(topic, seq, payload)`` for each buffered batch from that seq on, then
``(b"", -1, b"")``: the frames vLLM 0.32's publisher replays (vllm-router drops replies
of any other shape). Anyone who can reach the socket can ask, so what one request and one
peer cost is bounded:

- the buffer holds the newest batches whose payloads fit in ``replay_buffer_bytes``;
- one request is answered with at most ``replay_max_batches`` batches (the oldest
  first; the subscriber asks again from the seq after the last it got);
- one peer address may make ``replay_requests_per_s`` requests a second (a token bucket,
  the burst as large as the rate); the rest are dropped unanswered and counted;
- every peer together gets ``replay_batches_per_s`` batches a second (a bucket whose burst
  holds one whole answer): past it the thread waits before it reads the next request, so
  requests queue in the socket and then in their senders, and peers from many addresses
  take no more CPU than that together;
- replies are sent without blocking into a queue of ``replay_max_batches + 1`` messages
  per connection: a peer that does not read loses replies, the thread never waits for one.

The thread shares nothing with the event loop but the buffer, under a lock held for an
append or for slicing at most one answer.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time

import structlog
import zmq
from prometheus_client import Counter

from cache_service.events.settings import EventSettings
from pagedkv.token_bucket import TokenBucket, refill

log = structlog.get_logger()

REPLAY_REQUESTS = Counter(
    "pagedkv_cache_kv_events_replay_requests",
    "Replay requests on the KV events replay sockets, by outcome (answered, rate_limited, malformed)",
    ["outcome"],
)
REPLAY_BATCHES = Counter("pagedkv_cache_kv_events_replay_batches", "Event batches sent in replay answers")
REPLAY_WAIT_SECONDS = Counter("pagedkv_cache_kv_events_replay_wait_seconds",
                              "Seconds the replay thread waited for its batch budget (--kv-events-replay-batches-per-s)")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# Peers whose request budget is remembered; past it the least recently seen is forgotten.
MAX_TRACKED_PEERS = 4096
# How often the thread looks up from its socket to see whether the service is stopping.
POLL_MS = 100


class ReplayBuffer:
    """The newest published batches, bounded in payload bytes; safe across threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.deque[tuple[int, bytes]] = collections.deque()
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._entries.append((seq, payload))
            self.bytes += len(payload)
            while self.bytes > self.max_bytes:
                self.bytes -= len(self._entries.popleft()[1])

    def since(self, start: int, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` batches from seq ``start`` on, oldest first (seqs are consecutive)."""
        with self._lock:
            if not self._entries:
                return []
            skip = max(start - self._entries[0][0], 0)
            return list(itertools.islice(self._entries, skip, skip + limit))

    def __len__(self) -> int:
        return len(self._entries)


class PeerRate:
    """A token bucket per peer address: ``rate`` requests a second, bursts of ``rate``."""

    def __init__(self, rate: float, clock=time.monotonic) -> None:
        self.rate = rate
        self.burst = max(rate, 1.0)
        self._clock = clock
        self._peers: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def allow(self, peer: str) -> bool:
        now = self._clock()
        tokens, last = self._peers.pop(peer, (self.burst, now))
        tokens = refill(tokens, last, now, self.rate, self.burst)
        allowed = tokens >= 1.0
        self._peers[peer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._peers) > MAX_TRACKED_PEERS:
            self._peers.popitem(last=False)
        return allowed


class ReplayServer:
    """Answers replay requests on ``socket`` (a bound ROUTER this thread owns from ``start`` on)."""

    def __init__(self, socket: zmq.Socket, buffer: ReplayBuffer, topic: bytes, settings: EventSettings,
                 model: str | None) -> None:
        self._socket = socket
        self._buffer = buffer
        self._topic = topic
        self._max_batches = settings.replay_max_batches
        self._rate = PeerRate(settings.replay_requests_per_s)
        # A whole answer (its batches and the end message) always fits in one burst.
        self._budget = TokenBucket(settings.replay_batches_per_s,
                                   max(settings.replay_batches_per_s, settings.replay_max_batches + 1))
        self._model = model
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-replay", daemon=True)
        socket.set_hwm(settings.replay_max_batches + 1)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops the thread (within a poll interval) and closes its socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        else:
            self._socket.close(linger=0)

    def _run(self) -> None:
        socket = self._socket
        try:
            while not self._stop.is_set():
                if socket.poll(POLL_MS, zmq.POLLIN):
                    try:
                        self._answer(socket.recv_multipart(copy=False))
                    except zmq.ZMQError as error:
                        log.warning("kv_events_replay_send_failed", model=self._model, error=str(error))
        except Exception:  # a replay failure must not end the service's event publishing
            log.exception("kv_events_replay_failed", model=self._model)
        finally:
            socket.close(linger=0)

    def _answer(self, frames: list[zmq.Frame]) -> None:
        # A REQ client's request arrives as [identity, b"", seq]; a DEALER's may omit the delimiter.
        if len(frames) == 3 and frames[1].bytes == b"":
            envelope = [frames[0].bytes, b""]
        elif len(frames) == 2:
            envelope = [frames[0].bytes]
        else:
            REPLAY_REQUESTS.labels("malformed").inc()
            return
        request = frames[-1].bytes
        if len(request) != 8:
            REPLAY_REQUESTS.labels("malformed").inc()
            return
        if not self._rate.allow(_peer(frames[-1])):
            REPLAY_REQUESTS.labels("rate_limited").inc()
            return
        batches = self._buffer.since(int.from_bytes(request, "big", signed=True), self._max_batches)
        while (wait_s := self._budget.take(len(batches) + 1)) > 0:
            REPLAY_WAIT_SECONDS.inc(wait_s)
            if self._stop.wait(wait_s):
                return
        for seq, payload in batches:
            self._send((*envelope, self._topic, seq.to_bytes(8, "big"), payload))
        self._send((*envelope, b"", END_SEQ, b""))
        REPLAY_BATCHES.inc(len(batches))
        REPLAY_REQUESTS.labels("answered").inc()  # once its replies are queued

    def _send(self, frames: tuple[bytes, ...]) -> None:
        """send_multipart without its enum arithmetic a frame, a good part of a flood's cost."""
        send = self._socket.send
        for frame in frames[:-1]:
            send(frame, _MORE)
        send(frames[-1], _LAST)


_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), int(zmq.NOBLOCK)


def _peer(frame: zmq.Frame) -> str:
    """The peer's address (its IP over TCP); one budget for every connection from it."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return ""  # a transport without addresses (ipc, inproc): one budget for all
