"""fp8 KV against bfloat16 KV on SmolLM2 (bfloat16 compute), and against vLLM's CPU engine with fp8 KV, in turns.

Two pagedkv stacks stay up side by side (a cache service and a model service each, over gRPC,
`--model smollm2 --dtype bfloat16`, one with `--kv-cache-dtype bfloat16`, one with
`fp8_e4m3`), and beside them vLLM's offline engine with kv_cache_dtype fp8_e4m3 and its
default scales (harness/peers/vllm_worker.py in the vLLM venv that harness/peers/vllm_offline.py makes or
PAGEDKV_VLLM_VENV names; the float32 Hugging Face copy of the same GGUF, dtype bfloat16,
prefix caching off, the same max_model_len; on CPU its fp8 KV needs AVX-512 or AMX). The
three take turns on the same requests, who goes first rotating by round: W48's shape
(48 requests, prompts 8-200, max_new_tokens 8-128) and one stream of 128 tokens after a
32-token prompt, greedy, eos ignored, new prompt tokens every round (bench_vs_vllm.py's
workloads, clients and vLLM worker).

    .venv/bin/python -m bench.serve.kv_fp8_speed [--rounds 3] [--threads 2] [--kv-cache-dtype fp8_e4m3] [--no-vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.serve.bench_generate import workload
from bench.serve.bench_vs_vllm import pagedkv_services, rate, redraw, single_stream
from harness.peers.vllm_offline import VllmWorker, ensure_vllm_venv, smollm2_checkpoint

VOCAB = 49152
VLLM = "vLLM"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3", help="the fp8 KV dtype, pagedkv's and vLLM's")
    parser.add_argument("--no-vllm", action="store_true", help="the two pagedkv stacks only")
    args = parser.parse_args()
    fp8 = args.kv_cache_dtype
    names = ("bfloat16", fp8) + (() if args.no_vllm else (VLLM,))
    shapes = {"W48": workload(), "one stream": single_stream(VOCAB)}
    rows = {work: {name: [] for name in names} for work in shapes}
    pairs = [("bfloat16", fp8)] + ([] if args.no_vllm else [(fp8, VLLM)])
    same = {work: {pair: [0, 0] for pair in pairs} for work in shapes}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        runs = {}
        if not args.no_vllm:
            worker = VllmWorker(ensure_vllm_venv(), smollm2_checkpoint(), "bfloat16", Path(tmp) / "vllm.log",
                                args.threads, fp8)
            stack.callback(worker.close)
            runs[VLLM] = worker.run
        for name in ("bfloat16", fp8):
            (Path(tmp) / name).mkdir()
            runs[name] = stack.enter_context(pagedkv_services(
                Path("smollm2"), "bfloat16", Path(tmp) / name, args.threads, ["--kv-cache-dtype", name]))
        for name in names:
            runs[name](redraw(shapes["W48"][:4], -1, VOCAB))  # warm up on prompts no round uses
        for round_index in range(args.rounds):
            for work, shape in shapes.items():
                requests = redraw(shape, round_index, VOCAB)
                shift = round_index % len(names)
                order = names[shift:] + names[:shift]
                results = {name: runs[name](requests) for name in order}
                for name in names:
                    rows[work][name].append(results[name])
                for pair, counts in same[work].items():
                    a, b = (results[name]["outputs"] for name in pair)
                    counts[0] += sum(x == y for x, y in zip(a, b, strict=True))
                    counts[1] += len(a)
                print(f"  round {round_index + 1} {work}: " + ", ".join(
                    f"{name} {rate(results[name]):.0f} tok/s" for name in order), flush=True)
    load = os.getloadavg()
    print(f"\n{args.rounds} rounds, {args.threads} threads, SmolLM2 bfloat16 compute; load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    header = (f"| workload | bfloat16 KV tok/s | {fp8} KV tok/s | {fp8} / bfloat16 (median of rounds) "
              "| every round |")
    if not args.no_vllm:
        header += f" vLLM {fp8} KV tok/s | pagedkv / vLLM, both {fp8} (median; every round) |"
    print(header + " same greedy outputs: " + "; ".join(f"{a} vs {b}" for a, b in pairs) + " |")
    print("| --- " * header.count("|") + "|")
    for work in shapes:
        base, quantized = rows[work]["bfloat16"], rows[work][fp8]
        ratios = [rate(f) / rate(b) for f, b in zip(quantized, base)]
        line = (f"| {work} | {statistics.median(map(rate, base)):,.0f} "
                f"| {statistics.median(map(rate, quantized)):,.0f} "
                f"| **{statistics.median(ratios):.2f}x** | {', '.join(f'{r:.2f}' for r in ratios)} |")
        if not args.no_vllm:
            theirs = rows[work][VLLM]
            against = [rate(f) / rate(v) for f, v in zip(quantized, theirs)]
            line += (f" {statistics.median(map(rate, theirs)):,.0f} | **{statistics.median(against):.2f}x** "
                     f"({', '.join(f'{r:.2f}' for r in against)}) |")
        print(line + " " + "; ".join("{}/{}".format(*same[work][pair]) for pair in pairs) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
