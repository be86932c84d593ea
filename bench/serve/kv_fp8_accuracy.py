"""How close fp8 KV stays to bfloat16 KV on SmolLM2, pagedkv's and vLLM's CPU engine's, greedy tokens and logprobs.

The chat prompts are rendered once, by pagedkv's chat template and tokenizer, and both
engines get the same token ids. Greedy, eos ignored, logprobs of the chosen token and the
top 2, bfloat16 compute, the same max_model_len, prefix caching off on vLLM.
  - pagedkv: for each configuration (KV dtype, scales) a cache service and a model service
    start (`--model smollm2 --dtype bfloat16 --kv-cache-dtype ...`), all prompts at once over
    gRPC.
  - vLLM: its offline engine (harness/peers/vllm_worker.py, in the vLLM venv harness/peers/vllm_offline.py makes or
    PAGEDKV_VLLM_VENV names) with kv_cache_dtype auto (= bfloat16), fp8_e4m3, fp8_e5m2, its
    default scales (1.0; on CPU fp8 KV needs AVX-512 or AMX), on the float32 Hugging Face copy
    of the same GGUF (harness.peers.vllm_offline.smollm2_checkpoint: in bfloat16 its tensors equal those
    pagedkv loads from the GGUF), one engine start a configuration, all prompts in one generate.
Each engine's fp8 runs against its own bfloat16 KV run, per prompt: the tokens generated
before the first difference, the reference's margin between its top two logprobs where they
differ (a near tie lets any rounding flip the choice), and over the tokens before it the
mean |Δ logprob| of the chosen tokens. Also printed: pagedkv's bfloat16 run against vLLM's.

    .venv/bin/python -m bench.serve.kv_fp8_accuracy [--prompts 32] [--max-new-tokens 128]
        [--configs bfloat16,fp8_e4m3:one,fp8_e4m3:warmup,fp8_e5m2:one,fp8_e5m2:warmup]
        [--vllm-configs bfloat16,fp8_e4m3,fp8_e5m2]   (empty: no vLLM)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from harness.peers.vllm_offline import MAX_MODEL_LEN, VllmWorker, ensure_vllm_venv, smollm2_checkpoint
from harness.processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

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


def prompt_token_ids(loaded, conversations) -> list[list[int]]:
    """The chat prompts as the model service renders them: its template, no special tokens added."""
    return [loaded.tokenizer.encode(loaded.chat_template.render(messages), add_special_tokens=False)
            for messages in conversations]


def render(conversations) -> list[list[int]]:
    import torch

    from model_service.loading.loader import load_model

    return prompt_token_ids(load_model("smollm2", torch.bfloat16, "cpu"), conversations)


def margin(top) -> float:
    top = sorted(top, reverse=True)
    return top[0] - top[1] if len(top) > 1 else math.inf


def run_config(kv_dtype: str, scales: str, token_lists, max_new_tokens: int, tmp: Path):
    """[(tokens, chosen logprobs, top-2 margins)] per prompt."""
    extra = ["--kv-cache-dtype", kv_dtype] + (["--kv-cache-scales", scales] if scales else [])
    with start_cache_service(tmp, "--kv-cache-bytes", "256MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", "smollm2", "--dtype", "bfloat16",
                                "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-prefill-tokens", "1024",
                                "--threads", "2", *extra, timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)

        def one(prompt):
            request = model_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True,
                                                 logprobs=2))
            tokens, chosen, margins = [], [], []
            for response in stub.Generate(request, timeout=3600):
                tokens.extend(response.token_ids)
                for entry in response.logprobs:
                    chosen.append(entry.logprob)
                    margins.append(margin([alternative.logprob for alternative in entry.top]))
            return tokens, chosen, margins

        with concurrent.futures.ThreadPoolExecutor(len(token_lists)) as pool:
            return list(pool.map(one, token_lists))


def run_vllm(python: Path, kv_dtype: str, token_lists, max_new_tokens: int, tmp: Path):
    """The same as run_config, from vLLM's offline engine with this kv_cache_dtype (bfloat16: auto)."""
    worker = VllmWorker(python, smollm2_checkpoint(), "bfloat16", tmp / f"vllm-{kv_dtype}.log", 2,
                        "auto" if kv_dtype == "bfloat16" else kv_dtype)
    try:
        reply = worker.run([[tokens, max_new_tokens] for tokens in token_lists], logprobs=2)
    finally:
        worker.close()
    return [(tokens, [chosen for chosen, _ in entries], [margin(top) for _, top in entries])
            for tokens, entries in zip(reply["outputs"], reply["logprobs"], strict=True)]


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


