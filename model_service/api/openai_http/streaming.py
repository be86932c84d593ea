"""Running GenerateRequests for one HTTP body: start them all, merge their results, and
make sure every one is closed (its blocks freed) whatever the client does.

`EventStream` is FastAPI's SSE response (text/event-stream, events framed by its
format_sse_event) that closes the body's requests when the response ends for any reason:
finished, failed, or cancelled by Starlette because the client went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from fastapi.sse import EventSourceResponse
from starlette.types import Receive, Scope, Send

from model_service.api.generation import GenerateError, GenerationService, ResponseStream
from model_service.api.tenants import SINGLE, Tenant
from pagedkv.model.v1 import model_pb2


class Running:
    """The ResponseStreams of one body's GenerateRequests."""

    def __init__(self, streams: list[ResponseStream]) -> None:
        self.streams = streams

    @classmethod
    async def start(cls, generation: GenerationService, requests: list[model_pb2.GenerateRequest],
                    tenant: Tenant = SINGLE) -> Running:
        """Starts every request, its prompt tokenized on a worker thread as gRPC's are
        (start_async), a list of prompts side by side; if one is refused, those started
        are closed and its GenerateError is raised."""
        tasks = [asyncio.ensure_future(generation.start_async(request, tenant=tenant)) for request in requests]
        try:
            await asyncio.wait(tasks)
        finally:  # also when the client went away meanwhile: nothing started may stay open
            for task in tasks:
                task.cancel()
            started = [task.result() for task in tasks if task.done() and not task.cancelled()
                       and task.exception() is None]
            errors = [task.exception() for task in tasks if task.done() and not task.cancelled()
                      and task.exception() is not None]
            if errors or len(started) < len(tasks):
                cls(started).close()
        if errors:
            raise errors[0]
        return cls(started)

    async def results(self) -> AsyncIterator[tuple[int, model_pb2.GenerateResponse]]:
        """(prompt index, response) in arrival order; GenerateError if any request fails."""
        if len(self.streams) == 1:  # the common case, without a task per request
            async for response in self.streams[0]:
                yield 0, response
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_index: int, stream: ResponseStream) -> None:
            try:
                async for response in stream:
                    merged.put_nowait((prompt_index, response))
            except GenerateError as error:
                merged.put_nowait(error)
            merged.put_nowait(None)

        pumps = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(self.streams)]
        try:
            remaining = len(pumps)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, GenerateError):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


class EventStream(EventSourceResponse):
    """SSE events from `events`; `on_end` runs however the response ends."""

    def __init__(self, events: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        super().__init__(events, headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
