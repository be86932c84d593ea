"""W48: pagedkv end to end over gRPC against transformers on the same weights.

A random Llama checkpoint (hidden 256, 4 layers, 8 heads, 4 KV heads, intermediate 688,
vocab 32000, float32) is written in Hugging Face format; 48 requests with prompt lengths
8-200 and max_new_tokens 8-128, greedy, eos ignored, fixed seed. Measured in one script:

  - pagedkv: both services as real processes, all 48 requests sent at once over gRPC;
  - transformers `generate` in batches of 8 with left padding;
  - transformers continuous batching (`init_continuous_batching`, per-request max_new_tokens).

Tokens/s counts the tokens each request asked for. Also reported: the share of the
engine's step time spent waiting on the cache service (from the model service's metrics).

    .venv/bin/python bench/bench_generate.py [--skip-transformers] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from processes import start_cache_service, start_model_service  # noqa: E402

from pagedkv.model.v1 import model_pb2, model_pb2_grpc  # noqa: E402

NUM_REQUESTS = 48


def write_w48_checkpoint(directory: Path) -> Path:
    from hf_checkpoints import write_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=688, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 32000) for _ in range(rng.randint(8, 200))], rng.randint(8, 128))
        for _ in range(NUM_REQUESTS)
    ]


def metric(url: str, name: str) -> float:
    for line in urllib.request.urlopen(url).read().decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def run_pagedkv(path: Path, requests, tmp: Path, threads: int) -> dict:
    with start_cache_service(tmp, "--kv-cache-bytes", "512MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(path), "--threads", str(threads),
                                "--max-num-seqs", "64", "--max-batch-prefill-tokens", "2048") as model:

        async def send_all(items) -> int:
            # One asyncio client for all streams: 48 blocking client threads would spend
            # more of these two cores on the GIL than the service spends on a token.
            async with grpc.aio.insecure_channel(model.address) as channel:
                stub = model_pb2_grpc.ModelServiceStub(channel)

                async def one(prompt, max_new) -> int:
                    request = model_pb2.GenerateRequest(
                        prompt_token_ids=prompt,
                        sampling=model_pb2.SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True),
                    )
                    return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=600)])

                return sum(await asyncio.gather(*(one(*item) for item in items)))

        asyncio.run(send_all(requests[:1]))  # warm the service once, as the warm transformers path is warm
        wait_before = metric(model.metrics_url, "pagedkv_model_lease_wait_seconds_total")
        step_before = metric(model.metrics_url, "pagedkv_model_engine_step_seconds_total")
        started = time.perf_counter()
        tokens = asyncio.run(send_all(requests))
        elapsed = time.perf_counter() - started
        wait = metric(model.metrics_url, "pagedkv_model_lease_wait_seconds_total") - wait_before
        step = metric(model.metrics_url, "pagedkv_model_engine_step_seconds_total") - step_before
    return {"tokens": tokens, "seconds": elapsed, "lease_wait_share": wait / step if step else 0.0}


def run_hf_generate(model, requests) -> dict:
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(requests), 8):
        batch = requests[start:start + 8]
        width = max(len(p) for p, _ in batch)
        max_new = max(n for _, n in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens += sum(n for _, n in batch)
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


def run_hf_continuous(model, requests) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=128, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    started = time.perf_counter()
    for index, (prompt, max_new) in enumerate(requests):
        manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=max_new, eos_token_id=-1)
    tokens = 0
    for _ in requests:
        result = manager.get_result(timeout=600)
        tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - started
    manager.stop(block=True)
    return {"tokens": tokens, "seconds": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = workload()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = write_w48_checkpoint(tmp / "w48")
        paged = run_pagedkv(path, requests, tmp, args.threads)
        rows.append(("pagedkv (gRPC, both services)", paged))
        if not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            rows.append(("transformers generate, batches of 8", run_hf_generate(model, requests)))
            rows.append(("transformers continuous batching, cold", run_hf_continuous(model, requests)))
            rows.append(("transformers continuous batching, warm", run_hf_continuous(model, requests)))
    print(f"W48: {NUM_REQUESTS} requests, {sum(n for _, n in requests)} new tokens asked, {args.threads} threads\n")
    print("| path | new tokens | seconds | tokens/s |")
    print("| --- | --- | --- | --- |")
    for name, row in rows:
        print(f"| {name} | {row['tokens']} | {row['seconds']:.2f} | {row['tokens'] / row['seconds']:.0f} |")
    if len(rows) > 1:
        best = max(r["tokens"] / r["seconds"] for _, r in rows[1:])
        print(f"\npagedkv / fastest transformers path: {paged['tokens'] / paged['seconds'] / best:.2f}x")
    print(f"engine step time spent waiting on the cache service: {100 * paged['lease_wait_share']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
