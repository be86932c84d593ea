"""W48 through the OpenAI HTTP API with the async `openai` client, beside the same workload
over gRPC, against the same model service.

The W48 checkpoint and workload of bench_generate.py (48 requests, prompt lengths 8-200,
max_new_tokens 8-128, greedy, eos ignored), all 48 sent at once from one asyncio client:
over gRPC as Generate streams, over HTTP as streamed /v1/completions with the prompt as
token ids (stream_options.include_usage, to count the tokens). One cache service and one
model service serve both paths, which take turns for --rounds rounds; each round draws new
prompt tokens of the same lengths, so neither path finds the other's prompts in the prefix
cache. The median round of each path is reported, with the HTTP path's cost relative to
gRPC, paired by round, and the CPU seconds the model service and this client spent on it
(both share the machine's cores, so a client's parsing slows the service down too).

    .venv/bin/python -m bench.serve.bench_http [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import openai
import torch

from bench.serve.bench_generate import NUM_REQUESTS, redraw_tokens, workload, write_w48_checkpoint
from harness.processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

GRPC = "gRPC, Generate streams"
HTTP = "HTTP, openai AsyncOpenAI, streamed /v1/completions"


async def over_grpc(address: str, items) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)

        async def one(prompt, max_new) -> int:
            request = model_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=model_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
            )
            return sum([len(response.token_ids) async for response in stub.Generate(request, timeout=600)])

        return sum(await asyncio.gather(*(one(*item) for item in items)))


async def over_http(base_url: str, model: str, items) -> int:
    # One client, as one channel for gRPC (its default pool holds 1,000 connections).
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:

        async def one(prompt, max_new) -> int:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_new, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            tokens = 0
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        return sum(await asyncio.gather(*(one(*item) for item in items)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(coroutine, service_pid: int) -> dict:
    service_before, client_before = cpu_seconds(service_pid), time.process_time()
    started = time.perf_counter()
    tokens = asyncio.run(coroutine)
    return {"tokens": tokens, "seconds": time.perf_counter() - started,
            "service_cpu": cpu_seconds(service_pid) - service_before, "client_cpu": time.process_time() - client_before}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each path, taking turns; medians reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = workload()
    asked = sum(n for _, n in requests)
    rounds: dict[str, list[dict]] = {GRPC: [], HTTP: []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = write_w48_checkpoint(tmp / "w48")
        with start_cache_service(tmp, "--kv-cache-bytes", "512MiB") as cache, \
                start_model_service(tmp, cache.address, "--model", str(path), "--threads", str(args.threads),
                                    "--max-num-seqs", "64", "--max-batch-prefill-tokens", "2048") as service:
            model = openai.OpenAI(base_url=service.http_url, api_key="unused").models.list().data[0].id
            # Warm both paths once, on prompts no round uses.
            warm = redraw_tokens(requests, -1)[:2]
            asyncio.run(over_grpc(service.address, warm))
            asyncio.run(over_http(service.http_url, model, warm))
            for round_index in range(args.rounds):
                items = redraw_tokens(requests, 2 * round_index + 1)
                rounds[GRPC].append(timed(over_grpc(service.address, items), service.pid))
                items = redraw_tokens(requests, 2 * round_index + 2)
                rounds[HTTP].append(timed(over_http(service.http_url, model, items), service.pid))
    for rows in rounds.values():
        for row in rows:
            assert row["tokens"] == asked, f"a round generated {row['tokens']} tokens, {asked} were asked"

    def rate(row: dict) -> float:
        return row["tokens"] / row["seconds"]

    print(f"W48: {NUM_REQUESTS} requests, {asked} new tokens, {args.threads} threads, {args.rounds} rounds in turns, "
          "median round shown\n")
    print("| path | seconds | tokens/s | every round, tokens/s | model service CPU s | client CPU s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rows in rounds.items():
        median = sorted(rows, key=rate)[len(rows) // 2]
        print(f"| {name} | {median['seconds']:.2f} | {rate(median):.0f} | "
              f"{', '.join(f'{rate(row):.0f}' for row in rows)} | "
              f"{statistics.median(row['service_cpu'] for row in rows):.2f} | "
              f"{statistics.median(row['client_cpu'] for row in rows):.2f} |")
    costs = [1 - rate(http) / rate(grpc_row) for grpc_row, http in zip(rounds[GRPC], rounds[HTTP])]
    print(f"\nHTTP cost against gRPC (1 - HTTP tokens/s / gRPC tokens/s), paired by round: "
          f"{', '.join(f'{100 * c:.1f}%' for c in costs)}; median {100 * statistics.median(costs):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
