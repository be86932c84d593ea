"""The KV event sockets' limits and keys (--kv-events-* flags), checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

# A published message's payload is kept under this size (a larger batch goes out as
# several, each with its own seq), so a subscriber's queue, counted in messages by ZMQ,
# is bounded in bytes: high-water mark x this.
MAX_MESSAGE_BYTES = 16 * 1024
DEFAULT_SUBSCRIBER_BUFFER_BYTES = 8 * 1024 * 1024
DEFAULT_REPLAY_BUFFER_BYTES = 32 * 1024 * 1024
DEFAULT_REPLAY_MAX_BATCHES = 1000
DEFAULT_REPLAY_REQUESTS_PER_S = 10.0
DEFAULT_REPLAY_BATCHES_PER_S = 2000.0


@dataclass(frozen=True, slots=True)
class EventSettings:
    # What one subscriber that reads slowly (or not at all) may have queued in the
    # service; past it that subscriber loses messages and can replay them.
    subscriber_buffer_bytes: int = DEFAULT_SUBSCRIBER_BUFFER_BYTES
    # The replay buffer: the newest batches whose payloads fit in this many bytes.
    replay_buffer_bytes: int = DEFAULT_REPLAY_BUFFER_BYTES
    # Batches one replay request is answered with at most (the oldest first); a
    # subscriber further behind asks again from the next seq.
    replay_max_batches: int = DEFAULT_REPLAY_MAX_BATCHES
    # Replay requests one peer address may make per second (and in one burst); the rest
    # are dropped unanswered.
    replay_requests_per_s: float = DEFAULT_REPLAY_REQUESTS_PER_S
    # Batches the replay socket sends a second, every peer together (bursts of one whole
    # answer): past it the thread waits and unread requests queue in the socket. Peers
    # from many addresses each have their request budget; this bounds what all of them
    # cost the service's CPU together.
    replay_batches_per_s: float = DEFAULT_REPLAY_BATCHES_PER_S
    # CURVE: the service's secret key file (zmq.auth's format); None: plain TCP.
    curve_secret_key: str | None = None
    # CURVE: a folder of the public key files of the subscribers allowed in (None with a
    # secret key: any client that knows the service's public key).
    curve_clients: str | None = None

    def __post_init__(self) -> None:
        if self.subscriber_buffer_bytes < MAX_MESSAGE_BYTES:
            raise ValueError(f"--kv-events-subscriber-buffer-bytes must be at least {MAX_MESSAGE_BYTES} "
                             f"(one message), got {self.subscriber_buffer_bytes}")
        if self.replay_buffer_bytes < 0:
            raise ValueError(f"--kv-events-replay-buffer-bytes cannot be negative, got {self.replay_buffer_bytes}")
        if self.replay_max_batches < 1:
            raise ValueError(f"--kv-events-replay-max-batches must be at least 1, got {self.replay_max_batches}")
        if not self.replay_requests_per_s > 0:
            raise ValueError(f"--kv-events-replay-rate must be positive, got {self.replay_requests_per_s}")
        if not self.replay_batches_per_s > 0:
            raise ValueError(f"--kv-events-replay-batches-per-s must be positive, got {self.replay_batches_per_s}")
        if self.curve_clients and not self.curve_secret_key:
            raise ValueError("--kv-events-curve-clients needs --kv-events-curve-secret-key: the service's own key")

    @property
    def send_hwm(self) -> int:
        """The PUB socket's high-water mark, in messages, per subscriber."""
        return max(1, self.subscriber_buffer_bytes // MAX_MESSAGE_BYTES)
