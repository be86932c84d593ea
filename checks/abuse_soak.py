"""The abuse soak (checks/soak.py --abuse): normal tenants beside an abusive tenant, a KV-event
replay flooder and a grammar bomber, in turns with the normal tenants alone.

    .venv/bin/python -m checks.soak --abuse --duration-s 60 --rounds 2 --concurrency 4

The cache service publishes KV events and answers replay requests (its default caps); the
model service runs --api-keys with two normal tenants, an abusive one (its compute budget:
--abuser-tokens-per-s, 0 for none) and a bomber (both at --abuser-requests-per-s), and
compiles one small grammar before the first run (xgrammar's import and the vocabulary are a
cost once a process, not the abuse's). Every run has --concurrency clients of the normal tenants (checks/soak.py's streams with random
cancels, half a tenant) and a probe that calls the cache service as an engine does, once
every --probe-interval-s: Lease (allocate a sequence), Lease (release it), Heartbeat and
GetSizing, each call timed. The abusive runs add, in a process of their own (so that their
own CPU does not hold the measuring clients' GIL):

- the abusive tenant's --abusive-concurrency clients (checks/soak.py's abuses: oversized
  bodies without a token, max-size prompts, the vocabulary as stop ids, bursts past its
  limits);
- a replay flooder: --replay-flooders DEALER sockets, each from a loopback address of its
  own (so each has the per-peer budget), sending replay requests from sequence 0 as fast
  as the socket takes them and reading what comes back;
- a grammar bomber: --grammar-bombers clients of the bomber tenant posting JSON schemas
  nested one short of the depth limit with many properties (each new, so none is cached)
  and, every other call, past the limit.

The table gives, for the normal tenants alone and beside the abuse: their requests (all
must succeed), tokens/s and inter-token p99 (noise on a shared machine), each probe call's
latency p50 / p99 / max, and both services' RssAnon after the run (with the compiled
grammars' share); then the sessions the cache service expired, its replay requests by
outcome. So that the server's part of a gap can be told from the clients', it gives the
CPU seconds of each process a run (the services, the abusive clients' process, this one)
and the services' in the AFTER_S seconds after it with no client (work a run left
running), the model service's tokens by tenant (and the steps and tokens a compute budget
deferred), and its threads' CPU by role (engine, event loop, grammar compiles, xgrammar's
threads, the rest; harness/cpu_use.py's ThreadSampler); then the
abuses' answers. Exits 1 if
a normal tenant's request failed, a probe call failed or took the lease TTL or longer, a
session expired, or blocks stayed leased.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

from checks import soak
from harness import cpu_use
from harness.cache_helpers import allocate, attach, lease, release
from checks.memory_soak import status_kib
from harness.processes import free_port, start_cache_service, start_model_service

from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

NORMAL_KEYS = ("sk-soak-normal-a", "sk-soak-normal-b")
BOMBER_KEY = "sk-soak-grammar-bomber"
MAX_DEPTH = 64  # the model service's default --max-json-schema-depth
LEASE_TTL_S = 5.0  # the cache service's default --lease-ttl-ms
PROBES = ("Lease allocate", "Lease release", "Heartbeat", "GetSizing")
# After each run, the services' CPU is measured this long with no client: work the run left.
AFTER_S = 5.0


def nested_arrays(depth: int, leaf: str) -> dict:
    schema: dict = {"type": leaf}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def bomb(number: int, properties: int = 24) -> dict:
    """A schema under the 64 KiB cap whose text nests as deep as the limit allows (the root,
    its properties and each property's own levels count); ``number`` makes it new. Odd
    numbers nest past the limit."""
    depth = MAX_DEPTH - 3 if number % 2 == 0 else MAX_DEPTH
    leaves = ["string", "integer", "boolean", "number", "null"]
    return {"type": "object", "properties": {f"p{number}_{index}": nested_arrays(depth, leaves[index % 5])
                                             for index in range(properties)}}


def warm_grammars(http_url: str) -> None:
    """One structured completion before the runs: the first compile imports xgrammar (and
    transformers with it) and reads the vocabulary, once a process, a cost that would
    otherwise fall in the first abusive run."""
    body = json.dumps({"model": "soak", "prompt": "hi", "max_tokens": 2,
                       "structured_outputs": {"json": {"type": "object"}}}).encode()
    request = urllib.request.Request(f"{http_url}/completions", data=body, method="POST",
                                     headers={"content-type": "application/json",
                                              "authorization": f"Bearer {NORMAL_KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def bomber(http_url: str, seed: int, deadline: float, answers: Counter, lock: threading.Lock) -> None:
    number = seed * 1_000_000
    while time.monotonic() < deadline:
        number += 1
        body = json.dumps({"model": "soak", "prompt": "hi", "max_tokens": 2,
                           "structured_outputs": {"json": bomb(number)}}).encode()
        request = urllib.request.Request(f"{http_url}/completions", data=body, method="POST",
                                         headers={"content-type": "application/json",
                                                  "authorization": f"Bearer {BOMBER_KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = str(response.status)
        except urllib.error.HTTPError as error:
            # The message's start says which limit (its numbers are the schema's own).
            message = json.loads(error.read() or b"{}").get("error", {}).get("message", "")
            answer = f"{error.code} ({re.sub(r'[0-9]+', 'N', message)[:90]}…)"
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            answer = type(getattr(error, "reason", error)).__name__
        with lock:
            answers[f"grammar bomb {'past the depth limit' if number % 2 else 'at the limit'}: {answer}"] += 1


def flooder(endpoint: str, peer: int, deadline: float, answers: Counter, lock: threading.Lock) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint.replace("tcp://", f"tcp://127.0.0.{peer}:0;"))
    sent = full = frames = 0
    request = (b"", (0).to_bytes(8, "big"))
    while time.monotonic() < deadline:
        try:
            sock.send_multipart(request, flags=zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            full += 1
            sock.poll(10)
        while sock.poll(0):
            sock.recv_multipart()
            frames += 1
    sock.close()
    with lock:
        answers["replay requests sent"] += sent
        answers["replay requests the socket would not take (its queue full)"] += full
        answers["replay frames received"] += frames


def abuse(model_address: str, http_url: str, replay_endpoint: str, args, vocab: int, max_model_len: int,
          deadline: float, out) -> None:
    """The abusive side of a run, in a process of its own."""
    if args.pin:  # stands for other machines: it takes only the CPU that the rest leaves idle
        os.nice(19)
    answers: Counter[str] = Counter()
    lock = threading.Lock()
    threads = [threading.Thread(target=flooder, args=(replay_endpoint, 2 + index, deadline, answers, lock))
               for index in range(args.replay_flooders)]
    threads += [threading.Thread(target=bomber, args=(http_url, index + 1, deadline, answers, lock))
                for index in range(args.grammar_bombers)]
    if args.abusive_concurrency:
        results = soak.Results()
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_address))
        threads += [threading.Thread(target=soak.abuser, args=(stub, http_url, args, random.Random(args.seed * 1000 + 500 + i),
                                                               vocab, max_model_len, deadline, results))
                    for i in range(args.abusive_concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if args.abusive_concurrency:
        answers.update(results.abuses)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out.put((dict(answers), usage.ru_utime + usage.ru_stime))


class Probe:
    """Calls the cache service as an engine does, timing each call, until stopped."""

    def __init__(self, address: str, interval_s: float) -> None:
        self.stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(address))
        self.session = attach(self.stub, name="soak-probe").session_id
        self.interval_s = interval_s
        self.latencies: dict[str, list[float]] = {name: [] for name in PROBES}
        self.failures: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def timed(self, name: str, call):
        started = time.perf_counter()
        try:
            return call()
        except grpc.RpcError as error:
            self.failures[f"{name}: {error.code().name}"] += 1
        finally:
            self.latencies[name].append(time.perf_counter() - started)

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            reply = self.timed("Lease allocate", lambda: lease(self.stub, self.session, allocate(16)))
            if reply is not None and reply.results[0].status == cache_pb2.LEASE_STATUS_OK:
                sequence = reply.results[0].sequence_id
                self.timed("Lease release", lambda: lease(self.stub, self.session, release(sequence)))
            self.timed("Heartbeat", lambda: self.stub.Heartbeat(
                cache_pb2.HeartbeatRequest(session_id=self.session), timeout=10))
            self.timed("GetSizing", lambda: self.stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10))

    def __enter__(self) -> Probe:
        self.thread.start()
        return self

    def __exit__(self, *_) -> None:
        self.stop.set()
        self.thread.join()
        self.stub.Detach(cache_pb2.DetachRequest(session_id=self.session), timeout=10)


def run_phase(services, args, vocab: int, max_model_len: int, abusive: bool) -> dict:
    cache, model, replay_endpoint = services
    normal = soak.Results()
    sampler = cpu_use.ThreadSampler(model.pid).start()
    before = cpu_snapshot(model, cache)
    tokens_before = tenant_tokens(model)
    stubs = [model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address)) for _ in NORMAL_KEYS]
    process = None
    if abusive:  # started first: a new interpreter takes a second or two to import
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        process = context.Process(target=abuse, args=(model.address, model.http_url, replay_endpoint, args, vocab,
                                                      max_model_len, time.monotonic() + args.duration_s, out))
        process.start()
    started = time.monotonic()
    deadline = started + args.duration_s
    with Probe(cache.address, args.probe_interval_s) as probe:
        threads = [threading.Thread(target=soak.client, args=(
            stubs[i % 2], args, random.Random(args.seed * 1000 + i), vocab, deadline, normal,
            bearer_metadata(NORMAL_KEYS[i % 2])), daemon=True) for i in range(args.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        answers, abusers_cpu = out.get(timeout=args.request_timeout_s) if process else ({}, 0.0)
    if process:
        process.join()
    during = cpu_snapshot(model, cache)
    sampler.stop()
    with cpu_use.ThreadSampler(model.pid) as after_sampler:
        time.sleep(AFTER_S)
    after = cpu_snapshot(model, cache)
    cpu = {"model service": during["model"] - before["model"], "cache service": during["cache"] - before["cache"],
           "abusive clients (a process)": abusers_cpu, "normal clients and probe (this process)": during["self"] - before["self"],
           f"model service, the {AFTER_S:g} s after": after["model"] - during["model"],
           f"cache service, the {AFTER_S:g} s after": after["cache"] - during["cache"]}
    tokens = tenant_tokens(model)
    tokens.subtract(tokens_before)
    # The probe's own session holds nothing between its calls.
    leased = soak.settled_stats(cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address)))
    return dict(normal=normal, elapsed=elapsed, probe=probe, answers=answers, leased=leased.blocks_leased,
                cpu=cpu, threads=sampler.roles, tokens=tokens, after_threads=after_sampler.roles,
                model_rss=status_kib(model.pid)["RssAnon"], cache_rss=status_kib(cache.pid)["RssAnon"],
                grammar_cache=soak.metric(model.metrics_url, "pagedkv_model_grammar_cache_bytes"))


DEFERRED = {"pagedkv_model_tenant_budget_deferred_steps_total": "deferred steps",
            "pagedkv_model_tenant_budget_deferred_tokens_total": "deferred tokens"}


def tenant_tokens(model) -> Counter[str]:
    """The tokens the model service computed for each tenant so far, prompt and completion,
    and the steps and tokens its compute budget deferred ("TENANT deferred steps")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(model.metrics_url, timeout=10).read().decode()
    counts = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagedkv_model_tenant_tokens_total":
                counts[f"{sample.labels['tenant']} {sample.labels['kind']}"] = sample.value
            elif sample.name in DEFERRED:
                counts[f"{sample.labels['tenant']} {DEFERRED[sample.name]}"] = sample.value
    return counts


def cpu_snapshot(model, cache) -> dict:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"model": cpu_use.cpu_seconds(model.pid), "cache": cpu_use.cpu_seconds(cache.pid),
            "self": usage.ru_utime + usage.ru_stime}


