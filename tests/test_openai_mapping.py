"""OpenAI bodies -> GenerateRequests, and GenerateErrors -> HTTP statuses: plain code, no server.

Every OpenAI field and vLLM extra parameter the HTTP API accepts lands in the proto field
that the gRPC path validates and runs, so both doors mean the same thing by it.
"""

from __future__ import annotations

import grpc
import pytest

from model_service.api.generation import GenerateError
from model_service.api.openai_http import to_generate
from model_service.api.openai_http.errors import ApiError, from_generate_error
from model_service.api.openai_http.protocol import ChatCompletionRequest, CompletionRequest
from model_service.api.openai_http.unsupported import refuse_unsupported
from pagedkv.model.v1 import model_pb2


def test_every_sampling_field_reaches_the_proto():
    body = CompletionRequest(
        model="m", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, n=3, stop="END", seed=11,
        presence_penalty=0.25, frequency_penalty=-0.5, logit_bias={"5": -100, "9": 2.5}, logprobs=2,
        top_k=40, min_p=0.05, repetition_penalty=1.2, min_tokens=3, ignore_eos=True, skip_special_tokens=False,
        include_stop_str_in_output=True, stop_token_ids=[4, 8], cache_salt="tenant-a", priority=-2,
    )
    [request] = to_generate.completion_requests(body, "cmpl-1")
    sampling = request.sampling
    assert request.prompt == "hi" and request.request_id == "cmpl-1"
    assert sampling.max_new_tokens == 7 and sampling.n == 3 and sampling.seed == 11
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert list(sampling.stop) == ["END"] and list(sampling.stop_token_ids) == [4, 8]
    assert sampling.presence_penalty == pytest.approx(0.25) and sampling.frequency_penalty == pytest.approx(-0.5)
    assert dict(sampling.logit_bias) == {5: -100.0, 9: 2.5}
    assert sampling.HasField("logprobs") and sampling.logprobs == 2
    assert sampling.top_k == 40 and sampling.min_p == pytest.approx(0.05)
    assert sampling.repetition_penalty == pytest.approx(1.2) and sampling.min_tokens == 3
    assert sampling.ignore_eos and sampling.include_stop_str_in_output
    assert sampling.HasField("skip_special_tokens") and not sampling.skip_special_tokens
    assert request.cache_salt == "tenant-a" and request.priority == -2


def test_openai_defaults_differ_from_proto_zero_values_where_openai_s_do():
    [request] = to_generate.completion_requests(CompletionRequest(model="m", prompt="hi"), "id")
    sampling = request.sampling
    assert sampling.temperature == 1.0  # OpenAI samples unless told temperature 0
    assert not sampling.HasField("max_new_tokens") and not sampling.HasField("top_p")
    assert not sampling.HasField("logprobs") and not sampling.HasField("repetition_penalty")
    assert not sampling.HasField("skip_special_tokens") and sampling.n == 0
    # vLLM's "no top-k" is -1, the proto's is 0.
    [request] = to_generate.completion_requests(CompletionRequest(model="m", prompt="hi", top_k=-1), "id")
    assert request.sampling.top_k == 0


def test_a_whole_answer_asks_the_engine_not_to_stream():
    for build, body in ((to_generate.completion_requests, CompletionRequest(model="m", prompt="hi")),
                        (lambda b, i: [to_generate.chat_request(b, i)],
                         ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}]))):
        [whole] = build(body, "id")
        [streamed] = build(body.model_copy(update={"stream": True}), "id")
        assert whole.HasField("stream") and not whole.stream  # one message a completion
        assert not streamed.HasField("stream")  # every token as it comes


def test_chat_messages_logprobs_and_template_kwargs():
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                             {"role": "assistant", "content": None}],
        max_tokens=50, max_completion_tokens=9, logprobs=True, top_logprobs=4,
        chat_template_kwargs={"enable_thinking": False},
    )
    request = to_generate.chat_request(body, "chatcmpl-1")
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "Hi there"),
                                                               ("assistant", "")]
    assert request.sampling.max_new_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert request.sampling.logprobs == 4
    assert dict(request.chat_template_kwargs) == {"enable_thinking": False}
    assert not request.prompt and not request.prompt_token_ids


