"""How long one engine step takes with D decoding streams and a prefill chunk of P tokens.

The forward pass alone (ModelRunner.execute over a pool of its own, no cache service, no
sampling): D sequences decode one token each at a context of --context tokens, beside one
new prompt's first chunk of P tokens. Every repetition runs every (D, P) cell once, in
turns, so drift on a loaded machine touches all cells alike; the table gives each cell's
median and its ratio to the decode-only step at the same D, by wall time or (--clock
cpu) by the process's CPU time, which other processes' load inflates far less (with
--threads 1 it is the step's work, whatever else runs). What a decoding stream's gap
between tokens becomes when a step carries a chunk of P tokens (the ITL tail), and what
a prompt's chunks cost in steps (its TTFT) are read from it:
`--max-prefill-tokens-while-decoding` in model_service/server.py was chosen so.

    .venv/bin/python -m bench.engine.step_time_vs_chunk [--model smollm2] [--dtype bfloat16]
        [--decodes 8,32] [--chunks 0,32,64,128,256,512,1024,2048] [--repeats 5] [--threads 2]
        [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from model_service.loading.loader import load_model
from model_service.sched.sequence import Sequence
from model_service.worker.runner import ModelRunner
from model_service.worker.torch_threads import run_in_passing_thread

BLOCK_SIZE = 16


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, a .gguf or a checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--decodes", default="8,32", help="decoding streams a step carries (comma list)")
    parser.add_argument("--chunks", default="0,32,64,128,256,512,1024,2048", help="prefill chunk sizes (comma list)")
    parser.add_argument("--context", type=int, default=320, help="tokens each decoding stream has in the pool")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--offset", type=int, default=0,
                        help="prompt tokens already in the pool before the chunk (a later chunk of a prompt)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: time.perf_counter; cpu: time.process_time (all of this process's threads)")
    args = parser.parse_args()
    decodes = [int(d) for d in args.decodes.split(",")]
    chunks = [int(p) for p in args.chunks.split(",")]
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    dtype = getattr(torch, args.dtype)
    loaded = run_in_passing_thread(lambda: load_model(args.model, dtype, "cpu"))
    config = loaded.config
    per_decode = blocks_for(args.context + 1)
    per_prompt = blocks_for(args.offset + max(chunks) + 1)
    num_blocks = max(decodes) * per_decode + per_prompt
    pool = torch.zeros((config.num_layers, 2, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim),
                       dtype=dtype)
    runner = ModelRunner(loaded.model, pool, BLOCK_SIZE)
    vocab = config.vocab_size

    def sequence(name: str, length: int, first_block: int, blocks: int, computed: int) -> Sequence:
        tokens = [(index * 7919 + first_block) % vocab for index in range(length)]
        return Sequence(request_id=name, token_ids=tokens, prompt_len=length, options=None, arrival=0,
                        block_table=list(range(first_block, first_block + blocks)), num_computed=computed)

    streams = [sequence(f"decode-{i}", args.context + 1, i * per_decode, per_decode, 0)
               for i in range(max(decodes))]
    # Longer than any chunk, so no chunk ends its prompt: a chunk mid-prompt samples nothing.
    prompt = sequence("prompt", args.offset + max(chunks) + 1, max(decodes) * per_decode, per_prompt, 0)
    if args.offset:  # its earlier chunks' K/V, written as a prefill would
        runner.execute([(prompt, args.offset)])
        prompt.num_computed = args.offset
    for stream in streams:  # their context's K/V, written as a prefill would
        runner.execute([(stream, args.context)])
        stream.num_computed = args.context
    cells = [(d, p) for d in decodes for p in chunks if d or p]
    times: dict[tuple[int, int], list[float]] = {cell: [] for cell in cells}
    for repeat in range(args.repeats + 1):  # the first is a warmup, not counted
        for d, p in cells:
            batch = [(stream, 1) for stream in streams[:d]] + ([(prompt, p)] if p else [])
            started = clock()
            runner.execute(batch)
            if repeat:
                times[(d, p)].append(clock() - started)
        print(f"repeat {repeat}/{args.repeats} done", file=sys.stderr, flush=True)

    load = os.getloadavg()
    print(f"\n{args.model}, {args.dtype}, {args.threads} threads, decode context {args.context}, {args.clock} time, "
          f"median of {args.repeats} repeats; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| decoding streams | prefill chunk | ms a step | x the decode-only step | ms per chunk token over decode-only |")
    print("| --- | --- | --- | --- | --- |")
    for d in decodes:
        base = statistics.median(times[(d, 0)]) if d else 0.0
        for p in chunks:
            if not (d or p):
                continue
            step = statistics.median(times[(d, p)])
            ratio = f"{step / base:.2f}" if base else "-"
            per_token = f"{1e3 * (step - base) / p:.2f}" if p else "-"
            print(f"| {d} | {p} | {1e3 * step:.1f} | {ratio} | {per_token} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
