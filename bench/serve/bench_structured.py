"""What structured output costs: W48 on SmolLM2 with a quarter of the requests constrained by a JSON schema,
against the same 48 requests all unconstrained, in turns; and how long a schema takes to compile, cold and cached.

The workload is bench_smollm2.py's (48 chat requests over real English text, max_new_tokens
8-128), greedy, sent at once over gRPC to both services as real processes. Unconstrained
requests ignore EOS; a constrained one cannot (the grammar decides where it ends), so its
schema asks for a summary string of at least 4,000 characters, which no completion of at
most 128 tokens reaches: both arms generate exactly the same number of tokens, and the
constrained arm pays for a bitmask filled and applied at every one of its steps.

    .venv/bin/python -m bench.serve.bench_structured [--rounds 3] [--threads 2]

--step-only times one W48 decode step's sampling alone (the engine's StepSampler, batch
48, SmolLM2's vocabulary of 49,152, random logits), with no row constrained and with 12
rows under LONG_SUMMARY, in turns: the mask's cost without the forward pass around it,
for a machine too busy for the end-to-end rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.serve.bench_smollm2 import for_round, workload
from harness.processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

LONG_SUMMARY = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 4000}},
                "required": ["summary"]}
# What the compile-time table measures besides LONG_SUMMARY: an everyday nested schema.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                  "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "address"]}


def run(address: str, requests, constrained_every: int) -> dict:
    """All requests at once; every constrained_every-th one (0: none) under LONG_SUMMARY."""
    structured = model_pb2.StructuredOutputs(json=json.dumps(LONG_SUMMARY))

    async def send_all() -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)

            async def one(index, messages, max_new) -> int:
                constrained = constrained_every and index % constrained_every == 0
                sampling = model_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=not constrained)
                if constrained:
                    sampling.structured.CopyFrom(structured)
                request = model_pb2.GenerateRequest(messages=[model_pb2.ChatMessage(**m) for m in messages],
                                                    sampling=sampling)
                return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=3600)])

            return sum(await asyncio.gather(*(one(i, *item) for i, item in enumerate(requests))))

    started = time.perf_counter()
    tokens = asyncio.run(send_all())
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


def compile_times() -> list[tuple[str, float, float, float]]:
    """(schema, first compile with the vocabulary read, cold compile, cached) seconds, in this process."""
    from model_service.loading.embedded import embedded_model_path
    from model_service.loading.gguf_file import GGUFFile
    from model_service.loading.gguf_tokenizer import tokenizer_from_gguf
    from model_service.sample.grammar import GrammarCompiler
    from model_service.sample.params import StructuredSpec

    tokenizer = tokenizer_from_gguf(GGUFFile(embedded_model_path()), (2,), 1)
    rows = []
    for name, schema in (("LONG_SUMMARY", LONG_SUMMARY), ("PERSON", PERSON)):
        grammars = GrammarCompiler(tokenizer, 49152, {2})
        started = time.perf_counter()
        grammars.compile(StructuredSpec("regex", "x"))  # reads the vocabulary
        first = time.perf_counter() - started
        spec = StructuredSpec("json", json.dumps(schema))
        started = time.perf_counter()
        grammars.compile(spec)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(1000):
            grammars.compile(spec)
        rows.append((name, first, cold, (time.perf_counter() - started) / 1000))
    return rows


def step_only(threads: int, repeats: int) -> None:
    import torch
    from dataclasses import replace

    from model_service.engine.output import Completion, RequestOutput
    from model_service.engine.step_sampler import StepSampler
    from model_service.loading.embedded import embedded_model_path
    from model_service.loading.gguf_file import GGUFFile
    from model_service.loading.gguf_tokenizer import tokenizer_from_gguf
    from model_service.sample.grammar import GrammarCompiler
    from model_service.sample.params import SamplingOptions, StructuredSpec
    from model_service.sched.sequence import Sequence

    torch.set_num_threads(threads)
    batch, vocab = 48, 49152
    tokenizer = tokenizer_from_gguf(GGUFFile(embedded_model_path()), (2,), 1)
    spec = StructuredSpec("json", json.dumps(LONG_SUMMARY))
    plain = SamplingOptions(max_new_tokens=4096, ignore_eos=True)
    constrained = replace(SamplingOptions(max_new_tokens=4096), structured=spec,
                          grammar=GrammarCompiler(tokenizer, vocab, {2}).compile(spec))

    def completions(constrained_rows: int):
        seqs, table = [], {}
        for row in range(batch):
            options = constrained if row % 4 == 0 and row // 4 < constrained_rows else plain
            seq = Sequence(request_id=f"r{row}", token_ids=list(range(100)), prompt_len=90, options=options,
                           arrival=row)
            request = RequestOutput(key=row, request_id=seq.request_id, sink=lambda d: None, options=options,
                                    prompt_len=90, submitted_at=0.0, deadline=None, unfinished=1)
            table[seq] = Completion(0, seq, None, None, request)
            seqs.append(seq)
        return seqs, table

    logits = torch.randn(batch, vocab) * 3
    paths = {}
    for name, rows in (("no row constrained", 0), ("12 of 48 rows under LONG_SUMMARY", 12)):
        sampler = StepSampler(vocab, [2], torch.device("cpu"))
        seqs, table = completions(rows)
        paths[name] = (lambda sampler=sampler, seqs=seqs, table=table: sampler.sample(seqs, logits, table))
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run_step in paths.items():
            started = time.perf_counter()
            run_step()
            times[name].append(time.perf_counter() - started)
    print(f"one W48 decode step's sampling, vocab {vocab}, {threads} threads, median of {repeats} in turns\n")
    print("| rows | ms a step |")
    print("| --- | --- |")
    for name, samples in times.items():
        print(f"| {name} | {1e3 * statistics.median(samples):.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    if args.step_only:
        step_only(args.threads, args.repeats)
        return 0
    requests = workload()
    arms = {"all unconstrained": 0, "a quarter under a JSON schema": 4}
    rounds: dict[str, list[dict]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with start_cache_service(tmp, "--kv-cache-bytes", "1GiB") as cache, \
                start_model_service(tmp, cache.address, "--model", "smollm2", "--threads", str(args.threads),
                                    "--max-model-len", "2048", "--max-num-seqs", "64",
                                    "--max-batch-prefill-tokens", "2048", timeout_s=600) as service:
            run(service.address, for_round(requests[:4], -1), 4)  # warm, the schema compiled
            for round_index in range(args.rounds):
                for arm, (name, every) in enumerate(arms.items()):  # in turns; prompts new to the prefix cache
                    rounds[name].append(run(service.address, for_round(requests, len(arms) * round_index + arm),
                                            every))

    def rate(row: dict) -> float:
        return row["tokens"] / row["seconds"]

    print(f"SmolLM2-135M-Instruct (float32), {len(requests)} chat requests, greedy, {args.threads} threads, "
          f"{args.rounds} round(s)\n")
    print("| requests | new tokens | median seconds | median tokens/s | every round, tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in rounds.items():
        median = sorted(rows, key=rate)[len(rows) // 2]
        every = ", ".join(f"{rate(row):.0f}" for row in rows)
        print(f"| {name} | {median['tokens']} | {median['seconds']:.2f} | {rate(median):.0f} | {every} |")
    names = list(arms)
    ratios = [rate(b) / rate(a) for a, b in zip(rounds[names[0]], rounds[names[1]])]
    print(f"\nconstrained quarter / unconstrained, by round: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}x\n")
    print("| schema | first compile (reads the vocabulary) | cold compile | cached |")
    print("| --- | --- | --- | --- |")
    for name, first, cold, cached in compile_times():
        print(f"| {name} | {first * 1000:.0f} ms | {cold * 1000:.1f} ms | {cached * 1e6:.1f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
