"""Reading a cache service's KV events replay socket as a vLLM subscriber does."""

from __future__ import annotations

import zmq


def replay(endpoint: str, start_seq: int) -> list[tuple[int, bytes]]:
    """Asks the replay socket for every batch from ``start_seq`` on, as a vLLM subscriber does:
    a DEALER sends the seq behind an empty delimiter and reads (topic, seq, payload) replies,
    vLLM's publisher's frames, up to seq -1 (whose topic and payload are empty)."""
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 60_000)  # generous: a loaded machine, never a pace
        sock.connect(endpoint)
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while True:
            delimiter, topic, seq_bytes, payload = sock.recv_multipart()
            assert delimiter == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert (topic, payload) == (b"", b"")
                return batches
            assert topic == b""  # the cache service's channels all publish under vllm-router's topic
            batches.append((seq, payload))
