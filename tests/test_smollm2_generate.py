"""SmolLM2-135M-Instruct (`--model smollm2`) through both real services, chatting.

Greedy tokens for chat conversations equal transformers' reading the same .gguf file
(`gguf_file=`, float32) with its own chat template, one request at a time and eight at
once; every block is back in the pool afterwards. Then the chat error rows against a model
that has a template. Generations are short: SmolLM2 runs at a few hundred tokens a second
on these machines.
"""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest
import torch
from google.protobuf import struct_pb2
from test_smollm2_tokenizer import CONVERSATIONS

from harness.cache_helpers import cache_stub, stats, wait_for
from pagedkv.stack import example_arguments
from pagedkv.model.v1 import model_pb2

MAX_NEW_TOKENS = 16
EIGHT_CONVERSATIONS = CONVERSATIONS + [
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "system", "content": "Be concise."}, {"role": "user", "content": "What is 12 times 12?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]


@pytest.fixture(scope="module")
def reference(smollm2_reference):
    return smollm2_reference


@pytest.fixture(scope="module")
def stack(smollm2_stack):
    return smollm2_stack.stub, smollm2_stack.cache, smollm2_stack.model.address


def reference_greedy(reference, messages) -> list[int]:
    tokenizer, model = reference
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**prompt, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return output[0, prompt["input_ids"].shape[1]:].tolist()


def chat(stub, messages, **request_fields) -> tuple[list[int], str, model_pb2.GenerateResponse]:
    request = model_pb2.GenerateRequest(
        messages=[model_pb2.ChatMessage(**message) for message in messages],
        sampling=model_pb2.SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0),
        **request_fields,
    )
    tokens, text, last = [], "", None
    for response in stub.Generate(request, timeout=300):
        tokens.extend(response.token_ids)
        text += response.text
        last = response
    return tokens, text, last


def test_model_info_says_it_has_a_chat_template(stack):
    stub, _, _ = stack
    info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=30)
    assert info.model_id == "smollm2" and info.has_chat_template
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]


def test_the_ready_line_asks_a_chat_model_a_real_question(stack):
    _, _, address = stack
    assert example_arguments(address) == '--chat "What is the capital of Japan?" --max-new-tokens 64'


def test_the_capital_of_france(stack):
    stub, _, _ = stack
    tokens, text, last = chat(stub, [{"role": "user", "content": "What is the capital of France?"}])
    assert text == "The capital of France is Paris."
    assert last.finish_reason == model_pb2.FINISH_REASON_EOS and tokens[-1] == 2


@pytest.mark.timeout(900)  # a few seconds on a quiet machine; minutes on a shared, loaded one
def test_conversations_match_transformers_alone_and_eight_at_once(stack, reference):
    stub, cache, _ = stack
    expected = [reference_greedy(reference, messages) for messages in EIGHT_CONVERSATIONS]
    for messages, want in zip(EIGHT_CONVERSATIONS[:3], expected):
        tokens, text, _ = chat(stub, messages)
        assert tokens == want, messages
        assert text == reference[0].decode(want, skip_special_tokens=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda messages: chat(stub, messages)[0], EIGHT_CONVERSATIONS))
    for messages, got, want in zip(EIGHT_CONVERSATIONS, results, expected):
        assert got == want, messages
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block to be released")


def test_chat_template_kwargs_the_template_does_not_read_change_nothing(stack):
    # SmolLM2's template reads no extra variable: the kwargs are accepted and change nothing.
    # That they reach a template that reads them is test_openai_http_chat.py's (gRPC and HTTP).
    stub, _, _ = stack
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    assert chat(stub, messages, chat_template_kwargs=kwargs)[0] == chat(stub, messages)[0]


INVALID = grpc.StatusCode.INVALID_ARGUMENT
USER_HI = [model_pb2.ChatMessage(role="user", content="hi")]


@pytest.mark.parametrize("fields, phrase", [
    (dict(messages=[model_pb2.ChatMessage(role="wizard", content="hi")]),
     "messages[0].role is 'wizard'; known roles: system, user, assistant, tool"),
    (dict(messages=[*USER_HI, model_pb2.ChatMessage(role="", content="x")]), "messages[1].role is ''"),
    (dict(messages=USER_HI, prompt="hi"), "set exactly one of prompt, prompt_token_ids and messages, not prompt and messages"),
    (dict(messages=USER_HI, prompt_token_ids=[1, 2]), "not prompt_token_ids and messages"),
    (dict(chat_template_kwargs=struct_pb2.Struct(), prompt="hi"), "chat_template_kwargs apply to messages only"),
    (dict(messages=USER_HI, chat_template_kwargs=struct_pb2.Struct(fields={
        "add_generation_prompt": struct_pb2.Value(bool_value=False)})), "cannot set add_generation_prompt"),
], ids=["unknown-role", "empty-role", "prompt-and-messages", "ids-and-messages", "kwargs-without-messages",
        "kwargs-reserved-name"])
def test_bad_chat_requests_are_invalid_argument(stack, fields, phrase):
    stub, cache, _ = stack
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(max_new_tokens=4), **fields)
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(request, timeout=60))
    assert raised.value.code() == INVALID, raised.value.details()
    assert phrase in raised.value.details()
    wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block to be released")
