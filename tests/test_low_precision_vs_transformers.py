"""bfloat16 and float16 against transformers in the same dtype, on the same weights.

Two outputs computed in a 16-bit dtype by different (both correct) code differ by rounding,
so the comparisons use a tolerance fit for the dtype: a few units of its rounding at the
scale of the logits (`dtype_tolerance`). Here transformers' own 16-bit logits are 5-8 times
closer than that to its float32 ones; a wrong mask, a dropped bias or a wrong block moves
logits by whole units.

Greedy generations must agree token for token until the first position where
transformers' own top-2 logits are within that tolerance (a near tie that rounding may
break either way; vLLM's check_logprobs_close); there our token must be transformers'
runner-up, and the comparison stops, since the two continuations then differ.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import torch
from cache_helpers import cache_stub, stats, wait_for
from hf_checkpoints import write_checkpoint
from paged_runner import PagedRunner
from processes import start_cache_service, start_model_service

from model_service.models.loader import load_model
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

KINDS = ["llama", "mistral", "qwen2"]  # mistral: sliding window 7, shorter than the sequences
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
ULPS = 4


def dtype_tolerance(dtype: torch.dtype, reference_logits: torch.Tensor) -> float:
    """ULPS units of the dtype's rounding (its eps) at the largest logit's magnitude."""
    return ULPS * torch.finfo(dtype).eps * float(reference_logits.abs().max())


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return request.param, write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def load_reference(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def assert_close_in_dtype(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    tolerance = dtype_tolerance(dtype, expected)
    error = float((ours - expected).abs().max())
    assert error <= tolerance, f"{where}: logits differ by {error:.4f} > {tolerance:.4f} ({ULPS} ulps of {dtype})"
    # The argmax agrees wherever transformers' top two are further apart than the tolerance.
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tolerance
    assert torch.equal(ours.argmax(-1)[clear], expected.argmax(-1)[clear]), f"{where}: argmax differs"


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


def reference_greedy(reference, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate (eos ignored) and its raw logits at each step [n, vocab]."""
    with torch.inference_mode():
        output = reference.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            output_logits=True, return_dict_in_generate=True,
        )
    return output.sequences[0, len(prompt):].tolist(), torch.cat(output.logits).float()


def agreeing_prefix(ours: list[int], theirs: list[int], logits: torch.Tensor, dtype: torch.dtype, where: str) -> int:
    """How many tokens agree; fails unless the first disagreement is at a near tie."""
    assert len(ours) == len(theirs), where
    for position, (mine, expected) in enumerate(zip(ours, theirs)):
        if mine != expected:
            tolerance = dtype_tolerance(dtype, logits[position])
            top2 = logits[position].topk(2)
            gap = float(top2.values[0] - top2.values[1])
            assert gap <= tolerance and mine == int(top2.indices[1]), (
                f"{where}: token {position} is {mine}, transformers' is {expected} with a top-2 gap of "
                f"{gap:.4f} (tolerance {tolerance:.4f}); ours {ours}, theirs {theirs}"
            )
            return position
    return len(ours)


def generate(stub, prompt: list[int], max_new_tokens: int) -> list[int]:
    request = model_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
    )
    tokens, last = [], None
    for response in stub.Generate(request, timeout=120):
        tokens.extend(response.token_ids)
        last = response
    assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH
    return tokens


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_greedy_through_both_services(checkpoint, dtype_name, tmp_path):
    kind, path = checkpoint
    dtype = DTYPES[dtype_name]
    reference = load_reference(path, dtype)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 300, (n,), generator=generator).tolist() for n in (6, 19, 33)]
    new_tokens = 12
    expected = [reference_greedy(reference, prompt, new_tokens) for prompt in prompts]

    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(path), "--dtype", dtype_name) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # batched decode
            results = list(pool.map(lambda p: generate(stub, p, new_tokens), prompts))
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block to be released")

    agreed = [
        agreeing_prefix(ours, theirs, logits, dtype, f"{kind} {dtype_name} prompt {i}")
        for i, (ours, (theirs, logits)) in enumerate(zip(results, expected))
    ]
    print(f"{kind} {dtype_name}: tokens agreeing before a near tie {agreed} of {new_tokens} each")
