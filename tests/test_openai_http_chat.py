"""/v1/chat/completions through the official `openai` client, against a real model service
whose checkpoint carries a chat template (tests/hf_checkpoints.py's tiny Llama, with a
template written into its tokenizer_config.json).

The messages go into GenerateRequest.messages and are rendered by the same code as a gRPC
call's: the prompt equals transformers' `apply_chat_template`, and the greedy answer equals
gRPC's for those token ids.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
from cache_helpers import cache_stub, stats, wait_for
from hf_checkpoints import write_checkpoint
from processes import start_cache_service, start_model_service

from pagedkv.model.v1 import model_pb2, model_pb2_grpc

MODEL = "llama-chat"
# A ChatML-like template with a variable of its own, as real checkpoints have.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|extra|>{{ message['role'] }}\n"
    "{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|extra|>assistant\n{% if brief %}Briefly: {% endif %}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Paged attention keeps the KV cache in fixed-size blocks."},
    {"role": "user", "content": "The quick brown fox?"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = write_checkpoint("llama", tmp_path_factory.mktemp("llama-chat"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def services(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    with start_cache_service(tmp, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--model", str(checkpoint), "--served-model-name", MODEL) as model:
        channel = grpc.insecure_channel(model.address)
        yield cache, model, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


@pytest.fixture(scope="module")
def client(services):
    return openai.OpenAI(base_url=services[1].http_url, api_key="unused", max_retries=0, timeout=120)


def template_ids(checkpoint, messages, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                         **kwargs)


def grpc_text(stub, **fields) -> str:
    sampling = fields.pop("sampling")
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **fields)
    return "".join(response.text for response in stub.Generate(request, timeout=120))


GREEDY = dict(max_new_tokens=10, temperature=0, ignore_eos=True)


def test_chat_prompt_is_transformers_apply_chat_template(client, services, checkpoint):
    _, _, stub = services
    ids = template_ids(checkpoint, MESSAGES)
    expected = grpc_text(stub, prompt_token_ids=ids, sampling=GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length"
    assert chat.usage.prompt_tokens == len(ids) and chat.usage.completion_tokens == 10
    # The same messages through gRPC.
    grpc_messages = [model_pb2.ChatMessage(**message) for message in MESSAGES]
    assert grpc_text(stub, messages=grpc_messages, sampling=GREEDY) == expected


def test_chat_template_kwargs_reach_the_template(client, checkpoint):
    ids = template_ids(checkpoint, MESSAGES, brief=True)
    assert ids != template_ids(checkpoint, MESSAGES)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0,
                                          extra_body={"chat_template_kwargs": {"brief": True}})
    assert chat.usage.prompt_tokens == len(ids)


def test_chat_stream_sends_the_role_first_then_content_then_the_reason(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks[1:-1])
    assert content == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-2].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_async_client_chat(services, client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})

    async def streamed() -> str:
        async with openai.AsyncOpenAI(base_url=services[1].http_url, api_key="unused", max_retries=0) as aclient:
            answer = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                           temperature=0, extra_body={"ignore_eos": True})
            stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            assert answer.choices[0].message.content == text
            return text

    assert asyncio.run(streamed()) == whole.choices[0].message.content


def test_bad_messages_are_400_with_the_grpc_path_s_message(client, services):
    cache, _, stub = services
    with pytest.raises(grpc.RpcError) as grpc_error:
        list(stub.Generate(model_pb2.GenerateRequest(messages=[model_pb2.ChatMessage(role="wizard", content="hi")]),
                           timeout=30))
    assert grpc_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    assert error.value.body["message"] == grpc_error.value.details()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 30, "every block released")


def test_chat_logprobs_and_top_logprobs_equal_grpc_s(client, services):
    _, _, stub = services
    request = model_pb2.GenerateRequest(
        messages=[model_pb2.ChatMessage(**message) for message in MESSAGES],
        sampling=model_pb2.SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True, logprobs=2))
    entries = [entry for response in stub.Generate(request, timeout=120) for entry in response.logprobs]
    assert len(entries) == 5
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True,
                                                                      "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [item.token for item in content] == [f"token_id:{entry.token_id}" for entry in entries]
    assert [item.logprob for item in content] == [entry.logprob for entry in entries]
    assert [[(top.token, top.logprob) for top in item.top_logprobs] for item in content] == [
        [(f"token_id:{top.token_id}", top.logprob) for top in entry.top] for entry in entries]
    # logprobs without top_logprobs: the sampled token's alone, named by its text.
    named = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                           logprobs=True, extra_body={"ignore_eos": True})
    content = named.choices[0].logprobs.content
    assert [item.logprob for item in content] == [entry.logprob for entry in entries]
    assert all(item.top_logprobs == [] and not item.token.startswith("token_id:") for item in content)


def test_chat_n_2_streams_both_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=1.0,
                                                 seed=3, stream=True, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=2, temperature=1.0,
                                           seed=3, extra_body={"ignore_eos": True})
    for choice in whole.choices:
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == choice.index)
        assert streamed == choice.message.content
    assert [c.index for c in whole.choices] == [0, 1] and whole.usage.completion_tokens == 12
