"""Two replicas behind vllm-router's kv_aware policy, as plain processes.

Each replica is a cache service publishing KV events and a model service on the tiny
model; vllm-router (a Rust binary from the `vllm-router` wheel in the test extras)
subscribes to both event streams, renders each request on the workers
(/v1/completions/render) and routes it to the worker holding the longest prefix of its
blocks. A prompt warmed on replica A alone draws every request that shares its prefix
to A, which serves it from its prefix cache; once A's prefix cache is reset, such a
request goes where the rest of the prefix is.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from cache_helpers import cache_stub, leased_blocks, wait_for
from cache_service.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cache_service.vllm_block_hash import chain, external
from processes import free_port, start_cache_service, start_model_service

ROUTER = Path(sys.executable).parent / "vllm-router"
MODEL = "tiny-replica"
# With the tiny model's byte tokenizer and its BOS, 97 tokens: six full blocks.
PREFIX = "Paged attention keeps every sequence's keys and values in fixed-size blocks of the shared pool. "
BLOCK_SIZE = 16


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def finished_requests(model) -> float:
    text = urllib.request.urlopen(model.metrics_url, timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "pagedkv_model_requests_total")


def start_replica(tmp: Path) -> tuple:
    """A cache service publishing KV events and a model service on it; (cache, model, events endpoint)."""
    events = f"tcp://127.0.0.1:{free_port()}"
    cache = start_cache_service(tmp, "--kv-cache-bytes", "8MiB", "--kv-events-endpoint", events)
    try:
        return cache, start_model_service(tmp, cache.address, "--served-model-name", MODEL), events
    except BaseException:
        cache.stop()
        raise


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    assert ROUTER.exists(), f"{ROUTER} is missing: install the test extras (pip install '.[test]')"
    tmp = tmp_path_factory.mktemp("replicas")
    # One after the other: a child started from a worker thread would get SIGTERM when
    # that thread ends (processes.py asks the kernel for it, PR_SET_PDEATHSIG).
    replicas = []
    try:
        for _ in range(2):
            replicas.append(start_replica(tmp))
        worker_urls = [model.http_url.removesuffix("/v1") for _, model, _ in replicas]
        port = free_port()
        # Its own Prometheus port: the default (29000) is one for the whole machine.
        argv = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                # Its first look at the workers' /health may come before they answer it
                # (default: again 30 s later).
                "--worker-startup-check-interval", "1",
                "--worker-urls", *worker_urls, "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
        for worker_url, (_, _, events) in zip(worker_urls, replicas):
            argv += ["--kv-event-source", f"{worker_url}={events}"]
        with open(tmp / "router.log", "wb") as log:
            router = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if router.poll() is not None:
                raise AssertionError(f"vllm-router exited {router.returncode}: {(tmp / 'router.log').read_text()}")
            try:
                return urllib.request.urlopen(url + "/health", timeout=5).status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        try:
            wait_for(ready, 120, "vllm-router to serve")
            yield url, replicas
        finally:
            router.terminate()
            router.wait(timeout=15)
    finally:
        for cache, model, _ in replicas:
            model.stop()
            cache.stop()


def subscribe(endpoint: str) -> zmq.Socket:
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.connect(endpoint)
    return subscriber


def wait_for_event(subscriber, wanted, what: str) -> None:
    """Reads an event stream until ``wanted(event)`` holds for an event."""
    poller = zmq.Poller()
    poller.register(subscriber, zmq.POLLIN)
    deadline = time.monotonic() + 60  # a bound on a loaded machine, not a pace: it ends at the event
    while time.monotonic() < deadline:
        if not poller.poll(1000):
            continue
        _, _, payload = subscriber.recv_multipart()
        if any(wanted(event) for event in decode_batch(payload).events):
            return
    raise AssertionError(f"no {what} within 60 s")


def wait_for_stored(subscriber, block_hash: int) -> None:
    wait_for_event(subscriber, lambda event: isinstance(event, BlockStored) and block_hash in event.block_hashes,
                   f"BlockStored for block hash {block_hash}")


def test_requests_sharing_a_warm_prefix_go_to_the_replica_holding_it(replicas):
    url, [(_, model_a, events_a), (_, model_b, _)] = replicas
    # The blocks the router will look up: vLLM's hashes of the prefix's token ids.
    tokens = post(model_a.http_url.removesuffix("/v1") + "/tokenize", {"model": MODEL, "prompt": PREFIX})["tokens"]
    full_blocks = len(tokens) // BLOCK_SIZE
    last_block_hash = external(chain(tokens, BLOCK_SIZE)[full_blocks - 1])
    subscriber = subscribe(events_a)
    try:
        # Warm the prefix on A alone, straight to its HTTP port; the router has subscribed
        # to A's events since it started, so once they are out it knows A holds the prefix.
        post(model_a.http_url + "/completions", {"model": MODEL, "prompt": PREFIX, "max_tokens": 1, "temperature": 0})
        wait_for_stored(subscriber, last_block_hash)
    finally:
        subscriber.close()
    served = {"a": finished_requests(model_a), "b": finished_requests(model_b)}
    cached = []
    for index in range(4):
        answer = post(url + "/v1/completions", {"model": MODEL, "prompt": PREFIX + f"question {index}?",
                                                "max_tokens": 2, "temperature": 0})
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert finished_requests(model_a) - served["a"] == 4, "every request sharing A's prefix goes to A"
    assert finished_requests(model_b) == served["b"]
    # Served from A's prefix cache: every full block of the prefix.
    assert min(cached) >= full_blocks * BLOCK_SIZE, cached


def routed(url: str, models, prompt: str) -> tuple[str, dict]:
    """Sends ``prompt`` through the router; which replica served it ("a" or "b") and the answer."""
    before = [finished_requests(model) for model in models]
    answer = post(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    served = [finished_requests(model) - count for model, count in zip(models, before)]
    assert sorted(served) == [0, 1], served
    return "ab"[served.index(1)], answer


def test_after_a_reset_of_a_the_prefix_goes_to_the_replica_holding_more_of_it(replicas):
    # kv_aware (vllm-router 0.1.17) sends a request to the worker whose cost is lowest, the
    # cost growing with the prompt tokens a worker does not hold (its "KV prefix decision"
    # debug log: new_prefill_tokens, credited_prefix_tokens) and with its load; between
    # equal costs, as when no worker holds any of the prompt, it takes one fixed worker per
    # router process, A or B by its registry's order (seen both ways). So after A's reset
    # the prefix would follow that tie. Instead B holds the prefix's first two blocks
    # (warmed on B alone): while A holds all six, A still wins; once A's reset is out, B
    # holds the longest prefix and wins, whatever the tie-break. Requests go one at a time,
    # so load never decides.
    url, [(cache_a, model_a, events_a), (_, model_b, events_b)] = replicas
    models = (model_a, model_b)
    tokens = post(model_a.http_url.removesuffix("/v1") + "/tokenize", {"model": MODEL, "prompt": PREFIX})["tokens"]
    digests = chain(tokens, BLOCK_SIZE)
    partial = PREFIX[:40] + "~" * 12  # BOS and 40 bytes: the prefix's first two full blocks, then others
    subscriber_a, subscriber_b = subscribe(events_a), subscribe(events_b)
    try:
        post(model_b.http_url + "/completions", {"model": MODEL, "prompt": partial, "max_tokens": 1, "temperature": 0})
        wait_for_stored(subscriber_b, external(digests[1]))
        # A holds the whole prefix (the test before warmed it): A still wins over B's two blocks.
        assert routed(url, models, PREFIX + "before the reset?")[0] == "a"

        stub_a = cache_stub(cache_a.address)
        wait_for(lambda: leased_blocks(stub_a) == 0, 60, "replica A's requests to release their blocks")
        reset = post(model_a.http_url.removesuffix("/v1") + "/reset_prefix_cache", {})
        assert reset["blocks_dropped"] >= len(tokens) // BLOCK_SIZE and reset["blocks_kept"] == 0, reset
        last = external(digests[len(tokens) // BLOCK_SIZE - 1])
        wait_for_event(subscriber_a, lambda event: isinstance(event, AllBlocksCleared) or (
            isinstance(event, BlockRemoved) and last in event.block_hashes), "A's events of the reset")
    finally:
        subscriber_a.close()
        subscriber_b.close()
    where, answer = routed(url, models, PREFIX + "after the reset?")
    assert where == "b", "with A's prefix cache reset, the prefix goes to B, which holds its first blocks"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK_SIZE  # B's two blocks


def test_the_routers_flush_cache_empties_every_replicas_prefix_cache(replicas):
    # vllm-router's POST /flush_cache posts /flush_cache to each worker; pagedkv's workers
    # answer it as /reset_prefix_cache, so a prefix warmed on each is gone from both.
    url, [(cache_a, model_a, _), (cache_b, model_b, _)] = replicas
    prompt = PREFIX + "after the flush?"
    for model in (model_a, model_b):
        for _ in range(2):  # the second finds the first's blocks
            answer = post(model.http_url + "/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                             "temperature": 0})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (model.http_url, answer["usage"])
    for cache in (cache_a, cache_b):
        stub = cache_stub(cache.address)
        wait_for(lambda: leased_blocks(stub) == 0, 60, "the replicas' requests to release their blocks")
    request = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200, response.read()
    for model in (model_a, model_b):
        answer = post(model.http_url + "/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (model.http_url, answer["usage"])
