"""How close fp8 KV stays to bfloat16 KV on SmolLM2: greedy tokens and logprobs, both services real.

For each configuration (KV dtype, scales) a cache service and a model service start
(`--model smollm2 --dtype bfloat16`), and the same chat prompts run greedy with
logprobs (the chosen token's and the top 2). Against the bfloat16 KV run, per prompt:
the tokens generated before the first difference, the reference's margin between its top
two logprobs where they differ (a near tie lets any rounding flip the choice), and over
the tokens before it the mean |Δ logprob| of the chosen tokens.

    .venv/bin/python bench/kv_fp8_accuracy.py [--prompts 32] [--max-new-tokens 128]
        [--configs bfloat16,fp8_e4m3:one,fp8_e4m3:warmup,fp8_e5m2:one,fp8_e5m2:warmup]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
from pathlib import Path

import grpc

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from processes import start_cache_service, start_model_service  # noqa: E402

from pagedkv.model.v1 import model_pb2, model_pb2_grpc  # noqa: E402

TOPICS = [
    "the sea", "volcanoes", "honey bees", "the moon landing", "bread baking", "chess openings", "rainforests",
    "the printing press", "black holes", "coffee", "the Roman empire", "electric cars", "penguins",
    "photosynthesis", "jazz music", "the internet", "mountain climbing", "ancient Egypt", "recycling",
    "the human heart", "earthquakes", "origami", "the Olympic games", "solar panels", "whales", "tea ceremonies",
    "the Silk Road", "glaciers", "vaccines", "lighthouses", "the violin", "deserts",
]
FORMS = ["Write a short paragraph about {}.", "Explain {} to a child.", "List five facts about {}.",
         "Tell me a story that involves {}."]


def prompts(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": FORMS[index % len(FORMS)].format(TOPICS[index % len(TOPICS)])}]
            for index in range(count)]


def run_config(kv_dtype: str, scales: str, conversations, max_new_tokens: int, tmp: Path):
    """[(tokens, chosen logprobs, top-2 margins)] per prompt."""
    extra = ["--kv-cache-dtype", kv_dtype] + (["--kv-cache-scales", scales] if scales else [])
    with start_cache_service(tmp, "--kv-cache-bytes", "256MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", "smollm2", "--dtype", "bfloat16",
                                "--max-model-len", "1024", "--max-batch-prefill-tokens", "1024",
                                "--threads", "2", *extra, timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)

        def one(messages):
            request = model_pb2.GenerateRequest(
                messages=[model_pb2.ChatMessage(**message) for message in messages],
                sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True,
                                                 logprobs=2))
            tokens, chosen, margins = [], [], []
            for response in stub.Generate(request, timeout=3600):
                tokens.extend(response.token_ids)
                for entry in response.logprobs:
                    chosen.append(entry.logprob)
                    top = sorted((alternative.logprob for alternative in entry.top), reverse=True)
                    margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
            return tokens, chosen, margins

        with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
            return list(pool.map(one, conversations))


def compare(reference, candidate) -> dict:
    matched, deltas, tie_margins, flips = [], [], [], 0
    for (ref_tokens, ref_logprobs, ref_margins), (tokens, logprobs, _) in zip(reference, candidate, strict=True):
        same = 0
        while same < min(len(ref_tokens), len(tokens)) and ref_tokens[same] == tokens[same]:
            same += 1
        matched.append(same)
        deltas.extend(abs(a - b) for a, b in zip(ref_logprobs[:same], logprobs[:same]))
        if same < len(ref_tokens):
            flips += 1
            tie_margins.append(ref_margins[same])
    return {
        "identical": sum(1 for (r, _, _), (c, _, _) in zip(reference, candidate) if r == c),
        "mean_matched": statistics.mean(matched),
        "min_matched": min(matched),
        "mean_abs_dlogprob": statistics.mean(deltas) if deltas else 0.0,
        "max_abs_dlogprob": max(deltas) if deltas else 0.0,
        "max_margin_at_divergence": max(tie_margins) if tie_margins else 0.0,
        "divergences": flips,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", default="bfloat16,fp8_e4m3:one,fp8_e4m3:warmup,fp8_e5m2:one,fp8_e5m2:warmup")
    args = parser.parse_args()
    conversations = prompts(args.prompts)
    configs = [tuple((item.split(":") + [""])[:2]) for item in args.configs.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kv_dtype, scales in configs:
            results[(kv_dtype, scales)] = run_config(kv_dtype, scales, conversations, args.max_new_tokens, Path(tmp))
            print(f"ran {kv_dtype} {scales}", flush=True)
    reference = results[configs[0]]
    print(f"\n{args.prompts} prompts x {args.max_new_tokens} greedy tokens, SmolLM2 bfloat16 compute, "
          f"against {configs[0][0]} KV")
    print("| KV dtype | scales | identical | tokens before first difference (mean, min) | mean abs dlogprob "
          "| max abs dlogprob | largest ref top-2 margin where they differ |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config in configs[1:]:
        row = compare(reference, results[config])
        print(f"| {config[0]} | {config[1]} | {row['identical']}/{args.prompts} | {row['mean_matched']:.1f}, "
              f"{row['min_matched']} | {row['mean_abs_dlogprob']:.4f} | {row['max_abs_dlogprob']:.3f} "
              f"| {row['max_margin_at_divergence']:.3f} |")


if __name__ == "__main__":
    main()
