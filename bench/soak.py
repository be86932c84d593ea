"""Bounded soak: both services as real processes, 64 concurrent streams, random cancels.

    .venv/bin/python bench/soak.py                      # tiny model, 150 s, 2 MiB pool
    .venv/bin/python bench/soak.py --duration-s 60 --model /path/to/checkpoint

Each client loops until the duration is over: a random prompt (--prompt-tokens range),
random max_new_tokens (--new-tokens range), sampled at temperature 0.8 with eos ignored
(so lengths are what was asked), and with probability --cancel-fraction it cancels the
call after a random number of tokens. The KV pool is kept small (--kv-cache-bytes) so the
engine must queue and preempt. Measured at the client: time to first token and the gap
between tokens (a message carrying n tokens counts as n gaps of gap/n). At the end, once
every client is done, the cache service must show no leased block. Prints a markdown
table; exits 1 if blocks leaked or a request failed with an unexpected status.

Not run in CI: it takes minutes and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from processes import start_cache_service, start_model_service  # noqa: E402

from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc  # noqa: E402
from pagedkv.model.v1 import model_pb2, model_pb2_grpc  # noqa: E402


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


def client(stub, args, rng: random.Random, vocab: int, deadline: float, results: Results) -> None:
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
        call = stub.Generate(request, timeout=args.request_timeout_s)
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
    args = parser.parse_args()

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


if __name__ == "__main__":
    sys.exit(main())
