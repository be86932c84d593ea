"""Bounded soak: both services as real processes, 64 concurrent streams, random cancels.

    .venv/bin/python -m checks.soak                      # tiny model, 150 s, 2 MiB pool
    .venv/bin/python -m checks.soak --duration-s 60 --model /path/to/checkpoint
    .venv/bin/python -m checks.soak --abusive-concurrency 8   # two tenants, one abusive (issue 28)
    .venv/bin/python -m checks.soak --requests 10000 --concurrency 8   # memory: RSS every 500 requests
    .venv/bin/python -m checks.soak --abuse --abusive-concurrency 2 --concurrency 4 --duration-s 60 --rounds 2

With --abuse it is the abuse soak instead (checks/abuse_soak.py): normal tenants alone and
beside an abusive tenant, a KV-event replay flooder and a grammar bomber, in turns, with the
cache service's Lease, Heartbeat and GetSizing timed by a probe throughout.

With --requests N it is the memory soak instead (checks/memory_soak.py): N requests of
mixed shapes (streams, n > 1, logprobs, structured output, tools, aborts, deadlines,
two tenants), both services' resident memory sampled every --sample-every requests.

Each client loops until the duration is over: a random prompt (--prompt-tokens range),
random max_new_tokens (--new-tokens range), sampled at temperature 0.8 with eos ignored
(so lengths are what was asked), and with probability --cancel-fraction it cancels the
call after a random number of tokens. The KV pool is kept small (--kv-cache-bytes) so the
engine must queue and preempt. Measured at the client: time to first token and the gap
between tokens (a message carrying n tokens counts as n gaps of gap/n). At the end, once
every client is done, the cache service must show no leased block. Prints a markdown
table; exits 1 if blocks leaked or a request failed with an unexpected status.

With --abusive-concurrency N, the model service runs --api-keys with two tenants, and the
soak runs twice on the same services: the normal tenant's clients alone, then again with
N clients of an abusive tenant (max_concurrent_requests 4, max_queued_requests 2, a
kv_blocks share, a compute budget of --abuser-tokens-per-s, a request rate of
--abuser-requests-per-s) beside them. Each abusive client loops over four abuses at random:
an oversized HTTP body sent without a token (401 or 413 before it is read), a prompt of
max_model_len - 1 tokens, the whole vocabulary as stop ids with min_tokens, and a burst of
3 × its max_concurrent_requests at once (RESOURCE_EXHAUSTED past the limit). The table
compares the normal tenant's throughput and inter-token p99 between the runs (the target:
within 10 %), counts its failures (the target: 0) and the abuses' answers by status;
exits 1 if the normal tenant failed or blocks leaked. --rounds N runs the two N times in
turns (medians in the table); --pin gives the services CPU 0 and the clients CPU 1, with the
abusive clients at nice 19, so that on a 2-core machine the abusers' own CPU (building and
sending 32 MiB bodies) stands for other machines' and what is measured is the server's.

Not run in CI: it takes minutes and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
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

from harness.cpu_use import cpu_seconds
from harness.processes import start_cache_service, start_model_service

from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

NORMAL_KEY, ABUSER_KEY = "sk-soak-normal-tenant", "sk-soak-abusive-tenant"
ABUSER_MAX_CONCURRENT = 4


def parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


class Results:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed = 0
        self.cancelled = 0
        self.errors: Counter[str] = Counter()
        self.tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.abuses: Counter[str] = Counter()  # "abuse: answer"
        self.cpu = 0.0  # CPU seconds (run_phase)


def client(stub, args, rng: random.Random, vocab: int, deadline: float, results: Results, metadata=None) -> None:
    while time.monotonic() < deadline:
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(*args.prompt_tokens))]
        max_new_tokens = rng.randint(*args.new_tokens)
        cancel_after = rng.randint(1, max(1, max_new_tokens - 1)) if rng.random() < args.cancel_fraction else None
        request = model_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8,
                                              seed=rng.randrange(2**31), ignore_eos=True),
        )
        started = last = time.perf_counter()
        tokens, ttft, gaps = 0, None, []
        call = stub.Generate(request, timeout=args.request_timeout_s, metadata=metadata)
        try:
            for response in call:
                now = time.perf_counter()
                count = len(response.token_ids)
                if count:
                    if ttft is None:
                        ttft = now - started  # tokens that came with the first one have no gap of their own
                    else:
                        gaps.extend([(now - last) / count] * count)
                    last = now
                tokens += count
                if cancel_after is not None and tokens >= cancel_after:
                    call.cancel()
                    break
            outcome = "cancelled" if cancel_after is not None and tokens >= cancel_after else "completed"
        except grpc.RpcError as error:
            outcome = "cancelled" if error.code() == grpc.StatusCode.CANCELLED and cancel_after else error.code().name
        with results.lock:
            results.tokens += tokens
            if ttft is not None:
                results.ttft.append(ttft)
            results.itl.extend(gaps)
            if outcome == "completed":
                results.completed += 1
            elif outcome == "cancelled":
                results.cancelled += 1
            else:
                results.errors[outcome] += 1


def abuser(stub, http_url: str, args, rng: random.Random, vocab: int, max_model_len: int, deadline: float,
           results: Results) -> None:
    """One abusive tenant's client: each iteration one abuse, its answer counted by status."""
    metadata = bearer_metadata(ABUSER_KEY)

    def generate(prompt: list[int], **sampling) -> str:
        request = model_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=model_pb2.SamplingParams(**sampling))
        try:
            for _ in stub.Generate(request, timeout=args.request_timeout_s, metadata=metadata):
                pass
            return "OK"
        except grpc.RpcError as error:
            return error.code().name

    def oversized_body() -> str:
        body = b'{"model": "x", "prompt": "' + b"a" * (args.abusive_body_bytes) + b'"}'
        request = urllib.request.Request(f"{http_url}/completions", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=60).read()
            return "200"
        except urllib.error.HTTPError as error:
            return str(error.code)
        except (urllib.error.URLError, ConnectionError) as error:  # closed before the body was all sent
            return f"closed ({type(getattr(error, 'reason', error)).__name__})"

    def burst() -> str:
        answers: Counter[str] = Counter()
        lock = threading.Lock()

        def one() -> None:
            answer = generate([rng.randrange(4, vocab) for _ in range(8)], max_new_tokens=4, ignore_eos=True)
            with lock:
                answers[answer] += 1

        threads = [threading.Thread(target=one) for _ in range(3 * ABUSER_MAX_CONCURRENT)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return " ".join(f"{answer}×{count}" for answer, count in sorted(answers.items()))

    abuses = {
        "oversized body, no token": oversized_body,
        "max-size prompt": lambda: generate([rng.randrange(4, vocab) for _ in range(max_model_len - 1)],
                                            max_new_tokens=1),
        "whole vocabulary as stop ids": lambda: generate([rng.randrange(4, vocab) for _ in range(16)],
                                                         max_new_tokens=16, min_tokens=8,
                                                         stop_token_ids=list(range(vocab)), temperature=1.0),
        "burst past its limits": burst,
    }
    chosen = [name for name in abuses if any(word in name for word in args.abuses.split(","))]
    while time.monotonic() < deadline:
        name = rng.choice(chosen)
        answer = abuses[name]()
        with results.lock:
            if name == "burst past its limits":
                for part in answer.split():
                    status, _, count = part.partition("×")
                    results.abuses[f"{name}: {status}"] += int(count)
            else:
                results.abuses[f"{name}: {answer}"] += 1


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=150.0, help="how long clients start new requests")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default="tiny", help="'tiny' or a local Hugging Face checkpoint directory")
    parser.add_argument("--kv-cache-bytes", default="2MiB",
                        help="pool budget; small so that 64 streams cannot all fit (tiny model: 8 KiB a block)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=parse_range, default=(8, 256), help="LOW:HIGH, uniform")
    parser.add_argument("--new-tokens", type=parse_range, default=(8, 192), help="LOW:HIGH, uniform")
    parser.add_argument("--cancel-fraction", type=float, default=0.10)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where logs and port files go (default: a temp dir)")
    parser.add_argument("--abusive-concurrency", type=int, default=0,
                        help="clients of an abusive tenant; > 0 runs the normal clients alone, then beside them")
    parser.add_argument("--abuser-kv-blocks", type=int, default=32, help="the abusive tenant's kv_blocks share")
    parser.add_argument("--abuser-tokens-per-s", type=int, default=512,
                        help="the abusive tenant's compute budget (--api-keys max_tokens_per_s: one max-size prompt "
                             "of the default --max-model-len a second); 0: none")
    parser.add_argument("--abuser-requests-per-s", type=int, default=8,
                        help="the abusive tenant's and the grammar bomber's request rate (--api-keys "
                             "max_requests_per_s); 0: none")
    parser.add_argument("--abuses", default="body,prompt,stop,burst",
                        help="which abuses to run, by a word of their name (body, prompt, stop, burst), comma-separated")
    parser.add_argument("--abusive-body-bytes", type=int, default=32 * 1024 * 1024,
                        help="size of the oversized HTTP bodies the abusive tenant sends without a token")
    parser.add_argument("--rounds", type=int, default=1,
                        help="two tenants: the runs alone and beside the abusive tenant take turns this many times")
    parser.add_argument("--pin", action="store_true",
                        help="two tenants: the services on CPU 0 (the model service with --threads 1), the clients "
                             "on CPU 1, the abusive ones at nice 19: the server has a core of its own and the "
                             "abusers' own CPU stands for other machines', as in a deployment")
    parser.add_argument("--abuse", action="store_true",
                        help="the abuse soak (checks/abuse_soak.py): two normal tenants alone and beside an abusive "
                             "tenant (--abusive-concurrency clients), a replay flooder and a grammar bomber, in turns")
    parser.add_argument("--replay-flooders", type=int, default=8,
                        help="abuse soak: DEALER sockets flooding the KV-event replay socket, a loopback address each")
    parser.add_argument("--grammar-bombers", type=int, default=2,
                        help="abuse soak: clients posting deep JSON schemas, each new")
    parser.add_argument("--probe-interval-s", type=float, default=0.05,
                        help="abuse soak: seconds between the cache-service probe's rounds of calls")
    parser.add_argument("--requests", type=int, default=0,
                        help="> 0: the memory soak (checks/memory_soak.py), this many requests of mixed shapes")
    parser.add_argument("--sample-every", type=int, default=500, help="memory soak: requests between RSS samples")
    parser.add_argument("--from-request", type=int, default=1000,
                        help="memory soak: RSS growth is measured from the first sample at or past this request")
    parser.add_argument("--max-growth", type=float, default=0.02,
                        help="memory soak: exit 1 if the model service's RssAnon grew by this fraction or more")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="memory soak: new tokens, 1 to this")
    parser.add_argument("--model-flags", default="",
                        help="memory soak: more flags for the model service, one string (e.g. '--malloc-arena-max 0')")
    parser.add_argument("--model-env", action="append", default=[], metavar="NAME=VALUE",
                        help="memory soak: an environment variable for the model service (e.g. LD_PRELOAD=...); "
                             "may be repeated")
    args = parser.parse_args()
    if args.requests:
        from checks import memory_soak

        if args.kv_cache_bytes == parser.get_default("kv_cache_bytes"):
            args.kv_cache_bytes = "64MiB"
        return memory_soak.run(args)
    if args.abuse:
        from checks import abuse_soak

        return abuse_soak.run(args)
    if args.abusive_concurrency:
        return two_tenants(args)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedkv-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shm_dir = workdir / "shm"
    shm_dir.mkdir(exist_ok=True)
    # Started from this (main) thread: the children get PR_SET_PDEATHSIG for it.
    with start_cache_service(workdir, "--kv-cache-bytes", args.kv_cache_bytes, "--shm-dir", shm_dir) as cache, \
            start_model_service(workdir, cache.address, "--model", args.model,
                                "--max-model-len", args.max_model_len) as model:
        channel = grpc.insecure_channel(model.address)
        stub = model_pb2_grpc.ModelServiceStub(channel)
        cache_stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
        info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10)
        results = Results()
        started = time.monotonic()
        deadline = started + args.duration_s
        threads = [
            threading.Thread(target=client, args=(stub, args, random.Random(args.seed * 1000 + i),
                                                  min(info.vocab_size, 256), deadline, results), daemon=True)
            for i in range(args.concurrency)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started

        # Leases go back with the engine's next lease call: poll briefly, then report what is left.
        cache_stats = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        settle_until = time.monotonic() + 5
        while cache_stats.blocks_leased and time.monotonic() < settle_until:
            time.sleep(0.05)
            cache_stats = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10)
        preemptions = metric(model.metrics_url, "pagedkv_model_preemptions_total")
        sizing = cache_stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)

    rows = [
        ("model", f"{info.model_id} ({info.dtype} on {info.device})"),
        ("pool", f"{sizing.num_blocks} blocks × {sizing.block_size} tokens = {sizing.max_total_tokens} tokens "
                 f"(--kv-cache-bytes {args.kv_cache_bytes})"),
        ("concurrent streams", str(args.concurrency)),
        ("duration (s)", f"{elapsed:.1f} (new requests for {args.duration_s:g})"),
        ("prompt / new tokens", f"uniform {args.prompt_tokens[0]}–{args.prompt_tokens[1]} / "
                                f"{args.new_tokens[0]}–{args.new_tokens[1]}"),
        ("requests completed", str(results.completed)),
        ("requests cancelled by the client", f"{results.cancelled} (p = {args.cancel_fraction:g})"),
        ("requests failed", ", ".join(f"{k}: {v}" for k, v in results.errors.items()) or "0"),
        ("tokens generated", str(results.tokens)),
        ("throughput (tokens/s)", f"{results.tokens / elapsed:.0f}"),
        ("time to first token p50 / p99 (ms)",
         f"{percentile(results.ttft, 0.5) * 1e3:.1f} / {percentile(results.ttft, 0.99) * 1e3:.1f}"),
        ("inter-token latency p50 / p99 (ms)",
         f"{percentile(results.itl, 0.5) * 1e3:.2f} / {percentile(results.itl, 0.99) * 1e3:.2f}"),
        ("preemptions (pagedkv_model_preemptions_total)", f"{preemptions:.0f}"),
        ("blocks leased after all clients finished", str(cache_stats.blocks_leased)),
        ("sequences / sessions left", f"{cache_stats.sequences} / {cache_stats.sessions}"),
    ]
    print("| measure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\nlogs: {workdir}", file=sys.stderr)
    return 1 if cache_stats.blocks_leased or results.errors else 0


