"""GrpcServer (pagedkv/serving.py): a handler's unexpected exception reaches the service's
own log and the caller gets INTERNAL naming it; a handler's own abort passes untouched.

A real aio server on a free loopback port and a real channel; the handlers are this
file's, so each case is one raise away."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from structlog.testing import capture_logs

from pagedkv.serving import GrpcServer, ServerConfig

SERVICE = "pagedkv.test.Errors"


def identity(data: bytes) -> bytes:
    return data


async def crash(request: bytes, context) -> bytes:
    raise RuntimeError("the pool's memory could not be mapped")


async def refuse(request: bytes, context) -> bytes:
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "budget too small")


async def crash_midway(request: bytes, context):
    yield b"first"
    raise KeyError("a sequence the step lost")


async def fine(request: bytes, context) -> bytes:
    return b"ok:" + request


def register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Crash": grpc.unary_unary_rpc_method_handler(crash, identity, identity),
        "Refuse": grpc.unary_unary_rpc_method_handler(refuse, identity, identity),
        "Fine": grpc.unary_unary_rpc_method_handler(fine, identity, identity),
        "CrashMidway": grpc.unary_stream_rpc_method_handler(crash_midway, identity, identity),
    })])


async def call_each() -> dict:
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, metrics_port=-1), [SERVICE], register)
    port = await server.start()
    answers: dict = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for name in ("Crash", "Refuse", "Fine"):
                call = channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=identity,
                                           response_deserializer=identity)
                try:
                    answers[name] = await call(b"x", timeout=10)
                except grpc.aio.AioRpcError as error:
                    answers[name] = (error.code(), error.details())
            streamed = []
            call = channel.unary_stream(f"/{SERVICE}/CrashMidway", request_serializer=identity,
                                        response_deserializer=identity)(b"x", timeout=10)
            try:
                async for response in call:
                    streamed.append(response)
            except grpc.aio.AioRpcError as error:
                streamed.append((error.code(), error.details()))
            answers["CrashMidway"] = streamed
    finally:
        await server.stop(0)
    return answers


@pytest.fixture(scope="module")
def answers_and_logs():
    with capture_logs() as logs:
        answers = asyncio.run(call_each())
    return answers, logs


def test_an_unexpected_exception_is_internal_with_its_name_and_logged(answers_and_logs):
    answers, logs = answers_and_logs
    code, details = answers["Crash"]
    assert code == grpc.StatusCode.INTERNAL  # gRPC alone answers UNKNOWN
    assert "RuntimeError: the pool's memory could not be mapped" in details
    failed = [entry for entry in logs if entry["event"] == "rpc_failed"]
    assert {entry["method"] for entry in failed} == {f"/{SERVICE}/Crash", f"/{SERVICE}/CrashMidway"}
    crash_entry = next(entry for entry in failed if entry["method"].endswith("/Crash"))
    assert "the pool's memory could not be mapped" in crash_entry["error"]
    assert isinstance(crash_entry["exc_info"], RuntimeError)


def test_a_handlers_own_abort_and_answer_pass_unchanged(answers_and_logs):
    answers, _ = answers_and_logs
    assert answers["Refuse"] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "budget too small")
    assert answers["Fine"] == b"ok:x"


def test_a_stream_that_fails_midway_keeps_what_it_sent_and_ends_internal(answers_and_logs):
    answers, _ = answers_and_logs
    first, (code, details) = answers["CrashMidway"]
    assert first == b"first"
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in details
