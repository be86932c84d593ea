"""W48 on a real model: SmolLM2-135M-Instruct (`--model smollm2`), chat requests, pagedkv end
to end over gRPC against transformers on the same weights.

48 chat requests whose user messages are real English text of varied lengths (paragraphs of
the Python standard library's documentation, as installed: nothing is downloaded), 24 of
them with a system message; max_new_tokens 8-128; greedy, eos ignored so every path makes
the same number of tokens. Both paths read the same .gguf file, in float32:

  - pagedkv: both services as real processes, all 48 requests sent at once over gRPC as
    `messages` (the service renders the chat template and tokenizes);
  - transformers `generate` in batches of 8 with left padding, on the same prompts rendered
    by transformers' own apply_chat_template (rendering and tokenizing not timed).

With --rounds N the paths take turns N times; each pagedkv round puts a round number in its
system messages so no round finds an earlier one's prompts in the prefix cache. Ratios are
paired by round: this machine is shared and noisy.

    .venv/bin/python -m bench.serve.bench_smollm2 [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from harness.processes import start_cache_service, start_model_service
from bench.serve.bench_generate import run_hf_generate as generate_batches

from model_service.loading.embedded import embedded_model_path
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

NUM_REQUESTS = 48
# Modules whose documentation is long, plain English prose.
_DOC_MODULES = ("argparse", "asyncio", "collections", "contextlib", "dataclasses", "decimal", "email", "functools",
                "json", "logging", "pathlib", "pickle", "re", "sqlite3", "subprocess", "threading", "typing",
                "unittest", "urllib.request", "zipfile")


def real_paragraphs() -> list[str]:
    import importlib

    paragraphs = []
    for name in _DOC_MODULES:
        module = importlib.import_module(name)
        for _, member in inspect.getmembers(module):
            doc = inspect.getdoc(member) if callable(member) or inspect.ismodule(member) else None
            if doc:
                paragraphs += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 12]
    return sorted(set(paragraphs))


def workload(seed: int = 0) -> list[tuple[list[dict], int]]:
    """48 (messages, max_new_tokens): user messages of 1-12 paragraphs (~20-900 tokens)."""
    rng = random.Random(seed)
    paragraphs = real_paragraphs()
    requests = []
    for index in range(NUM_REQUESTS):
        text = "\n\n".join(rng.sample(paragraphs, rng.choice((1, 1, 2, 3, 5, 8, 12))))
        ask = rng.choice(("Summarize this:", "Explain the following in simple words:", "What is this about?"))
        messages = [{"role": "user", "content": f"{ask}\n\n{text}"}]
        if index % 2:
            messages.insert(0, {"role": "system", "content": "You are a concise technical writer."})
        requests.append((messages, rng.randint(8, 128)))
    return requests


def for_round(requests, round_index: int):
    """The same requests with a system message that names the round: no prefix reuse across rounds."""
    out = []
    for messages, max_new in requests:
        system = {"role": "system", "content": f"Round {round_index}. You are a concise technical writer."}
        body = [m for m in messages if m["role"] != "system"]
        out.append(([system, *body], max_new))
    return out


class PagedkvRunner:
    def __init__(self, address: str) -> None:
        self.address = address

    def run(self, requests) -> dict:
        async def send_all() -> int:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = model_pb2_grpc.ModelServiceStub(channel)

                async def one(messages, max_new) -> int:
                    request = model_pb2.GenerateRequest(
                        messages=[model_pb2.ChatMessage(**m) for m in messages],
                        sampling=model_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
                    )
                    return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=1800)])

                return sum(await asyncio.gather(*(one(*item) for item in requests)))

        started = time.perf_counter()
        tokens = asyncio.run(send_all())
        return {"tokens": tokens, "seconds": time.perf_counter() - started}


def run_hf_generate(model, tokenizer, requests) -> dict:
    """The chat prompts rendered by the tokenizer's template (untimed), then generate_batches."""
    prompts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
               for messages, _ in requests]
    result = generate_batches(model, [(prompt, n) for prompt, (_, n) in zip(prompts, requests)],
                              pad_token_id=tokenizer.pad_token_id or 0)
    return {**result, "prompt_tokens": sum(map(len, prompts))}


PAGEDKV = "pagedkv (gRPC, both services, chat messages)"
HF_GENERATE = "transformers generate, batches of 8"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    requests = workload()
    prompt_tokens = [len(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)) for m, _ in requests]
    rounds: dict[str, list[dict]] = {PAGEDKV: [], HF_GENERATE: []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        with start_cache_service(tmp, "--kv-cache-bytes", "1GiB") as cache, \
                start_model_service(tmp, cache.address, "--model", "smollm2", "--threads", str(args.threads),
                                    "--max-model-len", "2048", "--max-num-seqs", "64",
                                    "--max-batch-prefill-tokens", "2048", timeout_s=600) as service:
            pagedkv = PagedkvRunner(service.address)
            pagedkv.run(for_round(requests[:1], -1))  # warm, as the in-process model is warm
            for round_index in range(args.rounds):
                round_requests = for_round(requests, round_index)
                rounds[HF_GENERATE].append(run_hf_generate(model, tokenizer, round_requests))
                rounds[PAGEDKV].append(pagedkv.run(round_requests))

    def rate(row: dict) -> float:
        return row["tokens"] / row["seconds"]

    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF, float32), {NUM_REQUESTS} chat requests, prompts "
          f"{min(prompt_tokens)}-{max(prompt_tokens)} tokens ({sum(prompt_tokens)} in all), "
          f"{sum(n for _, n in requests)} new tokens asked, {args.threads} threads, {args.rounds} round(s)\n")
    print("| path | new tokens | median seconds | median tokens/s | every round, tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in rounds.items():
        median = sorted(rows, key=rate)[len(rows) // 2]
        every = ", ".join(f"{rate(row):.0f}" for row in rows)
        print(f"| {name} | {median['tokens']} | {median['seconds']:.2f} | {rate(median):.0f} | {every} |")
    ratios = [rate(paged) / rate(hf) for paged, hf in zip(rounds[PAGEDKV], rounds[HF_GENERATE])]
    print(f"\npagedkv / transformers generate, by round: {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
