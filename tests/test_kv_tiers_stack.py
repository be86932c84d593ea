"""KV tiers through real services (the tiny model): greedy output is the same whether a
prompt's prefix is computed, promoted from the host tier, or read back from disk after
a restart of the cache service, even one killed with SIGKILL in the middle of demotions;
usage says which tier the cached tokens came from, and nothing stays leased. Preemption,
an abort and a model service killed with SIGKILL, with blocks going to and coming back
from the tiers, leave nothing leased and every invariant of the ledger, the pool and the
tiers holding (the cache service checks them after every call: --check-invariants).
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import grpc
import pytest
import torch
from generate_stream import GenerateStream
from grpc_generate import greedy

from harness.cache_helpers import cache_stub, leased_blocks, stats, wait_for
from harness.processes import free_port, start_cache_service, start_model_service, start_together
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
    out, last = greedy(stub, tokens, NEW_TOKENS)
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
        # Every demotion settled: copied, or missed where a loaded machine let the pool take
        # a block before its write-behind copy (a count of blocks in the tier would wait forever).
        wait_for(lambda: tier(stats(cstub), "host").blocks_queued == 0, 30, "the demotions to host settled")
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


def test_check_invariants_logs_a_broken_invariant_and_serves_on(tmp_path, capsys):
    from cache_service.core.pool import KvPool, PoolSettings
    from pagedkv.kv_geometry import KvGeometry

    pool = KvPool(PoolSettings(kv_cache_bytes=1 << 20, max_blocks=8, shm_dir=str(tmp_path), check_invariants=True))
    try:
        session = pool.attach("test", KvGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                                                 device="cpu"), 0, 0).session
        pool.ledger.allocate(session.owner, 16)
        pool.check_invariants("lease")
        assert pool.invariants_broken == 0
        pool.ledger.pool.blocks[0].ref_count += 1  # what a lost release would leave
        pool.check_invariants("lease")
        assert pool.invariants_broken == 1
        assert "invariant_broken" in capsys.readouterr().out
    finally:
        pool.close()


def generate_long(stub, tokens: list[int], max_new_tokens: int) -> tuple[list[int], model_pb2.Usage]:
    stream = GenerateStream(stub, tokens, max_new_tokens)
    assert stream.done.wait(120) and stream.code == grpc.StatusCode.OK
    return stream.tokens, stream.last.usage


def test_preemption_an_abort_and_a_killed_model_service_leave_nothing_leased_and_the_tiers_consistent(tmp_path):
    # 16 pool blocks, 8 host slots (a tiny block is 8 KiB), a disk tier. A TTL far beyond
    # the test: the killed service's blocks come back because its session's hold closed
    # with it (half a second later), and no live service on a loaded machine misses it.
    cache_args = (*POOL_ARGS, "--host-cache-bytes", "64KiB", "--disk-cache-dir", tmp_path / "kv-disk",
                  "--disk-cache-bytes", "1MiB", "--check-invariants", "--lease-ttl-ms", "600000",
                  "--reclaim-grace-ms", "500", "--port", free_port())
    model_args = ("--max-model-len", "192")  # room for an aborted request that runs long
    cache, model, doomed = start_together(tmp_path, cache_args, model_args, model_args)
    with cache, model, doomed:
        stub, doomed_stub = (model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(service.address))
                             for service in (model, doomed))
        cstub = cache_stub(cache.address)

        def settled() -> bool:
            cache_stats = stats(cstub)
            return cache_stats.blocks_leased == 0 and all(entry.blocks_queued == 0 for entry in cache_stats.tiers)

        def promotions() -> int:
            return sum(entry.promotions for entry in stats(cstub).tiers)

        # Prompts whose full blocks go to the tiers: three of the one aborted below, two
        # each of those the killed service runs.
        aborted_prompt = prompt(400)[:60]
        doomed_prompts = [prompt(401)[:40], prompt(402)[:40]]
        want_aborted, _ = generate_long(stub, aborted_prompt, 8)
        for tokens in doomed_prompts:
            generate_long(stub, tokens, 8)
        wait_for(settled, 30, "the prompts' blocks demoted")

        # Preemption: four requests that end at 7 blocks each share 16; the blocks they
        # take push every prompt above out of the pool (and of the 8-slot host tier).
        batch = [prompt(410 + index)[:40] for index in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda tokens: generate_long(stub, tokens, 64), batch))
        with urllib.request.urlopen(model.metrics_url, timeout=30) as response:
            metrics = response.read().decode()
        preempted = [line for line in metrics.splitlines() if line.startswith("pagedkv_model_preemptions_total")]
        assert preempted and float(preempted[0].split()[-1]) > 0, "the small pool forced no preemption"
        assert sum(usage.recomputed_tokens for _, usage in answers) > 0
        wait_for(settled, 30, "the batch's blocks demoted")

        # An abort: the prompt's blocks are promoted back from a tier by its allocation,
        # and the request is aborted after its first token, while the blocks it holds and
        # the ones it registered are on their way.
        before = promotions()
        stream = GenerateStream(stub, aborted_prompt, 120, request_id="aborted-after-promotion")
        assert stream.first_token.wait(60)
        assert stub.Abort(model_pb2.AbortRequest(request_ids=["aborted-after-promotion"]), timeout=30).aborted == 1
        assert stream.done.wait(60) and stream.tokens[:8] == want_aborted[:len(stream.tokens)]
        assert stream.last.finish_reason == model_pb2.FINISH_REASON_ABORT
        assert promotions() - before == 3, "the aborted request's prompt was not promoted from a tier"

        # A model service killed with SIGKILL while its streams hold promoted blocks: its
        # leases come back once its hold's connection closes; the other service serves on.
        before = promotions()
        streams = [GenerateStream(doomed_stub, tokens, 80) for tokens in doomed_prompts]
        for doomed_stream in streams:
            assert doomed_stream.first_token.wait(60)
        assert promotions() - before == 4 and stats(cstub).blocks_leased > 0
        doomed.kill()
        wait_for(lambda: (lambda s: s.sessions == 1 and s.blocks_leased == 0)(stats(cstub)), 60,
                 "the killed service's session to end and its blocks to be reclaimed")
        assert generate_long(stub, batch[0], 64)[0] == answers[0][0]
        assert generate_long(stub, aborted_prompt, 8)[0] == want_aborted

        wait_for(settled, 30, "every block released and every demotion done")
        for entry in stats(cstub).tiers:  # GetStats checks the invariants once more
            assert entry.blocks_cached <= entry.blocks_total and entry.errors == 0, entry
        broken = [event for event in cache.log_events() if event.get("event") == "invariant_broken"]
        assert not broken, broken
