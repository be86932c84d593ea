"""Greedy outputs through both real services equal transformers', token for token.

Each checkpoint is a tiny random model in Hugging Face format written by the test; the
cache and model services run as real processes; requests go over real channels.
"""

from __future__ import annotations

import concurrent.futures
import urllib.request

import grpc
import pytest
import torch
from grpc_generate import greedy

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import start_cache_service, start_model_service
from harness.reference_generate import reference_greedy
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [5 + (17 * i) % 40 for i in range(count)]
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


def write_and_load(kind: str, directory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(kind, directory)
    return kind, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen2-window"])
def checkpoint(request, tmp_path_factory):
    return write_and_load(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_and_load("llama", tmp_path_factory.mktemp("llama-preempt"))


def test_one_and_eight_concurrent_requests_match(checkpoint, tmp_path):
    kind, path, reference = checkpoint
    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(path)) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        batch = prompts(8, 300, seed=1)
        lengths = [6 + 5 * i for i in range(8)]
        expected = [reference_greedy(reference, p, n) for p, n in zip(batch, lengths)]

        tokens, last = greedy(stub, batch[0], lengths[0])
        assert tokens == expected[0], f"{kind}: single request differs from transformers"
        assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH
        assert last.usage.prompt_tokens == len(batch[0]) and last.usage.completion_tokens == lengths[0]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: greedy(stub, batch[i], lengths[i])[0], range(8)))
        for i, (got, want) in enumerate(zip(results, expected)):
            assert got == want, f"{kind}: concurrent request {i} differs from transformers"
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block to be released")


def test_preemption_and_prefix_cache_keep_outputs_exact(llama, tmp_path):
    kind, path, reference = llama
    # 24 blocks of 16 tokens: 8 requests of up to ~90 tokens cannot all run at once.
    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
    with start_cache_service(tmp_path, "--kv-cache-bytes", str(24 * block_bytes), "--headroom", "0") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(path), "--max-model-len", "256") as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        batch = prompts(8, 300, seed=2)
        batch = [p + p[:20] for p in batch]  # longer prompts
        expected = [reference_greedy(reference, p, 40) for p in batch]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: greedy(stub, p, 40), batch))
        assert [tokens for tokens, _ in answers] == expected, f"{kind}: outputs changed under preemption"
        metrics = urllib.request.urlopen(model.metrics_url).read().decode()
        preemptions = [line for line in metrics.splitlines() if line.startswith("pagedkv_model_preemptions_total")]
        assert preemptions and float(preemptions[0].split()[-1]) > 0, "the small pool forced no preemption"
        # Each request's usage says what the pool lent it and what preemption cost it: K/V
        # at prompt + 39 positions at least, never past prompt + 40 nor the 24 blocks, and
        # a preempted request computes again what its released blocks no longer hold.
        for prompt, (_, last) in zip(batch, answers):
            assert -(-(len(prompt) + 39) // 16) <= last.usage.peak_kv_blocks <= min(24, -(-(len(prompt) + 40) // 16))
            assert last.usage.peak_kv_bytes == last.usage.peak_kv_blocks * block_bytes
        assert sum(last.usage.recomputed_tokens for _, last in answers) > 0, "preempted, yet nothing recomputed"

        # The longest prompt again, twice: the second run's full blocks come from the prefix
        # cache. (After the batch alone they may not: with 24 blocks, requests that finished
        # later can have evicted them, depending on how the batch was scheduled.)
        longest = max(range(len(batch)), key=lambda i: len(batch[i]))
        assert len(batch[longest]) > 32
        assert greedy(stub, batch[longest], 40)[0] == expected[longest]
        tokens, last = greedy(stub, batch[longest], 40)
        assert tokens == expected[longest]
        assert last.usage.cached_tokens >= 16 and last.usage.cached_tokens % 16 == 0
        cache_stats = stats(cache_stub(cache.address))
        assert cache_stats.prefix_hits >= last.usage.cached_tokens
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block to be released")
