"""Two replicas behind vllm-router's kv_aware policy, as plain processes.

Each replica is a cache service publishing KV events and a model service on the tiny
model; vllm-router (a Rust binary from the `vllm-router` wheel in the test extras)
subscribes to both event streams, renders each request on the workers
(/v1/completions/render) and routes it to the worker holding the longest prefix of its
blocks. A prompt warmed on replica A alone draws every request that shares its prefix
to A, which serves it from its prefix cache; once A's prefix cache is reset, such a
request goes where the rest of the prefix is.

What the router knows is what it has read of the events, and a test must not route
before that includes what the test just did. Two things stand between an event being
out and the router knowing it: its SUB socket joins a publisher some time after it
connects, after /health answers (ZMQ's slow joiner: what was published before never
reaches the socket; the router fetches those batches from the cache service's replay
socket, --kv-event-replay-source, only once a later batch shows the gap), and it applies
what it reads a little later, in order, per replica. So ``router_caught_up`` sees to
both, from where the router routes requests, whatever the timing: each test starts with
both prefix caches empty and the router caught up (``cluster``), so it has joined both
streams before the test's own events, and the test waits for it again after its events,
before it routes what they decide. One test starts a second router after a replica
published a prefix, which that router can know only through the replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
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

from harness.cache_helpers import cache_stub, leased_blocks, wait_for
from harness.processes import SHARED_LEASE_TTL, free_port, start_cache_service, start_model_service
from cache_service.events.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from cache_service.events.vllm_block_hash import chain, external

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
    """A cache service publishing KV events, with their replay socket, and a model service
    on it; (cache, model, events endpoint, replay endpoint). 32 MiB: 3,888 blocks.
    router_caught_up stores at most 6 blocks a pair of sentinels on each replica and tries
    at most MAX_PAIRS pairs, so even two calls after a test warmed its prompts cannot push
    those out of the cache."""
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cache = start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "32MiB", "--kv-events-endpoint", events,
                                "--kv-events-replay-endpoint", replay)
    try:
        return cache, start_model_service(tmp, cache.address, "--served-model-name", MODEL), events, replay
    except BaseException:
        cache.stop()
        raise


class EventStream:
    """A replica's KV events as the tests read them: one SUB socket for the module."""

    def __init__(self, endpoint: str) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def find(self, wanted, timeout_s: float) -> bool:
        """Reads the stream until ``wanted(event)`` holds for an event (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(min(left, 1.0) * 1000) + 1):
                continue
            _, _, payload = self.socket.recv_multipart()
            if any(wanted(event) for event in decode_batch(payload).events):
                return True
        return False

    def wait_for(self, wanted, what: str, timeout_s: float = 60) -> None:
        # 60 s: a bound on a loaded machine, not a pace: it ends at the event.
        assert self.find(wanted, timeout_s), f"no {what} within {timeout_s:g} s"

    def wait_for_stored(self, block_hash: int) -> None:
        self.wait_for(stored(block_hash), f"BlockStored for block hash {block_hash}")


def stored(block_hash: int):
    return lambda event: isinstance(event, BlockStored) and block_hash in event.block_hashes


@dataclasses.dataclass(frozen=True)
class Replica:
    name: str  # "a" or "b", as routed() names them
    cache: object
    model: object
    stream: EventStream
    events: str  # the cache service's KV events endpoint
    replay: str  # and its replay socket

    @property
    def base_url(self) -> str:
        return self.model.http_url.removesuffix("/v1")


@dataclasses.dataclass(frozen=True)
class Cluster:
    url: str  # the router's
    replicas: tuple[Replica, Replica]
    tie: str  # the replica ("a" or "b") this router process takes between equal costs
    tmp: Path  # the module's folder (logs)


def complete(replica: Replica, prompt: str) -> dict:
    """One token for ``prompt``, straight to the replica's HTTP port (the router never sees it)."""
    return post(replica.model.http_url + "/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                           "temperature": 0})


def tokenize(replica: Replica, prompt: str) -> list[int]:
    return post(replica.base_url + "/tokenize", {"model": MODEL, "prompt": prompt})["tokens"]


def last_full_block_hash(replica: Replica, prompt: str) -> int:
    """vLLM's hash of the prompt's last full block, as its BlockStored carries it."""
    tokens = tokenize(replica, prompt)
    return external(chain(tokens, BLOCK_SIZE)[len(tokens) // BLOCK_SIZE - 1])


_sentinels = itertools.count()


def sentinel(blocks: int) -> str:
    """A prompt of ``blocks`` full blocks, BOS included, that shares none with any other
    prompt here: its first block (BOS and 15 bytes) starts with a number of its own."""
    text = f"{next(_sentinels):06d} is a sentinel prompt: where its blocks are tells where the router stands."
    return text[:blocks * BLOCK_SIZE - 1]


MAX_PAIRS = 250


def router_caught_up(cluster: Cluster, timeout_s: float = 120) -> None:
    """Returns once the router has applied every event that both replicas published
    before the call (and after its SUB sockets joined them), seen from where it routes.

    It applies each replica's events in order, so one event published after the call,
    on each replica, will do: those of sentinel prompts. Between equal costs (no worker
    credited with any of a prompt) it takes ``tie``; call the other replica ``other``.
    For a pair of sentinels, ``other`` stores the first block of ``sb`` and then ``sa``
    (two blocks), and ``tie`` stores ``sb`` (three). A request sharing ``sa`` that goes
    to ``other`` cannot be a tie: the router credits ``other`` with ``sa``, so it has
    applied ``other``'s events up to it, ``sb``'s first block included. A request
    sharing ``sb`` then goes to ``tie`` only if the router credits ``tie`` with all of
    ``sb``: without that, ``other``'s first block of it would win.

    A request routed the other way (an event not applied yet) has stored its sentinel
    where it went, so each pair is asked once. Pairs are stored in pools, one pool
    before its requests, and asked oldest first; when a pool runs out, the next is
    twice as large, so the pairs asked grow older until the router is past them,
    however late it applies what it reads (up to MAX_PAIRS pairs and ``timeout_s``).
    """
    tie = next(replica for replica in cluster.replicas if replica.name == cluster.tie)
    other = next(replica for replica in cluster.replicas if replica.name != cluster.tie)
    models = tuple(replica.model for replica in cluster.replicas)
    deadline = time.monotonic() + timeout_s
    missed = []
    tried = 0

    def check_bounds() -> None:
        assert tried < MAX_PAIRS and time.monotonic() < deadline, (
            f"vllm-router did not catch up with the replicas' KV events ({tried} pairs, {timeout_s:g} s): of "
            f"{len(missed)} pairs of requests sharing a sentinel on {other.name}, then one on {tie.name} "
            f"(ties going to {tie.name}), none went to {other.name} then {tie.name}; the last went to {missed[-3:]}")

    pool_size = 1
    while True:
        pool = [(sentinel(2), sentinel(3)) for _ in range(pool_size)]
        for sa, sb in pool:
            check_bounds()
            tried += 1
            complete(other, sb[:BLOCK_SIZE - 1] + "~" * 20)  # BOS and 15 bytes: sb's first block, then others
            complete(other, sa)
            complete(tie, sb)
        # Out on both streams (each replica's in order: the pool's last are its last).
        other.stream.wait_for_stored(last_full_block_hash(other, pool[-1][0]))
        tie.stream.wait_for_stored(last_full_block_hash(tie, pool[-1][1]))
        for sa, sb in pool:
            first = routed(cluster.url, models, sa + "?")[0]
            second = routed(cluster.url, models, sb + "?")[0] if first == other.name else None
            if second == tie.name:
                return
            missed.append((first, second))
        pool_size *= 2


@contextlib.contextmanager
def router(tmp: Path, replicas: tuple[Replica, Replica], name: str = "router"):
    """vllm-router's kv_aware policy in front of the replicas, subscribed to their KV events
    and to their replay sockets; yields its URL once it serves."""
    worker_urls = [replica.base_url for replica in replicas]
    port = free_port()
    # Its own Prometheus port: the default (29000) is one for the whole machine.
    argv = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            # Its first look at the workers' /health may come before they answer it
            # (default: again 30 s later).
            "--worker-startup-check-interval", "1",
            "--worker-urls", *worker_urls, "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    for worker_url, replica in zip(worker_urls, replicas):
        argv += ["--kv-event-source", f"{worker_url}={replica.events}",
                 "--kv-event-replay-source", f"{worker_url}={replica.replay}"]
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"vllm-router exited {process.returncode}: {log_path.read_text()}")
        try:
            return urllib.request.urlopen(url + "/health", timeout=5).status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        wait_for(ready, 120, "vllm-router to serve")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)


def tie_of(url: str, replicas: tuple[Replica, Replica]) -> str:
    """The replica a router process takes between equal costs: two prompts no replica holds."""
    models = tuple(replica.model for replica in replicas)
    ties = {routed(url, models, sentinel(2) + "?")[0] for _ in range(2)}
    assert len(ties) == 1, f"vllm-router broke two ties two ways ({ties}): router_caught_up needs one"
    return ties.pop()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas and vllm-router in front of them, for the module: a Cluster whose
    event streams have joined (each has read an event published after it connected)."""
    assert ROUTER.exists(), f"{ROUTER} is missing: install the test extras (pip install '.[test]')"
    tmp = tmp_path_factory.mktemp("replicas")
    # One after the other: a child started from a worker thread would get SIGTERM when
    # that thread ends (processes.py asks the kernel for it, PR_SET_PDEATHSIG).
    started = []
    replicas = ()
    try:
        for _ in range(2):
            started.append(start_replica(tmp))
        replicas = tuple(Replica(name, cache, model, EventStream(events), events, replay)
                         for name, (cache, model, events, replay) in zip("ab", started))
        with router(tmp, replicas) as url:
            # Our own SUB sockets join their publishers some time after they connect too: each
            # has joined once it reads a batch published after the connect, any of those
            # stored here until one arrives.
            deadline = time.monotonic() + 60
            for replica in replicas:
                sent = set()
                while True:
                    prompt = sentinel(2)
                    complete(replica, prompt)
                    sent.add(last_full_block_hash(replica, prompt))
                    if replica.stream.find(lambda event: isinstance(event, BlockStored) and bool(
                            sent.intersection(event.block_hashes)), 1.0):
                        break
                    assert time.monotonic() < deadline, f"replica {replica.name}'s KV events never reached the test"
            yield Cluster(url, replicas, tie_of(url, replicas), tmp)
    finally:
        for replica in replicas:
            replica.stream.socket.close()
        for cache, model, _, _ in started:
            model.stop()
            cache.stop()


@pytest.fixture
def cluster(replicas):
    """The replicas with empty prefix caches, and the router caught up with that: each
    test starts alike, whatever ran before it and however that ended."""
    for replica in replicas.replicas:
        stub = cache_stub(replica.cache.address)
        wait_for(lambda: leased_blocks(stub) == 0, 60, f"replica {replica.name}'s requests to release their blocks")
        reset = post(replica.base_url + "/reset_prefix_cache", {})
        assert reset["blocks_kept"] == 0, reset
    router_caught_up(replicas)
    return replicas


def test_requests_sharing_a_warm_prefix_go_to_the_replica_holding_it(cluster):
    a, b = cluster.replicas
    # The blocks the router will look up: vLLM's hashes of the prefix's token ids.
    tokens = tokenize(a, PREFIX)
    full_blocks = len(tokens) // BLOCK_SIZE
    # Warm the prefix on A alone, straight to its HTTP port; once its BlockStored is out
    # and the router has applied it, the router knows A holds the prefix.
    complete(a, PREFIX)
    a.stream.wait_for_stored(external(chain(tokens, BLOCK_SIZE)[full_blocks - 1]))
    router_caught_up(cluster)
    served = {"a": finished_requests(a.model), "b": finished_requests(b.model)}
    cached = []
    for index in range(4):
        answer = post(cluster.url + "/v1/completions", {"model": MODEL, "prompt": PREFIX + f"question {index}?",
                                                        "max_tokens": 2, "temperature": 0})
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert finished_requests(a.model) - served["a"] == 4, "every request sharing A's prefix goes to A"
    assert finished_requests(b.model) == served["b"]
    # Served from A's prefix cache: every full block of the prefix.
    assert min(cached) >= full_blocks * BLOCK_SIZE, cached


def routed(url: str, models, prompt: str) -> tuple[str, dict]:
    """Sends ``prompt`` through the router; which replica served it ("a" or "b") and the answer."""
    before = [finished_requests(model) for model in models]
    answer = post(url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    served = [finished_requests(model) - count for model, count in zip(models, before)]
    assert sorted(served) == [0, 1], served
    return "ab"[served.index(1)], answer


def test_after_a_reset_of_a_the_prefix_goes_to_the_replica_holding_more_of_it(cluster):
    # kv_aware (vllm-router 0.1.17) sends a request to the worker whose cost is lowest, the
    # cost growing with the prompt tokens a worker does not hold (its "KV prefix decision"
    # debug log: new_prefill_tokens, credited_prefix_tokens) and with its load; between
    # equal costs, as when no worker holds any of the prompt, it takes one fixed worker per
    # router process, A or B by its registry's order (seen both ways). So after A's reset
    # the prefix would follow that tie. Instead B holds the prefix's first two blocks
    # (warmed on B alone): while A holds all six, A still wins; once A's reset is out, B
    # holds the longest prefix and wins, whatever the tie-break. Requests go one at a time,
    # so load never decides.
    a, b = cluster.replicas
    models = (a.model, b.model)
    tokens = tokenize(a, PREFIX)
    digests = chain(tokens, BLOCK_SIZE)
    full_blocks = len(tokens) // BLOCK_SIZE
    last = external(digests[full_blocks - 1])
    partial = PREFIX[:40] + "~" * 12  # BOS and 40 bytes: the prefix's first two full blocks, then others
    complete(a, PREFIX)
    a.stream.wait_for_stored(last)
    complete(b, partial)
    b.stream.wait_for_stored(external(digests[1]))
    router_caught_up(cluster)
    # A holds the whole prefix: A still wins over B's two blocks.
    assert routed(cluster.url, models, PREFIX + "before the reset?")[0] == "a"

    stub_a = cache_stub(a.cache.address)
    wait_for(lambda: leased_blocks(stub_a) == 0, 60, "replica A's requests to release their blocks")
    reset = post(a.base_url + "/reset_prefix_cache", {})
    assert reset["blocks_dropped"] >= full_blocks and reset["blocks_kept"] == 0, reset
    a.stream.wait_for(lambda event: isinstance(event, AllBlocksCleared) or (
        isinstance(event, BlockRemoved) and last in event.block_hashes), "A's events of the reset")
    router_caught_up(cluster)
    where, answer = routed(cluster.url, models, PREFIX + "after the reset?")
    assert where == "b", "with A's prefix cache reset, the prefix goes to B, which holds its first blocks"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK_SIZE  # B's two blocks


def test_the_routers_flush_cache_empties_every_replicas_prefix_cache(cluster):
    # vllm-router's POST /flush_cache posts /flush_cache to each worker; pagedkv's workers
    # answer it as /reset_prefix_cache, so a prefix warmed on each is gone from both.
    prompt = PREFIX + "after the flush?"
    for replica in cluster.replicas:
        for _ in range(2):  # the second finds the first's blocks
            answer = complete(replica, prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, (replica.name, answer["usage"])
    for replica in cluster.replicas:
        stub = cache_stub(replica.cache.address)
        wait_for(lambda: leased_blocks(stub) == 0, 60, "the replicas' requests to release their blocks")
    request = urllib.request.Request(cluster.url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200, response.read()
    for replica in cluster.replicas:
        answer = complete(replica, prompt)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (replica.name, answer["usage"])


def test_a_router_started_late_learns_what_it_missed_from_the_replay_sockets(cluster):
    """A's BlockStored for the whole prefix goes out before a second router exists, so its
    SUB socket never reads it (ZMQ drops what was published before a subscriber joined).
    B's first two blocks of the prefix go out once that router has joined both streams.
    Routed there, the prefix goes to A (six blocks over B's two) only if the router fetched
    A's missed batches from A's replay socket: without them it knows B's blocks alone."""
    a, b = cluster.replicas
    models = (a.model, b.model)
    tokens = tokenize(a, PREFIX)
    digests = chain(tokens, BLOCK_SIZE)
    full_blocks = len(tokens) // BLOCK_SIZE
    complete(a, PREFIX)
    a.stream.wait_for_stored(external(digests[full_blocks - 1]))
    with router(cluster.tmp, cluster.replicas, "late-router") as url:
        late = Cluster(url, cluster.replicas, tie_of(url, cluster.replicas), cluster.tmp)
        router_caught_up(late)  # joined both streams: what B publishes now, it reads
        complete(b, PREFIX[:40] + "~" * 12)  # BOS and 40 bytes: the prefix's first two full blocks
        b.stream.wait_for_stored(external(digests[1]))
        router_caught_up(late)
        where, answer = routed(url, models, PREFIX + "asked late?")
    assert where == "a", "the late router never replayed A's events from before it started"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * BLOCK_SIZE
