"""The scheduler against a model of step time: TTFT and ITL of `vllm bench serve`'s
workloads under each prefill cap and prefill order, with no model and no noise.

The real Scheduler (model_service/sched/scheduler.py) runs as the engine drives it: the
lease call a step sends is answered at the next step (so an admitted prompt prefills a
step after its allocation), a cache service with room for everything answers it and
shares committed or released full blocks as prefix cache (exact token match). A step
takes `a0 + a1 * decodes + b * prefill tokens` milliseconds; the defaults come from
bench/engine/step_time_vs_chunk.py and the ITL p50 / p99 that issue 29 measured (BENCHMARKS.md,
"Issue 29"). Clients behave as `vllm bench serve --max-concurrency C` with no request
rate: C requests at once, each next one sent when one ends.

    .venv/bin/python -m bench.engine.sched_sim [--caps 0,512,256,128,64] [--orders scheduler,admitted,shortest]
        [--a0 48 --a1 1.3 --b 0.9] [--workloads random1,random8,random32,prefix16] [--admit-now] [--aging N]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import random
import statistics
import sys
from collections.abc import Callable

from model_service.sample.params import SamplingOptions
from model_service.sched.lease_ops import (
    Allocated, Committed, Extended, Forked, LeaseAnswer, Released, blocks_for,
)
from model_service.sched.scheduler import Scheduler, SchedulerLimits
from model_service.sched.sequence import Sequence
from model_service.sched.step import StepOutput

BLOCK = 16
NUM_BLOCKS = 5000  # 2 GiB of SmolLM2 bfloat16 K/V is ~5,800 blocks of 16


class RoomyCache:
    """Answers every op; shares committed and released full blocks by exact token prefix."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.lease_ids = itertools.count(1)
        self.block_ids = itertools.count()

    def _register(self, token_ids, tokens: int) -> None:
        for end in range(BLOCK, tokens - tokens % BLOCK + 1, BLOCK):
            self.cached.add(tuple(token_ids[:end]))

    def answer(self, ops):
        outcomes = []
        for fork in ops.forks:
            outcomes.append(Forked(next(self.lease_ids), tuple(itertools.islice(self.block_ids, 64))))
        for release in ops.releases:
            self._register(release.cached_token_ids, len(release.cached_token_ids))
            outcomes.append(Released())
        for seq, tokens in ops.extends:
            more = blocks_for(tokens, BLOCK) - len(seq.block_table)
            outcomes.append(Extended(tuple(itertools.islice(self.block_ids, max(more, 0)))))
        for seq, tokens in ops.commits:
            self._register(seq.token_ids, tokens)
            outcomes.append(Committed())
        for seq in ops.allocations:
            cached = 0
            # The last prompt token is always computed: its logits give the first token.
            for end in range(BLOCK, len(seq.token_ids), BLOCK):
                if tuple(seq.token_ids[:end]) not in self.cached:
                    break
                cached = end
            need = blocks_for(len(seq.token_ids), BLOCK)
            outcomes.append(Allocated(next(self.lease_ids), tuple(itertools.islice(self.block_ids, need)), cached))
        for seq, tokens in ops.top_ups:
            more = blocks_for(tokens, BLOCK) - len(seq.block_table)
            outcomes.append(Extended(tuple(itertools.islice(self.block_ids, max(more, 0)))))
        return LeaseAnswer.of(ops, outcomes, NUM_BLOCKS)


def random_prompts(count: int, seed: int) -> list[tuple[list[int], int]]:
    """vllm bench serve --dataset-name random --random-input-len 256 --random-range-ratio 0.5
    --random-output-len 128: prompts of 128-384 tokens, 128 out."""
    rng = random.Random(seed)
    return [([rng.randrange(100, 49000) for _ in range(rng.randint(128, 384))], 128) for _ in range(count)]