def run(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedkv-abuse-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "shm").mkdir(exist_ok=True)
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({
        **{key: {"tenant": f"normal-{key[-1]}"} for key in NORMAL_KEYS},
        soak.ABUSER_KEY: soak.abuser_limits(args),
        BOMBER_KEY: {"tenant": "bomber", "max_concurrent_requests": 2, "max_requests_per_s": args.abuser_requests_per_s},
    }))
    keys.chmod(0o600)
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pinned = soak.pin_services(args.pin)
    with start_cache_service(workdir, "--kv-cache-bytes", args.kv_cache_bytes, "--shm-dir", workdir / "shm",
                             "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep) as cache, \
            start_model_service(workdir, cache.address, "--model", args.model, "--max-model-len", args.max_model_len,
                                "--api-keys", keys, "--served-model-name", "soak", *pinned) as model:
        soak.pin_clients(args.pin)
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10,
                                 metadata=bearer_metadata(NORMAL_KEYS[0]))
        vocab = min(info.vocab_size, 256)
        warm_grammars(model.http_url)
        rss_before = status_kib(model.pid)["RssAnon"], status_kib(cache.pid)["RssAnon"]
        runs: dict[str, list[dict]] = {"alone": [], "beside": []}
        for round_index in range(args.rounds):
            for name in runs:
                result = run_phase((cache, model, rep), args, vocab, info.max_model_len, name == "beside")
                runs[name].append(result)
                print(f"round {round_index + 1} {name}: {result['normal'].completed} completed, "
                      f"{dict(result['normal'].errors)} failed; GetSizing max "
                      f"{max(result['probe'].latencies['GetSizing']) * 1e3:.1f} ms", file=sys.stderr, flush=True)
        expired = soak.metric(cache.metrics_url, "pagedkv_cache_sessions_expired_total")
        replays = soak.label_samples(cache.metrics_url, "pagedkv_cache_kv_events_replay_requests_total", "outcome")
        attaches = sum(event.get("event") == "attached" for event in model.log_events())
    return report(args, info, runs, rss_before, expired, replays, attaches)


