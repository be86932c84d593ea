"""One batched Lease call for 64 sequences over loopback gRPC, against an empty RPC.

Starts the cache service as a real process, attaches, then times (median and p99):
  - GetStats with nothing to count, as the empty-RPC baseline of this machine;
  - one Lease call allocating 64 sequences of 16 blocks each, and one releasing them
    (allocate+release alternate so the pool never fills).

    .venv/bin/python -m bench.cache.bench_lease_grpc [--iterations 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.cache_helpers import allocate, attach, cache_stub, release
from harness.processes import start_cache_service

from pagedkv.cache.v1 import cache_pb2

SEQUENCES = 64
TOKENS = 256  # 16 blocks of 16 tokens


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            start_cache_service(Path(tmp), "--kv-cache-bytes", "64MiB", "--headroom", "0") as cache:
        stub = cache_stub(cache.address)
        session = attach(stub, max_model_len=256).session_id
        empty, allocate_s, release_s = [], [], []
        stats_request = cache_pb2.GetStatsRequest()
        allocate_request = cache_pb2.LeaseRequest(session_id=session, ops=[allocate(TOKENS)] * SEQUENCES)
        for _ in range(args.iterations):
            started = time.perf_counter()
            stub.GetStats(stats_request)
            empty.append(time.perf_counter() - started)

            started = time.perf_counter()
            reply = stub.Lease(allocate_request)
            allocate_s.append(time.perf_counter() - started)
            assert all(r.status == cache_pb2.LEASE_STATUS_OK for r in reply.results)

            release_request = cache_pb2.LeaseRequest(
                session_id=session, ops=[release(r.sequence_id) for r in reply.results])
            started = time.perf_counter()
            stub.Lease(release_request)
            release_s.append(time.perf_counter() - started)
    print(f"{args.iterations} iterations, {SEQUENCES} sequences × {TOKENS // 16} blocks per call\n")
    print("| call | median | p99 |")
    print("| --- | --- | --- |")
    for name, samples in (("empty RPC (GetStats)", empty), (f"Lease: allocate {SEQUENCES} sequences", allocate_s),
                          (f"Lease: release {SEQUENCES} sequences", release_s)):
        print(f"| {name} | {statistics.median(samples) * 1e3:.3f} ms | {percentile(samples, 0.99) * 1e3:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
