"""What both front doors do with a tenant's requests before GenerationService sees them.

- Every request of a body is counted against the tenant's limits (and the service's
  stream limit) at once, before any of them is tokenized or compiled: a body of 20,000
  prompts from a tenant allowed 2 is refused whole, for the cost of a comparison.
- With --api-keys, a request's cache salt becomes its tenant's namespace
  (tenants.cache_namespace): no salt reaches another tenant's cached prefixes.
- A structured output's grammar is compiled on the grammar compiler's own threads and
  awaited here, on the event loop, under the tenant's share of them: validation then
  finds it compiled, and no tokenizing thread ever waits behind a slow grammar.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from model_service.api.generation import GenerationService, rejected
from model_service.api.sampling_proto import structured_from_proto
from model_service.api.tenants import ApiKeys, Tenant, cache_namespace
from model_service.api.validation import MAX_CACHE_SALT_CHARS
from model_service.sample.grammar import CompilerBusy
from model_service.sample.params import InvalidRequest
from pagedkv.model.v1 import model_pb2


async def admit(generation: GenerationService, requests: Sequence[model_pb2.GenerateRequest], tenant: Tenant,
                api_keys: ApiKeys | None) -> None:
    """Raises GenerateError when the requests cannot all start now; else scopes their cache
    salts to the tenant and compiles their grammars."""
    check_room(generation, tenant, len(requests))
    scope_cache_salts(requests, tenant, api_keys)
    await compile_grammars(generation, requests, tenant)


def scope_cache_salts(requests: Sequence[model_pb2.GenerateRequest], tenant: Tenant,
                      api_keys: ApiKeys | None) -> None:
    """With --api-keys, each request's salt becomes its tenant's namespace: what it runs
    with, and what a render shows the routers that hash its blocks as the KV events do."""
    if api_keys is not None and api_keys.has_tenants:
        for request in requests:
            if len(request.cache_salt) <= MAX_CACHE_SALT_CHARS:  # a longer one is refused by validation
                request.cache_salt = cache_namespace(tenant, request.cache_salt)


def check_room(generation: GenerationService, tenant: Tenant, count: int) -> None:
    """RESOURCE_EXHAUSTED unless `count` more requests fit the tenant's limits and the
    service's --max-concurrent-streams; retry later only when they could ever fit."""
    # One request is told as GenerationService tells it; a body of several, with its count.
    asks = "" if count == 1 else f" and this call asks for {count} more"
    limit = generation.max_concurrent_streams
    if limit and generation.open_streams + count > limit:
        raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{generation.open_streams} Generate streams are open{asks}, the limit is "
                       f"--max-concurrent-streams {limit}; retry later", retry_later=count <= limit)
    for open_now, limit, what in ((tenant.open_requests, tenant.max_concurrent_requests, "max_concurrent_requests"),
                                  (tenant.queued_requests, tenant.max_queued_requests, "max_queued_requests")):
        if limit and open_now + count > limit:
            state = "open" if what == "max_concurrent_requests" else "queued"
            fix = "retry later" if count <= limit else f"send at most {limit} prompts in one body"
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"tenant {tenant.name!r} has {open_now} requests {state}{asks}, its {what} is {limit} "
                           f"(--api-keys); {fix}", retry_later=count <= limit)


async def compile_grammars(generation: GenerationService, requests: Sequence[model_pb2.GenerateRequest],
                           tenant: Tenant) -> None:
    """Each distinct structured output of `requests`, compiled (or found compiled)."""
    specs = []
    for request in requests:
        if request.sampling.HasField("structured"):
            try:
                spec = structured_from_proto(request.sampling.structured)
            except InvalidRequest:
                continue  # validation refuses it, with the same message, in its turn
            if spec not in specs:
                specs.append(spec)
    for spec in specs:
        try:
            await generation.grammars.compile_async(spec, tenant.name)
        except InvalidRequest as error:  # does not compile, too deep, or past the time limit
            raise rejected(grpc.StatusCode.INVALID_ARGUMENT, error) from None
        except CompilerBusy as error:
            raise rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, error, retry_later=True) from None