ROW_HEADER = ("| engine | KV dtype | scales | identical | tokens before first difference (mean, min) "
              "| mean abs dlogprob | max abs dlogprob | largest ref top-2 margin where they differ |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |")


def row(engine: str, kv_dtype: str, scales: str, reference, candidate) -> str:
    measured = compare(reference, candidate)
    return (f"| {engine} | {kv_dtype} | {scales} | {measured['identical']}/{len(reference)} "
            f"| {measured['mean_matched']:.1f}, {measured['min_matched']} | {measured['mean_abs_dlogprob']:.4f} "
            f"| {measured['max_abs_dlogprob']:.3f} | {measured['max_margin_at_divergence']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--configs", default="bfloat16,fp8_e4m3:one,fp8_e4m3:warmup,fp8_e5m2:one,fp8_e5m2:warmup",
                        help="pagedkv's, KV dtype[:scales]; the first is the reference")
    parser.add_argument("--vllm-configs", default="bfloat16,fp8_e4m3,fp8_e5m2",
                        help="vLLM's kv_cache_dtype (bfloat16: auto); the first is the reference; empty: no vLLM")
    args = parser.parse_args()
    configs = [tuple((item.split(":") + [""])[:2]) for item in args.configs.split(",")]
    vllm_configs = [item for item in args.vllm_configs.split(",") if item]
    python = ensure_vllm_venv() if vllm_configs else None
    token_lists = render(prompts(args.prompts))
    results, vllm_results = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kv_dtype, scales in configs:
            started = time.monotonic()
            results[(kv_dtype, scales)] = run_config(kv_dtype, scales, token_lists, args.max_new_tokens, Path(tmp))
            print(f"ran pagedkv {kv_dtype} {scales} in {time.monotonic() - started:.0f} s (start included)", flush=True)
        for kv_dtype in vllm_configs:
            started = time.monotonic()
            vllm_results[kv_dtype] = run_vllm(python, kv_dtype, token_lists, args.max_new_tokens, Path(tmp))
            print(f"ran vLLM {kv_dtype} in {time.monotonic() - started:.0f} s (start included)", flush=True)
    print(f"\n{args.prompts} prompts ({min(map(len, token_lists))}-{max(map(len, token_lists))} tokens) x "
          f"{args.max_new_tokens} greedy tokens, SmolLM2 bfloat16 compute; each engine against its own "
          f"{configs[0][0]} KV run (pagedkv) / {vllm_configs[0] if vllm_configs else '-'} KV run (vLLM)")
    print(ROW_HEADER)
    for config in configs[1:]:
        print(row("pagedkv", *config, results[configs[0]], results[config]))
    for kv_dtype in vllm_configs[1:]:
        print(row("vLLM", kv_dtype, "default (1.0)", vllm_results[vllm_configs[0]], vllm_results[kv_dtype]))
    if vllm_configs:
        print("\nThe two engines' references against each other (vLLM's against pagedkv's):")
        print(ROW_HEADER)
        print(row("vLLM", f"{vllm_configs[0]} / pagedkv {configs[0][0]}", "", results[configs[0]],
                  vllm_results[vllm_configs[0]]))


if __name__ == "__main__":
    main()
