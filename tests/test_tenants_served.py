"""Tenants through both doors of a real model service started with --api-keys (a JSON
file, three tenants) and --auth-token (a key of no tenant), on a pool of 32 blocks: keys
map to tenants on gRPC and HTTP alike, a tenant past its max_concurrent_requests gets
RESOURCE_EXHAUSTED / 429 while the other runs, cached prefixes are not shared between
tenants (each salt is scoped to its tenant), a tenant past its kv_blocks share is the one
preempted when the pool runs short, a tenant past its compute budget (max_tokens_per_s)
waits while another's requests run, a tenant past its max_requests_per_s is refused on
both doors (on HTTP before its body is read), and the per-tenant Prometheus series, scraped from
/metrics, count what each ran, held and lost to preemption.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import grpc
import openai
import pytest
import grpc_generate
from scrape import metric
from prometheus_client.parser import text_string_to_metric_families

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

KEY_A, KEY_B, KEY_C, KEY_D = "sk-tenant-a-key", "sk-tenant-b-key", "sk-tenant-c-key", "sk-tenant-d-key"
KEY_E = "sk-tenant-e-key"  # max_requests_per_s: 1
SINGLE_TOKEN = "sk-no-tenant-token"  # --auth-token: requests of no tenant
POOL_BLOCKS = 32  # of 16 tokens: two completions of 300 tokens cannot run side by side
# Long enough for several full blocks: the prefix cache keys whole blocks.
PROMPT = "Paged attention keeps each sequence's keys and values in fixed-size blocks. " * 2


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "max_concurrent_requests": 1},
                                KEY_B: {"tenant": "b"}, KEY_C: {"tenant": "c", "kv_blocks": 4},
                                KEY_D: {"tenant": "d", "max_tokens_per_s": 400, "burst_tokens": 16},
                                KEY_E: {"tenant": "e", "max_requests_per_s": 1}}))
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB",
                             "--max-blocks", str(POOL_BLOCKS)) as cache, \
            start_model_service(tmp, cache.address, "--api-keys", str(keys), "--auth-token", SINGLE_TOKEN,
                                "--max-model-len", "512") as model:
        channel = grpc.insecure_channel(model.address)
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


def generate(stub, key: str, **fields) -> model_pb2.GenerateResponse:
    return grpc_generate.generate(stub, sampling=dict(max_new_tokens=2), metadata=bearer_metadata(key), **fields).last



def by_tenant(model, name: str, **labels) -> dict[str, float]:
    """The samples of one metric from /metrics, by their tenant label."""
    text = urllib.request.urlopen(model.metrics_url, timeout=10).read().decode()
    return {sample.labels["tenant"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name
            and all(sample.labels.get(key) == value for key, value in labels.items())}


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
    assert metric(model, "pagedkv_model_tenant_requests_total", tenant="a") >= 1
    assert metric(model, "pagedkv_model_tenant_tokens_total", kind="completion", tenant="b") >= 2


def test_tenants_do_not_share_cached_prefixes_even_given_one_salt(services):
    _, _, stub = services
    generate(stub, KEY_A, prompt=PROMPT)
    assert generate(stub, KEY_A, prompt=PROMPT).usage.cached_tokens > 0
    assert generate(stub, KEY_B, prompt=PROMPT).usage.cached_tokens == 0
    # A salt is scoped to its tenant: the same salt, given by both, shares nothing, and a's
    # own salt hits its own blocks.
    generate(stub, KEY_A, prompt=PROMPT, cache_salt="shared")
    assert generate(stub, KEY_A, prompt=PROMPT, cache_salt="shared").usage.cached_tokens > 0
    assert generate(stub, KEY_B, prompt=PROMPT, cache_salt="shared").usage.cached_tokens == 0


def test_the_tenant_series_count_requests_tokens_blocks_and_preemptions_and_none_is_no_tenant(services):
    cache, model, stub = services
    requests_before = by_tenant(model, "pagedkv_model_tenant_requests_total")
    tokens_before = by_tenant(model, "pagedkv_model_tenant_tokens_total", kind="completion")
    preempted_before = by_tenant(model, "pagedkv_model_tenant_preemptions_total")
    # b's one request of two completions that cannot both fit: they grow side by side to
    # 2 x 19 blocks in a pool of 32, so one of them is preempted.
    request = model_pb2.GenerateRequest(prompt="grow", sampling=model_pb2.SamplingParams(
        n=2, max_new_tokens=300, ignore_eos=True, temperature=0))
    call = stub.Generate(request, timeout=120, metadata=bearer_metadata(KEY_B))
    assert sum(response.usage.completion_tokens for response in call if response.finish_reason) == 600
    assert generate(stub, SINGLE_TOKEN, prompt="no tenant").usage.completion_tokens == 2
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")

    requests = by_tenant(model, "pagedkv_model_tenant_requests_total")
    assert requests["b"] - requests_before.get("b", 0) == 1
    assert requests["none"] - requests_before.get("none", 0) == 1, "a request of no tenant is counted as none"
    tokens = by_tenant(model, "pagedkv_model_tenant_tokens_total", kind="completion")
    assert tokens["b"] - tokens_before.get("b", 0) == 600 and tokens["none"] - tokens_before.get("none", 0) == 2
    preempted = by_tenant(model, "pagedkv_model_tenant_preemptions_total")
    assert preempted["b"] > preempted_before.get("b", 0), "the pool of 32 blocks preempted none of b's"
    assert preempted.get("a", 0) == preempted_before.get("a", 0)
    # Now: nothing held (the gauge follows releases). Peaks: b's two completions grew until
    # the pool had no block left for either (nothing else held one), so b held all 32; the
    # request of no tenant, a few prompt tokens and 2 more, one block.
    wait_for(lambda: set(by_tenant(model, "pagedkv_model_tenant_kv_blocks").values()) == {0}, 30,
             "every tenant's gauge to come back to 0")
    peaks = by_tenant(model, "pagedkv_model_tenant_kv_blocks_peak")
    assert (peaks["b"], peaks["none"]) == (POOL_BLOCKS, 1)


def test_the_tenant_past_its_kv_blocks_share_is_preempted_not_the_newer_request_of_another(services):
    cache, model, stub = services
    preempted_before = by_tenant(model, "pagedkv_model_tenant_preemptions_total")
    # Two requests of 8 + 480 tokens (31 blocks each) in a pool of 32: once both run, one
    # must be preempted. c's arrives first, so by arrival b's, the newest, would be; but
    # c holds more than its share of 4 blocks.
    sampling = model_pb2.SamplingParams(max_new_tokens=480, ignore_eos=True, temperature=0)
    c_call = stub.Generate(model_pb2.GenerateRequest(prompt="c grows", sampling=sampling), timeout=120,
                           metadata=bearer_metadata(KEY_C))
    next(c_call)  # c runs
    b_call = stub.Generate(model_pb2.GenerateRequest(prompt="b grows", sampling=sampling), timeout=120,
                           metadata=bearer_metadata(KEY_B))
    b_last = [response for response in b_call][-1]
    c_last = [response for response in c_call][-1]
    assert b_last.usage.completion_tokens == c_last.usage.completion_tokens == 480
    preempted = by_tenant(model, "pagedkv_model_tenant_preemptions_total")
    assert preempted.get("c", 0) > preempted_before.get("c", 0), "c was never preempted"
    assert preempted.get("b", 0) == preempted_before.get("b", 0), "b was preempted though c was past its share"
    assert c_last.usage.recomputed_tokens > 0 and b_last.usage.recomputed_tokens == 0
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def test_a_tenant_past_its_compute_budget_is_deferred_while_the_other_s_requests_complete(services):
    cache, model, stub = services
    deferred_before = by_tenant(model, "pagedkv_model_tenant_budget_deferred_tokens_total")
    # d's bucket holds 16 tokens: its 120-token prompt cannot go in one step, so its
    # sequence waits between chunks (about 0.3 s in all at 400 tokens a second).
    sampling = model_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0)
    d_call = stub.Generate(model_pb2.GenerateRequest(prompt_token_ids=[5 + i % 50 for i in range(120)],
                                                     sampling=sampling), timeout=120, metadata=bearer_metadata(KEY_D))
    for _ in range(3):
        assert generate(stub, KEY_B, prompt="b runs").usage.completion_tokens == 2
    d_last = [response for response in d_call][-1]
    assert d_last.usage.completion_tokens == 8 and d_last.usage.recomputed_tokens == 0
    deferred = by_tenant(model, "pagedkv_model_tenant_budget_deferred_tokens_total")
    steps = by_tenant(model, "pagedkv_model_tenant_budget_deferred_steps_total")
    assert deferred["d"] > deferred_before.get("d", 0) and steps["d"] > 0
    assert "b" not in deferred, "b has no budget: nothing of its is ever deferred"
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def counted_refusals(calls: int, call) -> tuple[int, list[float], float]:
    """`calls` calls at once: (let through, each refusal's (seconds it took, seconds it said
    to wait), seconds in all). `call()` answers None, or for a refusal by the rate the wait
    its message gave. A bucket of 1 a second starting full lets through at most 1 + the
    seconds taken (rounded up); the bound holds however slow the machine."""
    def timed():
        started = time.monotonic()
        said = call()
        return None if said is None else (time.monotonic() - started, said)

    started = time.monotonic()
    with ThreadPoolExecutor(calls) as pool:
        answers = list(pool.map(lambda _: timed(), range(calls)))
    refusals = [answer for answer in answers if answer is not None]
    return calls - len(refusals), refusals, time.monotonic() - started


def said_wait(message: str) -> float:
    return float(re.search(r"retry in ([0-9.]+) s", message).group(1))


def test_a_tenant_past_its_request_rate_is_refused_on_both_doors_before_its_body_is_read(services):
    _, model, stub = services
    host, port = model.http_url.split("//")[1].split("/")[0].split(":")
    client = openai.OpenAI(base_url=model.http_url, api_key=KEY_E, max_retries=0, timeout=30)

    def post_without_its_body() -> tuple[int, dict] | None:
        """A POST that declares a large body and sends none: (status, error) when answered,
        None when the server waited for the body (the rate let it through)."""
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in (("Authorization", f"Bearer {KEY_E}"), ("Content-Type", "application/json"),
                            ("Content-Length", "1000000")):
            connection.putheader(name, value)
        connection.endheaders()
        try:
            answer = connection.getresponse()
            return answer.status, json.loads(answer.read() or b"{}")
        except TimeoutError:
            return None
        finally:
            connection.close()

    # Right after a request that empties the bucket, the POST is answered 429 at once: the
    # gate refuses before reading (had it read, it would wait for the bytes).
    for _ in range(3):
        with contextlib.suppress(openai.RateLimitError):
            client.models.list()
        answered = post_without_its_body()
        if answered is not None and answered[0] == 429:
            break
    assert answered is not None and answered[0] == 429, "the rate never refused a body it had not read"
    error = answered[1]["error"]
    assert error["code"] == "rate_limit_exceeded" and "max_requests_per_s 1" in error["message"]

    def models_list() -> float | None:
        try:
            client.models.list()
        except openai.RateLimitError as error:
            return said_wait(str(error))
        return None

    def empty_generate() -> float | None:  # refused by validation, if the rate lets it that far
        try:
            generate(stub, KEY_E, prompt="")
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return said_wait(error.details())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        return None

    for call in (models_list, empty_generate):
        through, refusals, seconds = counted_refusals(8, call)
        assert refusals and through <= 2 + int(seconds)
        # A refusal is held until the bucket would let a request through (at most a second),
        # so a client that waits for each answer is slowed to the rate.
        assert all(took >= min(wait, 1.0) * 0.9 for took, wait in refusals)
    # Another tenant's requests are not counted against e's rate, nor refused by it.
    assert generate(stub, KEY_B, prompt="b runs").usage.completion_tokens == 2
