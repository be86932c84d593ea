"""KV tiers through real services (the tiny model): greedy output is the same whether a
prompt's prefix is computed, promoted from the host tier, or read back from disk after
a restart of the cache service, even one killed with SIGKILL in the middle of demotions;
usage says which tier the cached tokens came from, and nothing stays leased.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
import torch
from cache_helpers import cache_stub, leased_blocks, stats, wait_for
from processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.timeout(300)

# 16 blocks of 16 tokens: three 108-token requests after the first evict all of its blocks.
POOL_ARGS = ("--kv-cache-bytes", "1MiB", "--max-blocks", "16")
MODEL_ARGS = ("--max-model-len", "128")
PROMPT_LEN, NEW_TOKENS = 100, 8
FULL_BLOCK_TOKENS = 96  # the prompt's full blocks a second request may reuse: (100 - 1) // 16 blocks


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 250, (PROMPT_LEN,), generator=generator).tolist()


def generate(stub, tokens: list[int]) -> tuple[list[int], model_pb2.Usage]:
    request = model_pb2.GenerateRequest(prompt_token_ids=tokens, sampling=model_pb2.SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    out, last = [], None
    for response in stub.Generate(request, timeout=120):
        out.extend(response.token_ids)
        last = response
    return out, last.usage


def tier(cache_stats, name: str):
    return next(entry for entry in cache_stats.tiers if entry.tier == name)


def evict_with_other_prompts(stub) -> None:
    for seed in range(100, 103):
        generate(stub, prompt(seed))


def test_greedy_output_is_the_same_after_promotion_from_the_host_tier(tmp_path):
    with start_cache_service(tmp_path, *POOL_ARGS, "--host-cache-bytes", "1MiB") as cache, \
            start_model_service(tmp_path, cache.address, *MODEL_ARGS) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        cstub = cache_stub(cache.address)
        tokens = prompt(1)
        want, usage = generate(stub, tokens)
        assert usage.cached_tokens == 0
        wait_for(lambda: tier(stats(cstub), "host").blocks_cached >= 6, 30, "the prompt's blocks demoted to host")
        evict_with_other_prompts(stub)
        got, usage = generate(stub, tokens)
        assert got == want
        assert (usage.cached_tokens, usage.cached_tokens_host, usage.cached_tokens_disk) == (FULL_BLOCK_TOKENS,) * 2 + (0,)
        host = tier(stats(cstub), "host")
        assert host.promotions >= 6 and host.hit_tokens >= FULL_BLOCK_TOKENS and host.bytes_out > 0
        # The OpenAI API says the same in usage.prompt_tokens_details.
        wait_for(lambda: tier(stats(cstub), "host").blocks_cached >= 24, 30, "every prompt demoted to host")
        evict_with_other_prompts(stub)
        body = json.dumps({"model": "tiny", "prompt": tokens, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{model.http_url}/completions", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            details = json.loads(response.read())["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] == FULL_BLOCK_TOKENS and details["cached_tokens_host"] == FULL_BLOCK_TOKENS
        wait_for(lambda: leased_blocks(cstub) == 0, 30, "no block leased")


def test_the_disk_tier_serves_the_same_output_after_a_restart_and_a_kill(tmp_path):
    disk = tmp_path / "kv-disk"
    disk_args = ("--disk-cache-dir", disk, "--disk-cache-bytes", "4MiB")
    tokens = prompt(2)
    with start_cache_service(tmp_path, *POOL_ARGS, *disk_args) as cache, \
            start_model_service(tmp_path, cache.address, *MODEL_ARGS) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        want, usage = generate(stub, tokens)
        cstub = cache_stub(cache.address)
        wait_for(lambda: tier(stats(cstub), "disk").blocks_cached >= 6, 30, "the prompt's blocks written to disk")
        # More demotions in flight, then SIGKILL: whatever it was writing must not be served.
        for seed in range(200, 203):
            generate(stub, prompt(seed))
        cache.kill()
    with start_cache_service(tmp_path, *POOL_ARGS, *disk_args) as cache, \
            start_model_service(tmp_path, cache.address, *MODEL_ARGS) as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        got, usage = generate(stub, tokens)
        assert got == want
        assert (usage.cached_tokens, usage.cached_tokens_disk) == (FULL_BLOCK_TOKENS,) * 2
        cstub = cache_stub(cache.address)
        assert tier(stats(cstub), "disk").errors == 0
        assert not [path for path in (disk).rglob("*.tmp")], "a temporary file survived the restart"
        wait_for(lambda: leased_blocks(cstub) == 0, 30, "no block leased")
