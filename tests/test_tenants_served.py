"""Tenants through both doors of a real model service started with --api-keys (a JSON
file, two tenants): keys map to tenants on gRPC and HTTP alike, a tenant past its
max_concurrent_requests gets RESOURCE_EXHAUSTED / 429 while the other runs, cached
prefixes are not shared between tenants (cache_salt defaults to the tenant), and the
per-tenant Prometheus series count what each ran.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
from cache_helpers import cache_stub, stats, wait_for
from processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

KEY_A, KEY_B = "sk-tenant-a-key", "sk-tenant-b-key"
# Long enough for several full blocks: the prefix cache keys whole blocks.
PROMPT = "Paged attention keeps each sequence's keys and values in fixed-size blocks. " * 2


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "max_concurrent_requests": 1},
                                KEY_B: {"tenant": "b"}}))
    with start_cache_service(tmp, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--api-keys", str(keys)) as model:
        channel = grpc.insecure_channel(model.address)
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


def generate(stub, key: str, **fields) -> model_pb2.GenerateResponse:
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(max_new_tokens=2), **fields)
    return list(stub.Generate(request, timeout=120, metadata=bearer_metadata(key)))[-1]


def metric(model, line_start: str) -> float:
    for line in urllib.request.urlopen(model.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_key_outside_the_file_is_refused_on_both_doors(services):
    _, model, stub = services
    with pytest.raises(grpc.RpcError) as error:
        generate(stub, "sk-not-a-key", prompt="hi")
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=model.http_url, api_key="sk-not-a-key", max_retries=0).models.list()


def test_a_tenant_past_its_concurrent_requests_is_429_and_resource_exhausted_the_other_runs(services):
    cache, model, stub = services
    client_a = openai.OpenAI(base_url=model.http_url, api_key=KEY_A, max_retries=0, timeout=120)
    holding = client_a.completions.create(model="tiny", prompt="hold", max_tokens=400, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
    next(iter(holding))  # a's one request is open
    with pytest.raises(openai.RateLimitError) as error:
        client_a.completions.create(model="tiny", prompt="again", max_tokens=2)
    assert "tenant 'a' has 1 requests open, its max_concurrent_requests is 1" in error.value.message
    with pytest.raises(grpc.RpcError) as grpc_error:
        generate(stub, KEY_A, prompt="again")
    assert grpc_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert generate(stub, KEY_B, prompt="b runs").usage.completion_tokens == 2
    holding.close()
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")
    assert metric(model, 'pagedkv_model_tenant_requests_total{tenant="a"}') >= 1
    assert metric(model, 'pagedkv_model_tenant_tokens_total{kind="completion",tenant="b"}') >= 2


def test_tenants_do_not_share_cached_prefixes_unless_given_one_salt(services):
    _, _, stub = services
    generate(stub, KEY_A, prompt=PROMPT)
    assert generate(stub, KEY_A, prompt=PROMPT).usage.cached_tokens > 0
    assert generate(stub, KEY_B, prompt=PROMPT).usage.cached_tokens == 0
    # The same salt, given by both, shares again.
    generate(stub, KEY_A, prompt=PROMPT, cache_salt="shared")
    assert generate(stub, KEY_B, prompt=PROMPT, cache_salt="shared").usage.cached_tokens > 0
