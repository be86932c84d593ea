"""ModelService over gRPC: validates requests, maps errors to status codes, streams.

Everything a client can get wrong is caught here, before the engine sees the request,
so a rejected request never holds a block.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import grpc
import structlog

from model_service import metrics
from model_service.engine import Delta, Engine, EngineUnavailable, QueueFull
from model_service.sampling import InvalidRequest
from model_service.sequence import Finish
from model_service.validation import GenerateLimits, PoolTooSmall, validate_generate_request
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

log = structlog.get_logger()

FINISH_REASON = {
    Finish.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    Finish.STOP: model_pb2.FINISH_REASON_STOP,
    Finish.EOS: model_pb2.FINISH_REASON_EOS,
}


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, engine: Engine, *, default_max_new_tokens: int, max_prompt_tokens: int,
                 max_concurrent_streams: int = 0) -> None:
        self.engine = engine
        self.limits = GenerateLimits(
            vocab_size=engine.loaded.config.vocab_size,
            max_model_len=engine.settings.max_model_len,
            max_prompt_tokens=max_prompt_tokens,
            default_max_new_tokens=default_max_new_tokens,
        )
        self.max_concurrent_streams = max_concurrent_streams  # 0: no limit
        # Generate calls in progress; read and written on the event loop only.
        self.open_streams = 0

    async def GetModelInfo(self, request, context):
        loaded = self.engine.loaded
        return model_pb2.GetModelInfoResponse(
            model_id=loaded.model_id,
            architecture=loaded.config.architecture,
            vocab_size=loaded.config.vocab_size,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            max_total_tokens=self.engine.max_total_tokens,
            block_size=self.engine.block_size,
            max_model_len=self.engine.settings.max_model_len,
            dtype=str(self.engine.geometry.dtype).removeprefix("torch."),
            device=str(self.engine.device),
            has_chat_template=loaded.chat_template is not None,
        )

    async def Generate(self, request, context):
        if self.max_concurrent_streams and self.open_streams >= self.max_concurrent_streams:
            await reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{self.open_streams} Generate streams are open, the limit is "
                         f"--max-concurrent-streams {self.max_concurrent_streams}; retry later")
        self.open_streams += 1
        responses = self._generate(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            self.open_streams -= 1
            await responses.aclose()  # its own finally cancels the request, if it still runs

    async def _generate(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            prompt_token_ids, options = validate_generate_request(
                request, self._limits(), self.engine.loaded.tokenizer, self.engine.loaded.chat_template)
        except InvalidRequest as error:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        except PoolTooSmall as error:
            await reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error)

        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        try:
            # The engine calls sinks on this event loop (deliver_on_loop), so put_nowait is safe.
            key = self.engine.submit(request_id, prompt_token_ids, options, deltas.put_nowait)
        except QueueFull as error:
            await reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error)
        except EngineUnavailable as error:
            await reject(context, grpc.StatusCode.UNAVAILABLE, error)

        finished = False
        try:
            while not finished:
                delta = merge(await deltas.get(), deltas)
                if delta.error is not None:
                    finished = True
                    await context.abort(*delta.error)
                response = model_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text,
                                                      request_id=request_id)
                if delta.finish is not None:
                    finished = True
                    response.finish_reason = FINISH_REASON[delta.finish]
                    response.usage.prompt_tokens = delta.prompt_tokens
                    response.usage.completion_tokens = delta.completion_tokens
                    response.usage.cached_tokens = delta.cached_tokens
                yield response
        finally:
            if not finished:
                # Cancelled, disconnected or past its deadline: free the blocks now.
                self.engine.cancel(key)
            structlog.contextvars.unbind_contextvars("request_id")

    def _limits(self) -> GenerateLimits:
        # max_total_tokens is known once attached, and may change on a re-attach.
        return replace(self.limits, max_total_tokens=self.engine.max_total_tokens)


def deliver_on_loop(loop: asyncio.AbstractEventLoop):
    """The engine's Deliver for a server: one hop to the event loop per engine step,
    carrying every stream's deltas, instead of a wake-up per token."""

    def deliver_all(deliveries) -> None:
        for sink, delta in deliveries:
            sink(delta)

    def deliver(deliveries) -> None:
        loop.call_soon_threadsafe(deliver_all, deliveries)

    return deliver


async def reject(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: object) -> None:
    """Ends a call before it reached the engine, counted by status."""
    metrics.REJECTED.labels(code.name).inc()
    await context.abort(code, str(reason))


def merge(first: Delta, deltas: asyncio.Queue) -> Delta:
    """Folds every delta already queued into one message: a stream that fell behind
    catches up with several tokens a message instead of one message a token."""
    merged = first
    while merged.finish is None and merged.error is None and not deltas.empty():
        following = deltas.get_nowait()
        if following.error is not None:
            return following
        merged = Delta(
            token_ids=merged.token_ids + following.token_ids,
            text=merged.text + following.text,
            finish=following.finish,
            prompt_tokens=following.prompt_tokens,
            completion_tokens=following.completion_tokens,
            cached_tokens=following.cached_tokens,
        )
    return merged
