"""stream_interval and stream=false on the engine side: how LiveRequests holds a
completion's tokens back and lets them go (every stream_interval tokens, the first at
once, the rest with the end, whatever ends it; without streaming all of them with the
end), and how a request's interval meets the service's."""

from __future__ import annotations

import grpc

from model_service.engine.live_requests import LiveRequests
from model_service.engine.deltas import Delta
from model_service.sample.logprobs import TokenLogprob
from model_service.engine.output import new_request
from model_service.sample.params import SamplingOptions
from model_service.api.sampling_proto import options_from_proto
from model_service.sched.step import append_token
from model_service.sched.sequence import Finish
from model_service.api.validation import GenerateLimits, validate_generate_request
from pagedkv.model.v1 import model_pb2

LIMITS = GenerateLimits(vocab_size=100, max_model_len=64, max_prompt_tokens=32, default_max_new_tokens=8)


def live(interval: int = 1, max_new_tokens: int = 20, stream: bool = True, n: int = 1, prompt_logprobs=None):
    """A request of token ids only (no tokenizer) and the deltas its stream gets."""
    delivered: list[Delta] = []
    requests = LiveRequests(lambda deliveries: delivered.extend(delta for _, delta in deliveries),
                            on_request_end=lambda request: None)
    options = SamplingOptions(max_new_tokens=max_new_tokens, ignore_eos=True, detokenize=False,
                              stream_interval=interval, stream=stream, n=n, prompt_logprobs=prompt_logprobs)
    request = new_request(1, "r", [5, 6, 7], options, sink=None, tokenizer=None, device="cpu", deadline=None,
                          priority=0, arrival=0)
    requests.add(request)
    return requests, request, delivered


def step(requests: LiveRequests, request, token: int) -> None:
    """One engine step: each completion samples `token` (the scheduler's append_token
    appends it and says whether it ended the completion), the step's deltas go out."""
    completions = [c for c in request.completions if not c.finished]
    ended = {c.seq: e for c in completions if (e := append_token(c.seq, token, frozenset(), max_model_len=100))}
    requests.emit(completions, [token] * len(completions), [None] * len(completions), ended)
    requests.flush()


def test_tokens_go_out_every_interval_the_first_at_once_the_rest_with_the_end():
    requests, request, delivered = live(interval=4, max_new_tokens=10)
    for token in range(100, 110):
        step(requests, request, token)
    assert [d.token_ids for d in delivered] == [[100], [101, 102, 103, 104], [105, 106, 107, 108], [109]]
    assert delivered[-1].finish is Finish.LENGTH and delivered[-1].completion_tokens == 10


def test_held_tokens_go_out_with_an_abort():
    requests, request, delivered = live(interval=8)
    for token in range(100, 104):
        step(requests, request, token)
    assert [d.token_ids for d in delivered] == [[100]]
    requests.end_request(request, Finish.ABORTED)
    requests.flush()
    assert delivered[-1].token_ids == [101, 102, 103] and delivered[-1].finish is Finish.ABORTED


def test_held_tokens_go_out_before_an_error():
    requests, request, delivered = live(interval=8)
    for token in range(100, 103):
        step(requests, request, token)
    requests.fail_all(grpc.StatusCode.UNAVAILABLE, "the cache service went away")
    requests.flush()
    assert [d.token_ids for d in delivered] == [[100], [101, 102], []]
    assert delivered[-1].error == (grpc.StatusCode.UNAVAILABLE, "the cache service went away")


def test_interval_one_sends_every_token_in_its_own_message():
    requests, request, delivered = live(interval=1, max_new_tokens=5)
    for token in range(100, 105):
        step(requests, request, token)
    assert [d.token_ids for d in delivered] == [[100], [101], [102], [103], [104]]


def test_a_request_s_interval_is_raised_to_the_service_s_never_lowered():
    def interval(asked: int, service: int) -> int:
        return options_from_proto(model_pb2.SamplingParams(max_new_tokens=4, stream_interval=asked),
                                          prompt_tokens=3, max_model_len=64, vocab_size=100,
                                          default_max_new_tokens=8, min_stream_interval=service).stream_interval

    assert interval(0, 1) == 1  # unset: every token
    assert interval(0, 4) == 4  # unset: the service's
    assert interval(2, 4) == 4
    assert interval(9, 4) == 9


def test_without_streaming_each_completion_comes_whole_in_one_message():
    requests, request, delivered = live(max_new_tokens=6, stream=False, n=2, prompt_logprobs=0)
    request.prompt_logprobs = [TokenLogprob(6, -1.0), TokenLogprob(7, -2.0)]
    for token in range(100, 105):
        step(requests, request, token)
    assert delivered == []  # not even the first token
    step(requests, request, 105)
    assert [(d.index, d.token_ids, d.finish) for d in delivered] == [
        (0, [100, 101, 102, 103, 104, 105], Finish.LENGTH), (1, [100, 101, 102, 103, 104, 105], Finish.LENGTH)]
    assert delivered[0].prompt_logprobs == request.prompt_logprobs and delivered[1].prompt_logprobs is None
    assert [d.completion_tokens for d in delivered] == [6, 6] and delivered[1].prompt_tokens == 3


def test_without_streaming_an_abort_sends_what_was_made():
    requests, request, delivered = live(stream=False)
    for token in range(100, 103):
        step(requests, request, token)
    requests.end_request(request, Finish.ABORTED)
    requests.flush()
    assert [(d.token_ids, d.finish) for d in delivered] == [([100, 101, 102], Finish.ABORTED)]


def test_stream_comes_from_the_request_and_is_on_unless_set_false():
    def stream(**fields) -> bool:
        request = model_pb2.GenerateRequest(prompt_token_ids=[1, 2], sampling=model_pb2.SamplingParams(
            max_new_tokens=4), **fields)
        return validate_generate_request(request, LIMITS, tokenizer=None)[1].stream

    assert stream() is True
    assert stream(stream=True) is True
    assert stream(stream=False) is False
