"""The generation API through both real services, against transformers on the same weights:
logprobs, penalties, min_p, min_tokens, logit_bias, n completions, Abort, stop details,
and random sampling parameters that must never crash the engine."""

from __future__ import annotations

import concurrent.futures
import math
import re

import grpc
import pytest
import torch
from grpc_generate import deadline_after_first_token
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import MinPLogitsWarper

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import EOS_ID, write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from harness.reference_generate import prompt_ids, reference_greedy
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

VOCAB = 384


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("generation-api")
    path = write_checkpoint("llama", directory / "llama")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with start_cache_service(directory, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(directory, cache.address, "--model", str(path), "--max-model-len", "256") as model:
        channel = grpc.insecure_channel(model.address)
        yield model_pb2_grpc.ModelServiceStub(channel), cache_stub(cache.address), reference
        channel.close()


def run(stub, prompt, timeout=60, request_id="", stream=None, **sampling) -> dict[int, list[model_pb2.GenerateResponse]]:
    """Every message of one Generate call, by completion index (stream: GenerateRequest.stream, None: unset)."""
    request = model_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, stream=stream,
                                        sampling=model_pb2.SamplingParams(**sampling))
    by_index: dict[int, list[model_pb2.GenerateResponse]] = {}
    for response in stub.Generate(request, timeout=timeout):
        by_index.setdefault(response.index, []).append(response)
    return by_index


