"""Requests that end on EOS or STOP, and seeded sampling, through both real services.

One Llama checkpoint (written by the test, eos ids [</s>, <|extra|>] in its
generation_config) whose lm_head row for </s> is set to 1.02 times the row of a token that
transformers' greedy continuation of PROMPT first picks a few tokens in: wherever that
token's logit is the top one and positive, </s> beats it (and almost nowhere else), so
greedy generation ends on </s> after a few tokens, in transformers' generate and here. Every other expectation comes from
transformers' greedy continuation (eos ignored) or from this service's own unstopped stream.

The services are shared by the module: every test waits until it has left no block leased.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import grpc_generate
import pytest
import torch

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import BOS_ID, EOS_ID, EXTRA_ID, write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from harness.reference_generate import reference_greedy
from model_service.text.detokenizer import IncrementalDetokenizer
from model_service.text.tokenizer import HFTokenizer
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

PROMPT = [BOS_ID, 30, 31, 32, 33]


@pytest.fixture(scope="module")
def reference_and_path(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint("llama", tmp_path_factory.mktemp("llama-eos"))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    free = reference_greedy(reference, PROMPT, 12)
    index = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    with torch.no_grad():
        reference.lm_head.weight[EOS_ID] = 1.02 * reference.lm_head.weight[free[index]]
    reference.save_pretrained(path)
    return reference, path, index


@pytest.fixture(scope="module")
def stack(reference_and_path, tmp_path_factory):
    _, path, _ = reference_and_path
    tmp_path = tmp_path_factory.mktemp("stack")
    with start_cache_service(tmp_path, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--model", str(path)) as model:
        yield model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(model.address)), cache_stub(cache.address)


@pytest.fixture
def stub(stack):
    model, cache = stack
    yield model
    # Whatever this test started has ended: none of its blocks may stay leased.
    wait_for(lambda: stats(cache).blocks_leased == 0, 30, "this test's blocks to be released")


def generate(stub, prompt: list[int], **sampling) -> tuple[list[model_pb2.GenerateResponse], list[int], str]:
    answer = grpc_generate.generate(stub, prompt_token_ids=prompt, sampling=sampling)
    return answer.responses, answer.tokens, answer.text


def assert_finished(responses, reason, tokens, prompt) -> None:
    last = responses[-1]
    assert last.finish_reason == reason, model_pb2.FinishReason.Name(last.finish_reason)
    assert all(r.finish_reason == model_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == len(tokens)


def test_greedy_ends_on_the_models_eos_as_transformers_generate(reference_and_path, stub):
    reference, _, eos_index = reference_and_path
    assert reference.generation_config.eos_token_id == [EOS_ID, EXTRA_ID]
    expected = reference_greedy(reference, PROMPT, 16, eos_token_id=reference.generation_config.eos_token_id)
    assert len(expected) == eos_index + 1 and expected[-1] == EOS_ID, expected  # the premise

    responses, tokens, text = generate(stub, PROMPT, max_new_tokens=16, temperature=0)

    assert tokens == expected  # the eos token itself is the last one returned, as in generate
    assert_finished(responses, model_pb2.FINISH_REASON_EOS, tokens, PROMPT)
    assert "</s>" not in text  # a special token: left out of the text

    # ignore_eos runs on through it to max_new_tokens, still equal to transformers.
    responses, tokens, _ = generate(stub, PROMPT, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert tokens == reference_greedy(reference, PROMPT, 10)
    assert EOS_ID in tokens
    assert_finished(responses, model_pb2.FINISH_REASON_LENGTH, tokens, PROMPT)


def free_run(reference, stub, prompt, max_new_tokens):
    """The service's unstopped greedy stream (eos ignored), checked against transformers."""
    responses, tokens, text = generate(stub, prompt, max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    assert tokens == reference_greedy(reference, prompt, max_new_tokens)
    return responses, tokens, text


def test_stop_token_id_ends_the_request_on_that_token(reference_and_path, stub):
    reference, _, _ = reference_and_path
    prompt = [BOS_ID, 7, 140, 77, 251, 19]
    _, free, _ = free_run(reference, stub, prompt, 12)
    index = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] not in (EOS_ID, EXTRA_ID))

    responses, tokens, _ = generate(
        stub, prompt, max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[free[index], 5000 % 384],
    )

    assert tokens == free[: index + 1]
    assert_finished(responses, model_pb2.FINISH_REASON_STOP, tokens, prompt)
    assert responses[-1].WhichOneof("matched_stop") == "matched_stop_token_id"
    assert responses[-1].matched_stop_token_id == free[index]


