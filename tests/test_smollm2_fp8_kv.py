"""SmolLM2 (bfloat16 compute) through both real services with an fp8 KV pool and with a
bfloat16 one, each measured against one reference from outside: transformers in float64
on the same weights, over the same prompt and each run's own tokens (teacher forcing).
A pool of the other dtype is never shared.

The bfloat16 pool's own distance from float64 (its weights and compute rounded to
bfloat16) is the scale: the fp8 pool's chosen-token logprobs may stray from float64's by
FACTOR times as much on average, and where a run's greedy pick is not float64's best,
float64 must score it within FACTOR times the largest logprob error the bfloat16 pool
makes anywhere (a near tie at that run's noise level, not a wrong answer). Thresholds
come from that measured distribution in every run, not from one run's parting margin.
(A scale applied twice or never is caught at the kernels, whose tests use scales far
from 1: tests/test_kv_fp8_kernels.py.)
"""

from __future__ import annotations

import concurrent.futures
import copy

import grpc
import pytest
import torch

from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
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
# e4m3 keeps 3 mantissa bits to bfloat16's 7 (a rounding step 16x as large), but attention
# averages the K/V rounding over the context and the bfloat16 weights and compute err
# alike in both runs: a factor of 4 over the bfloat16 pool's own error bounds what the
# 8-bit pool may add (docs/benchmark-log.md, "fp8 KV cache", measures the two pools' distance).
FACTOR = 4


def run_stack(tmp_path_factory, kv_dtype: str):
    """(model info, [(tokens, chosen logprobs, top-2 margins)] per prompt) of a stack whose
    pool holds kv_dtype; the stacks run one after the other (two cores)."""
    tmp_path = tmp_path_factory.mktemp(f"smollm2-{kv_dtype}")
    with start_cache_service(tmp_path, *SHARED_LEASE_TTL, "--kv-cache-bytes", "32MiB") as cache, \
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
    for response in stub.Generate(request, timeout=1200):  # a bound on a hang, not a pace
        tokens.extend(response.token_ids)
        for entry in response.logprobs:
            chosen.append(entry.logprob)
            top = sorted((alternative.logprob for alternative in entry.top), reverse=True)
            margins.append(top[0] - top[1])
    return tokens, chosen, margins


# Each stack starts in a test of its own, so that each gets the timeout (minutes on a shared,
# loaded machine; seconds on a quiet one).
@pytest.mark.timeout(1800)
def test_bfloat16_pool_reports_bfloat16(bfloat16_run):
    info, _ = bfloat16_run
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    assert "/kv=" not in info.model_fingerprint


@pytest.mark.timeout(1800)
def test_fp8_pool_reports_fp8_twice_the_tokens_and_a_namespace_of_its_own(bfloat16_run, fp8_run):
    bf16_info, fp8_info = bfloat16_run[0], fp8_run[0]
    assert (fp8_info.dtype, fp8_info.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    # The same checkpoint, but its fp8 blocks live in a prefix namespace of their own.
    assert fp8_info.model_fingerprint.startswith(bf16_info.model_fingerprint + "/kv=fp8_e4m3:")
    # 32 MiB of pool: an fp8 block is half a bfloat16 one, so twice the tokens fit.
    assert fp8_info.max_total_tokens == 2 * bf16_info.max_total_tokens


@pytest.fixture(scope="module")
def float64_reference(smollm2_reference):
    tokenizer, model = smollm2_reference
    return tokenizer, copy.deepcopy(model).double().eval()


def against_float64(reference, run) -> tuple[torch.Tensor, torch.Tensor]:
    """Per generated token of every prompt: |the run's logprob - float64's| of the token the
    run chose, and how far below float64's best token float64 scores it (0: its best)."""
    tokenizer, model = reference
    errors, gaps = [], []
    for text, (tokens, chosen, _) in zip(PROMPTS, run, strict=True):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)]
        logprobs = torch.log_softmax(logits, dim=-1)
        theirs = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
        errors.append((torch.tensor(chosen, dtype=torch.float64) - theirs).abs())
        gaps.append(logprobs.max(dim=-1).values - theirs)
    return torch.cat(errors), torch.cat(gaps)


@pytest.mark.timeout(1800)  # loads the float64 reference: minutes on a loaded machine
def test_both_pools_stay_within_the_bfloat16_pools_distance_from_float64(bfloat16_run, fp8_run, float64_reference):
    for _, run in (bfloat16_run, fp8_run):
        assert [len(tokens) for tokens, _, _ in run] == [MAX_NEW_TOKENS] * len(PROMPTS)
    bf16_errors, bf16_gaps = against_float64(float64_reference, bfloat16_run[1])
    fp8_errors, fp8_gaps = against_float64(float64_reference, fp8_run[1])
    noise = float(bf16_errors.max())
    print(f"|logprob - float64's|: bfloat16 pool mean {float(bf16_errors.mean()):.4f} max {noise:.4f}; "
          f"fp8 pool mean {float(fp8_errors.mean()):.4f} max {float(fp8_errors.max()):.4f}; "
          f"float64's gaps to a pick: bfloat16 {float(bf16_gaps.max()):.4f}, fp8 {float(fp8_gaps.max()):.4f}")
    assert float(fp8_errors.mean()) <= FACTOR * float(bf16_errors.mean())
    # A pick float64 does not rank first is one float64 scores within the noise: for the
    # bfloat16 pool its own largest error, twice (both logprobs of the pair may move).
    assert float(bf16_gaps.max()) <= 2 * noise
    assert float(fp8_gaps.max()) <= 2 * FACTOR * noise