def settled_stats(cache_stub, metadata=None) -> cache_pb2.CacheStats:
    """GetStats once the last releases are in: they go with the engine's next lease call."""
    stats = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=metadata)
    settle_until = time.monotonic() + 5
    while stats.blocks_leased and time.monotonic() < settle_until:
        time.sleep(0.05)
        stats = cache_stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=metadata)
    return stats


def label_samples(url: str, name: str, label: str = "tenant") -> dict[str, float]:
    """One metric's samples by one of their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {sample.labels.get(label, ""): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def abusers(model_address: str, http_url: str, args, seeds: list[int], vocab: int, max_model_len: int,
            deadline: float, answers) -> None:
    """A process of its own for the abusive clients (one thread each): the bodies they build
    and the bursts they start must not hold the measuring clients' GIL."""
    if args.pin:
        os.nice(19)
    stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model_address))
    results = Results()
    threads = [threading.Thread(target=abuser, args=(stub, http_url, args, random.Random(seed), vocab, max_model_len,
                                                     deadline, results)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    answers.put((dict(results.abuses), usage.ru_utime + usage.ru_stime))


def run_phase(model, args, vocab: int, max_model_len: int, abusive: int) -> tuple[Results, Results, float]:
    """The normal tenant's clients, and `abusive` clients of the abusive one, for --duration-s.
    Results.cpu: the model service's CPU seconds meanwhile, and the abusive clients'."""
    normal, abuses = Results(), Results()
    server_cpu = cpu_seconds(model.pid)
    stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
    process = None
    if abusive:  # started first: a new interpreter takes a second or two to import
        context = multiprocessing.get_context("spawn")
        answers = context.Queue()
        seeds = [args.seed * 1000 + 500 + i for i in range(abusive)]
        process = context.Process(target=abusers, args=(model.address, model.http_url, args, seeds, vocab,
                                                        max_model_len, time.monotonic() + args.duration_s, answers))
        process.start()
    started = time.monotonic()
    deadline = started + args.duration_s
    threads = [threading.Thread(target=client, args=(stub, args, random.Random(args.seed * 1000 + i), vocab, deadline,
                                                     normal, bearer_metadata(NORMAL_KEY)), daemon=True)
               for i in range(args.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    normal.cpu = cpu_seconds(model.pid) - server_cpu
    if process is not None:
        answered, abuses.cpu = answers.get(timeout=args.request_timeout_s)
        abuses.abuses.update(answered)
        process.join()
    return normal, abuses, elapsed


def pin_services(pin: bool) -> list[str]:
    """--pin, before the services start: they inherit CPU 0 from this process. Returns the
    model service's flags for it (one compute thread, on that core)."""
    if not pin:
        return []
    os.sched_setaffinity(0, {0})
    return ["--threads", "1"]


def pin_clients(pin: bool) -> None:
    """--pin, once the services run: this process (the clients) moves to CPU 1."""
    if pin:
        os.sched_setaffinity(0, {1})


def abuser_limits(args) -> dict:
    """The abusive tenant's entry in the --api-keys file."""
    return {"tenant": "abuser", "max_concurrent_requests": ABUSER_MAX_CONCURRENT, "max_queued_requests": 2,
            "kv_blocks": args.abuser_kv_blocks, "max_tokens_per_s": args.abuser_tokens_per_s,
            "max_requests_per_s": args.abuser_requests_per_s}


def two_tenants(args) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pagedkv-soak-tenants-"))
    workdir.mkdir(parents=True, exist_ok=True)
    shm_dir = workdir / "shm"
    shm_dir.mkdir(exist_ok=True)
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({
        NORMAL_KEY: {"tenant": "normal"},
        ABUSER_KEY: abuser_limits(args),
    }))
    metadata = bearer_metadata(NORMAL_KEY)
    pinned = pin_services(args.pin)
    with start_cache_service(workdir, "--kv-cache-bytes", args.kv_cache_bytes, "--shm-dir", shm_dir) as cache, \
            start_model_service(workdir, cache.address, "--model", args.model, "--max-model-len", args.max_model_len,
                                "--api-keys", keys, *pinned) as model:
        pin_clients(args.pin)
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        cache_stub = cache_pb2_grpc.CacheServiceStub(grpc.insecure_channel(cache.address))
        info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10, metadata=metadata)
        vocab = min(info.vocab_size, 256)
        runs: dict[str, list] = {"alone": [], "beside": []}
        for round_index in range(args.rounds):
            for name, abusive in (("alone", 0), ("beside", args.abusive_concurrency)):
                normal, abuses, elapsed = run_phase(model, args, vocab, info.max_model_len, abusive)
                runs[name].append((normal, abuses, elapsed, settled_stats(cache_stub)))
                print(f"round {round_index + 1} {name}: {normal.tokens / elapsed:.0f} tokens/s, "
                      f"ITL p99 {percentile(normal.itl, 0.99) * 1e3:.2f} ms", file=sys.stderr, flush=True)
        preempted = label_samples(model.metrics_url, "pagedkv_model_tenant_preemptions_total")
        peaks = label_samples(model.metrics_url, "pagedkv_model_tenant_kv_blocks_peak")
        deferred = label_samples(model.metrics_url, "pagedkv_model_tenant_budget_deferred_steps_total")
        sizing = cache_stub.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)

    def rate(run) -> float:
        return run[0].tokens / run[2]

    def itl_p99_ms(run) -> float:
        return percentile(run[0].itl, 0.99) * 1e3

    print(f"pool: {sizing.num_blocks} blocks × {sizing.block_size} tokens; model {info.model_id}; "
          f"{args.concurrency} normal clients, {args.abusive_concurrency} abusive ones, {args.duration_s:g} s a run, "
          f"{args.rounds} round(s) in turns{', pinned (--pin)' if args.pin else ''}\n")
    print("| normal tenant, median of rounds | alone | beside the abusive tenant | change | every round (alone / beside) |\n"
          "| --- | --- | --- | --- | --- |")
    for label, measure, unit in (("throughput (tokens/s)", rate, "{:.0f}"),
                                 ("inter-token latency p99 (ms)", itl_p99_ms, "{:.2f}")):
        before, after = (statistics.median(measure(run) for run in runs[name]) for name in ("alone", "beside"))
        every = ", ".join(f"{unit.format(measure(a))} / {unit.format(measure(b))}"
                          for a, b in zip(runs["alone"], runs["beside"]))
        print(f"| {label} | {unit.format(before)} | {unit.format(after)} | "
              f"{100 * (after - before) / before:+.1f} % | {every} |")
    alone = [run[0] for run in runs["alone"]]
    beside = [run[0] for run in runs["beside"]]
    for label, pick in (
        ("time to first token p99 (ms)", lambda r: f"{percentile(r.ttft, 0.99) * 1e3:.1f}"),
        ("requests completed / cancelled", lambda r: f"{r.completed} / {r.cancelled}"),
        ("requests failed", lambda r: ", ".join(f"{k}: {v}" for k, v in r.errors.items()) or "0"),
        ("model service CPU (s)", lambda r: f"{r.cpu:.1f}"),
    ):
        print(f"| {label} (every round) | {', '.join(map(pick, alone))} | {', '.join(map(pick, beside))} | | |")
    abuses = Results()
    for _, answered, _, _ in runs["beside"]:
        abuses.abuses.update(answered.abuses)
        abuses.cpu += answered.cpu
    leased = max(run[3].blocks_leased for name in runs for run in runs[name])
    print(f"\nthe abusive clients' own CPU: {abuses.cpu:.1f} s (a process of their own); "
          f"preemptions by tenant: {preempted}; peak KV blocks by tenant: {peaks}; steps its compute budget "
          f"(--abuser-tokens-per-s {args.abuser_tokens_per_s}) deferred a tenant's tokens in: {deferred}; "
          f"most blocks leased after a run: {leased}\n")
    print("| abuse: answer | count |\n| --- | --- |")
    for name, count in sorted(abuses.abuses.items()):
        print(f"| {name} | {count} |")
    print(f"\nlogs: {workdir}", file=sys.stderr)
    return 1 if leased or any(r.errors for r in alone + beside) else 0


if __name__ == "__main__":
    sys.exit(main())