def test_chat_logprobs_off_unless_asked_and_top_logprobs_needs_them():
    plain = to_generate.chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]), "i")
    assert not plain.sampling.HasField("logprobs")
    on = to_generate.chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                        logprobs=True), "i")
    assert on.sampling.HasField("logprobs") and on.sampling.logprobs == 0
    with pytest.raises(ApiError, match="top_logprobs needs logprobs"):
        to_generate.chat_request(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                       top_logprobs=3), "i")


def test_prompt_batches_become_one_request_each():
    requests = to_generate.completion_requests(CompletionRequest(model="m", prompt=["a", "b"]), "cmpl-9")
    assert [(r.prompt, r.request_id) for r in requests] == [("a", "cmpl-9-0"), ("b", "cmpl-9-1")]
    requests = to_generate.completion_requests(CompletionRequest(model="m", prompt=[[1, 2], [3]]), "c")
    assert [list(r.prompt_token_ids) for r in requests] == [[1, 2], [3]]
    [single] = to_generate.completion_requests(CompletionRequest(model="m", prompt=[5, 6, 7]), "c")
    assert list(single.prompt_token_ids) == [5, 6, 7]


@pytest.mark.parametrize("fields", [
    {"functions": [{"name": "f"}]},  # tools and response_format are implemented (test_smollm2_structured.py)
    {"function_call": {"name": "f"}},
    {"modalities": ["text", "audio"]},
    {"reasoning_effort": "low"},
    {"add_generation_prompt": False},
    {"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]},  # tool_calls: implemented
])
def test_unsupported_chat_fields_are_refused_by_name(fields):
    body = ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "x"}]} | fields))
    with pytest.raises(ApiError) as error:
        refuse_unsupported(body)
    assert error.value.status == 400 and "not supported" in error.value.message


def test_off_values_of_unsupported_fields_pass():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[], tool_choice="none",
                                 response_format={"type": "text"}, modalities=["text"], parallel_tool_calls=False)
    refuse_unsupported(body)
    refuse_unsupported(CompletionRequest(model="m", prompt="x", echo=False, best_of=1))


@pytest.mark.parametrize(("code", "retry_later", "status"), [
    (grpc.StatusCode.INVALID_ARGUMENT, False, 400),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, True, 429),   # queue or stream limit
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False, 400),  # larger than the whole pool
    (grpc.StatusCode.UNAVAILABLE, True, 503),
    (grpc.StatusCode.ALREADY_EXISTS, False, 400),
    (grpc.StatusCode.INTERNAL, False, 500),
])
def test_generate_errors_map_to_http_statuses(code, retry_later, status):
    error = from_generate_error(GenerateError(code, "why", retry_later=retry_later))
    assert error.status == status
    assert error.body()["error"] == {"message": "why", "type": error.body()["error"]["type"], "param": None,
                                     "code": code.name.lower()}


def test_finish_reasons_name_every_proto_reason():
    from model_service.api.openai_http.responses import FINISH_REASON

    named = {value for name, value in model_pb2.FinishReason.items() if name != "FINISH_REASON_UNSPECIFIED"}
    assert set(FINISH_REASON) == named


class PieceTokenizer:
    """decode() of fixed pieces: token 1 is "ab", 2 is "c", 3 is "def"."""

    PIECES = {1: "ab", 2: "c", 3: "def"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


@pytest.mark.parametrize("as_token_ids", [False, True], ids=["token texts", "token_id:N names"])
def test_completion_text_offsets_follow_the_text_of_a_message_of_several_tokens(as_token_ids):
    """A client that falls behind gets several tokens in one message: each token's offset
    is after the decoded text of those before it in the message, whatever their names."""
    from model_service.api.openai_http.logprobs import TokenNames, completion_logprobs, merge_completion_logprobs

    names = TokenNames(PieceTokenizer(), as_token_ids=as_token_ids)
    entries = [model_pb2.TokenLogprob(token_id=i, logprob=-0.5) for i in (1, 2, 3)]
    first = completion_logprobs(entries, names, 10, len("abcdef"))
    assert first["text_offset"] == [10, 12, 13]
    assert first["tokens"] == (["token_id:1", "token_id:2", "token_id:3"] if as_token_ids else ["ab", "c", "def"])
    # The detokenizer held back the end of the message's text: no offset past what was sent.
    held = completion_logprobs(entries[:2] + entries[:1], names, 16, len("ab"))
    assert held["text_offset"] == [16, 18, 18]
    merged = merge_completion_logprobs([first, held])
    assert merged["text_offset"] == sorted(merged["text_offset"])