def tokens_of(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: transformers' logits at every position, float32."""
    return model(torch.tensor([ids])).logits[0].float()


def assert_logprob_matches(entry: model_pb2.TokenLogprob, expected_row: torch.Tensor, token: int, top: int):
    assert entry.token_id == token
    assert abs(entry.logprob - float(expected_row[token])) < 1e-4
    assert len(entry.top) == top
    values = [t.logprob for t in entry.top]
    assert values == sorted(values, reverse=True)
    best = torch.topk(expected_row, top)
    for got, want_value in zip(entry.top, best.values.tolist()):
        assert abs(got.logprob - want_value) < 1e-4
        assert abs(got.logprob - float(expected_row[got.token_id])) < 1e-4  # ids right, ties aside


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(stack):
    stub, _, reference = stack
    prompt = prompt_ids(37, seed=1)  # more than two blocks: prefill in chunks would still line up
    messages = run(stub, prompt, max_new_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)[0]
    generated = tokens_of(messages)
    expected = torch.log_softmax(reference_logits(reference, prompt + generated), dim=-1)
    entries = [e for m in messages for e in m.logprobs]
    assert len(entries) == len(generated) == 6
    for step, (entry, token) in enumerate(zip(entries, generated)):
        assert_logprob_matches(entry, expected[len(prompt) - 1 + step], token, 5)
        assert token == int(expected[len(prompt) - 1 + step].argmax()), "greedy is the best token"
    prompt_entries = messages[0].prompt_logprobs
    assert len(prompt_entries) == len(prompt) - 1, "entry i belongs to prompt token i + 1"
    for position, entry in enumerate(prompt_entries):
        assert_logprob_matches(entry, expected[position], prompt[position + 1], 3)
    assert all(not m.prompt_logprobs for m in messages[1:])


def test_logprobs_are_raw_before_temperature_and_penalties(stack):
    stub, _, reference = stack
    prompt = prompt_ids(9, seed=2)
    messages = run(stub, prompt, max_new_tokens=4, ignore_eos=True, logprobs=0, temperature=0.7, seed=3,
                   repetition_penalty=1.4, presence_penalty=1.0)[0]
    generated = tokens_of(messages)
    expected = torch.log_softmax(reference_logits(reference, prompt + generated), dim=-1)
    for step, entry in enumerate(e for m in messages for e in m.logprobs):
        assert_logprob_matches(entry, expected[len(prompt) - 1 + step], generated[step], 0)


def test_prompt_logprobs_skip_the_prefix_cache_and_still_count_it(stack):
    stub, _, reference = stack
    prompt = prompt_ids(40, seed=4)
    run(stub, prompt, max_new_tokens=2, ignore_eos=True)  # its full blocks are cached now
    messages = run(stub, prompt, max_new_tokens=2, ignore_eos=True, prompt_logprobs=0)[0]
    expected = torch.log_softmax(reference_logits(reference, prompt), dim=-1)
    entries = messages[0].prompt_logprobs
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        assert abs(entry.logprob - float(expected[position, prompt[position + 1]])) < 1e-4


# --- penalties, min_p, min_tokens, logit_bias ---------------------------------------------


def test_repetition_penalty_equals_transformers_generate(stack):
    stub, _, reference = stack
    prompt = prompt_ids(12, seed=5)
    plain = tokens_of(run(stub, prompt, max_new_tokens=24, ignore_eos=True)[0])
    for penalty in (1.5, 0.8):
        got = tokens_of(run(stub, prompt, max_new_tokens=24, ignore_eos=True, repetition_penalty=penalty)[0])
        assert got == reference_greedy(reference, prompt, 24, min_new_tokens=24, repetition_penalty=penalty)
    assert got != plain, "the penalty changed nothing: the test would not see it ignored"


def test_min_tokens_equals_transformers_min_new_tokens(stack):
    stub, _, reference = stack
    prompt = prompt_ids(10, seed=6)
    greedy = reference_greedy(reference, prompt, 8, min_new_tokens=8)
    stop = greedy[1]  # greedy would stop at its second token
    got = tokens_of(run(stub, prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[stop], min_tokens=5)[0])
    expected = reference_greedy(reference, prompt, 12, eos_token_id=stop, min_new_tokens=5)
    expected = expected[: expected.index(stop) + 1] if stop in expected else expected
    assert got == expected and len(got) > 2
    assert stop not in got[:5]


def test_min_p_draws_only_tokens_transformers_keeps(stack):
    stub, _, reference = stack
    prompt = prompt_ids(8, seed=7)
    warper = MinPLogitsWarper(0.1)
    distinct = set()
    for seed in range(4):
        generated = tokens_of(run(stub, prompt, max_new_tokens=10, ignore_eos=True, temperature=1.5, min_p=0.1,
                                  seed=seed)[0])
        logits = reference_logits(reference, prompt + generated) / 1.5
        for step, token in enumerate(generated):
            kept = warper(None, logits[len(prompt) - 1 + step].unsqueeze(0).clone())[0]
            assert not math.isinf(float(kept[token])), f"seed {seed} step {step}: token {token} was dropped by min_p"
        distinct.update(generated)
    assert len(distinct) > 4, "sampling drew too few distinct tokens to test anything"


def plain_reference(model, prompt, steps, presence=0.0, frequency=0.0, bias=None) -> list[int]:
    """Greedy decoding with OpenAI's presence/frequency penalties and logit_bias, by hand."""
    ids = list(prompt)
    for _ in range(steps):
        logits = reference_logits(model, ids)[-1]
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.shape[0]).float()
        logits = logits - frequency * counts - presence * (counts > 0).float()
        for token, value in (bias or {}).items():
            logits[token] += value
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_presence_frequency_and_logit_bias_equal_a_plain_reference(stack):
    stub, _, reference = stack
    prompt = prompt_ids(11, seed=5)  # greedy repeats a token here, so each penalty changes something
    plain = tokens_of(run(stub, prompt, max_new_tokens=20, ignore_eos=True)[0])
    cases = [dict(presence=1.5), dict(frequency=0.9), dict(presence=-2.0, frequency=2.0),
             dict(bias={plain[3]: -8.0, 17: 4.5})]
    for case in cases:
        sampling = dict(presence_penalty=case.get("presence", 0.0), frequency_penalty=case.get("frequency", 0.0),
                        logit_bias=case.get("bias", {}))
        got = tokens_of(run(stub, prompt, max_new_tokens=20, ignore_eos=True, **sampling)[0])
        assert got == plain_reference(reference, prompt, 20, **case), case
        assert got != plain, f"{case} changed nothing"