def prefix_prompts(count: int, seed: int) -> list[tuple[list[int], int]]:
    """--dataset-name prefix_repetition: 8 prefixes of 512 tokens, suffixes of 64, 64 out."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 49000) for _ in range(512)] for _ in range(8)]
    prompts = [(prefixes[i % 8] + [rng.randrange(100, 49000) for _ in range(64)], 64) for i in range(count)]
    rng.shuffle(prompts)
    return prompts


WORKLOADS: dict[str, tuple[Callable, int, int]] = {  # name: (prompts, requests, concurrency)
    "random1": (random_prompts, 16, 1), "random8": (random_prompts, 64, 8), "random32": (random_prompts, 64, 32),
    "random32x256": (random_prompts, 256, 32), "prefix16": (prefix_prompts, 64, 16),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def simulate(prompts, concurrency: int, cap: int, order: str, a0: float, a1: float, b: float,
             admit_now: bool = False, aging: int | None = None, hold: int | None = None) -> dict:
    limits = SchedulerLimits(block_size=BLOCK, max_num_seqs=64, max_batch_tokens=2048, lookahead_tokens=BLOCK,
                             max_model_len=1024, max_prefill_tokens_while_decoding=cap)
    if hold is not None:
        limits = dataclasses.replace(limits, prefix_hold_min_tokens=hold)
    if aging is not None:
        limits = dataclasses.replace(limits, prefill_aging_tokens=aging)
    scheduler = Scheduler(limits, NUM_BLOCKS)
    if order == "shortest":  # fewest prompt tokens left first, not aged
        scheduler.policy.prefill_order = lambda running: sorted((seq for seq in running if seq.num_uncomputed > 1),
                                                                key=lambda seq: (seq.num_uncomputed, seq.arrival))
    elif order == "admitted":  # first come, first chunked
        scheduler.policy.prefill_order = lambda running: [seq for seq in running if seq.num_uncomputed > 1]
    cache = RoomyCache()
    arrivals: dict[str, float] = {}
    tokens_at: dict[str, list[float]] = {}
    queue = list(enumerate(prompts))
    seqs: dict[str, Sequence] = {}
    now, pending, started = 0.0, None, 0

    def send(count: int) -> None:
        nonlocal started
        for _ in range(min(count, len(queue))):
            index, (prompt, out) = queue.pop(0)
            request_id = f"r{index}"
            seqs[request_id] = Sequence(request_id=request_id, token_ids=list(prompt), prompt_len=len(prompt),
                                        options=SamplingOptions(max_new_tokens=out, ignore_eos=True), arrival=index)
            scheduler.add(seqs[request_id])
            arrivals[request_id], tokens_at[request_id] = now, []
            started += 1

    send(concurrency)
    while scheduler.has_work() or pending is not None:
        if pending is not None:
            scheduler.apply(*pending)
            scheduler.take_copies()
        step = scheduler.schedule()
        if admit_now and step.lease_ops.allocations and step.batch:
            # What the engine would do if it waited for a step's allocations (a loopback
            # call) before running it: the new prompts join this step, not the next.
            scheduler.apply(step.lease_ops, cache.answer(step.lease_ops))
            step = scheduler.schedule()
        pending = (step.lease_ops, cache.answer(step.lease_ops)) if step.lease_ops else None
        if not step.batch:
            continue  # waits only for its lease call: loopback, about a millisecond
        decodes = sum(1 for _, n in step.batch if n == 1)
        now += a0 + a1 * decodes + b * sum(n for _, n in step.batch if n > 1)
        sampled = [(seq, 7) for seq, n in step.batch if seq.num_computed + n == len(seq.token_ids)]
        for seq, _ in sampled:
            tokens_at[seq.request_id].append(now)
        finished = scheduler.update_from_output(step, StepOutput(sampled=sampled))
        send(len(finished))
    ttft = [times[0] - arrivals[rid] for rid, times in tokens_at.items()]
    itl = [later - earlier for times in tokens_at.values() for earlier, later in itertools.pairwise(times)]
    total = sum(len(times) for times in tokens_at.values())
    prefill = sum(len(prompt) for prompt, _ in prompts) - sum(seq.cached_tokens for seq in seqs.values())
    return {"prefill": prefill, "tok_s": 1e3 * total / now, "ttft50": statistics.median(ttft),
            "ttft99": percentile(ttft, 99), "itl50": statistics.median(itl), "itl99": percentile(itl, 99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0,512,256,128,64", help="max_prefill_tokens_while_decoding values (0: none)")
    parser.add_argument("--orders", default="scheduler,admitted,shortest",
                        help="scheduler: its own (shortest first, aged); admitted: first come, first chunked; "
                             "shortest: fewest prompt tokens left first, not aged")
    parser.add_argument("--workloads", default="random1,random8,random32,prefix16", help=", ".join(WORKLOADS))
    parser.add_argument("--a0", type=float, default=48.0, help="ms of a step, fixed")
    parser.add_argument("--a1", type=float, default=1.3, help="ms a decoding stream adds to a step")
    parser.add_argument("--b", type=float, default=0.9, help="ms a prefill token adds to a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aging", type=int, default=None, help="the scheduler's prefill_aging_tokens (default: its own)")
    parser.add_argument("--holds", default=None,
                        help="prefix_hold_min_tokens values to compare, e.g. 0,32 (default: the scheduler's own)")
    parser.add_argument("--admit-now", action="store_true",
                        help="a step that admits waits for those allocations and runs their prompts at once")
    args = parser.parse_args()
    print(f"step = {args.a0} + {args.a1} x decodes + {args.b} x prefill tokens (ms)\n")
    print("| workload | cap | order | prefix hold | prompt tokens computed | output tok/s | TTFT p50 | TTFT p99 "
          "| ITL p50 | ITL p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    holds = [int(h) for h in args.holds.split(",")] if args.holds else [None]
    for name in args.workloads.split(","):
        make, count, concurrency = WORKLOADS[name]
        prompts = make(count, args.seed)
        for cap in (int(c) for c in args.caps.split(",")):
            for order in args.orders.split(","):
                for hold in holds:
                    r = simulate(prompts, concurrency, cap, order, args.a0, args.a1, args.b, args.admit_now,
                                 args.aging, hold)
                    print(f"| {name} | {cap or 'none'} | {order} | {'own' if hold is None else hold} | "
                          f"{r['prefill']} | {r['tok_s']:.1f} | {r['ttft50']:.0f} | {r['ttft99']:.0f} | "
                          f"{r['itl50']:.0f} | {r['itl99']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
