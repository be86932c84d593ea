"""The HTTP gate's drain of a refused body (model_service/api/openai_http/gate.py): the answer
goes out first, then the body is read and dropped up to each bound, never past it; a body
announced past the bound, or one the client waits to be asked for, is not read at all.
The real server and the openai client are in tests/test_openai_http.py."""

from __future__ import annotations

import asyncio

import pytest

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.gate import drain, refuse

CHUNK = b"x" * 65536


def endless(pause_s: float = 0.0, calls: list | None = None):
    async def receive():
        if calls is not None:
            calls.append(1)
        if pause_s:
            await asyncio.sleep(pause_s)
        return {"type": "http.request", "body": CHUNK, "more_body": True}
    return receive


def run(coroutine):
    # A bound that failed would hang: the outer limit turns that into a failure.
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_the_drain_stops_at_the_bodys_end():
    messages = [{"type": "http.request", "body": CHUNK, "more_body": True},
                {"type": "http.request", "body": b"end", "more_body": False}]

    async def receive():
        return messages.pop(0)
    assert run(drain(receive, 1 << 20)) == len(CHUNK) + 3 and not messages


def test_the_drain_stops_past_its_bytes_and_on_a_disconnect():
    assert run(drain(endless(), 1 << 20, idle_s=30, total_s=30)) == (1 << 20) + len(CHUNK)

    async def gone():
        return {"type": "http.disconnect"}
    assert run(drain(gone, 1 << 20)) == 0


def test_a_client_that_stops_sending_or_sends_slowly_forever_is_let_go():
    async def silent():
        await asyncio.Event().wait()
    assert run(drain(silent, 1 << 20, idle_s=0.05, total_s=30)) == 0
    # a chunk every 10 ms never leaves the drain idle; its total time ends it
    assert 0 < run(drain(endless(pause_s=0.01), 1 << 40, idle_s=30, total_s=0.3)) < 1 << 40


def refused(headers: list[tuple[bytes, bytes]], drain_bytes: int, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
    run(refuse(ApiError(413, "too large"), {"type": "http", "headers": headers}, receive, send, drain_bytes))
    return sent


@pytest.mark.parametrize(("headers", "drained"), [
    ([(b"content-length", b"1000000")], True),
    ([], True),  # chunked: no length announced
    ([(b"content-length", b"999999999")], False),  # past the bound: closed at once
    ([(b"content-length", b"1000000"), (b"expect", b"100-Continue")], False),  # never asked for
])
def test_the_answer_goes_out_whole_before_any_drain_and_the_last_part_closes_it(headers, drained):
    calls: list = []
    sent = refused(headers, 1 << 20, endless(calls=calls))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    assert b"too large" in sent[1]["body"] and sent[1]["more_body"]
    assert sent[2] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert bool(calls) == drained