# --- n completions ----------------------------------------------------------------------


def test_n_greedy_gives_n_equal_completions_equal_to_transformers(stack):
    stub, cache, reference = stack
    prompt = prompt_ids(40, seed=9)
    by_index = run(stub, prompt, n=4, max_new_tokens=12, ignore_eos=True)
    assert sorted(by_index) == [0, 1, 2, 3]
    expected = reference_greedy(reference, prompt, 12, min_new_tokens=12)
    lasts = []
    for index, messages in by_index.items():
        assert tokens_of(messages) == expected, f"completion {index}"
        assert messages[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == 12
        lasts.append(messages[-1])
    assert sum(m.usage.prompt_tokens for m in lasts) == len(prompt), "usage counts the prompt once"
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_usage_has_each_completion_s_peak_kv_blocks_and_bytes_and_no_recompute(stack):
    stub, cache, _ = stack
    sizing = cache.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)
    prompt = prompt_ids(37, seed=13)
    by_index = run(stub, prompt, n=2, max_new_tokens=4, ignore_eos=True)
    # 37 + 4 tokens, of which the last sampled one is never written: K/V at 40 positions,
    # 3 blocks of 16. Completion 1 forks the 2 full prompt blocks and a copy of the third,
    # and no block is leased past prompt + max_new_tokens, so each held exactly 3.
    assert sizing.block_size == 16
    for index, messages in by_index.items():
        usage = messages[-1].usage
        assert (usage.peak_kv_blocks, usage.recomputed_tokens) == (3, 0), f"completion {index}"
        assert usage.peak_kv_bytes == 3 * sizing.bytes_per_block
        assert all(not m.HasField("usage") for m in messages[:-1])
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_n_seeded_is_reproducible_and_independent_of_batch_neighbours(stack):
    stub, cache, _ = stack
    prompt = prompt_ids(20, seed=10)
    sampling = dict(n=4, max_new_tokens=16, ignore_eos=True, temperature=1.2, seed=1234)
    alone = {i: tokens_of(m) for i, m in run(stub, prompt, **sampling).items()}
    assert len({tuple(t) for t in alone.values()}) > 1, "the 4 completions should differ from each other"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        neighbours = [pool.submit(run, stub, prompt_ids(15 + i, seed=20 + i), max_new_tokens=30, ignore_eos=True,
                                  temperature=0.9) for i in range(3)]
        crowded = pool.submit(run, stub, prompt, **sampling).result()
        for neighbour in neighbours:
            neighbour.result()
    assert {i: tokens_of(m) for i, m in crowded.items()} == alone
    first = run(stub, prompt, **{**sampling, "n": 1})
    assert tokens_of(first[0]) == alone[0], "completion 0 draws with the request's own seed"
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_cancelling_an_n_request_leaves_nothing_leased(stack):
    stub, cache, _ = stack
    request = model_pb2.GenerateRequest(prompt_token_ids=prompt_ids(30, seed=11), sampling=model_pb2.SamplingParams(
        n=4, max_new_tokens=200, ignore_eos=True, temperature=1.0))
    call = stub.Generate(request, timeout=60)
    seen = set()
    for response in call:
        seen.add(response.index)
        if len(seen) == 4:
            break
    call.cancel()
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "the cancelled request's blocks to be released")


