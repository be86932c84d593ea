"""The generation API through HTTP equals it through gRPC: n, logprobs, penalties, stop
reasons, each asked for with OpenAI's (or vLLM's) field names through the official
`openai` client and compared with the GenerateResponses of the same request over gRPC.
"""

from __future__ import annotations

import grpc
import openai
import pytest

from harness.hf_checkpoints import write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("generation")
    checkpoint = write_checkpoint("llama", tmp / "llama")
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(checkpoint)) as model:
        channel = grpc.insecure_channel(model.address)
        client = openai.OpenAI(base_url=model.http_url, api_key="unused", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        yield client, model_id, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


def grpc_responses(stub, **sampling) -> list[model_pb2.GenerateResponse]:
    request = model_pb2.GenerateRequest(prompt=PROMPT, sampling=model_pb2.SamplingParams(**sampling))
    return list(stub.Generate(request, timeout=120))


def by_index(responses) -> dict[int, str]:
    texts: dict[int, str] = {}
    for response in responses:
        texts[response.index] = texts.get(response.index, "") + response.text
    return texts


def test_n_2_gives_two_choices_equal_to_grpc_s(services):
    client, model, stub = services
    expected = by_index(grpc_responses(stub, n=2, max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
    completion = client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=5,
                                           extra_body={"ignore_eos": True})
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert {choice.index: choice.text for choice in completion.choices} == expected
    assert expected[0] != expected[1], "two samples of 8 tokens at temperature 1 should differ"
    assert completion.usage.completion_tokens == 16
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=5,
                                           stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == expected


def test_completion_logprobs_equal_grpc_s(services):
    client, model, stub = services
    responses = grpc_responses(stub, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    entries = [entry for response in responses for entry in response.logprobs]
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{entry.token_id}" for entry in entries]
    assert logprobs.token_logprobs == [entry.logprob for entry in entries]
    assert logprobs.top_logprobs == [{f"token_id:{top.token_id}": top.logprob for top in entry.top}
                                     for entry in entries]
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_penalties_logit_bias_and_vllm_extras_give_grpc_s_tokens(services):
    client, model, stub = services
    plain = grpc_responses(stub, max_new_tokens=12, temperature=0, ignore_eos=True)
    first = plain[0].token_ids[0]
    sampling = dict(max_new_tokens=12, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=1.0,
                    repetition_penalty=3.0, min_tokens=4, logit_bias={first: -100.0})
    expected = "".join(response.text for response in grpc_responses(stub, **sampling))
    assert expected != "".join(response.text for response in plain), "the bias should change the first token"
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, presence_penalty=2.0, frequency_penalty=1.0,
        logit_bias={str(first): -100}, extra_body={"ignore_eos": True, "repetition_penalty": 3.0, "min_tokens": 4})
    assert completion.choices[0].text == expected


def test_a_bad_penalty_is_400_with_the_grpc_path_s_message(services):
    client, model, stub = services
    with pytest.raises(grpc.RpcError) as grpc_error:
        grpc_responses(stub, max_new_tokens=2, presence_penalty=5.0)
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, presence_penalty=5.0)
    assert error.value.body["message"] == grpc_error.value.details()


def test_stop_reason_names_the_matched_stop_string(services):
    client, model, stub = services
    greedy = "".join(response.text for response in grpc_responses(stub, max_new_tokens=16, temperature=0,
                                                                   ignore_eos=True))
    stop = greedy[5:8]
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == greedy[:greedy.index(stop) + len(stop)]
