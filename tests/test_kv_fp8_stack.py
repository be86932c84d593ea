"""An fp8 pool through real services (the tiny model): prefix hits from the pool and from
the host tier read the same bytes, forks copy 8-bit blocks, and nothing stays leased.
(A prefix hit reads the prompt's K/V back in 8 bits where the first run attended over them
unquantized, as in vLLM, so hits are compared with hits.)"""

from __future__ import annotations

import grpc
import pytest
import torch
from test_kv_tiers_stack import FULL_BLOCK_TOKENS, MODEL_ARGS, POOL_ARGS, evict_with_other_prompts, generate, prompt, tier

from harness.cache_helpers import cache_stub, leased_blocks, stats, wait_for
from harness.processes import start_cache_service, start_model_service
from cache_service.tiers.host_tier import HostTier
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.timeout(300)


def test_prefix_hits_from_the_pool_and_the_host_tier_and_forks_on_an_fp8_pool(tmp_path):
    with start_cache_service(tmp_path, *POOL_ARGS, "--host-cache-bytes", "1MiB") as cache, \
            start_model_service(tmp_path, cache.address, *MODEL_ARGS, "--kv-cache-dtype", "fp8_e4m3",
                                "--kv-cache-scales", "warmup") as model:
        stub = model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address))
        cstub = cache_stub(cache.address)
        tokens = prompt(1)
        generate(stub, tokens)
        from_pool, usage = generate(stub, tokens)
        assert usage.cached_tokens == FULL_BLOCK_TOKENS
        wait_for(lambda: tier(stats(cstub), "host").blocks_cached >= 6, 30, "the prompt's blocks demoted to host")
        evict_with_other_prompts(stub)
        from_host, usage = generate(stub, tokens)
        assert (usage.cached_tokens, usage.cached_tokens_host) == (FULL_BLOCK_TOKENS, FULL_BLOCK_TOKENS)
        assert from_host == from_pool

        # n=2 greedy: the completions fork the prompt's blocks (the last partial one copied).
        request = model_pb2.GenerateRequest(prompt_token_ids=prompt(7), sampling=model_pb2.SamplingParams(
            max_new_tokens=8, temperature=0, ignore_eos=True, n=2))
        completions: dict[int, list[int]] = {0: [], 1: []}
        for response in stub.Generate(request, timeout=120):
            completions[response.index].extend(response.token_ids)
        assert completions[0] == completions[1] and len(completions[0]) == 8
        wait_for(lambda: leased_blocks(cstub) == 0, 30, "no block leased")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_host_tier_moves_fp8_blocks_byte_for_byte(dtype):
    pool = (torch.randn(2, 2, 6, 4, 1, 8) * 50).to(dtype)
    tier_storage = HostTier(pool, num_slots=3)
    tier_storage.store(pool, [4, 1], [0, 2])
    restored = torch.zeros_like(pool)
    tier_storage.load([2, 0], restored, [3, 5])
    assert torch.equal(restored[:, :, 3].view(torch.uint8), pool[:, :, 1].view(torch.uint8))
    assert torch.equal(restored[:, :, 5].view(torch.uint8), pool[:, :, 4].view(torch.uint8))
