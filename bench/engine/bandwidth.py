"""How much of this machine's memory bandwidth one-stream decode of SmolLM2 reaches.

1. The read bandwidth, STREAM-like, at torch's thread count (--threads, default 2): the
   sum of a float32 tensor far larger than the caches (a read), and a copy of it into
   another (read plus write, counted as both, as STREAM does). Best of the rounds.
2. One greedy sequence decoding in process (harness/paged_runner.py, as
   bench/engine/quantized_decode_inprocess.py does), SmolLM2-135M-Instruct with --weights native
   (the Q4_1 file's blocks, float32 activations) and dequantized to bfloat16, in turns:
   tokens/s (median of the rounds).
3. The weight bytes a token reads: every weight once (the model's weights_bytes_by_type;
   SmolLM2's embedding is also its lm_head, whose product reads all of it each token, while
   the lookup reads one row), and the fraction of the read bandwidth that tokens/s x bytes
   a token reaches. The K/V a token reads (a few hundred KB at these contexts) is left out.

A virtual machine's bandwidth moves with its neighbours' load, minute to minute, so each
round also reads the bandwidth again right before its decodes, and the fraction is the
median of the rounds' own fractions (each decode over the read measured beside it).

    .venv/bin/python -m bench.engine.bandwidth [--threads 2] [--rounds 3] [--mib 512] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from harness.paged_runner import PagedRunner

from model_service.loading.loader import load_model


def best_seconds(function, rounds: int) -> float:
    function()  # first touch: page faults are not bandwidth
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def stream(mib: int, rounds: int) -> dict[str, float]:
    """GB/s (10^9 bytes) of a read and of a copy of `mib` MiB of float32."""
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    size = source.numel() * 4
    read = best_seconds(lambda: source.sum(), rounds)
    copy = best_seconds(lambda: target.copy_(source), rounds)
    return {"read": size / read / 1e9, "copy": 2 * size / copy / 1e9}


def decode_rates(models: dict, steps: int, rounds: int, mib: int) -> tuple[dict[str, list[float]], list[float]]:
    """tokens/s of one greedy sequence a round, each model in turn (who goes first rotates),
    and the read bandwidth (GB/s) measured at the start of each round."""
    rates: dict[str, list[float]] = {name: [] for name in models}
    reads: list[float] = []
    for round_index in range(rounds):
        reads.append(stream(mib, 3)["read"])
        names = list(models)
        names = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in names:
            loaded = models[name]
            runner = PagedRunner(loaded.model, loaded.config)
            (logits,) = runner.step([("a", list(range(1, 41)))], 0)  # a 40-token prompt
            token = int(logits[-1].argmax())
            started = time.perf_counter()
            for _ in range(steps):
                (logits,) = runner.step([("a", [token])], 1)
                token = int(logits[-1].argmax())
            rates[name].append(steps / (time.perf_counter() - started))
    return rates, reads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=512, help="size of the STREAM arrays, MiB each")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    bandwidth = stream(args.mib, args.rounds)
    print(f"{args.threads} threads, {args.mib} MiB arrays: read {bandwidth['read']:.1f} GB/s, "
          f"copy {bandwidth['copy']:.1f} GB/s (read + write)")

    models = {"SmolLM2 native (Q4_1 blocks, float32 activations)": load_model("smollm2", torch.float32, "cpu",
                                                                               weights="native"),
              "SmolLM2 bfloat16 (dequantized at load)": load_model("smollm2", torch.bfloat16, "cpu",
                                                                   weights="dequantize")}
    rates, reads = decode_rates(models, args.steps, args.rounds, args.mib)
    print(f"read bandwidth at the start of each round: {', '.join(f'{r:.1f}' for r in reads)} GB/s")
    print("| model | weight bytes a token | tokens/s, median | rounds | GB/s of weights read | of the read bandwidth, "
          "median of the rounds | each round's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, loaded in models.items():
        weight_bytes = sum(loaded.weights_bytes_by_type.values())
        rate = statistics.median(rates[name])
        shares = [r * weight_bytes / 1e9 / read for r, read in zip(rates[name], reads)]
        print(f"| {name} | {weight_bytes:,} | {rate:.1f} | {', '.join(f'{r:.1f}' for r in rates[name])} "
              f"| {rate * weight_bytes / 1e9:.1f} | {statistics.median(shares):.0%} "
              f"| {', '.join(f'{share:.0%}' for share in shares)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
