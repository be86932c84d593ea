"""SmolLM2-135M-Instruct's Q4_1 GGUF served with its weights held in their blocks
(`--weights native`, the integer kernels of model_service/cpu_kernels/quant_matmul.py)
against the same file dequantized to float32 at load (`--weights dequantize`), end to end
over gRPC, the two services taking turns:

  - one stream: a chat request, greedy, 128 new tokens (eos ignored), tokens/s timed from
    the first streamed token to the last (decode alone, as llama.cpp's eval rate);
  - W48: bench_smollm2.py's 48 chat requests sent at once, new tokens/s over the whole run.

Each path runs as its own pair of real services (cache and model), both up for the whole
run; each round puts its number in the system messages so no round hits an earlier one's
prefix cache. Ratios are paired by round: the machine is shared and noisy.

    .venv/bin/python bench/bench_quantized.py [--rounds 3] [--threads 2] [--skip-w48]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from bench_smollm2 import PagedkvRunner, for_round, workload  # noqa: E402
from processes import start_cache_service, start_model_service  # noqa: E402

from pagedkv.model.v1 import model_pb2, model_pb2_grpc  # noqa: E402

STREAM_TOKENS = 128
MODES = ("native", "dequantize")


def one_stream(address: str, round_index: int) -> float:
    """Decode tokens/s of one greedy stream, from its first streamed token."""
    request = model_pb2.GenerateRequest(
        messages=[model_pb2.ChatMessage(role="system", content=f"Round {round_index}. Answer at length."),
                  model_pb2.ChatMessage(role="user", content="Tell me about the history of Paris.")],
        sampling=model_pb2.SamplingParams(max_new_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        first_at, tokens_after_first = None, 0
        for response in stub.Generate(request, timeout=1800):
            if first_at is None:
                first_at = time.perf_counter()
                tokens_after_first += len(response.token_ids) - 1
            else:
                tokens_after_first += len(response.token_ids)
        return tokens_after_first / (time.perf_counter() - first_at)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-w48", action="store_true", help="one stream only")
    args = parser.parse_args()
    requests = workload()
    stream: dict[str, list[float]] = {mode: [] for mode in MODES}
    w48: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        addresses = {}
        for mode in MODES:
            directory = Path(tmp) / mode
            directory.mkdir()
            cache = stack.enter_context(start_cache_service(directory, "--kv-cache-bytes", "1GiB"))
            service = stack.enter_context(start_model_service(
                directory, cache.address, "--model", "smollm2", "--weights", mode, "--threads", str(args.threads),
                "--max-model-len", "2048", "--max-num-seqs", "64", "--max-batch-prefill-tokens", "2048",
                timeout_s=900))
            addresses[mode] = service.address
            one_stream(service.address, -1)  # warm
        for round_index in range(args.rounds):
            for mode in MODES:
                stream[mode].append(one_stream(addresses[mode], round_index))
            if not args.skip_w48:
                for mode in MODES:
                    result = PagedkvRunner(addresses[mode]).run(for_round(requests, round_index))
                    w48[mode].append(result["tokens"] / result["seconds"])

    print(f"SmolLM2-135M-Instruct Q4_1 GGUF, float32 activations, {args.threads} threads, {args.rounds} round(s)\n")
    print("| workload | --weights | median tokens/s | every round |")
    print("| --- | --- | --- | --- |")
    for name, table in (("one stream, 128 tokens", stream), ("W48", w48)):
        for mode in MODES:
            rates = table[mode]
            if rates:
                print(f"| {name} | {mode} | {statistics.median(rates):.1f} | {', '.join(f'{r:.1f}' for r in rates)} |")
    for name, table in (("one stream", stream), ("W48", w48)):
        if table["native"]:
            ratios = [a / b for a, b in zip(table["native"], table["dequantize"])]
            print(f"\n{name}: native / dequantize by round {', '.join(f'{r:.2f}' for r in ratios)}; "
                  f"median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
