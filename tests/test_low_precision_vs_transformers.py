"""bfloat16 and float16 against transformers in the same dtype, on the same weights.

The tolerance and the greedy rule are low_precision.py's: logits within a few units of the
dtype's rounding at their scale (here transformers' own 16-bit logits are 5-8 times closer
than that to its float32 ones; a wrong mask, a dropped bias or a wrong block moves logits by
whole units), and greedy tokens equal until transformers' own top-2 are a near tie.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import torch
from grpc_generate import greedy

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.low_precision import agreeing_prefix, assert_close_in_dtype, reference_greedy_with_logits
from harness.paged_runner import PagedRunner
from harness.processes import start_cache_service, start_model_service
from model_service.loading.loader import load_model
from pagedkv.model.v1 import model_pb2_grpc

KINDS = ["llama", "mistral", "qwen2"]  # mistral: sliding window 7, shorter than the sequences
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Through both services, each kind once and each dtype at least once: a stack per case is
# most of this module's time, and test_paged_logits_within_dtype_tolerance crosses them all.
SERVICE_CASES = [("llama", "bfloat16"), ("mistral", "float16"), ("qwen2", "bfloat16")]


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory):
    """The kind's checkpoint, written once for the module."""
    written = {}

    def of(kind: str):
        if kind not in written:
            written[kind] = write_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return written[kind]

    return of


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, checkpoint_of):
    return request.param, checkpoint_of(request.param)


def load_reference(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_paged_logits_within_dtype_tolerance(checkpoint, dtype_name):
    kind, path = checkpoint
    dtype = DTYPES[dtype_name]
    loaded = load_model(str(path), dtype, "cpu")
    reference = load_reference(path, dtype)
    prompt = loaded.tokenizer.encode("Paged attention keeps the KV cache in blocks; 日本語 🙂 too.")
    runner = PagedRunner(loaded.model, loaded.config)
    assert runner.pool.dtype == dtype

    prefix_len = 9
    (logits,) = runner.step([("a", prompt[:prefix_len])], num_decode_seqs=0)
    expected = reference_logits(reference, prompt)
    assert_close_in_dtype(logits, expected[:prefix_len], dtype, f"{kind} {dtype_name} prefill")
    for position in range(prefix_len, len(prompt)):  # decode past the window (mistral: 7)
        (logits,) = runner.step([("a", [prompt[position]])], num_decode_seqs=1)
        assert_close_in_dtype(logits, expected[position : position + 1], dtype, f"{kind} {dtype_name} decode {position}")

@pytest.mark.parametrize(("kind", "dtype_name"), SERVICE_CASES)
def test_greedy_through_both_services(checkpoint_of, kind, dtype_name, tmp_path):
    path = checkpoint_of(kind)
    dtype = DTYPES[dtype_name]
    reference = load_reference(path, dtype)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (6, 19, 33)]
    new_tokens = 12
    expected = [reference_greedy_with_logits(reference, prompt, new_tokens) for prompt in prompts]

    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(path), "--dtype", dtype_name) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched decode
            results = list(pool.map(lambda p: greedy(stub, p, new_tokens)[0], prompts))
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block to be released")

    agreed = [
        agreeing_prefix(ours, theirs, logits, dtype, f"{kind} {dtype_name} prompt {i}")
        for i, (ours, (theirs, logits)) in enumerate(zip(results, expected))
    ]
    print(f"{kind} {dtype_name}: tokens agreeing before a near tie {agreed} of {new_tokens} each")
    # A floor, so that agreeing on nothing (each first disagreement at a near tie) cannot
    # pass: every prompt's first token agrees, and half of all tokens before a near tie.
    # Seen on CPU: llama bfloat16 [11, 12, 2], float16 [12, 12, 12], mistral bfloat16 [12, 12, 12].
    assert min(agreed) >= 1 and sum(agreed) >= len(prompts) * new_tokens // 2, agreed
