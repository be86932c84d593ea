"""Lease-call latency while the host tier demotes: does write-behind demotion stall Lease calls?

One cache service, SmolLM2-135M's KV geometry in bfloat16 (30 layers x 3 KV heads x
head_dim 64: 368 KiB a 16-token block). A client leases a 256-token prompt (16 blocks) and
releases it into the prefix cache, over and over, each prompt new: every release queues 16
blocks for demotion, so the background task copies about 6 MiB behind every pair of calls
while the next calls arrive. Each Lease call's round trip is timed at the client; the same
loop runs against a service without tiers, in turns.

    .venv/bin/python bench/bench_tier_lease.py [--iterations 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cache_helpers import allocate, attach, cache_stub, lease, release, stats  # noqa: E402
from processes import start_cache_service  # noqa: E402

from pagedkv.cache.v1 import cache_pb2  # noqa: E402

GEOMETRY = dict(num_layers=30, num_kv_heads=3, head_dim=64, dtype=cache_pb2.DTYPE_BFLOAT16, device="cpu")
PROMPT_TOKENS = 256


def run(address: str, iterations: int) -> dict:
    stub = cache_stub(address)
    session = attach(stub, "bench", max_model_len=2048, **GEOMETRY).session_id
    times = []
    for index in range(iterations):
        prompt = [(index * PROMPT_TOKENS + position) % 30000 + 1 for position in range(PROMPT_TOKENS)]
        started = time.perf_counter()
        [allocated] = lease(stub, session, allocate(PROMPT_TOKENS + 16, prompt)).results
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        lease(stub, session, release(allocated.sequence_id, cache_prefix=True, token_ids=prompt))
        times.append(time.perf_counter() - started)
    lease_seconds = sum(times)
    demoted, previous = -1, -2
    while demoted != previous:  # until the demotions behind the calls are done
        time.sleep(0.5)
        host = [tier for tier in stats(stub).tiers if tier.tier == "host"]
        previous, demoted = demoted, host[0].demotions if host else 0
    times.sort()
    return {
        "p50_ms": 1000 * statistics.median(times),
        "p99_ms": 1000 * times[int(0.99 * len(times))],
        "max_ms": 1000 * times[-1],
        "lease_seconds": lease_seconds,
        "demotions": host[0].demotions if host else 0,
        "demote_seconds": host[0].seconds_in if host else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    pool = ["--kv-cache-bytes", "200MiB", "--max-blocks", "512"]
    configs = [("pool", pool), ("pool+host", [*pool, "--host-cache-bytes", "256MiB"])]
    print(f"{'round':>5} {'config':<10} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'calls s':>7} {'demoted':>8} "
          f"{'copy s':>7}")
    for round_index in range(args.rounds):
        for name, cache_args in configs:
            with tempfile.TemporaryDirectory() as tmp, start_cache_service(Path(tmp), *cache_args) as cache:
                row = run(cache.address, args.iterations)
            print(f"{round_index:>5} {name:<10} {row['p50_ms']:>7.2f} {row['p99_ms']:>7.2f} {row['max_ms']:>7.2f} "
                  f"{row['lease_seconds']:>7.2f} {row['demotions']:>8} {row['demote_seconds']:>7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
