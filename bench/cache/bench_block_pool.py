"""In-process benchmark of the block pool and lease ledger (no gRPC, no torch).

    .venv/bin/python -m bench.cache.bench_block_pool

Measures:
- allocate + release throughput, sequences of 16 blocks, counted in blocks per second
  (each block is both leased and given back once): goal >= 1,000,000 blocks/s;
- the same with the prefix cache in play (release with cache_prefix, so allocation
  evicts cached blocks);
- prefix lookup of a cached 2,048-token prompt at block size 16 (127 full blocks reused,
  the block holding the last prompt token is never reused): goal <= 100 µs median.
"""

from __future__ import annotations

import random
import statistics
import time

from cache_service.core.ledger import Ledger

BLOCK_SIZE = 16
BLOCKS_PER_SEQUENCE = 16


def bench_allocate_release(num_blocks: int, live: int, rounds: int) -> float:
    """Blocks/s for allocate + release of 16-block sequences, ``live`` sequences in flight."""
    ledger = Ledger(num_blocks, BLOCK_SIZE)
    num_tokens = BLOCK_SIZE * BLOCKS_PER_SEQUENCE
    allocate, release = ledger.allocate, ledger.release
    window = [allocate("bench", num_tokens).sequence_id for _ in range(live)]
    start = time.perf_counter()
    for index in range(rounds):
        release("bench", window[index % live])
        window[index % live] = allocate("bench", num_tokens).sequence_id
    elapsed = time.perf_counter() - start
    ledger.check_invariants()
    return rounds * BLOCKS_PER_SEQUENCE / elapsed


def bench_allocate_release_cached(num_blocks: int, rounds: int) -> float:
    """Blocks/s when every release registers its blocks as prefix cache.

    256 distinct prompts of 16 blocks are twice what a 2,048-block pool holds, so most
    allocations evict cached blocks and most releases register new ones.
    """
    ledger = Ledger(num_blocks, BLOCK_SIZE)
    num_tokens = BLOCK_SIZE * BLOCKS_PER_SEQUENCE
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(32000) for _ in range(num_tokens)) for _ in range(256)]
    allocate, release = ledger.allocate, ledger.release
    start = time.perf_counter()
    for index in range(rounds):
        tokens = prompts[index % 256]
        sequence_id = allocate("bench", num_tokens).sequence_id
        release("bench", sequence_id, True, tokens)
    elapsed = time.perf_counter() - start
    ledger.check_invariants()
    return rounds * BLOCKS_PER_SEQUENCE / elapsed


def bench_prefix_lookup(prompt_len: int, repeats: int) -> tuple[float, float, float, int]:
    """Lookup median and p90 µs, ``allocate`` median µs with a fully cached prompt, cached tokens."""
    ledger = Ledger(4096, BLOCK_SIZE)
    rng = random.Random(1)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    first = ledger.allocate("bench", prompt_len, prompt)
    ledger.release("bench", first.sequence_id, cache_prefix=True, token_ids=prompt)
    lookup = ledger.pool.lookup
    max_blocks = (prompt_len - 1) // BLOCK_SIZE
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hits = lookup(prompt, max_blocks)
        times.append(time.perf_counter() - start)
    assert len(hits) == max_blocks
    lookup_median = statistics.median(times) * 1e6
    lookup_p90 = statistics.quantiles(times, n=10)[-1] * 1e6
    alloc_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        allocation = ledger.allocate("bench", prompt_len, prompt)
        alloc_times.append(time.perf_counter() - start)
        ledger.release("bench", allocation.sequence_id)
    assert allocation.cached_tokens == max_blocks * BLOCK_SIZE
    ledger.check_invariants()
    return lookup_median, lookup_p90, statistics.median(alloc_times) * 1e6, allocation.cached_tokens


def main() -> None:
    rows = []
    rate = max(bench_allocate_release(4096, 64, 100_000) for _ in range(3))
    rows.append(("allocate+release, 16-block sequences", f"{rate:,.0f} blocks/s", ">= 1,000,000 blocks/s"))
    rate = max(bench_allocate_release_cached(2048, 20_000) for _ in range(3))
    rows.append(("  same, release with cache_prefix (evicting)", f"{rate:,.0f} blocks/s", ""))
    lookup_median, lookup_p90, alloc_median, cached = bench_prefix_lookup(2048, 2000)
    rows.append(("prefix lookup, 2,048-token prompt, median", f"{lookup_median:.1f} µs", "<= 100 µs"))
    rows.append(("  p90", f"{lookup_p90:.1f} µs", ""))
    rows.append((f"  allocate with that prompt ({cached} cached tokens), median", f"{alloc_median:.1f} µs", ""))
    width = max(len(row[0]) for row in rows)
    print(f"{'measure':<{width}}  {'result':>20}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:>20}  {goal}")


if __name__ == "__main__":
    main()
