"""The gRPC server scaffolding both services share.

Health checking, reflection (so grpcurl works), optional shared-token auth, optional
TLS, message size limits, the Prometheus HTTP endpoint and a graceful stop on SIGTERM.
A service registers its servicer and says when it is SERVING; everything else is here.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pagedkv.bearer import presented_token, token_matches
from pagedkv.logs import configure_logging

log = structlog.get_logger()

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str
    port: int
    metrics_port: int
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_bytes: int = 16 * 1024 * 1024
    port_file: str | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.max_message_bytes < 1024:
            raise ValueError(f"--max-message-bytes {self.max_message_bytes} is too small (at least 1024)")

    @classmethod
    def from_args(cls, args) -> ServerConfig:
        return cls(
            host=args.host,
            port=args.port,
            metrics_port=args.metrics_port,
            auth_token=args.auth_token or None,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            max_message_bytes=args.max_message_bytes,
            port_file=args.port_file,
            metrics_host=args.metrics_host,
        )


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries a shared token, for clients of either service."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call but health checks that lacks 'authorization: Bearer <token>'
    (the scheme in any case)."""

    def __init__(self, token: str | None = None, *, authenticate: Callable[[bytes], bool] | None = None) -> None:
        # authenticate(presented token) -> accepted: several keys (the model service's --api-keys).
        expected = token.encode() if token else None
        self._authenticate = authenticate or (lambda presented: token_matches(presented, expected))

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = presented_token(metadata.get("authorization"))
        if self._authenticate(presented):
            return handler
        reason = "missing authorization metadata" if not presented else "wrong token"
        return _deny(handler, f"{reason}: send 'authorization: Bearer <token>' matching the server's --auth-token")


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    async def abort_unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)


class _Malformed:
    """What a request that failed to parse becomes, so its handler can say INVALID_ARGUMENT."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a request that does not parse (bad UTF-8 in a string
    field, a truncated message), where gRPC would answer UNKNOWN and log a traceback.
    And a handler's unexpected exception is logged here (structlog, with its traceback),
    then answered INTERNAL with its type and message: gRPC alone answers UNKNOWN and
    logs it where the service's own log never shows it."""

    def __init__(self) -> None:
        # method -> (its handler, the wrapped one): wrapped once, not on every call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[method] = (handler, _parse_safely(handler, method))
        return cached[1]


def _parse_safely(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler`, but a request that does not parse gets INVALID_ARGUMENT."""
    # Only unary requests of async handlers: everything our services and health serve.
    if handler.request_streaming or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception as error:  # protobuf's DecodeError, whatever the runtime
            return _Malformed(f"malformed request to {method}: {error}")

    kwargs = dict(request_deserializer=deserialize, response_serializer=handler.response_serializer)
    if handler.unary_unary and inspect.iscoroutinefunction(handler.unary_unary):
        behavior = handler.unary_unary

        async def unary(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            try:
                return await behavior(request, context)
            except Exception as error:
                await _abort_unexpected(context, method, error)

        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
        behavior = handler.unary_stream

        async def stream(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            except Exception as error:
                await _abort_unexpected(context, method, error)
            finally:
                await responses.aclose()

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    return handler


async def _abort_unexpected(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    """Re-raises an abort (the handler's own answer); logs anything else and answers INTERNAL."""
    if isinstance(error, grpc.aio.AbortError):
        raise error
    log.error("rpc_failed", method=method, error=f"{type(error).__name__}: {error}", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL,
                        f"{method} failed on an internal error ({type(error).__name__}: {error}); "
                        "the service's log has the traceback")


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class GrpcServer:
    """An aio gRPC server with health, reflection, auth, TLS and metrics wired in."""

    def __init__(
        self,
        config: ServerConfig,
        service_names: Iterable[str],
        register: Callable[[grpc.aio.Server], None],
        authenticate: Callable[[bytes], bool] | None = None,
    ) -> None:
        self.config = config
        self.service_names = list(service_names)
        # Auth first: a caller without the token learns nothing, not even that a request parses.
        interceptors = ([TokenAuthInterceptor(config.auth_token, authenticate=authenticate)]
                        if config.auth_token or authenticate else [])
        interceptors.append(MalformedRequestInterceptor())
        self.server_authenticates = authenticate is not None
        self.server = grpc.aio.server(interceptors=interceptors, options=message_options(config.max_message_bytes))
        register(self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([*self.service_names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.server)
        self.port = 0
        self.metrics_port = -1
        self._metrics_server = None
        # Set as stop() begins: calls that stay open for good (a held session) end then,
        # rather than keeping the stop waiting out its grace.
        self.stopping = asyncio.Event()

    async def start(self, extra_ports: dict[str, int] | None = None) -> int:
        """Binds, serves, and writes the port file: {"port", "metrics_port", **extra_ports}
        (another listener of the same process, e.g. the model service's HTTP port)."""
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(self.config.tls_key).read_bytes(), Path(self.config.tls_cert).read_bytes())]
            )
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {address}: is the port in use?")
        # Everything starts NOT_SERVING; the service says when it is ready.
        await self.set_serving(False)
        await self.server.start()
        if self.config.metrics_port >= 0:
            self._metrics_server, _ = prometheus_client.start_http_server(self.config.metrics_port,
                                                                           addr=self.config.metrics_host)
            self.metrics_port = self._metrics_server.server_port
        if self.config.port_file:
            ports = {"port": self.port, "metrics_port": self.metrics_port, **(extra_ports or {})}
            Path(self.config.port_file).write_text(json.dumps(ports))
        log.info("grpc_listening", address=f"{self.config.host}:{self.port}", metrics_port=self.metrics_port,
                 tls=bool(self.config.tls_cert),
                 auth=bool(self.config.auth_token) or bool(self.server_authenticates))
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        self.stopping.set()
        await self.set_serving(False)
        await self.server.stop(grace_s)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


async def wait_for_stop_signal() -> signal.Signals:
    """Returns once SIGTERM or SIGINT arrives."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: stopped.done() or stopped.set_result(s))
    return await stopped


def run_server_main(parser, argv: list[str], serve: Callable[[object], Awaitable[int | None]],
                    startup_errors: tuple[type[BaseException], ...] = (ValueError,)) -> int:
    """The `main` of a service: parse flags, configure logs, serve; a start-up error a
    person can fix (bad flag values, a model that does not load) exits 2 with its message."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level, json=args.log_json)
    try:
        ServerConfig.from_args(args)
        return asyncio.run(serve(args)) or 0
    except startup_errors as error:
        log.error("startup_failed", error=str(error))
        print(f"{parser.prog}: error: {error}", file=sys.stderr, flush=True)
        return 2


def exit_process(code: int) -> None:
    """Ends a service process whose `main` has returned: everything it holds (the pool's
    file, sockets, leases, tier files) was closed explicitly on the way out, so the
    interpreter's own teardown has nothing left to do but unload torch's modules one by
    one, a pause that every stop (a rolling restart, each test's service) would wait on.
    Logs and streams are flushed first; then the process exits at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken pipe: nothing left to flush to
    os._exit(code)


async def serve_until_signal(server: GrpcServer, grace_s: float) -> None:
    """Runs until SIGTERM/SIGINT; then health goes NOT_SERVING and in-flight calls get
    grace_s seconds to finish before the server stops."""
    sig = await wait_for_stop_signal()
    log.info("stopping", signal=sig.name, grace_s=grace_s)
    await server.set_serving(False)
    await server.stop(grace_s)
    log.info("stopped")
