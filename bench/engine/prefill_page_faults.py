"""What the model service's malloc setting `--malloc-keep-free-bytes` (model_service/allocator.py)
does to a long prompt's prefill: its time, and the page faults it takes.

A forward pass frees each layer's activations just before the next layer asks for as much;
with glibc's own thresholds those blocks went back to the system at free and every layer
faulted its pages in again. Each setting runs in a process of its own (mallopt's thresholds
cannot be put back), the settings in turns round by round; each process loads the model,
attaches to a real cache service, runs one warm-up prompt, then prefills prompts of each
length (one new token each) --repeats times, lengths interleaved. The table gives each
setting's median wall time and minor page faults a prefill, and the ratio of the medians.

    .venv/bin/python -m bench.engine.prefill_page_faults [--model smollm2|w48|PATH] [--dtype float32]
        [--tokens 300,900,1500] [--settings 0,128MiB] [--rounds 3] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedkv.units import parse_bytes


def child(args) -> None:
    # Before the model loads and the engine's threads start, as the service does (server.py).
    from model_service import allocator
    allocator.configure(allocator.DEFAULT_ARENA_MAX, 0, parse_bytes(args.keep_free_bytes))
    import torch

    from bench.engine.inprocess_engine import engine_in_process, load_in_passing_thread
    from bench.serve.bench_generate import write_w48_checkpoint
    from harness.peers.vllm_offline import smollm2_checkpoint
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    lengths = [int(n) for n in args.tokens.split(",")]
    seconds: dict[int, list[float]] = {n: [] for n in lengths}
    faults: dict[int, list[int]] = {n: [] for n in lengths}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = {"w48": lambda: write_w48_checkpoint(tmp / "w48"), "smollm2": smollm2_checkpoint}.get(
            args.model, lambda: Path(args.model))()
        loaded = load_in_passing_thread(path, dtype)
        rng = random.Random(args.seed)
        vocab = loaded.config.vocab_size

        def prompt(tokens: int) -> list[int]:  # new ids each time: no prefix-cache hit
            return [rng.randrange(vocab // 8, vocab) for _ in range(tokens)]
        with engine_in_process(loaded, dtype, tmp, max_model_len=max(lengths) + 16) as run:
            run([(prompt(max(lengths)), 1)])
            for _ in range(args.repeats):
                for tokens in lengths:
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    seconds[tokens].append(run([(prompt(tokens), 1)])["seconds"])
                    faults[tokens].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"seconds": seconds, "faults": faults}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, w48 or a checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", default="300,900,1500", help="prompt lengths")
    parser.add_argument("--settings", default="0,128MiB", help="--malloc-keep-free-bytes values (0: glibc's own)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="prefills of each length a process runs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keep-free-bytes", default="0", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    settings = args.settings.split(",")
    seconds = {setting: {} for setting in settings}
    faults = {setting: {} for setting in settings}
    for round_index in range(args.rounds):
        for setting in settings:  # in turns
            command = [sys.executable, "-m", "bench.engine.prefill_page_faults", "--child", "--keep-free-bytes",
                       setting, "--model", args.model, "--dtype", args.dtype, "--tokens", args.tokens,
                       "--repeats", str(args.repeats), "--threads", str(args.threads), "--seed", str(round_index)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            for tokens, values in result["seconds"].items():
                seconds[setting].setdefault(int(tokens), []).extend(values)
            for tokens, values in result["faults"].items():
                faults[setting].setdefault(int(tokens), []).extend(values)
            print(f"  round {round_index + 1}, --malloc-keep-free-bytes {setting}: "
                  + ", ".join(f"{tokens} tokens {1e3 * statistics.median(v):.0f} ms"
                              for tokens, v in sorted(seconds[setting].items())), flush=True)
    first = settings[0]
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, {args.rounds} rounds x {args.repeats} prefills "
          f"a length; medians\n")
    print("| prompt tokens | --malloc-keep-free-bytes | ms a prefill | minor faults a prefill | time vs " + first + " |")
    print("| --- | --- | --- | --- | --- |")
    for tokens in sorted(seconds[first]):
        base = statistics.median(seconds[first][tokens])
        for setting in settings:
            median = statistics.median(seconds[setting][tokens])
            print(f"| {tokens} | {setting} | {1e3 * median:.0f} | {statistics.median(faults[setting][tokens]):,.0f} "
                  f"| {median / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
