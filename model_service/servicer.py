"""ModelService over gRPC: validates requests, maps errors to status codes, streams.

Everything a client can get wrong is caught here, before the engine sees the request,
so a rejected request never holds a block.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import grpc
import structlog

from model_service import metrics
from model_service.engine import Delta, DuplicateRequest, Engine, EngineUnavailable, QueueFull
from model_service.output import TokenLogprob
from model_service.sampling import InvalidRequest
from model_service.sequence import Finish
from model_service.validation import GenerateLimits, PoolTooSmall, validate_generate_request
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

log = structlog.get_logger()

FINISH_REASON = {
    Finish.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    Finish.STOP: model_pb2.FINISH_REASON_STOP,
    Finish.EOS: model_pb2.FINISH_REASON_EOS,
    Finish.ABORTED: model_pb2.FINISH_REASON_ABORT,
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
            max_completions=engine.settings.max_num_seqs,
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
            prompt_token_ids, options = validate_generate_request(request, self._limits(), self.engine.loaded.tokenizer)
        except InvalidRequest as error:
            await reject(context, grpc.StatusCode.INVALID_ARGUMENT, error)
        except PoolTooSmall as error:
            await reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error)

        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        remaining_s = context.time_remaining()
        deadline = time.monotonic() + remaining_s if remaining_s is not None else None
        try:
            # The engine calls sinks on this event loop (deliver_on_loop), so put_nowait is safe.
            key = self.engine.submit(request_id, prompt_token_ids, options, deltas.put_nowait,
                                     deadline=deadline, priority=request.priority)
        except QueueFull as error:
            await reject(context, grpc.StatusCode.RESOURCE_EXHAUSTED, error)
        except EngineUnavailable as error:
            await reject(context, grpc.StatusCode.UNAVAILABLE, error)
        except DuplicateRequest as error:
            await reject(context, grpc.StatusCode.ALREADY_EXISTS, error)

        unfinished = options.n
        finished = False
        held: Delta | None = None  # a delta of another completion that ended a merge
        try:
            while not finished:
                delta, held = merge(held or await deltas.get(), deltas)
                if delta.error is not None:
                    finished = True
                    await context.abort(*delta.error)
                if delta.finish is not None:
                    unfinished -= 1
                    finished = unfinished == 0
                yield to_response(delta, request_id)
        finally:
            if not finished:
                # Cancelled, disconnected or past its deadline: free the blocks now.
                self.engine.cancel(key)
            structlog.contextvars.unbind_contextvars("request_id")

    async def Abort(self, request, context):
        return model_pb2.AbortResponse(aborted=self.engine.abort(list(request.request_ids)))

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


def to_response(delta: Delta, request_id: str) -> model_pb2.GenerateResponse:
    response = model_pb2.GenerateResponse(token_ids=delta.token_ids, text=delta.text, request_id=request_id,
                                          index=delta.index, logprobs=[logprob_proto(lp) for lp in delta.logprobs])
    if delta.prompt_logprobs is not None:
        response.prompt_logprobs.extend(logprob_proto(lp) for lp in delta.prompt_logprobs)
    if delta.finish is not None:
        response.finish_reason = FINISH_REASON[delta.finish]
        response.usage.prompt_tokens = delta.prompt_tokens
        response.usage.completion_tokens = delta.completion_tokens
        response.usage.cached_tokens = delta.cached_tokens
        if isinstance(delta.matched_stop, str):
            response.matched_stop_str = delta.matched_stop
        elif delta.matched_stop is not None:
            response.matched_stop_token_id = delta.matched_stop
    return response


def logprob_proto(logprob: TokenLogprob) -> model_pb2.TokenLogprob:
    return model_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob,
        top=[model_pb2.TopLogprob(token_id=token_id, logprob=value) for token_id, value in logprob.top],
    )


def merge(first: Delta, deltas: asyncio.Queue) -> tuple[Delta, Delta | None]:
    """Folds the deltas already queued for the same completion into one message: a
    stream that fell behind catches up with several tokens a message instead of one
    message a token. Returns the message and the delta of another completion that ended
    the fold, if one did (it goes out next)."""
    merged = first
    while merged.finish is None and merged.error is None and not deltas.empty():
        following = deltas.get_nowait()
        if following.error is not None:
            return following, None
        if following.index != merged.index:
            return merged, following
        merged = Delta(
            token_ids=merged.token_ids + following.token_ids,
            text=merged.text + following.text,
            finish=following.finish,
            prompt_tokens=following.prompt_tokens,
            completion_tokens=following.completion_tokens,
            cached_tokens=following.cached_tokens,
            index=merged.index,
            logprobs=merged.logprobs + following.logprobs,
            prompt_logprobs=merged.prompt_logprobs,
            matched_stop=following.matched_stop,
        )
    return merged, None
