"""W48 (or one stream) through the engine alone: where a run's time goes, without gRPC
streaming or a client (bench/serve/bench_vs_vllm.py --pagedkv-path engine against its default gRPC
path says what those cost).

The same checkpoints and workloads as bench/serve/bench_vs_vllm.py (the W48 random Llama or SmolLM2,
float32 or bfloat16; W48 or one stream of 128 tokens); a real cache service process
leases the blocks, but the engine runs in this process (inprocess_engine.py) and its
tokens, ids only as bench/serve/bench_vs_vllm.py asks for them, go to plain callbacks. Reports the
wall time, engine steps by kind (prefill, decode by batch size), and the time inside the
layer linears (quantized ones too), the lm_head, paged attention (K/V write, gather and
SDPA), the norms, rotary, SiLU, the one-call decode steps (cpu_decode_stack.py: quantized or panel linears) and the
step's inputs, measured by timing those calls (CPU work is synchronous). A second table
splits the engine thread's time: forward passes, sampling, the scheduler, lease calls to
the cache service (sending, and waiting for the answer), handing tokens to the request
sinks (on the service, the hand-off to the gRPC threads) and the inbox; what is left of
the wall time the engine thread spent outside its steps.

    .venv/bin/python -m bench.engine.engine_breakdown [--threads 2] [--model w48|smollm2|PATH]
        [--dtype float32|bfloat16] [--workload w48|single] [--weights dequantize|native]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from bench.serve.bench_generate import workload, write_w48_checkpoint
from bench.serve.bench_vs_vllm import single_stream
from harness.peers.vllm_offline import smollm2_checkpoint
from bench.engine.inprocess_engine import engine_in_process, load_in_passing_thread

from model_service.attention.backend import PagedAttention
from model_service.models import fused_ops
from model_service.models.fused_ops import RotaryStep
from model_service.models.cpu_decode_stack import DecodeStack
from model_service.models.packed_linear import PackedLinear
from model_service.models.panel_linear import PanelLinear
from model_service.models.quantized_linear import QuantizedEmbedding, QuantizedLinear
from model_service.cache.session import CacheSession
from model_service.engine.live_requests import LiveRequests
from model_service.engine.loop import Engine
from model_service.engine.step_sampler import StepSampler
from model_service.sched.scheduler import Scheduler
from model_service.worker.runner import ModelRunner

# seconds spent inside each kind of call, and one (batch size, tokens, seconds) per step
time_in: collections.Counter[str] = collections.Counter()
# the engine thread's seconds by part (engine_parts), outermost call only
engine_time: collections.Counter[str] = collections.Counter()
steps: list[tuple[int, int, float]] = []
FORWARD = "forward passes and logits (ModelRunner.execute)"


def timed(owner, name: str, label, into: collections.Counter = time_in) -> None:
    """Replace owner.name with a wrapper that adds its wall time to into[label(args)]."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into[label(args)] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def engine_parts() -> None:
    """The engine thread's calls, by part: none of these calls another (a request's
    admission into the scheduler happens in the inbox's part)."""
    timed(Engine, "_step", lambda args: "engine steps, all of them", engine_time)
    parts = [(StepSampler, "sample", "sampling (StepSampler.sample)"),
             (Scheduler, "schedule", "scheduler"), (Scheduler, "update_from_output", "scheduler"),
             (Scheduler, "apply", "scheduler"),
             (CacheSession, "send", "lease calls: sending"), (CacheSession, "collect", "lease calls: waiting for answers"),
             (LiveRequests, "emit", "handing tokens to the sinks (LiveRequests.emit)"),
             (Engine, "_drain_inbox", "inbox (submits, cancels)")]
    for owner, name, label in parts:
        timed(owner, name, lambda args, label=label: label, engine_time)