def test_stop_string_spanning_two_tokens_cuts_the_text_before_it(reference_and_path, stub):
    reference, path, _ = reference_and_path
    prompt = [BOS_ID, 88, 12, 190, 64, 230, 41]
    _, free, free_text = free_run(reference, stub, prompt, 24)
    # Each token's text as the service's detokenizer gives it, one token at a time (the
    # stream itself merges tokens into one message when its client falls behind, so its
    # message boundaries are not token boundaries). A text may be empty while the
    # detokenizer holds back an incomplete character.
    detokenizer = IncrementalDetokenizer(HFTokenizer.from_dir(path), prompt, stop=())
    texts = [detokenizer.push([token]).text for token in free]
    texts[-1] += detokenizer.flush()
    assert "".join(texts) == free_text
    # A stop string made of the end of one token's text and the start of the next
    # non-empty one, at its first occurrence: it exists only once both tokens are out.
    shown = [i for i, text in enumerate(texts) if text]
    for k, j in zip(shown, shown[1:]):
        head, tail = texts[k][-2:], texts[j][:2]
        stop, start = head + tail, len("".join(texts[: k + 1])) - len(head)
        if stop.isprintable() and "\ufffd" not in stop and len(stop) >= 3 and free_text.find(stop) == start:
            break
    else:
        pytest.fail(f"no stop string spans two tokens of {texts!r}")

    responses, tokens, text = generate(stub, prompt, max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop])

    assert text == free_text[:start]
    assert stop not in text
    assert tokens == free[: j + 1]  # generation ended on the token that completed the stop string
    assert_finished(responses, model_pb2.FINISH_REASON_STOP, tokens, prompt)
    assert responses[-1].WhichOneof("matched_stop") == "matched_stop_str"
    assert responses[-1].matched_stop_str == stop

    # include_stop_str_in_output keeps the matched string at the end, and nothing after it.
    responses, tokens, text = generate(stub, prompt, max_new_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                       include_stop_str_in_output=True)
    assert text == free_text[:start] + stop
    assert tokens == free[: j + 1]
    assert_finished(responses, model_pb2.FINISH_REASON_STOP, tokens, prompt)
    assert responses[-1].matched_stop_str == stop


def test_seeded_sampling_repeats_and_ignores_batch_neighbours(stub):
    prompt = [BOS_ID, 57, 203, 118, 91]
    sampling = dict(max_new_tokens=14, temperature=1.5, seed=1234, ignore_eos=True)
    _, first, _ = generate(stub, prompt, **sampling)
    _, again, _ = generate(stub, prompt, **sampling)
    assert again == first
    _, other_seed, _ = generate(stub, prompt, **{**sampling, "seed": 4321})
    assert other_seed != first  # the seed decides the draw
    _, greedy_tokens, _ = generate(stub, prompt, max_new_tokens=14, temperature=0, ignore_eos=True)
    assert first != greedy_tokens  # a temperature of 1.5 really samples

    # The same request among neighbours of other lengths, seeds and temperatures.
    neighbours = [
        ([BOS_ID, 9, 8, 7], dict(max_new_tokens=20, temperature=1.0, ignore_eos=True)),
        ([BOS_ID, *range(40, 70)], dict(max_new_tokens=5, temperature=0.7, seed=7, ignore_eos=True)),
        ([BOS_ID, 100, 101], dict(max_new_tokens=9, temperature=0, ignore_eos=True)),
    ]
    requests = [(prompt, sampling)] + neighbours + [(prompt, sampling)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: generate(stub, r[0], **r[1])[1], requests))
    assert results[0] == first and results[-1] == first