def test_each_completion_finishes_on_its_own(stack):
    stub, _, _ = stack
    prompt = prompt_ids(12, seed=12)
    by_index = run(stub, prompt, n=3, max_new_tokens=40, temperature=1.5, seed=5, stop_token_ids=list(range(4, 60)))
    finishes = {i: m[-1].finish_reason for i, m in by_index.items()}
    assert sorted(by_index) == [0, 1, 2]
    for index, messages in by_index.items():
        assert sum(1 for m in messages if m.finish_reason) == 1, "one last message per completion"
        if finishes[index] == model_pb2.FINISH_REASON_STOP:
            assert messages[-1].WhichOneof("matched_stop") == "matched_stop_token_id"
            assert messages[-1].matched_stop_token_id == messages[-1].token_ids[-1]
    assert model_pb2.FINISH_REASON_STOP in finishes.values()


# --- Abort, request ids -------------------------------------------------------------------


def test_abort_ends_a_running_request_and_duplicate_ids_are_already_exists(stack):
    stub, cache, _ = stack
    request = model_pb2.GenerateRequest(request_id="abort-me", prompt_token_ids=prompt_ids(10, seed=13),
                                        sampling=model_pb2.SamplingParams(max_new_tokens=240, ignore_eos=True))
    call = stub.Generate(request, timeout=60)
    first = next(call)
    assert first.token_ids
    with pytest.raises(grpc.RpcError) as duplicate:
        list(stub.Generate(request, timeout=30))
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "abort-me" in duplicate.value.details()
    reply = stub.Abort(model_pb2.AbortRequest(request_ids=["abort-me", "no-such-request"]), timeout=10)
    assert reply.aborted == 1
    rest = list(call)
    assert rest[-1].finish_reason == model_pb2.FINISH_REASON_ABORT
    assert len(tokens_of([first, *rest])) < 240
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "the aborted request's blocks to be released")
    assert stub.Abort(model_pb2.AbortRequest(request_ids=["abort-me"]), timeout=10).aborted == 0
    again = run(stub, prompt_ids(5, seed=14), request_id="abort-me", max_new_tokens=2)  # the id is free again
    assert len(tokens_of(again[0])) == 2


def test_a_deadline_mid_stream_is_deadline_exceeded_and_frees_the_blocks(stack):
    stub, cache, _ = stack
    request = model_pb2.GenerateRequest(prompt_token_ids=prompt_ids(20, seed=17), sampling=model_pb2.SamplingParams(
        n=2, max_new_tokens=230, ignore_eos=True))
    # Every deadline tried ends DEADLINE_EXCEEDED with nothing leased, the last after tokens came.
    assert 0 < deadline_after_first_token(stub, request, lambda: wait_for(
        lambda: stats(cache).blocks_leased == 0, 30, "the expired request's blocks to be released")) < 2 * 230


# --- stop details --------------------------------------------------------------------------


def test_stop_string_is_reported_and_kept_when_asked(stack):
    stub, _, _ = stack
    prompt = prompt_ids(9, seed=15)
    text = "".join(m.text for m in run(stub, prompt, max_new_tokens=30, ignore_eos=True)[0])
    stop = text[10:12]
    assert len(stop) == 2
    cut = run(stub, prompt, max_new_tokens=30, ignore_eos=True, stop=[stop])[0]
    kept = run(stub, prompt, max_new_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)[0]
    cut_text, kept_text = "".join(m.text for m in cut), "".join(m.text for m in kept)
    assert cut[-1].finish_reason == model_pb2.FINISH_REASON_STOP and cut[-1].matched_stop_str == stop
    assert kept_text == cut_text + stop and not cut_text.endswith(stop)


def test_skip_special_tokens_off_keeps_them_in_the_text(stack):
    stub, _, _ = stack
    prompt = prompt_ids(6, seed=16)
    bias = {EOS_ID: 100.0}  # the next token is </s>
    kept = run(stub, prompt, max_new_tokens=1, ignore_eos=True, logit_bias=bias, skip_special_tokens=False)[0]
    skipped = run(stub, prompt, max_new_tokens=1, ignore_eos=True, logit_bias=bias)[0]
    assert tokens_of(kept) == [EOS_ID]
    assert "".join(m.text for m in kept) == "</s>" and "".join(m.text for m in skipped) == ""


