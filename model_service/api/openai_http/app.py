"""The FastAPI app: routes, bearer auth, and the run of one body through GenerationService.

Each POST body becomes GenerateRequests (to_generate) that go through the same
GenerationService.start() as a gRPC Generate call; the results come back as one JSON
object or as Server-Sent Events. However the response ends (done, failed, client gone),
every request it started is closed, so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.sse import format_sse_event

from model_service.api.admit import admit, compile_grammars, scope_cache_salts
from model_service.api.generation import GenerateError, GenerationService
from model_service.api.lora_admin import LoraAdmin
from model_service.api.openai_http import render, to_generate
from model_service.api.openai_http.to_generate import DEFAULT_MAX_PROMPTS
from model_service.api.openai_http.errors import ApiError, from_generate_error, install_handlers
from model_service.api.openai_http.gate import PRINCIPAL, Gate
from model_service.api.request_rate import throttled
from model_service.api.openai_http.logprobs import TokenNames
from model_service.api.openai_http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoraAdapterRequest,
)
from model_service.api.openai_http.responses import ChatEndpoint, CompletionEndpoint, Endpoint
from model_service.api.openai_http.streaming import EventStream, Running, until_disconnected
from model_service.api.openai_http.tools import ToolCallEndpoint, plan_tools
from model_service.api.openai_http.unsupported import refuse_unsupported
from model_service.api.tenants import SINGLE, ApiKeys, Tenant

DONE = format_sse_event(data_str="[DONE]")
# nginx's status for "the client closed the request": nobody reads it, the log does.
CLIENT_CLOSED_REQUEST = 499
# --max-request-bytes' default, gRPC's --max-message-bytes default too. The largest valid
# single-prompt body is far under it: the prompt byte cap (32 bytes a token, validation.py)
# is 262,112 bytes at 8,191 tokens, 1.6 MB even with every byte JSON-escaped as \u00XX.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


def create_app(generation: GenerationService, *, served_model_name: str | None = None,
               auth_token: str | None = None, api_keys: ApiKeys | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, max_prompts: int = DEFAULT_MAX_PROMPTS,
               lora_admin: LoraAdmin | None = None) -> FastAPI:
    """api_keys: the keys and their tenants (tenants.py); else auth_token, one key.
    max_prompts: the most prompts one /v1/completions body may carry. lora_admin: runtime
    LoRA loading (lora_admin.py); None: off."""
    lora_admin = lora_admin or LoraAdmin(generation.loras, None)
    app = FastAPI(title="pagedkv model service", summary="OpenAI-compatible API", docs_url=None, redoc_url=None)
    install_handlers(app)
    # Token and body size are checked in front of FastAPI, which reads the body first (gate.py).
    api_keys = api_keys or ApiKeys.configure(auth_token, None)
    app.add_middleware(Gate, max_request_bytes=max_request_bytes,
                       authenticate=api_keys.tenant_of if api_keys else None, throttle=throttled)
    loaded = generation.engine.loaded
    model_name = served_model_name or loaded.model_id
    created = int(time.time())
    token_names = TokenNames(loaded.tokenizer)
    token_ids_as_names = TokenNames(loaded.tokenizer, as_token_ids=True)
    template_source = loaded.chat_template.source if loaded.chat_template is not None else None

    def model_card(lora_name: str = "") -> dict[str, Any]:
        # An adapter's card names the base as its parent and its directory as its root, as vLLM's.
        adapter = generation.loras.get(lora_name) if lora_name and generation.loras is not None else None
        return {"id": adapter.name if adapter else model_name, "object": "model", "created": created,
                "owned_by": "pagedkv", "root": adapter.path if adapter else loaded.model_id,
                "parent": model_name if adapter else None,
                "max_model_len": generation.engine.settings.max_model_len}

    def check_model(name: str, request: Request) -> str:
        """The LoRA adapter `name` picks ("" for the base model); 404 for any other name, and
        for an adapter the caller's tenant may not use."""
        if name == model_name:
            return ""
        names = generation.adapter_names(_tenant(request))
        if name in names:
            return name
        shown = name if len(name) <= 128 else f"{name[:128]}..."
        raise ApiError(404, f"the model {shown!r} does not exist here; this server serves {model_name!r}"
                       f"{' and the LoRA adapters ' + repr(names) if names else ''} "
                       "(GET /v1/models)", param="model", code="model_not_found")

    def pick_adapter(requests, lora_name: str) -> None:
        for one in requests:
            if lora_name:
                one.lora_name = lora_name

    @app.get("/health")
    async def health() -> Response:
        if generation.engine.connected.is_set():
            return Response(status_code=200)
        return ApiError(503, "not attached to the cache service; generation is unavailable until it is back",
                        code="unavailable").response()

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [model_card(), *(model_card(name) for name in
                                                           generation.adapter_names(_tenant(request)))]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict[str, Any]:
        return model_card(check_model(model_id, request))

    # vLLM's runtime LoRA endpoints: a plain-text success, an error object otherwise (lora_admin.py).
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
        message = await lora_admin.load(body.lora_name, body.lora_path, _tenant(request))
        return PlainTextResponse(message)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
        return PlainTextResponse(lora_admin.unload(body.lora_name, _tenant(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        lora_name = check_model(body.model, request)
        refuse_unsupported(body)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        tools = plan_tools(body, template_source)
        # Off the loop: the body's chat_template_kwargs become a protobuf Struct, a walk over
        # however much JSON the client sent.
        requests = [await asyncio.to_thread(to_generate.chat_request, body, _request_id(body, request, response_id),
                                            tools)]
        pick_adapter(requests, lora_name)
        if tools is None:
            endpoint = ChatEndpoint(response_id, lora_name or model_name, body.n, _names(body), logprobs=body.logprobs)
        else:
            endpoint = ToolCallEndpoint(response_id, lora_name or model_name, body.n, _names(body),
                                        logprobs=body.logprobs, plan=tools)
        return await run(body, requests, endpoint, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        lora_name = check_model(body.model, request)
        refuse_unsupported(body)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        requests = to_generate.completion_requests(body, _request_id(body, request, response_id), max_prompts)
        pick_adapter(requests, lora_name)
        endpoint = CompletionEndpoint(response_id, lora_name or model_name, body.n, _names(body),
                                      logprobs=body.logprobs is not None)
        return await run(body, requests, endpoint, request)

    # What routers ask before routing (render.py): the token ids a request would run with.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> dict[str, Any]:
        if body.model is not None:
            check_model(body.model, request)
        token_ids = await generation.tokenize(await asyncio.to_thread(render.tokenize_request, body),
                                              body.add_special_tokens)
        return render.tokenize_body(token_ids, generation.engine.settings.max_model_len,
                                    token_names if body.return_token_strs else None)

    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest, request: Request) -> list[dict[str, Any]]:
        check_model(body.model, request)
        refuse_unsupported(body)
        requests = to_generate.completion_requests(body, _request_id(body, request, f"cmpl-{uuid.uuid4().hex}"),
                                                   max_prompts)
        scope_cache_salts(requests, _tenant(request), api_keys)
        await compile_grammars(generation, requests, _tenant(request))
        return [render.rendered(one, model_name, *await generation.render(one), body) for one in requests]

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        check_model(body.model, request)
        refuse_unsupported(body)
        one = await asyncio.to_thread(to_generate.chat_request, body,
                                      _request_id(body, request, f"chatcmpl-{uuid.uuid4().hex}"),
                                      plan_tools(body, template_source))
        scope_cache_salts([one], _tenant(request), api_keys)
        await compile_grammars(generation, [one], _tenant(request))
        return render.rendered(one, model_name, *await generation.render(one), body)

    # vLLM's endpoint of the same name: the pool drops this model's cached prefixes (its
    # KV events tell routers), so requests sharing them stop being drawn here. /flush_cache
    # is SGLang's name for it, which vllm-router's own POST /flush_cache sends to every worker.
    # It costs every tenant its cached prefixes: an admin's key only (tenants.py).
    @app.post("/reset_prefix_cache")
    @app.post("/flush_cache")
    async def reset_prefix_cache(request: Request) -> dict[str, Any]:
        if not _tenant(request).admin:
            raise ApiError(403, f"{request.url.path} drops every tenant's cached prefixes: it takes an admin's key "
                           "(--auth-token, or a key of a tenant with `admin: true` in --api-keys)",
                           code="permission_denied")
        dropped, kept = await generation.reset_prefix_cache()
        return {"blocks_dropped": dropped, "blocks_kept": kept}

    def _names(body: GenerationFields) -> TokenNames:
        return token_ids_as_names if body.return_tokens_as_token_ids else token_names

    async def run(body: GenerationFields, requests, endpoint: Endpoint, request: Request) -> Response:
        tenant = _tenant(request)
        await admit(generation, requests, tenant, api_keys)  # GenerateError: the handler answers it
        running = await Running.start(generation, requests, tenant)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(events(endpoint, running, len(requests) * body.n, include_usage), on_end=running.close)
        try:
            return await collect(endpoint, running, request)
        finally:
            running.close()

    return app


def _tenant(request: Request) -> Tenant:
    return request.scope.get(PRINCIPAL) or SINGLE


def _request_id(body: GenerationFields, request: Request, response_id: str) -> str:
    return body.request_id or request.headers.get("x-request-id") or response_id


async def collect(endpoint: Endpoint, running: Running, request: Request) -> Response:
    """The whole answer; a client that hangs up first cancels its requests at once."""

    async def gather() -> None:
        async for prompt_index, response in running.results():
            endpoint.add(prompt_index, response)

    gathering = asyncio.ensure_future(gather())
    hang_up = asyncio.ensure_future(until_disconnected(request.receive))
    try:
        await asyncio.wait([gathering, hang_up], return_when=asyncio.FIRST_COMPLETED)
    finally:
        hang_up.cancel()
    if not gathering.done():
        gathering.cancel()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    gathering.result()  # a GenerateError goes to its handler
    # Off the loop: a tool-calling answer is parsed whole here (tools.py).
    return JSONResponse(await asyncio.to_thread(endpoint.body))


async def events(endpoint: Endpoint, running: Running, num_choices: int, include_usage: bool):
    """The SSE events of a streamed answer, as OpenAI sends them: chunks, the usage chunk
    when asked for, `[DONE]`. An error after the first event is sent as an error event."""
    for choices in endpoint.first_chunks(num_choices):
        yield sse(endpoint.chunk(choices, with_usage_field=include_usage))
    try:
        async for prompt_index, response in running.results():
            # A choice's last message may have its whole output parsed (tool calls): off the loop.
            choices_of = (await asyncio.to_thread(endpoint.stream_choices, prompt_index, response)
                          if response.finish_reason else endpoint.stream_choices(prompt_index, response))
            for choices in choices_of:
                yield sse(endpoint.chunk(choices, with_usage_field=include_usage))
    except GenerateError as error:
        yield sse(from_generate_error(error).body())
    else:
        if include_usage:
            yield sse(endpoint.chunk([], usage=endpoint.usage.body()))
    yield DONE


def sse(payload: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False, separators=(",", ":")))
