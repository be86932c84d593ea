"""Which fp8 KV scales to default to, and what a broken scale looks like, on SmolLM2 in one process.

The model (`smollm2`, bfloat16 compute, the C decode kernel) runs greedy over the same chat
prompts once a pool: bfloat16 (the reference), then fp8 pools with unit scales ("one"), the
warmup's scales ("warmup": absmax / 200 and / 100 over the service's own warmup pass,
runner.measure_workspace), and deliberately wrong ones (every K and V scale 0.01: the K/V of
SmolLM2 saturate; 100: most of them round to zero). Against the reference, per run: prompts
identical, tokens before the first difference (mean, min), mean |Δ logprob| of the chosen
tokens before it, and the largest top-2 margin of the reference where a run first differs.
No services: what differs between the runs is only the pool's dtype and scales
(bench/serve/kv_fp8_accuracy.py does the same through both services).

    .venv/bin/python -m bench.engine.kv_fp8_scales [--prompts 16] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import os

import torch

from harness import paged_runner
from bench.serve.kv_fp8_accuracy import compare, prompt_token_ids, prompts

from model_service.attention.kv_quant import KvScales
from model_service.loading.loader import load_model
from model_service.worker.runner import measure_workspace


def greedy(loaded, token_lists, max_new_tokens, kv_dtype, scales):
    """[(tokens, chosen logprobs, top-2 margins)] per prompt, all prompts decoded together."""
    config = loaded.config
    loaded.model.set_kv_scales(None if scales is None else scales.layers)
    blocks = sum(-(-(len(t) + max_new_tokens) // paged_runner.BLOCK_SIZE) for t in token_lists) + 1
    paged_runner.NUM_BLOCKS = blocks
    runner = paged_runner.PagedRunner(loaded.model, config)
    runner.pool = torch.zeros((config.num_layers, 2, blocks, paged_runner.BLOCK_SIZE, config.num_kv_heads,
                               config.head_dim), dtype=kv_dtype)
    names = [str(i) for i in range(len(token_lists))]
    results = [([], [], []) for _ in names]
    logits = [runner.step([(name, tokens)], 0)[0][-1] for name, tokens in zip(names, token_lists)]
    for _ in range(max_new_tokens):
        step = []
        for (tokens, chosen, margins), row in zip(results, logits):
            logprobs = torch.log_softmax(row.float(), dim=-1)
            top = torch.topk(logprobs, 2)
            tokens.append(int(top.indices[0]))
            chosen.append(float(top.values[0]))
            margins.append(float(top.values[0] - top.values[1]))
        step = [(name, [result[0][-1]]) for name, result in zip(names, results)]
        logits = [rows[-1] for rows in runner.step(step, len(step))]
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2", torch.bfloat16, "cpu")
    config = loaded.config
    absmax: list = []
    measure_workspace(loaded.model, (config.num_layers, config.num_kv_heads, config.head_dim), torch.bfloat16,
                      torch.device("cpu"), block_size=16, num_tokens=1024, kv_absmax=absmax)
    warmup = KvScales.from_absmax(*absmax[0])
    token_lists = prompt_token_ids(loaded, prompts(args.prompts))
    runs = {
        ("bfloat16", ""): (torch.bfloat16, None),
        ("fp8_e4m3", "one"): (torch.float8_e4m3fn, KvScales.ones(config.num_layers)),
        ("fp8_e4m3", "warmup"): (torch.float8_e4m3fn, warmup),
        ("fp8_e5m2", "one"): (torch.float8_e5m2, KvScales.ones(config.num_layers)),
        ("fp8_e5m2", "warmup"): (torch.float8_e5m2, warmup),
        ("fp8_e4m3", "broken: 0.01"): (torch.float8_e4m3fn, KvScales(((0.01, 0.01),) * config.num_layers)),
        ("fp8_e4m3", "broken: 100"): (torch.float8_e4m3fn, KvScales(((100.0, 100.0),) * config.num_layers)),
    }
    results = {}
    for key, (dtype, scales) in runs.items():
        results[key] = greedy(loaded, token_lists, args.max_new_tokens, dtype, scales)
        print(f"ran {key}", flush=True)
    k_range = (min(k for k, _ in warmup.layers), max(k for k, _ in warmup.layers))
    v_range = (min(v for _, v in warmup.layers), max(v for _, v in warmup.layers))
    load = os.getloadavg()
    print(f"\n{args.prompts} chat prompts x {args.max_new_tokens} greedy tokens, SmolLM2 bfloat16 compute, in one "
          f"process, against a bfloat16 pool; warmup scales K {k_range[0]:.4f}-{k_range[1]:.4f}, "
          f"V {v_range[0]:.4f}-{v_range[1]:.4f}; load average {load[0]:.1f}")
    print("| KV dtype | scales | identical | tokens before first difference (mean, min) | mean abs dlogprob "
          "| max abs dlogprob | largest ref top-2 margin where they differ |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reference = results[("bfloat16", "")]
    for key in list(runs)[1:]:
        row = compare(reference, results[key])
        print(f"| {key[0]} | {key[1]} | {row['identical']}/{args.prompts} | {row['mean_matched']:.1f}, "
              f"{row['min_matched']} | {row['mean_abs_dlogprob']:.4f} | {row['max_abs_dlogprob']:.3f} "
              f"| {row['max_margin_at_divergence']:.3f} |")


if __name__ == "__main__":
    main()
