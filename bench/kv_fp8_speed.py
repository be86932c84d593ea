"""fp8 KV against bfloat16 KV on SmolLM2 (bfloat16 compute), end to end over gRPC, in turns.

Two stacks stay up side by side (a cache service and a model service each, `--model smollm2
--dtype bfloat16`, one with `--kv-cache-dtype bfloat16`, one with `fp8_e4m3`) and take turns
on the same requests, who goes first alternating by round: W48's shape (48 requests, prompts
8-200, max_new_tokens 8-128) and one stream of 128 tokens after a 32-token prompt, greedy,
eos ignored, new prompt tokens every round (bench_vs_vllm.py's workloads and client).

    .venv/bin/python bench/kv_fp8_speed.py [--rounds 3] [--threads 2] [--kv-cache-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH.parent / "tests"), str(BENCH)]

from bench_generate import workload  # noqa: E402
from bench_vs_vllm import pagedkv_services, rate, redraw, single_stream  # noqa: E402

VOCAB = 49152


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    args = parser.parse_args()
    names = ("bfloat16", args.kv_cache_dtype)
    shapes = {"W48": workload(), "one stream": single_stream(VOCAB)}
    rows = {work: {name: [] for name in names} for work in shapes}
    same = {work: [0, 0] for work in shapes}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        runs = {}
        for name in names:
            (Path(tmp) / name).mkdir()
            runs[name] = stack.enter_context(pagedkv_services(
                Path("smollm2"), "bfloat16", Path(tmp) / name, args.threads, ["--kv-cache-dtype", name]))
            runs[name](redraw(shapes["W48"][:4], -1, VOCAB))  # warm up on prompts no round uses
        for round_index in range(args.rounds):
            for work, shape in shapes.items():
                requests = redraw(shape, round_index, VOCAB)
                order = names if round_index % 2 == 0 else names[::-1]
                results = {name: runs[name](requests) for name in order}
                for name in names:
                    rows[work][name].append(results[name])
                a, b = (results[name]["outputs"] for name in names)
                same[work][0] += sum(x == y for x, y in zip(a, b))
                same[work][1] += len(a)
                print(f"  round {round_index + 1} {work}: " + ", ".join(
                    f"{name} {rate(results[name]):.0f} tok/s" for name in names), flush=True)
    load = os.getloadavg()
    print(f"\n{args.rounds} rounds, {args.threads} threads, SmolLM2 bfloat16 compute; load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print(f"| workload | bfloat16 KV tok/s | {names[1]} KV tok/s | ratio (median of rounds) | every round "
          "| same greedy outputs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for work in shapes:
        base, fp8 = rows[work][names[0]], rows[work][names[1]]
        ratios = [rate(f) / rate(b) for f, b in zip(fp8, base)]
        print(f"| {work} | {statistics.median(map(rate, base)):,.0f} | {statistics.median(map(rate, fp8)):,.0f} "
              f"| **{statistics.median(ratios):.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} "
              f"| {same[work][0]}/{same[work][1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