def test_detokenize_off_streams_the_same_tokens_without_text(stack):
    stub, cache, _ = stack
    prompt = prompt_ids(12, seed=18)
    with_text = run(stub, prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[7])[0]
    ids_only = run(stub, prompt, max_new_tokens=12, ignore_eos=True, stop_token_ids=[7], detokenize=False)[0]
    assert tokens_of(ids_only) == tokens_of(with_text)
    assert "".join(m.text for m in with_text) and not any(m.text for m in ids_only)
    assert ids_only[-1].finish_reason == with_text[-1].finish_reason
    assert ids_only[-1].usage.completion_tokens == len(tokens_of(ids_only))
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_stream_interval_sends_the_same_completions_in_fewer_messages(stack):
    stub, cache, _ = stack
    prompt = prompt_ids(10, seed=19)
    sampling = dict(max_new_tokens=40, ignore_eos=True, n=2, logprobs=2)
    every_token = run(stub, prompt, **sampling)
    batched = run(stub, prompt, stream_interval=8, **sampling)
    for index in (0, 1):
        messages = batched[index]
        assert tokens_of(messages) == tokens_of(every_token[index]) and len(tokens_of(messages)) == 40
        assert "".join(m.text for m in messages) == "".join(m.text for m in every_token[index])
        assert [e.token_id for m in messages for e in m.logprobs] == tokens_of(messages)
        assert messages[-1].finish_reason == every_token[index][-1].finish_reason
        assert messages[-1].usage.completion_tokens == 40
        # The first token at once, then 8 at a time (a client that falls behind can only
        # get fewer, larger messages): at most 1 + ceil(39 / 8) = 6.
        assert 2 <= len(messages) <= 6, [len(m.token_ids) for m in messages]
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_without_streaming_each_completion_comes_whole_in_one_message(stack):
    stub, cache, _ = stack
    prompt = prompt_ids(10, seed=23)
    sampling = dict(max_new_tokens=24, ignore_eos=True, n=2, logprobs=1, prompt_logprobs=1)
    streamed = run(stub, prompt, **sampling)
    whole = run(stub, prompt, stream=False, **sampling)
    assert sorted(whole) == [0, 1] and all(len(messages) == 1 for messages in whole.values())
    for index in (0, 1):
        (message,) = whole[index]
        assert list(message.token_ids) == tokens_of(streamed[index]) and len(message.token_ids) == 24
        assert message.text == "".join(m.text for m in streamed[index]) and message.text
        assert [e.token_id for e in message.logprobs] == list(message.token_ids)
        assert message.finish_reason == model_pb2.FINISH_REASON_LENGTH and message.usage.completion_tokens == 24
    # Prompt logprobs in the stream's first message, here the only one of whichever came first.
    first_streamed = next(m for messages in streamed.values() for m in messages if m.prompt_logprobs)
    (carrier,) = [m for messages in whole.values() for m in messages if m.prompt_logprobs]
    assert [e.token_id for e in carrier.prompt_logprobs] == [e.token_id for e in first_streamed.prompt_logprobs]
    assert sum(m.usage.prompt_tokens for messages in whole.values() for m in messages) == 10
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")


def test_stop_strings_without_detokenizing_are_invalid(stack):
    stub, cache, _ = stack
    with pytest.raises(grpc.RpcError) as error:
        run(stub, prompt_ids(5, seed=19), max_new_tokens=4, stop=["x"], detokenize=False)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "detokenize" in error.value.details() and "stop_token_ids still work" in error.value.details()
    assert stats(cache).blocks_leased == 0


# --- random parameters ---------------------------------------------------------------------

