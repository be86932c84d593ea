"""SmolLM2 (bfloat16 compute) through both real services with an fp8 KV pool, against the
same model with a bfloat16 pool: greedy tokens and logprobs stay close, and a pool of the
other dtype is never shared.

The floor (bench/kv_fp8_accuracy.py measures it at 32 prompts x 128 tokens, BENCHMARKS.md):
every prompt's greedy tokens equal the bfloat16 run's up to the first position where
bfloat16's own top two logprobs lie within NEAR_TIE of each other (there any rounding may
pick the other one), and over the tokens before the first difference the chosen tokens'
logprobs differ by MEAN_ABS_DLOGPROB at most on average. (A scale applied twice or never
is caught at the kernels, whose tests use scales far from 1: tests/test_kv_fp8_kernels.py.)
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
from processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

PROMPTS = [
    "Write a short paragraph about the sea.",
    "Explain photosynthesis to a child.",
    "List five facts about honey bees.",
    "Tell me a story that involves a lighthouse.",
    "What is the capital of France?",
    "Name three primary colors.",
]
MAX_NEW_TOKENS = 32
# Measured with e4m3 and unit scales (BENCHMARKS.md, "fp8 KV cache"): this test's 6 prompts
# x 32 tokens, mean |Δ logprob| 0.042 over the 122 tokens before the first differences;
# 4 prompts x 16 tokens, 0.027, first differences where bfloat16's top two were at most
# 0.125 apart. The bounds leave about 2.5x and 4x that. Since prefill attention on a pool
# of the model's dtype is the C kernel's (attention/backend.py) while an 8-bit pool's stays
# SDPA over the step's unquantized K/V, the two runs also round the prompt's attention
# differently: "Name three primary colors." then parts at a margin of 0.5 (a few bfloat16
# steps of a logit near 20), so the near tie is 0.75.
NEAR_TIE = 0.75
MEAN_ABS_DLOGPROB = 0.1


def run_stack(tmp_path_factory, kv_dtype: str):
    """(model info, [(tokens, chosen logprobs, top-2 margins)] per prompt) of a stack whose
    pool holds kv_dtype; the stacks run one after the other (two cores)."""
    tmp_path = tmp_path_factory.mktemp(f"smollm2-{kv_dtype}")
    with start_cache_service(tmp_path, "--kv-cache-bytes", "32MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", "smollm2", "--dtype", "bfloat16",
                                "--kv-cache-dtype", kv_dtype, "--max-model-len", "256",
                                "--max-batch-prefill-tokens", "256", timeout_s=600) as model, \
            grpc.insecure_channel(model.address) as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=30)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            return info, list(pool.map(lambda text: greedy(stub, text), PROMPTS))


@pytest.fixture(scope="module")
def bfloat16_run(tmp_path_factory):
    return run_stack(tmp_path_factory, "bfloat16")


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    return run_stack(tmp_path_factory, "fp8_e4m3")


def greedy(stub, text: str):
    request = model_pb2.GenerateRequest(
        messages=[model_pb2.ChatMessage(role="user", content=text)],
        sampling=model_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2))
    tokens, chosen, margins = [], [], []
    for response in stub.Generate(request, timeout=300):
        tokens.extend(response.token_ids)
        for entry in response.logprobs:
            chosen.append(entry.logprob)
            top = sorted((alternative.logprob for alternative in entry.top), reverse=True)
            margins.append(top[0] - top[1])
    return tokens, chosen, margins


# Each stack starts in a test of its own, so that each gets the timeout (minutes on a shared,
# loaded machine; seconds on a quiet one).
@pytest.mark.timeout(900)
def test_bfloat16_pool_reports_bfloat16(bfloat16_run):
    info, _ = bfloat16_run
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert "/kv=" not in info.model_fingerprint


@pytest.mark.timeout(900)
def test_fp8_pool_reports_fp8_twice_the_tokens_and_a_namespace_of_its_own(bfloat16_run, fp8_run):
    bf16_info, fp8_info = bfloat16_run[0], fp8_run[0]
    assert (fp8_info.dtype, fp8_info.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    # The same checkpoint, but its fp8 blocks live in a prefix namespace of their own.
    assert fp8_info.model_fingerprint.startswith(bf16_info.model_fingerprint + "/kv=fp8_e4m3:")
    # 32 MiB of pool: an fp8 block is half a bfloat16 one, so twice the tokens fit.
    assert fp8_info.max_total_tokens == 2 * bf16_info.max_total_tokens


def test_greedy_tokens_and_logprobs_stay_with_bfloat16_kv(bfloat16_run, fp8_run):
    reference, candidate = bfloat16_run[1], fp8_run[1]
    deltas = []
    for text, (ref_tokens, ref_logprobs, ref_margins), (tokens, logprobs, _) in zip(
            PROMPTS, reference, candidate, strict=True):
        assert len(tokens) == len(ref_tokens) == MAX_NEW_TOKENS
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), MAX_NEW_TOKENS)
        if same < MAX_NEW_TOKENS:
            assert ref_margins[same] < NEAR_TIE, (
                f"{text!r}: fp8 KV chose token {tokens[same]} at position {same}, where bfloat16 KV's top two "
                f"logprobs were {ref_margins[same]:.3f} apart (not a near tie)")
        deltas.extend(abs(a - b) for a, b in zip(ref_logprobs[:same], logprobs[:same]))
    assert len(deltas) >= MAX_NEW_TOKENS  # enough agreeing tokens for the mean to mean something
    mean = sum(deltas) / len(deltas)
    print(f"mean |Δ logprob| {mean:.4f} over {len(deltas)} tokens")
    assert mean < MEAN_ABS_DLOGPROB, f"mean |Δ logprob| {mean:.4f} over {len(deltas)} tokens"
