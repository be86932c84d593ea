"""SmolLM2 through both real services with KV tiers (conftest's smollm2_stack: a 64 MiB pool,
a 32 MiB host tier, a 128 MiB disk tier): a prompt's greedy output is the same when its
prefix comes back from the host tier, and from the disk tier after other prompts pushed it
out of the host tier; Usage says which tier the cached tokens came from.

The pool holds more blocks than the host tier, so pressure pushes a block out of the host
tier long before it leaves the pool, and evicting it from the pool by pressure costs
prefilling a whole pool (about 1,400 tokens, most of a minute on the shared cores):
the pool drops its copies through ResetPrefixCache instead (the tiers keep theirs; pool
eviction under pressure is test_kv_tiers_stack's, on the tiny model). A prompt run right
after the reset takes the freed blocks (they go to the front of the free list) and
overwrites them, so only the tier's copy can bring the first prompt's K/V back.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from grpc_generate import greedy

from harness.cache_helpers import cache_stub, stats, wait_for
from pagedkv.model.v1 import model_pb2

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 4
BLOCK = 16
PRESSURE_PROMPT_TOKENS = 480  # under the stack's --max-model-len 512, with the new tokens


def generate(stub, prompt: str = "", token_ids=()) -> tuple[list[int], model_pb2.Usage]:
    out, last = greedy(stub, token_ids, NEW_TOKENS, timeout=300, prompt=prompt)
    return out, last.usage


def tier(cache, name: str):
    return next(entry for entry in stats(cache).tiers if entry.tier == name)


def settled(cache) -> bool:
    """Nothing leased and no demotion on its way: every released block is where it will stay."""
    cache_stats = stats(cache)
    return cache_stats.blocks_leased == 0 and all(entry.blocks_queued == 0 for entry in cache_stats.tiers)


def full_block_tokens(usage: model_pb2.Usage) -> int:
    """The prompt tokens a later request may get from the cache: its full blocks but the last token's."""
    return (usage.prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack.stub, cache_stub(smollm2_stack.cache.address), smollm2_stack.model


def drop_from_the_pool(stub, model, prompt_tokens: int, seed: int) -> None:
    """The pool forgets its cached blocks; a prompt of ``prompt_tokens`` random tokens
    overwrites the ones freed last (the latest prompt's)."""
    reset = urllib.request.Request(model.http_url.removesuffix("/v1") + "/reset_prefix_cache", data=b"{}",
                                   method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(reset, timeout=60) as response:
        assert json.loads(response.read())["blocks_dropped"] > 0
    generate(stub, token_ids=random_tokens(prompt_tokens, seed))


def random_tokens(count: int, seed: int) -> list[int]:
    return torch.randint(1000, 40000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prompt_dropped_from_the_pool_comes_back_from_the_host_tier(stack):
    stub, cache, model = stack
    prompt = "List four things a gardener does in early spring, and say why each one matters."
    want, usage = generate(stub, prompt)
    cacheable = full_block_tokens(usage)
    assert cacheable >= BLOCK and usage.cached_tokens < cacheable  # not from an earlier run
    wait_for(lambda: settled(cache), 60, "the prompt's blocks demoted to the host tier")
    drop_from_the_pool(stub, model, usage.prompt_tokens, seed=24)
    host = tier(cache, "host")
    got, usage = generate(stub, prompt)
    assert got == want
    assert (usage.cached_tokens, usage.cached_tokens_host, usage.cached_tokens_disk) == (cacheable, cacheable, 0)
    assert tier(cache, "host").promotions - host.promotions == cacheable // BLOCK
    wait_for(lambda: stats(cache).blocks_leased == 0, 60, "no block leased")


def test_a_prompt_pushed_out_of_the_host_tier_comes_back_from_disk(stack):
    stub, cache, model = stack
    prompt = "Write a short poem about a lighthouse keeper who counts the ships that pass by at night."
    want, usage = generate(stub, prompt)
    cacheable = full_block_tokens(usage)
    assert cacheable >= BLOCK and usage.cached_tokens < cacheable
    wait_for(lambda: settled(cache), 60, "the prompt's blocks demoted to the host tier")
    host_before, disk_before = tier(cache, "host"), tier(cache, "disk")
    # Two prompts whose full blocks outnumber the host tier's slots: their demotions push
    # every older block, this prompt's too, out of the host tier onto disk.
    pressure_tokens = (host_before.blocks_total // 2 + 1) * BLOCK
    assert pressure_tokens <= PRESSURE_PROMPT_TOKENS
    for seed in (25, 26):
        generate(stub, token_ids=random_tokens(pressure_tokens, seed))
    wait_for(lambda: settled(cache), 60, "the other prompts' demotions done")
    host, disk = tier(cache, "host"), tier(cache, "disk")
    assert host.evictions - host_before.evictions >= cacheable // BLOCK
    assert disk.demotions - disk_before.demotions >= cacheable // BLOCK
    drop_from_the_pool(stub, model, usage.prompt_tokens, seed=27)
    got, usage = generate(stub, prompt)
    assert got == want
    assert (usage.cached_tokens, usage.cached_tokens_host, usage.cached_tokens_disk) == (cacheable, 0, cacheable)
    assert tier(cache, "disk").promotions - disk.promotions == cacheable // BLOCK
    wait_for(lambda: stats(cache).blocks_leased == 0, 60, "no block leased")
