"""TTFT and ITL of the engine alone under `vllm bench serve`'s random workload, for several
values of --max-prefill-tokens-while-decoding, in turns on one loaded engine.

The engine runs in this process against a real cache service (inprocess_engine.py), no
HTTP or gRPC: prompts of 128-384 random token ids, --new-tokens out, eos ignored, greedy,
--concurrency at a time (the next sent when one ends, as `vllm bench serve
--max-concurrency` does). Between runs only the scheduler's prefill cap changes; each
round runs every cap once, each on prompts of the round's lengths and tokens of its own (no
prefix-cache hits between runs), who goes first rotating. TTFT is from submit to
the first delta, ITL the gap between one delta and the next of a request (a delta is a
step's token here), both in milliseconds; the table gives the median over rounds.

    .venv/bin/python -m bench.engine.engine_itl [--caps 0,512,256] [--requests 48] [--concurrency 32]
        [--new-tokens 128] [--rounds 1] [--threads 2] [--model smollm2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench.engine.inprocess_engine import engine_in_process, load_in_passing_thread


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def metrics(result: dict) -> dict[str, float]:
    ttft = [1e3 * (stamps[1] - stamps[0]) for stamps in result["times"]]
    itl = [1e3 * (later - earlier) for stamps in result["times"] for earlier, later in itertools.pairwise(stamps[1:])]
    return {"tok/s": result["tokens"] / result["seconds"], "TTFT p50": statistics.median(ttft),
            "TTFT p99": percentile(ttft, 99), "ITL p50": statistics.median(itl), "ITL p99": percentile(itl, 99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0,512,256", help="--max-prefill-tokens-while-decoding values (0: none)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, a .gguf or a checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    caps = [int(cap) for cap in args.caps.split(",")]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows: dict[int, list[dict[str, float]]] = {cap: [] for cap in caps}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_in_passing_thread(args.model, dtype)
        vocab = loaded.config.vocab_size

        def prompts(round_index: int, draw: int) -> list[tuple[list[int], int]]:
            """The round's prompt lengths, with tokens of their own for each draw: no run
            finds another's prompts in the prefix cache."""
            lengths, tokens = random.Random(round_index), random.Random(1000 * round_index + draw)
            return [([tokens.randrange(3, vocab) for _ in range(lengths.randint(128, 384))], args.new_tokens)
                    for _ in range(args.requests)]

        with engine_in_process(loaded, dtype, Path(tmp)) as run:
            engine = run.engine
            run(prompts(-1, 0)[:4])  # warm up, on prompts no round uses
            for round_index in range(args.rounds):
                shift = round_index % len(caps)
                for draw, cap in enumerate(caps[shift:] + caps[:shift]):
                    work = prompts(round_index, draw)
                    scheduler = engine.scheduler
                    scheduler.limits = dataclasses.replace(scheduler.limits, max_prefill_tokens_while_decoding=cap)
                    row = metrics(run(work, args.concurrency))
                    rows[cap].append(row)
                    print(f"  round {round_index + 1} cap {cap or 'none'}: " +
                          ", ".join(f"{key} {value:.0f}" for key, value in row.items()), flush=True)

    load = os.getloadavg()
    print(f"\n{args.model} {args.dtype}, engine alone, {args.threads} threads, {args.requests} requests of 128-384 "
          f"prompt tokens and {args.new_tokens} new at concurrency {args.concurrency}, median of {args.rounds} "
          f"round(s); load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    keys = list(next(iter(rows.values()))[0])
    print("| prefill cap while decoding | " + " | ".join(keys) + " |")
    print("| --- | " + " | ".join("---" for _ in keys) + " |")
    for cap in caps:
        print(f"| {cap or 'none'} | " + " | ".join(f"{statistics.median(r[k] for r in rows[cap]):,.0f}"
                                                   for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
