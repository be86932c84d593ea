"""ModelService over gRPC: validates requests, maps errors to status codes, streams.

Everything a client can get wrong is caught here, before the engine sees the request,
so a rejected request never holds a block.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import structlog

from model_service import metrics
from model_service.engine import Delta, Engine, EngineUnavailable, QueueFull
from model_service.sampling import InvalidRequest, SamplingOptions
from model_service.sequence import Finish
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

log = structlog.get_logger()

FINISH_REASON = {
    Finish.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    Finish.STOP: model_pb2.FINISH_REASON_STOP,
    Finish.EOS: model_pb2.FINISH_REASON_EOS,
}
MAX_REQUEST_ID_CHARS = 128


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, engine: Engine, *, default_max_new_tokens: int, max_prompt_tokens: int) -> None:
        self.engine = engine
        self.default_max_new_tokens = default_max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens

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
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            prompt_token_ids, options = self._validate(request)
        except InvalidRequest as error:
            metrics.REJECTED.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except PoolTooSmall as error:
            metrics.REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def sink(delta: Delta) -> None:  # called from the engine thread
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        try:
            key = self.engine.submit(request_id, prompt_token_ids, options, sink)
        except QueueFull as error:
            metrics.REJECTED.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except EngineUnavailable as error:
            metrics.REJECTED.labels("UNAVAILABLE").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))

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

    def _validate(self, request) -> tuple[list[int], SamplingOptions]:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"request_id is {len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
        config = self.engine.loaded.config
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("set exactly one of prompt and prompt_token_ids, not both")
        if request.prompt:
            prompt_token_ids = self.engine.loaded.tokenizer.encode(request.prompt)
        else:
            prompt_token_ids = list(request.prompt_token_ids)
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty: set prompt (text) or prompt_token_ids")
        out_of_range = [t for t in prompt_token_ids if t >= config.vocab_size]
        if out_of_range:
            raise InvalidRequest(
                f"{len(out_of_range)} prompt token ids are >= vocab_size {config.vocab_size} "
                f"(first: {out_of_range[0]})"
            )
        if len(prompt_token_ids) > self.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this service accepts at most "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)"
            )
        options = SamplingOptions.from_proto(
            request.sampling,
            prompt_tokens=len(prompt_token_ids),
            max_model_len=self.engine.settings.max_model_len,
            vocab_size=config.vocab_size,
            default_max_new_tokens=self.default_max_new_tokens,
        )
        total = len(prompt_token_ids) + options.max_new_tokens
        pool_tokens = self.engine.max_total_tokens
        if pool_tokens and total > pool_tokens:
            raise PoolTooSmall(
                f"prompt ({len(prompt_token_ids)}) + max_new_tokens ({options.max_new_tokens}) = {total} tokens "
                f"can never fit: the whole KV pool holds max_total_tokens={pool_tokens}; "
                "ask for fewer tokens or give the cache service more memory"
            )
        return prompt_token_ids, options


class PoolTooSmall(Exception):
    """A request larger than the whole pool: it could never run."""


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
