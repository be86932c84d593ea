"""One cache service, many models and tenants, through real services.

- Two checkpoints of one geometry with different weights share a pool, one after the
  other and at the same time: each one's greedy output equals transformers' (its output
  on a fresh cache service), the second never hits the first one's prefix, and the same
  checkpoint restarted still hits its own.
- cache_salt: different salts share no cached block, the same salt hits.
- A model service SIGSTOPped past its TTL while a second serves on the same pool: the
  second's outputs stay exact, and the first recovers after SIGCONT.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import urllib.request

import grpc
import pytest
import torch
from generate_stream import GenerateStream
from grpc_generate import greedy

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import free_port, start_cache_service, start_model_service, start_together
from harness.reference_generate import prompt_ids, reference_greedy
from pagedkv.health_probe import check as health_check
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

pytestmark = pytest.mark.timeout(300)

def model_stub(service) -> model_pb2_grpc.ModelServiceStub:
    return model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(service.address))


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two llama checkpoints of one geometry, different weights, with their transformers twins."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("two-models")
    paths = [write_checkpoint("llama", root / f"seed{seed}", seed=seed) for seed in (0, 1)]
    references = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for path in paths]
    return paths, references


def test_two_models_share_the_pool_but_never_a_prefix(two_models, tmp_path):
    (path_a, path_b), (ref_a, ref_b) = two_models
    shared_prompt = prompt_ids(40, 1)  # two full blocks outlive each request as prefix cache
    want_a, want_b = reference_greedy(ref_a, shared_prompt, 8), reference_greedy(ref_b, shared_prompt, 8)
    assert want_a != want_b, "the two checkpoints must differ in what they generate"
    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache:
        # One after the other: A caches the prompt's blocks, then B comes on the same pool.
        with start_model_service(tmp_path, cache.address, "--model", str(path_a)) as model_a:
            info_a = model_stub(model_a).GetModelInfo(model_pb2.GetModelInfoRequest())
            tokens, last = greedy(model_stub(model_a), shared_prompt, 8)
            assert tokens == want_a and last.usage.cached_tokens == 0
        assert stats(cache_stub(cache.address)).blocks_cached >= 2
        with start_model_service(tmp_path, cache.address, "--model", str(path_b)) as model_b:
            stub_b = model_stub(model_b)
            info_b = stub_b.GetModelInfo(model_pb2.GetModelInfoRequest())
            assert info_a.model_fingerprint and info_a.model_fingerprint != info_b.model_fingerprint
            tokens, last = greedy(stub_b, shared_prompt, 8)
            assert last.usage.cached_tokens == 0, "model B was given model A's cached K/V"
            assert tokens == want_b
            # At the same time: A restarted (same checkpoint) hits its own cache, B its own.
            with start_model_service(tmp_path, cache.address, "--model", str(path_a)) as restarted_a:
                stub_a = model_stub(restarted_a)
                tokens, last = greedy(stub_a, shared_prompt, 8)
                assert tokens == want_a and last.usage.cached_tokens >= 16, last.usage
                tokens, last = greedy(stub_b, shared_prompt, 8)
                assert tokens == want_b and last.usage.cached_tokens >= 16, last.usage
                batch = [prompt_ids(20 + 7 * i, 10 + i) for i in range(4)]
                expected = [(reference_greedy(ref_a, p, 12), reference_greedy(ref_b, p, 12)) for p in batch]
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    runs = [(pool.submit(greedy, stub_a, p, 12), pool.submit(greedy, stub_b, p, 12)) for p in batch]
                    for (run_a, run_b), (exp_a, exp_b) in zip(runs, expected):
                        assert run_a.result()[0] == exp_a and run_b.result()[0] == exp_b
        wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block to be released")


def test_two_models_on_one_disk_tier_never_share_a_block_even_after_a_restart(two_models, tmp_path):
    """A's blocks go to the disk tier and leave the pool (A's ResetPrefixCache): B never
    gets them (cached_tokens 0), A does (from disk); the same after the cache service is
    restarted over the same folder, with both model services re-attaching by themselves."""
    (path_a, path_b), (ref_a, ref_b) = two_models
    before, after = prompt_ids(40, 3), prompt_ids(40, 4)  # two full blocks each outlive A's request
    want = {(name, tuple(tokens)): reference_greedy(reference, tokens, 4)
            for name, reference in (("a", ref_a), ("b", ref_b)) for tokens in (before, after)}
    cache_args = ("--kv-cache-bytes", "16MiB", "--disk-cache-dir", tmp_path / "kv-disk", "--disk-cache-bytes", "4MiB",
                  "--port", free_port())

    def settled(cache_rpc) -> bool:
        cache_stats = stats(cache_rpc)
        return cache_stats.blocks_leased == 0 and cache_stats.tiers[0].blocks_queued == 0

    def serving(service) -> bool:
        with grpc.insecure_channel(service.address) as channel:
            return health_check(channel) == "SERVING"

    def run(name: str, stub, tokens: list[int]) -> model_pb2.Usage:
        out, last = greedy(stub, tokens, 4)
        assert out == want[(name, tuple(tokens))], f"model {name}'s output changed"
        return last.usage

    cache, model_a, model_b = start_together(tmp_path, cache_args, ("--model", path_a), ("--model", path_b))
    with model_a, model_b:
        stub_a, stub_b = model_stub(model_a), model_stub(model_b)
        with cache:
            cache_rpc = cache_stub(cache.address)
            for tokens in (before, after):
                assert run("a", stub_a, tokens).cached_tokens == 0
            wait_for(lambda: settled(cache_rpc), 30, "A's blocks written to disk")
            assert stats(cache_rpc).tiers[0].blocks_cached == 4
            reset = urllib.request.Request(model_a.http_url.removesuffix("/v1") + "/reset_prefix_cache", data=b"{}",
                                           method="POST", headers={"content-type": "application/json"})
            with urllib.request.urlopen(reset, timeout=30) as response:
                assert json.loads(response.read())["blocks_dropped"] == 4
            assert run("b", stub_b, before).cached_tokens == 0, "model B was given model A's blocks from disk"
            usage = run("a", stub_a, before)
            assert (usage.cached_tokens, usage.cached_tokens_disk) == (32, 32)
            wait_for(lambda: settled(cache_rpc), 30, "B's blocks written to disk")
            cache.kill()
        with start_cache_service(tmp_path, *cache_args) as restarted:  # the same port: both re-attach
            cache_rpc = cache_stub(restarted.address)
            # The restarted service's own count, not the model services' health: right after
            # the kill they may still answer SERVING from before it.
            wait_for(lambda: stats(cache_rpc).sessions == 2 and serving(model_a) and serving(model_b), 60,
                     "both model services to re-attach", poll_s=0.1)
            assert stats(cache_rpc).tiers[0].blocks_cached == 6  # A's two prompts, B's one
            assert run("b", stub_b, after).cached_tokens == 0, "model B was given model A's blocks after a restart"
            usage = run("a", stub_a, after)
            assert (usage.cached_tokens, usage.cached_tokens_disk) == (32, 32)
            usage = run("b", stub_b, before)
            assert (usage.cached_tokens, usage.cached_tokens_disk) == (32, 32)  # its own, from disk
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, 30, "every block to be released")


def test_cache_salt_isolates_tenants(tmp_path):
    with start_cache_service(tmp_path, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address) as model:
        stub = model_stub(model)
        tokens = prompt_ids(50, 2, vocab=256)  # three full blocks of 16
        first, last = greedy(stub, tokens, 4, cache_salt="tenant-1")
        assert last.usage.cached_tokens == 0
        for other in ("tenant-2", ""):
            out, last = greedy(stub, tokens, 4, cache_salt=other)
            assert last.usage.cached_tokens == 0, f"salt {other!r} hit tenant-1's cache"
            assert out == first  # isolation costs recompute, never correctness
        out, last = greedy(stub, tokens, 4, cache_salt="tenant-1")
        assert last.usage.cached_tokens == 48 and out == first
        out, last = greedy(stub, tokens, 4)
        assert last.usage.cached_tokens == 48, "the unsalted request cached its own blocks a moment ago"
        with pytest.raises(grpc.RpcError) as error:
            greedy(stub, tokens, 4, cache_salt="x" * 257)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in error.value.details()


def test_a_stalled_model_service_never_writes_into_blocks_others_hold(two_models, tmp_path):
    """A is SIGSTOPped mid-generation past its lease TTL; B fills the whole pool (A's old
    blocks included) and stays exact; after SIGCONT, A fences itself (its streams end
    with UNAVAILABLE, it re-attaches) and serves exactly again, and so does B."""
    (path, _), (reference, _) = two_models
    config = reference.config
    head_dim = config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 4
    # A stopped process keeps its connection (and its session's hold) open: only the TTL
    # finds it. The TTL is one no live service on a loaded machine misses (B must not
    # expire while A is stopped); the waits below end when things happen, bounded only
    # on a hang.
    cache_args = ("--kv-cache-bytes", str(48 * block_bytes), "--headroom", "0",
                  "--lease-ttl-ms", "8000", "--reclaim-grace-ms", "500")
    model_args = ("--model", str(path), "--max-model-len", "128")
    with start_cache_service(tmp_path, *cache_args) as cache, \
            start_model_service(tmp_path, cache.address, *model_args) as model_a, \
            start_model_service(tmp_path, cache.address, *model_args) as model_b:
        cache_rpc = cache_stub(cache.address)
        stub_a, stub_b = model_stub(model_a), model_stub(model_b)
        streams = [GenerateStream(stub_a, prompt_ids(24, 20 + i), 100) for i in range(4)]
        for stream in streams:
            assert stream.first_token.wait(60)
        os.kill(model_a.pid, signal.SIGSTOP)
        try:
            held = stats(cache_rpc).blocks_leased
            wait_for(lambda: stats(cache_rpc).sessions == 1, 120, "the stopped service's session to expire")
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, 60, "its blocks to be reclaimed after the grace")
            # B now needs every block of the pool, A's old ones too.
            batch = [prompt_ids(30, 40 + i) for i in range(6)]
            expected = [reference_greedy(reference, p, 90) for p in batch]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(lambda p: greedy(stub_b, p, 90)[0], batch))
            assert results == expected, "B's outputs changed while A was stopped"
            assert held > 0
        finally:
            os.kill(model_a.pid, signal.SIGCONT)
        for stream in streams:
            assert stream.done.wait(60), "a stream of the stopped service never ended"
        assert {s.code for s in streams} <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK}
        assert any(s.code == grpc.StatusCode.UNAVAILABLE for s in streams), [(s.code, s.details) for s in streams]

        def serving(service) -> bool:
            with grpc.insecure_channel(service.address) as channel:
                return health_check(channel) == "SERVING"

        wait_for(lambda: serving(model_a) and stats(cache_rpc).sessions == 2, 60, "A to attach again", poll_s=0.1)
        fresh = [prompt_ids(30, 60 + i) for i in range(4)]
        expected = [reference_greedy(reference, p, 40) for p in fresh]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            from_a = pool.submit(lambda: [greedy(stub_a, p, 40)[0] for p in fresh[:2]])
            from_b = pool.submit(lambda: [greedy(stub_b, p, 40)[0] for p in fresh[2:]])
            assert from_a.result() == expected[:2], "A did not recover exactly"
            assert from_b.result() == expected[2:]
        events = {event.get("event") for event in model_a.log_events()}
        assert events & {"lease_deadline_passed", "heartbeat_failed", "session_hold_ended"}, (
            "A never noticed its session had expired")
        wait_for(lambda: stats(cache_rpc).blocks_leased == 0, 10, "every block to be released")