def latency_cell(runs: list[dict], name: str) -> str:
    values = [value for run in runs for value in run["probe"].latencies[name]]
    return (f"{soak.percentile(values, 0.5) * 1e3:.1f} / {soak.percentile(values, 0.99) * 1e3:.1f} / "
            f"{max(values) * 1e3:.1f} ({len(values)})")


def report(args, info, runs: dict, rss_before: tuple, expired: float, replays: dict, attaches: int) -> int:
    print(f"model {info.model_id}; {args.concurrency} clients of two normal tenants; beside them "
          f"{args.abusive_concurrency} abusive clients, {args.replay_flooders} replay flooders, "
          f"{args.grammar_bombers} grammar bombers; {args.duration_s:g} s a run, {args.rounds} round(s) in turns"
          f"{' (pinned: the services on CPU 0, the clients on CPU 1, the abusers at nice 19)' if args.pin else ''}; "
          f"a probe every {args.probe_interval_s:g} s\n")
    print("| | normal tenants alone | beside the abuse |\n| --- | --- | --- |")

    def row(label: str, cell) -> None:
        print(f"| {label} | {cell(runs['alone'])} | {cell(runs['beside'])} |")

    row("normal requests completed / cancelled / failed", lambda rs: ", ".join(
        f"{r['normal'].completed} / {r['normal'].cancelled} / {sum(r['normal'].errors.values())}" for r in rs))
    row("normal tokens/s (median of rounds)", lambda rs: f"{statistics.median(r['normal'].tokens / r['elapsed'] for r in rs):.0f}")
    row("normal inter-token p99 (ms, median of rounds)",
        lambda rs: f"{statistics.median(soak.percentile(r['normal'].itl, 0.99) for r in rs) * 1e3:.1f}")
    for name in PROBES:
        row(f"cache service {name} p50 / p99 / max (ms) (calls)", lambda rs, name=name: latency_cell(rs, name))
    row("probe calls failed", lambda rs: str(dict(sum((r["probe"].failures for r in rs), Counter()))) or "0")
    row("model service RssAnon after each run (MiB)", lambda rs: ", ".join(f"{r['model_rss'] / 1024:.1f}" for r in rs))
    row("of it, compiled grammars kept (MiB, xgrammar's estimate)",
        lambda rs: ", ".join(f"{r['grammar_cache'] / 2**20:.1f}" for r in rs))
    row("cache service RssAnon after each run (MiB)", lambda rs: ", ".join(f"{r['cache_rss'] / 1024:.1f}" for r in rs))
    row("blocks leased after each run", lambda rs: ", ".join(str(r["leased"]) for r in rs))
    print(f"\nRssAnon at the start: model service {rss_before[0] / 1024:.1f} MiB, cache service "
          f"{rss_before[1] / 1024:.1f} MiB. Sessions the cache service expired: {expired:.0f}; the model "
          f"service attached {attaches} time(s) (more than once: its session was lost). Replay requests by "
          f"outcome: {replays}\n")
    print("| CPU seconds a run (median of rounds) | alone | beside the abuse |\n| --- | ---: | ---: |")
    for name in runs["alone"][0]["cpu"]:
        row(name, lambda rs, name=name: f"{statistics.median(r['cpu'][name] for r in rs):.1f}")
    print(f"\nTokens the model service computed for each tenant a run (prompt / completion), every round; "
          f"with a compute budget (the abuser's: --abuser-tokens-per-s {args.abuser_tokens_per_s}), the steps "
          f"and tokens it deferred:\n")
    for kind, kind_runs in runs.items():
        for index, run in enumerate(kind_runs):
            tenants = sorted({name.split()[0] for name in run["tokens"]})
            print(f"- {kind} {index + 1}: " + ", ".join(
                f"{tenant} {run['tokens'][tenant + ' prompt']:.0f} / {run['tokens'][tenant + ' completion']:.0f}"
                + (f" (deferred: {run['tokens'][tenant + ' deferred steps']:.0f} steps, "
                   f"{run['tokens'][tenant + ' deferred tokens']:.0f} tokens)"
                   if run["tokens"][tenant + " deferred steps"] else "")
                for tenant in tenants))
    for key, what in (("threads", "during"), ("after_threads", f"the {AFTER_S:g} s after")):
        print(f"\nModel service threads by role (harness/cpu_use.py's thread_role), CPU seconds {what} each run:\n")
        for kind, kind_runs in runs.items():
            for index, run in enumerate(kind_runs):
                busiest = ", ".join(f"{name} {seconds:.1f}" for name, seconds in run[key].most_common())
                print(f"- {kind} {index + 1}: {busiest}")
    print()
    answers: Counter[str] = Counter()
    for run in runs["beside"]:
        answers.update(run["answers"])
    print("| abuse: answer | count |\n| --- | ---: |")
    for name, count in sorted(answers.items()):
        print(f"| {name} | {count} |")
    every = [run for kind in runs.values() for run in kind]
    slowest = max(max(values) for run in every for values in run["probe"].latencies.values())
    failed = (any(run["normal"].errors for run in every) or any(run["probe"].failures for run in every)
              or slowest >= LEASE_TTL_S or expired or attaches != 1 or any(run["leased"] for run in every))
    return 1 if failed else 0
