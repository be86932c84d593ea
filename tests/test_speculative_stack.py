"""Speculative decoding through the front doors: gRPC and OpenAI usage carry the proposed
and kept tokens (greedy and sampled requests; a seed gives the same tokens either way),
blocks holding only rejected tokens go back to the cache service (GetStats counts them), /metrics counts them by proposer, a request can turn it off, the cache
service's ledger stays exact (--check-invariants), and bad flag values stop the start."""

from __future__ import annotations

import subprocess
import sys

import grpc
import openai
import pytest
from scrape import metric
from grpc_generate import GREEDY, generate

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from harness.reference_generate import prompt_ids
from model_service.server import build_parser
from pagedkv.model.v1 import model_pb2_grpc

LOOPED = prompt_ids(12, seed=3) * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("speculative-stack")
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "8MiB", "--check-invariants") as cache, \
            start_model_service(tmp, cache.address, "--speculative-method", "ngram", "--num-speculative-tokens", "4",
                                "--speculative-always",
                                "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
                                # No blocks ahead: a block that a rejected proposal filled goes back at once.
                                "--lease-ahead-blocks", "0") as model, \
            grpc.insecure_channel(model.address) as channel:
        yield model, cache, model_pb2_grpc.ModelServiceStub(channel)


def test_usage_and_metrics_count_proposed_and_kept_tokens(stack):
    model, cache, stub = stack
    before = (metric(model, "pagedkv_model_spec_proposed_tokens_total", method="ngram"),
              metric(model, "pagedkv_model_spec_accepted_tokens_total", method="ngram"))
    on = generate(stub, prompt_token_ids=LOOPED, sampling=dict(GREEDY, max_new_tokens=40)).usage
    off = generate(stub, prompt_token_ids=LOOPED, sampling=dict(GREEDY, max_new_tokens=40, speculate=False))
    assert on.spec_proposed_tokens > 0 and 0 < on.spec_accepted_tokens <= on.spec_proposed_tokens
    assert (off.usage.spec_proposed_tokens, off.usage.spec_accepted_tokens) == (0, 0)
    assert on.completion_tokens == off.usage.completion_tokens == 40
    after = (metric(model, "pagedkv_model_spec_proposed_tokens_total", method="ngram"),
             metric(model, "pagedkv_model_spec_accepted_tokens_total", method="ngram"))
    assert (after[0] - before[0], after[1] - before[1]) == (on.spec_proposed_tokens, on.spec_accepted_tokens)
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")


def test_sampled_requests_speculate_and_a_seed_gives_the_same_tokens_as_without(stack):
    model, cache, stub = stack
    proposed = accepted = 0
    for seed in range(4):
        sampling = dict(temperature=0.6, top_p=0.95, top_k=40, seed=seed, ignore_eos=True, max_new_tokens=32)
        on = generate(stub, prompt_token_ids=LOOPED, sampling=sampling)
        off = generate(stub, prompt_token_ids=LOOPED, sampling=dict(sampling, speculate=False))
        assert on.tokens == off.tokens, seed
        assert (off.usage.spec_proposed_tokens, off.usage.spec_accepted_tokens) == (0, 0)
        proposed += on.usage.spec_proposed_tokens
        accepted += on.usage.spec_accepted_tokens
    assert proposed > 0 and 0 < accepted <= proposed
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")


def test_blocks_holding_only_rejected_tokens_go_back_in_a_truncate(stack):
    model, cache, stub = stack
    cache_service = cache_stub(cache.address)
    before = stats(cache_service).blocks_truncated
    rejected = 0
    for seed in range(3):  # hot sampling: many proposals rejected, some across a block boundary
        usage = generate(stub, prompt_token_ids=LOOPED,
                         sampling=dict(temperature=1.5, seed=seed, ignore_eos=True, max_new_tokens=48)).usage
        rejected += usage.spec_proposed_tokens - usage.spec_accepted_tokens
    assert rejected > 0
    assert stats(cache_service).blocks_truncated > before
    wait_for(lambda: stats(cache_service).blocks_leased == 0, 10, "every block released")


def test_openai_usage_carries_the_speculation_counts(stack):
    model = stack[0]
    client = openai.OpenAI(base_url=model.http_url, api_key="none")
    answer = client.completions.create(model=client.models.list().data[0].id, prompt=LOOPED, max_tokens=30,
                                       temperature=0, extra_body={"ignore_eos": True})
    usage = answer.usage.model_dump()
    assert usage["spec_proposed_tokens"] > 0 and usage["spec_accepted_tokens"] > 0
    off = client.completions.create(model=answer.model, prompt=LOOPED, max_tokens=30, temperature=0,
                                    extra_body={"ignore_eos": True, "speculate": False})
    assert off.usage.model_dump()["spec_proposed_tokens"] == 0
    assert off.choices[0].text == answer.choices[0].text


@pytest.mark.parametrize("flags, message", [
    (("--speculative-method", "ngram", "--prompt-lookup-min", "4", "--prompt-lookup-max", "3"),
     "--prompt-lookup-max must be from --prompt-lookup-min (4) to 32, got 3"),
    (("--speculative-method", "suffix", "--suffix-cache-tokens", "0"), "--suffix-cache-tokens must be from 1"),
], ids=["ngram-lookup", "suffix-cache"])
def test_bad_speculative_flags_stop_the_start_with_a_message(flags, message):
    # Each bad value's message is checked in tests/test_spec_rules.py; here, that the flags
    # reach that check and the start ends with status 2 before a model loads.
    done = subprocess.run([sys.executable, "-m", "model_service", "--model", "tiny", "--cache-service", "127.0.0.1:1",
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr


def test_an_unknown_speculative_method_is_refused_at_parsing(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--model", "tiny", "--speculative-method", "draft"])
    assert exited.value.code == 2
    assert "invalid choice: 'draft'" in capsys.readouterr().err
