"""uvicorn inside the model service's own event loop, beside the grpc.aio server.

The socket is bound here, before uvicorn starts, so a port in use is a start-up error
with the address in it and port 0 reports the port it got. uvicorn's own signal handlers
are left out: the model service decides when to stop (SIGTERM: health NOT_SERVING, the
engine drains, then both servers stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import structlog
import uvicorn

log = structlog.get_logger()


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, host: str, port: int, *, tls_cert: str | None = None, tls_key: str | None = None,
                 graceful_s: float = 1.0) -> None:
        self.host = host
        self.requested_port = port
        self.port = 0
        config = uvicorn.Config(app, host=host, port=port, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                log_config=None, access_log=False, lifespan="off", loop="none",
                                timeout_graceful_shutdown=graceful_s, server_header=False)
        self._server = _EmbeddedServer(config)
        self._socket: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self.tls = bool(tls_cert)

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.requested_port))
        except OSError as error:
            sock.close()
            raise OSError(f"cannot bind HTTP to {self.host}:{self.requested_port} ({error.strerror}): "
                          "is the port in use? set --http-port (-1 disables HTTP)") from None
        sock.listen(2048)
        sock.setblocking(False)
        self._socket = sock
        self.port = sock.getsockname()[1]
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # uvicorn failed to start: raise its error
                raise OSError(f"uvicorn stopped while starting on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        log.info("http_listening", address=f"{self.host}:{self.port}", tls=self.tls)
        return self.port

    async def stop(self) -> None:
        """Stops accepting, gives open responses uvicorn's graceful time, then closes."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
