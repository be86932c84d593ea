"""The Generate path behind every front door (gRPC, HTTP): validate, submit, stream.

Plain asyncio code, no gRPC context and no HTTP: one validation and one way of driving the
engine, so a request means the same whichever door it came in by. Its language is
model.proto's messages (a GenerateRequest in, GenerateResponses out), which the gRPC
door passes through and the HTTP door maps to and from OpenAI's JSON. A failure is a
GenerateError carrying the status the error table in docs/grpc-api.md ("Errors") gives it; the gRPC servicer
aborts the call with it, the HTTP app turns it into an OpenAI error object.

Everything a client can get wrong is caught before the engine sees the request, so a
rejected request never holds a block; a stream whose consumer goes away (cancelled call,
closed HTTP connection, aclose()) cancels its request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import structlog

from model_service import metrics
from model_service.engine.admission import DuplicateRequest, QueueFull
from model_service.engine.loop import Delta, Engine, EngineUnavailable
from model_service.engine.deltas import join_into
from model_service.sample.logprobs import TokenLogprob
from model_service.sample.params import InvalidRequest, SamplingOptions
from model_service.sched.sequence import Finish
from model_service.api.tenants import SINGLE, Tenant
from model_service.sample.grammar import CompilerBusy, GrammarCompiler
from model_service.api.validation import GenerateLimits, PoolTooSmall, tokenize_prompt, validate_generate_request
from model_service.lora.namespace import adapter_salt
from model_service.lora.peft_adapter import LoraAdapter
from model_service.lora.registry import LoraRegistry
from pagedkv.model.v1 import model_pb2

FINISH_REASON = {
    Finish.LENGTH: model_pb2.FINISH_REASON_LENGTH,
    Finish.STOP: model_pb2.FINISH_REASON_STOP,
    Finish.EOS: model_pb2.FINISH_REASON_EOS,
    Finish.ABORTED: model_pb2.FINISH_REASON_ABORT,
}


class GenerateError(Exception):
    """A request that ends with an error status: the code from the error table in docs/grpc-api.md ("Errors") and
    a message a person can act on. Each front door maps the code to its own wire form.

    `retry_later` tells a RESOURCE_EXHAUSTED that passes (queue or stream limit: HTTP 429)
    from one that never will (a request larger than the pool: HTTP 400); gRPC has one
    code for both."""

    def __init__(self, code: grpc.StatusCode, message: object, *, retry_later: bool = False) -> None:
        super().__init__(str(message))
        self.code = code
        self.message = str(message)
        self.retry_later = retry_later


class GenerationService:
    """ModelService's calls as plain async code over one engine, shared by every front door."""

    def __init__(self, engine: Engine, *, default_max_new_tokens: int, max_prompt_tokens: int,
                 max_concurrent_streams: int = 0, stream_interval: int = 1,
                 loras: LoraRegistry | None = None) -> None:
        self.engine = engine
        # The LoRA adapters requests may name (GenerateRequest.lora_name); None: none loaded.
        self.loras = loras
        self.limits = GenerateLimits(
            vocab_size=engine.loaded.config.vocab_size,
            max_model_len=engine.settings.max_model_len,
            max_prompt_tokens=max_prompt_tokens,
            default_max_new_tokens=default_max_new_tokens,
            max_completions=engine.settings.max_num_seqs,
            stream_interval=stream_interval,
        )
        self.max_concurrent_streams = max_concurrent_streams  # 0: no limit
        loaded = engine.loaded
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, engine.eos_token_ids)
        # Generate streams in progress, whichever door they came in by; event loop only.
        self.open_streams = 0

    def model_info(self) -> model_pb2.GetModelInfoResponse:
        loaded = self.engine.loaded
        return model_pb2.GetModelInfoResponse(
            model_id=loaded.model_id,
            architecture=loaded.config.architecture,
            vocab_size=loaded.config.vocab_size,
            eos_token_ids=sorted(self.engine.eos_token_ids),
            max_total_tokens=self.engine.max_total_tokens,
            block_size=self.engine.block_size,
            max_model_len=self.engine.settings.max_model_len,
            dtype=str(self.engine.dtype).removeprefix("torch."),
            kv_cache_dtype=self.engine.geometry.dtype_name,
            device=str(self.engine.device),
            model_fingerprint=self.engine.settings.model_fingerprint,
            has_chat_template=loaded.chat_template is not None,
            weights_bytes=sum(loaded.weights_bytes_by_type.values()),
            weights_bytes_by_type=loaded.weights_bytes_by_type,
        )

    async def generate(self, request: model_pb2.GenerateRequest, deadline: float | None = None,
                       tenant: Tenant = SINGLE) -> AsyncIterator[model_pb2.GenerateResponse]:
        """The responses of one Generate call, or GenerateError (before the first response
        when the request is refused, later when the engine fails it). Closing the
        generator early cancels the request. `deadline`: a time.monotonic() by which the
        engine ends the request with DEADLINE_EXCEEDED."""
        stream = await self.start_async(request, deadline, tenant)
        try:
            async for response in stream:
                yield response
        finally:
            stream.close()

    def abort(self, request_ids: list[str], tenant: Tenant = SINGLE) -> int:
        """Ends each named live request of `tenant` with FINISH_REASON_ABORT (ids are
        unique per tenant: another's requests of those ids run on); returns how many
        were live."""
        return self.engine.abort(request_ids, tenant.name)

    def start(self, request: model_pb2.GenerateRequest, deadline: float | None = None,
              validated=None, tenant: Tenant = SINGLE) -> ResponseStream:
        """Validates and submits `request` for `tenant` (tenants.py), or raises GenerateError
        without having touched the engine. The caller must close() the stream it gets,
        whatever happens next."""
        self._check_limits(tenant)
        # Held by the stream until it closes: an adapter unloaded meanwhile keeps its slot till then.
        lora = self.adapter_of(request.lora_name, tenant) if request.lora_name else None
        request_id = request.request_id or uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(request_id=request_id)  # unbound by close()
        if lora is not None:
            self.loras.acquire(lora.name)
        try:
            stream = ResponseStream(self, request_id, self._submit(request_id, request, deadline, validated, tenant,
                                                                   lora), tenant, lora)
        except GenerateError:
            if lora is not None:
                self.loras.release(lora)
            structlog.contextvars.unbind_contextvars("request_id")
            raise
        metrics.TENANT_REQUESTS.labels(metrics.tenant_label(tenant.name)).inc()
        if lora is not None:
            metrics.LORA_REQUESTS.labels(lora.name).inc()
        return stream

    def _check_limits(self, tenant: Tenant) -> None:
        if self.max_concurrent_streams and self.open_streams >= self.max_concurrent_streams:
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{self.open_streams} Generate streams are open, the limit is "
                           f"--max-concurrent-streams {self.max_concurrent_streams}; retry later",
                           retry_later=True)
        for count, limit, what in ((tenant.open_requests, tenant.max_concurrent_requests, "max_concurrent_requests"),
                                   (tenant.queued_requests, tenant.max_queued_requests, "max_queued_requests")):
            if limit and count >= limit:
                raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"tenant {tenant.name!r} has {count} requests {'open' if 'concurrent' in what else 'queued'}, "
                               f"its {what} is {limit} (--api-keys); retry later", retry_later=True)

    async def start_async(self, request: model_pb2.GenerateRequest, deadline: float | None = None,
                          tenant: Tenant = SINGLE) -> ResponseStream:
        """start(), with a text prompt tokenized on a worker thread (after validation's
        byte-length check), and a structured output compiled there too: a long prompt or a
        new grammar must not freeze every other stream."""
        if not (request.prompt or request.messages or request.sampling.HasField("structured")):
            return self.start(request, deadline, tenant=tenant)
        self._check_limits(tenant)  # before the tokenizing a refused request would waste
        validated = await asyncio.to_thread(self._validate, request)
        return self.start(request, deadline, validated, tenant)

    async def render(self, request: model_pb2.GenerateRequest) -> tuple[list[int], SamplingOptions]:
        """What start() would submit for ``request``, validated as start() validates it,
        without submitting anything (POST /v1/completions/render). Raises GenerateError."""
        if request.prompt or request.messages or request.sampling.HasField("structured"):
            return await asyncio.to_thread(self._validate, request)
        return self._validate(request)

    async def tokenize(self, request: model_pb2.GenerateRequest, add_special_tokens: bool | None = None) -> list[int]:
        """The token ids of ``request``'s prompt (POST /tokenize); its length is not checked."""
        loaded = self.engine.loaded

        def run() -> list[int]:
            try:
                return tokenize_prompt(request, self._limits(), loaded.tokenizer, loaded.chat_template,
                                       add_special_tokens)
            except InvalidRequest as error:
                raise rejected(grpc.StatusCode.INVALID_ARGUMENT, error) from None

        return await asyncio.to_thread(run) if request.prompt or request.messages else run()

    async def reset_prefix_cache(self) -> tuple[int, int]:
        """Drops this model's cached prefix blocks from the pool, those no request holds
        (POST /reset_prefix_cache); returns (blocks dropped, blocks kept because held).
        Raises GenerateError (UNAVAILABLE) while the cache service cannot be asked."""
        engine = self.engine
        session_id = engine.session_id
        if session_id is None:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "not attached to the cache service, whose pool holds "
                                "the prefix cache; retry once /health answers 200", retry_later=True)
        try:
            reply = await asyncio.to_thread(engine.cache.reset_prefix_cache, session_id)
        except grpc.RpcError as error:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, f"the cache service did not reset the prefix cache "
                                f"({error.code().name}: {error.details()}); retry shortly", retry_later=True) from None
        return reply.blocks_dropped, reply.blocks_kept

    def _validate(self, request: model_pb2.GenerateRequest):
        try:
            return validate_generate_request(
                request, self._limits(), self.engine.loaded.tokenizer, self.engine.loaded.chat_template,
                self.grammars)
        except InvalidRequest as error:
            raise rejected(grpc.StatusCode.INVALID_ARGUMENT, error) from None
        except PoolTooSmall as error:
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, error) from None
        except CompilerBusy as error:
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, error, retry_later=True) from None

    def _submit(self, request_id: str, request: model_pb2.GenerateRequest,
                deadline: float | None, validated=None, tenant: Tenant = SINGLE,
                lora: LoraAdapter | None = None) -> tuple[int, int, asyncio.Queue[Delta]]:
        prompt_token_ids, options = validated or self._validate(request)
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        # A tenant cannot ask to run before its min_priority (lower runs first), and shares
        # cached prefixes only with requests that carry its salt: by default its name.
        priority = request.priority
        if tenant.min_priority is not None and priority < tenant.min_priority:
            priority = tenant.min_priority
        cache_salt = request.cache_salt or tenant.name
        if lora is not None:
            cache_salt = adapter_salt(lora.digest, cache_salt)
        try:
            # The engine calls sinks on this event loop (deliver_on_loop), so put_nowait is safe.
            key = self.engine.submit(request_id, prompt_token_ids, options, deltas.put_nowait,
                                     deadline=deadline, priority=priority, cache_salt=cache_salt,
                                     tenant=tenant.name, lora=lora)
        except QueueFull as error:
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, error, retry_later=True) from None
        except EngineUnavailable as error:
            raise rejected(grpc.StatusCode.UNAVAILABLE, error, retry_later=True) from None
        except DuplicateRequest as error:
            raise rejected(grpc.StatusCode.ALREADY_EXISTS, error) from None
        return key, options.n, deltas

    def adapter_names(self, tenant: Tenant = SINGLE) -> list[str]:
        """The loaded adapters `tenant` may use (its `loras` in --api-keys); no other is shown to it."""
        if self.loras is None:
            return []
        return [a.name for a in self.loras.adapters() if tenant.may_use_lora(a.name)]

    def adapter_of(self, name: str, tenant: Tenant = SINGLE) -> LoraAdapter:
        """The loaded adapter of `name`; NOT_FOUND, listing what is served, for any other and
        for one `tenant` may not use (so that names do not leak between tenants)."""
        adapter = self.loras.get(name) if self.loras is not None and tenant.may_use_lora(name) else None
        if adapter is None:
            served = self.adapter_names(tenant)
            shown = name if len(name) <= 128 else f"{name[:128]}..."
            raise rejected(grpc.StatusCode.NOT_FOUND,
                           f"no LoRA adapter {shown!r} is loaded here; loaded: {served or 'none'} "
                           f"(--lora-modules NAME=PATH)")
        return adapter

    def _limits(self) -> GenerateLimits:
        # max_total_tokens is known once attached, and may change on a re-attach.
        return replace(self.limits, max_total_tokens=self.engine.max_total_tokens)