in_range = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0, 3), "top_k": st.integers(0, VOCAB), "top_p": st.floats(0.01, 1),
    "seed": st.integers(0, 2**64 - 1), "n": st.integers(0, 4), "logprobs": st.integers(0, 20),
    "prompt_logprobs": st.integers(0, 20), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.05, 5), "min_p": st.floats(0, 1), "min_tokens": st.integers(0, 4),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=5),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "detokenize": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3), "ignore_eos": st.booleans(),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sampling=in_range, length=st.integers(1, 40))
def test_random_in_range_parameters_never_crash_the_engine(stack, sampling, length):
    stub, _, _ = stack
    by_index = run(stub, prompt_ids(length, seed=length), max_new_tokens=4, **sampling)
    assert sorted(by_index) == list(range(max(sampling.get("n", 1), 1)))
    for messages in by_index.values():
        assert messages[-1].finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
        if "logprobs" in sampling:
            assert len([e for m in messages for e in m.logprobs]) == len(tokens_of(messages))


@pytest.mark.parametrize(("fields", "phrase"), [
    ({"n": 17}, r"n must be in \[0, 16\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
    ({"prompt_logprobs": 99}, r"prompt_logprobs must be in \[0, 20\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -3.0}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_tokens": 9, "max_new_tokens": 8}, r"min_tokens must be in \[0, max_new_tokens\] = \[0, 8\]"),
    ({"logit_bias": {5: 101.0}}, r"logit_bias\[5\] must be in \[-100, 100\]"),
    ({"logit_bias": {VOCAB: 1.0}}, f"logit_bias token ids must be < vocab_size \\({VOCAB}\\)"),
])
def test_out_of_range_parameters_are_invalid_argument_naming_the_field(stack, fields, phrase):
    stub, cache, _ = stack
    fields = {"max_new_tokens": 4, **fields}
    with pytest.raises(grpc.RpcError) as error:
        run(stub, prompt_ids(5, seed=0), **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(phrase, error.value.details()), error.value.details()


out_of_range = st.one_of(
    st.builds(lambda v: ("n", {"n": v}), st.integers(17, 2**32 - 1)),
    st.builds(lambda v: ("logprobs", {"logprobs": v}), st.integers(21, 2**32 - 1)),
    st.builds(lambda v: ("prompt_logprobs", {"prompt_logprobs": v}), st.integers(21, 2**32 - 1)),
    st.builds(lambda v: ("presence_penalty", {"presence_penalty": v}),
              st.floats(allow_nan=True, width=32).filter(lambda v: not -2 <= v <= 2)),
    st.builds(lambda v: ("frequency_penalty", {"frequency_penalty": v}),
              st.floats(allow_nan=True, width=32).filter(lambda v: not -2 <= v <= 2)),
    st.builds(lambda v: ("repetition_penalty", {"repetition_penalty": v}),
              st.floats(allow_nan=True, width=32).filter(lambda v: not (0 < v < math.inf))),
    st.builds(lambda v: ("min_p", {"min_p": v}), st.floats(allow_nan=True, width=32).filter(lambda v: not 0 <= v <= 1)),
    st.builds(lambda v: ("min_tokens", {"min_tokens": v}), st.integers(5, 2**32 - 1)),
    st.builds(lambda k, v: ("logit_bias", {"logit_bias": {k: v}}), st.integers(0, VOCAB - 1),
              st.floats(allow_nan=True, width=32).filter(lambda v: not -100 <= v <= 100)),
    st.builds(lambda k: ("logit_bias", {"logit_bias": {k: 0.0}}), st.integers(VOCAB, 2**32 - 1)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=out_of_range)
def test_every_out_of_range_parameter_is_invalid_argument(stack, case):
    stub, _, _ = stack
    field, fields = case
    with pytest.raises(grpc.RpcError) as error:
        run(stub, prompt_ids(5, seed=0), max_new_tokens=4, **fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()


def test_nothing_is_left_leased(stack):
    _, cache, _ = stack
    wait_for(lambda: stats(cache).blocks_leased == 0, 10, "every block to be released")
