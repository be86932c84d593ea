"""What a request leaves behind does not grow with the requests served.

The engine and GenerationService in this process (the tiny model) against a real cache
service, driven through GenerationService as both doors drive it: short requests of
mixed shapes (greedy, seeded n = 2, stop strings with a stop-id set of their own and
min_tokens, logprobs with prompt logprobs, a deadline an hour away, a deadline already
past, a stream closed after its first message, an Abort by id, a request refused by
validation), by two tenants. Between two samples a thousand requests apart, once every
request has ended, the engine's per-request records (Engine.record_counts), the objects
of a request's types that are still alive must not have grown, and no Prometheus label
may carry a request's own value (its id, its stop strings). Counts, not bytes or time: RSS moves with the allocator; a count moves only if
something keeps what it should drop.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import time

import pytest
import torch
from prometheus_client import REGISTRY

from harness.processes import SHARED_LEASE_TTL, start_cache_service
from model_service.api.generation import GenerateError, GenerationService, deliver_on_loop
from model_service.api.tenants import Tenant
from model_service.cache.client import CacheClient
from model_service.engine.loop import Engine
from model_service.engine.settings import EngineSettings
from model_service.loading.loader import load_model
from pagedkv.model.v1 import model_pb2

TENANTS = (Tenant("a"), Tenant("b"))
# The types a request makes; none may outlive it. frozenset: each request's stop-id set
# (a memo across requests once kept a thousand of them, and their sorted tuples).
TRACKED_TYPES = ("RequestOutput", "Completion", "Sequence", "Delta", "ResponseStream", "IncrementalDetokenizer",
                 "Generator", "frozenset", "GenerateRequest", "Task")
# At most this many entries of ended requests stay in the deadline heap while nothing runs
# (live_requests.py rebuilds it past twice the live requests and this).
IDLE_DEADLINES = 16
# Objects of a request's types alive after the second sample beyond those after the first.
# Not 0: now and then the last request or two of a burst stays referenced after its end by
# a reference the garbage collector cannot see (not from any Python object, and not
# released by the engine thread's exit), and is never replaced by later ones. A request
# kept per 250 served would still fail this by a wide margin.
SPARE = 4
CONCURRENCY = 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("request-memory")
    loop = asyncio.new_event_loop()
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache:
        engine = Engine(load_model("tiny"), EngineSettings(max_model_len=256, max_num_seqs=64),
                        CacheClient(cache.address), torch.device("cpu"), torch.float32, deliver=deliver_on_loop(loop))
        engine.start()
        assert engine.connected.wait(30)
        try:
            yield loop, engine, GenerationService(engine, default_max_new_tokens=2, max_prompt_tokens=255)
        finally:
            engine.stop(5)
            loop.close()


def shape(number: int) -> tuple[model_pb2.GenerateRequest, float | None, str]:
    """Request `number`: (the request, its deadline, what its stream does)."""
    prompt = [4 + number % 97, 5, 6]
    sampling = model_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)
    deadline, action = None, "read"
    match number % 9:
        case 1:
            sampling = model_pb2.SamplingParams(max_new_tokens=2, n=2, temperature=0.7, seed=number)
        case 2:
            sampling.stop.append("zz")
            sampling.stop_token_ids.extend(range(100 + number % 150, 108 + number % 150))
            sampling.min_tokens = 1
            sampling.temperature = 0.7
        case 3:
            deadline = time.monotonic() + 3600
        case 4:
            sampling.logprobs, sampling.prompt_logprobs = 2, 1
        case 5:
            deadline = time.monotonic() - 1
        case 6:
            sampling.max_new_tokens, action = 200, "close"
        case 7:
            sampling.max_new_tokens, action = 200, "abort"
        case 8:
            prompt = [10**6]  # past the vocabulary: refused before the engine sees it
    return model_pb2.GenerateRequest(request_id=f"req-{number}", prompt_token_ids=prompt, sampling=sampling), \
        deadline, action


async def one(generation: GenerationService, number: int) -> str:
    request, deadline, action = shape(number)
    tenant = TENANTS[number % 2]
    try:
        stream = await generation.start_async(request, deadline, tenant)
    except GenerateError as error:
        return error.code.name
    try:
        async for response in stream:
            if action == "close":
                return "closed"
            if action == "abort":
                assert generation.abort([request.request_id], tenant) in (0, 1)
                action = "read"
        return "finished"
    except GenerateError as error:
        return error.code.name
    finally:
        stream.close()


async def run(generation: GenerationService, numbers) -> collections.Counter:
    numbers = iter(numbers)
    outcomes: collections.Counter = collections.Counter()

    async def worker() -> None:
        for number in numbers:
            outcomes[await one(generation, number)] += 1

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return outcomes


def settled(engine: Engine) -> dict[str, int]:
    """The engine's record counts once the last cancels and aborts are through."""
    for _ in range(200):
        counts = engine.record_counts()
        if not counts["live_requests"] and not counts["admitted_pending"]:
            return counts
        time.sleep(0.05)
    raise AssertionError(f"requests still live after every stream ended: {counts}")


def sample(engine: Engine) -> dict[str, int]:
    gc.collect()
    alive = collections.Counter(type(item).__name__ for item in gc.get_objects())
    return {**settled(engine), **{f"alive {name}": alive[name] for name in TRACKED_TYPES}}


def label_values() -> set[str]:
    """Every label value of the process's Prometheus series: their count is bounded only
    if none comes from a request (its id, its prompt, its stop strings)."""
    return {value for family in REGISTRY.collect() for series in family.samples for value in series.labels.values()}


def test_requests_leave_nothing_behind_that_grows(served):
    loop, engine, generation = served
    numbers = itertools.count()
    warm = loop.run_until_complete(run(generation, itertools.islice(numbers, 300)))
    before = sample(engine)
    outcomes = loop.run_until_complete(run(generation, itertools.islice(numbers, 1000)))
    after = sample(engine)
    # Every shape ran its path.
    assert {"finished", "closed", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT"} <= set(outcomes), outcomes
    assert sum(outcomes.values()) == 1000 and warm
    assert after["deadlines"] <= IDLE_DEADLINES and before["deadlines"] <= IDLE_DEADLINES, (before, after)
    grew = {name: (before[name], after[name]) for name in after if name != "deadlines"
            and after[name] > before[name] + (SPARE if name.startswith("alive") else 0)}
    assert not grew, f"grew over 1,000 requests (before, after): {grew}"
    assert not {value for value in label_values() if "req-" in value or "zz" in value}
    assert generation.open_streams == 0 and all(t.open_requests == t.queued_requests == 0 for t in TENANTS)