class ResponseStream:
    """The responses of one submitted request, in order (async iteration); an engine
    failure surfaces as GenerateError. With n completions, their messages interleave
    (GenerateResponse.index) and the stream ends after the last one's last message.
    close() frees the request's blocks at once if it has not finished, and must be
    called exactly when its consumer is done or gone."""

    def __init__(self, service: GenerationService, request_id: str,
                 submitted: tuple[int, int, asyncio.Queue[Delta]], tenant: Tenant = SINGLE,
                 lora: LoraAdapter | None = None) -> None:
        self.request_id = request_id
        self._service = service
        self._key, self._unfinished, self._deltas = submitted
        self._held: Delta | None = None  # a delta of another completion that ended a merge
        self._finished = False
        self._closed = False
        self._tenant = tenant
        self._queued = True  # until its first message: the tenant's max_queued_requests
        self._lora = lora  # acquired from the registry by start(), released by close()
        service.open_streams += 1
        tenant.open_requests += 1
        tenant.queued_requests += 1

    def _first_message(self) -> None:
        if self._queued:
            self._queued = False
            self._tenant.queued_requests -= 1

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> model_pb2.GenerateResponse:
        if self._finished:
            raise StopAsyncIteration
        delta, self._held = merge(self._held or await self._deltas.get(), self._deltas)
        self._first_message()
        if delta.error is not None:
            self._finished = True
            raise GenerateError(*delta.error)
        if delta.finish is not None:
            self._unfinished -= 1
            self._finished = self._unfinished == 0
            label = metrics.tenant_label(self._tenant.name)
            metrics.TENANT_TOKENS.labels(label, "prompt").inc(delta.prompt_tokens)
            metrics.TENANT_TOKENS.labels(label, "completion").inc(delta.completion_tokens)
            if self._lora is not None and self._service.loras.is_current(self._lora):  # no series once unloaded
                metrics.LORA_GENERATED_TOKENS.labels(self._lora.name).inc(delta.completion_tokens)
        return to_response(delta, self.request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._service.open_streams -= 1
        self._first_message()
        self._tenant.open_requests -= 1
        if not self._finished:
            # Cancelled, disconnected or past its deadline: free the blocks now.
            self._service.engine.cancel(self._key)
        if self._lora is not None:
            self._service.loras.release(self._lora)
        structlog.contextvars.unbind_contextvars("request_id")


def rejected(code: grpc.StatusCode, reason: object, *, retry_later: bool = False) -> GenerateError:
    """The error for a call refused before it reached the engine, counted by status."""
    metrics.REJECTED.labels(code.name).inc()
    return GenerateError(code, reason, retry_later=retry_later)


def deliver_on_loop(loop: asyncio.AbstractEventLoop):
    """The engine's Deliver for a server: one hop to the event loop per engine step,
    carrying every stream's deltas, instead of a wake-up per token."""

    def deliver_all(deliveries) -> None:
        for sink, delta in deliveries:
            sink(delta)

    def deliver(deliveries) -> None:
        loop.call_soon_threadsafe(deliver_all, deliveries)

    return deliver


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
        usage = response.usage
        usage.cached_tokens_host, usage.cached_tokens_disk, usage.cached_tokens_remote = delta.cached_tokens_tiers
        response.usage.peak_kv_blocks = delta.peak_kv_blocks
        response.usage.peak_kv_bytes = delta.peak_kv_bytes
        response.usage.recomputed_tokens = delta.recomputed_tokens
        response.usage.spec_proposed_tokens = delta.spec_proposed_tokens
        response.usage.spec_accepted_tokens = delta.spec_accepted_tokens
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
        merged = join_into(merged, following)
    return merged, None