def instrument(vocab_size: int) -> None:
    for linear in (nn.Linear, PackedLinear, PanelLinear, QuantizedLinear):
        timed(linear, "forward", lambda args: "lm_head" if args[0].out_features == vocab_size else "layer linears")
    for embedding in (nn.Embedding, QuantizedEmbedding):
        timed(embedding, "forward", lambda args: "embedding")
    for name in ("rms_norm", "add_rms_norm"):
        timed(fused_ops, name, lambda args: "norms (with the residual add)")
    timed(fused_ops, "silu_mul", lambda args: "silu * up")
    timed(RotaryStep, "rotate", lambda args: "rotary")
    timed(DecodeStack, "run", lambda args: "decode steps' layers in one C call (decode_stack.c)")
    timed(ModelRunner, "prepare", lambda args: "step inputs and attention metadata (ModelRunner.prepare)")
    timed(PagedAttention, "__call__", lambda args: "paged attention, decode steps"
          if args[5].num_decode_seqs == args[5].num_seqs else "paged attention, prefill steps")
    execute = ModelRunner.execute

    def execute_and_log(runner, batch, *rest):
        started = time.perf_counter()
        result = execute(runner, batch, *rest)
        seconds = time.perf_counter() - started
        steps.append((len(batch), sum(n for _, n in batch), seconds))
        engine_time[FORWARD] += seconds
        return result

    ModelRunner.execute = execute_and_log
    engine_parts()


def step_kind(batch_size: int, tokens: int) -> str:
    if tokens > batch_size:
        return "prefill (or mixed)"
    return "decode, batch 1-8" if batch_size <= 8 else "decode, batch 9-24" if batch_size <= 24 else "decode, batch 25+"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="w48", help="w48, smollm2 or a checkpoint directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workload", default="w48", choices=["w48", "single"])
    parser.add_argument("--weights", default="dequantize", choices=["dequantize", "native"],
                        help="a GGUF file's linears: dequantized at load, or held in their blocks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = {"w48": lambda: write_w48_checkpoint(tmp / "w48"), "smollm2": smollm2_checkpoint}.get(
            args.model, lambda: Path(args.model))()
        loaded = load_in_passing_thread(path, dtype, weights=args.weights)
        requests = workload() if args.workload == "w48" else single_stream(loaded.config.vocab_size)
        instrument(loaded.config.vocab_size)
        with engine_in_process(loaded, dtype, tmp) as run:
            run([(requests[0][0][::-1], 2)])  # warm up, with a prompt the workload does not use
            time_in.clear()
            engine_time.clear()
            steps.clear()
            wall = run(requests)["seconds"]

    new_tokens = sum(n for _, n in requests)
    forward = sum(seconds for _, _, seconds in steps)
    time_in["outside the timed calls, in forward passes"] = forward - sum(time_in.values())
    print(f"{args.workload} on {args.model}, {args.dtype}, engine only, {args.threads} threads: {new_tokens} new tokens in {wall:.2f} s "
          f"({new_tokens / wall:.0f} tokens/s); {len(steps)} steps, {forward:.2f} s in forward passes\n")
    print("| steps | count | seconds | ms a step |")
    print("| --- | --- | --- | --- |")
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    for batch_size, tokens, seconds in steps:
        kinds[step_kind(batch_size, tokens)].append(seconds)
    for kind, times in sorted(kinds.items()):
        print(f"| {kind} | {len(times)} | {sum(times):.2f} | {1e3 * sum(times) / len(times):.1f} |")
    print("\n| inside the forward passes | seconds | share of wall |")
    print("| --- | --- | --- |")
    for label, seconds in time_in.most_common():
        print(f"| {label} | {seconds:.2f} | {100 * seconds / wall:.0f} % |")
    in_steps = engine_time.pop("engine steps, all of them")
    engine_time["the rest of the engine steps"] = in_steps - sum(engine_time.values())
    engine_time["engine thread outside its steps (idle, GIL waits)"] = wall - in_steps
    print("\n| the engine thread | seconds | share of wall |")
    print("| --- | --- | --- |")
    for label, seconds in engine_time.most_common():
        print(f"| {label} | {seconds:.2f} | {100 * seconds / wall:.0f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
