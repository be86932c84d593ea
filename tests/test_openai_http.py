"""The OpenAI HTTP API of the model service, through the official `openai` client.

Real processes: a cache service and model services serving a tiny random Llama checkpoint
(harness/hf_checkpoints.py, a real byte-level BPE tokenizer), with --auth-token on, so every
call here also goes through the bearer check. Each HTTP answer is compared with what the
gRPC Generate call gives for the same request: one validation and one engine behind both
doors. Every error status comes back as an OpenAI error object that the client turns into
its own exception class, and leaves no block leased.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request

import grpc
import openai
import pytest
from scrape import metric

from harness.cache_helpers import cache_stub, no_block_leased, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

TOKEN = "test-token"
METADATA = bearer_metadata(TOKEN)
MODEL = "llama-http"  # --served-model-name
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("llama", tmp_path_factory.mktemp("llama-http"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with start_cache_service(tmp_path_factory.mktemp("cache"), *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB",
                             "--auth-token", TOKEN) as service:
        yield service


@pytest.fixture(scope="module")
def model(cache, checkpoint, tmp_path_factory):
    with start_model_service(tmp_path_factory.mktemp("model"), cache.address, "--model", str(checkpoint),
                             "--auth-token", TOKEN, "--cache-auth-token", TOKEN,
                             "--served-model-name", MODEL, "--max-request-bytes", "1MiB") as service:
        yield service


@pytest.fixture(scope="module")
def client(model):
    # max_retries=0: the client retries 429 and 5xx by itself, which would hide the status.
    return openai.OpenAI(base_url=model.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stub(model):
    channel = grpc.insecure_channel(model.address)
    yield model_pb2_grpc.ModelServiceStub(channel)
    channel.close()


def leased(cache) -> int:
    return stats(cache_stub(cache.address), metadata=METADATA).blocks_leased


def grpc_text(stub, **fields) -> tuple[str, model_pb2.GenerateResponse]:
    """The text of a gRPC Generate call and its last message."""
    sampling = fields.pop("sampling", {})
    request = model_pb2.GenerateRequest(sampling=model_pb2.SamplingParams(**sampling), **fields)
    text, last = "", None
    for response in stub.Generate(request, timeout=120, metadata=METADATA):
        text += response.text
        last = response
    return text, last



# -- models and health ----------------------------------------------------------------------


def test_models_list_and_retrieve_name_the_served_model(client, stub):
    info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10, metadata=METADATA)
    models = client.models.list()
    assert [card.id for card in models.data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.owned_by == "pagedkv"
    assert card.model_extra["root"] == info.model_id
    assert card.model_extra["max_model_len"] == info.max_model_len
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("no-such-model")
    assert error.value.status_code == 404 and error.value.code == "model_not_found"


def test_health_is_open_without_a_token(model):
    with urllib.request.urlopen(f"http://127.0.0.1:{model.http_port}/health", timeout=10) as response:
        assert response.status == 200


# -- completions ----------------------------------------------------------------------------


def test_completion_equals_grpc_greedy(client, stub, cache):
    expected, last = grpc_text(stub, prompt=PROMPT, sampling=dict(max_new_tokens=12, temperature=0, ignore_eos=True))
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.object == "text_completion" and completion.model == MODEL
    assert completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.text == expected and choice.index == 0 and choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == last.usage.prompt_tokens
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == last.usage.prompt_tokens + 12
    no_block_leased(cache, metadata=METADATA)


def test_completion_prompt_as_token_ids_and_as_a_batch(client, stub):
    ids = [1, 40, 41, 42, 43, 44, 45]
    expected_ids, _ = grpc_text(stub, prompt_token_ids=ids, sampling=dict(max_new_tokens=6, temperature=0,
                                                                          ignore_eos=True))
    expected_text, _ = grpc_text(stub, prompt=PROMPT, sampling=dict(max_new_tokens=6, temperature=0, ignore_eos=True))
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == expected_ids
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT + " Again"], max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.choices[0].text == expected_text
    assert batch.usage.completion_tokens == 12
    token_batch = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert [choice.text for choice in token_batch.choices] == [expected_ids, expected_ids]


def test_completion_stream_with_usage(client, stub):
    expected, last = grpc_text(stub, prompt=PROMPT, sampling=dict(max_new_tokens=10, temperature=0, ignore_eos=True))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(chunk.choices[0].text for chunk in text_chunks) == expected
    assert [chunk.choices[0].finish_reason for chunk in text_chunks][-1] == "length"
    assert all(chunk.usage is None for chunk in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == last.usage.prompt_tokens
    assert len({chunk.id for chunk in chunks}) == 1


def test_usage_carries_the_peak_kv_blocks_and_recomputed_tokens_summed_over_choices(client, stub):
    by_index = {}
    request = model_pb2.GenerateRequest(prompt=PROMPT, sampling=model_pb2.SamplingParams(
        n=2, max_new_tokens=6, temperature=0, ignore_eos=True))
    for response in stub.Generate(request, timeout=120, metadata=METADATA):
        if response.finish_reason:
            by_index[response.index] = response.usage
    assert sorted(by_index) == [0, 1] and all(usage.peak_kv_blocks > 0 for usage in by_index.values())
    whole = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for usage in (whole.usage, chunks[-1].usage):  # the openai package keeps fields it does not know
        assert usage.peak_kv_blocks == sum(u.peak_kv_blocks for u in by_index.values())
        assert usage.peak_kv_bytes == sum(u.peak_kv_bytes for u in by_index.values()) > 0
        assert usage.recomputed_tokens == 0
        assert usage.completion_tokens == 12


def test_async_client_completion_stream_and_whole(model, stub):
    expected, _ = grpc_text(stub, prompt=PROMPT, sampling=dict(max_new_tokens=8, temperature=0, ignore_eos=True))

    async def both() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=model.http_url, api_key=TOKEN, max_retries=0) as client:
            whole = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
            stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            streamed = "".join([chunk.choices[0].text async for chunk in stream])
            return whole.choices[0].text, streamed

    assert asyncio.run(both()) == (expected, expected)


def test_stop_string_cuts_the_text_there(client, stub):
    greedy, _ = grpc_text(stub, prompt=PROMPT, sampling=dict(max_new_tokens=16, temperature=0, ignore_eos=True))
    stop = greedy[5:8]
    expected = greedy[:greedy.index(stop)]
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected and completion.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                              stop=[stop, "never-there"], stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_repeated_prompt_reports_cached_tokens(client):
    # Three full blocks of 16 tokens, then a few more: a second request finds the blocks cached.
    prompt = " ".join(["Paged attention keeps the KV cache in fixed-size blocks."] * 5)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 48
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_sse_wire_format_is_openai_s(model):
    """The raw stream: `data: {json}` events separated by blank lines, `data: [DONE]` last."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{model.http_url}/completions", data=body, method="POST", headers={
        "content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


# -- streams that end early free their blocks --------------------------------------------


def test_client_closing_a_stream_frees_its_blocks_at_once(client, cache, model):
    aborted_before = metric(model, "pagedkv_model_requests_total", finish_reason="aborted")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for count, _ in enumerate(stream):
        if count == 2:
            break
    assert leased(cache) > 0, "the request should hold blocks while it streams"
    stream.close()
    no_block_leased(cache, metadata=METADATA)
    # Cancelled, not run to its 400 tokens.
    wait_for(lambda: metric(model, "pagedkv_model_requests_total", finish_reason="aborted") == aborted_before + 1,
             30, "the request counted as aborted")


def test_client_hanging_up_on_a_whole_answer_cancels_it(model, cache):
    # The client hangs up once the service is generating its answer (its generated-token
    # count moved), not after a timeout: what the hang-up meets does not depend on the
    # machine's speed. Only if all 450 tokens were done between that count and the hang-up
    # (the answer ended "length") is it asked again.
    def ended(reason: str) -> float:
        return metric(model, "pagedkv_model_requests_total", finish_reason=reason)

    url = urllib.parse.urlsplit(model.http_url)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 450, "temperature": 0, "ignore_eos": True})
    for _ in range(5):
        aborted_before, finished_before = ended("aborted"), ended("length")
        generated_before = metric(model, "pagedkv_model_generated_tokens_total")
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        connection.request("POST", url.path + "/completions", body, {
            "content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
        wait_for(lambda: metric(model, "pagedkv_model_generated_tokens_total") > generated_before, 60,
                 "the answer's first tokens")
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        wait_for(lambda: ended("aborted") + ended("length") > aborted_before + finished_before, 60,
                 "the hung-up request to end")
        if ended("aborted") == aborted_before + 1:
            break
    else:
        pytest.fail("all 450 tokens were done before the hang-up every time")
    no_block_leased(cache, metadata=METADATA)


def test_32_concurrent_streams_complete_and_equal_grpc(model, stub, cache):
    prompts = [f"{PROMPT} Number {i}." for i in range(32)]
    expected = [grpc_text(stub, prompt=p, sampling=dict(max_new_tokens=8, temperature=0, ignore_eos=True))[0]
                for p in prompts]

    async def stream_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=model.http_url, api_key=TOKEN, max_retries=0, timeout=300) as client:
            async def one(prompt: str) -> str:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                         stream=True, extra_body={"ignore_eos": True})
                return "".join([chunk.choices[0].text async for chunk in stream])

            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(stream_all()) == expected
    no_block_leased(cache, metadata=METADATA)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param", "in_message"), [
    ({"temperature": -1.0}, None, "temperature must be a finite number >= 0"),
    ({"top_p": 0.0}, None, "top_p must be in (0, 1]"),
    ({"max_tokens": 100_000}, None, "exceeds max_model_len"),
    ({"prompt": "x" * 3000}, None, "this service accepts at most"),
    ({"prompt": [1, 99999]}, None, ">= vocab_size"),
    ({"prompt": []}, "prompt", "empty list"),
    ({"seed": -1}, "seed", "out of range"),
    ({"logit_bias": {"hello": 1.0}}, "logit_bias", "not a token id"),
    ({"max_token": 5}, "max_token", "not a field this server knows"),
    ({"echo": True}, "echo", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"stop_token_ids": list(range(1025))}, None, "at most 1024 stop_token_ids"),
])
def test_bad_completion_is_400_with_an_openai_error_body(client, cache, fields, param, in_message):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=fields)
    assert error.value.status_code == 400
    assert in_message in error.value.message, error.value.message
    assert error.value.type == "invalid_request_error"
    assert error.value.param == param
    assert leased(cache) == 0


@pytest.mark.parametrize(("fields", "param"), [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),  # tools are implemented; the legacy field is not
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
])
def test_unsupported_chat_feature_is_400_saying_so(client, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | fields
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**body)
    assert "not supported" in error.value.message and error.value.param == param
    assert error.value.code == "unsupported_parameter"


@pytest.mark.parametrize("api_key", ["wrong-token", ""])
def test_wrong_or_missing_token_is_401(model, api_key):
    client = openai.OpenAI(base_url=model.http_url, api_key=api_key or "unused", max_retries=0,
                           default_headers={} if api_key else {"Authorization": ""})
    with pytest.raises(openai.AuthenticationError) as error:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 401 and error.value.code == "invalid_api_key"
    assert ("wrong token" if api_key else "missing Authorization") in error.value.message
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions/render", "/v1/chat/completions/render"])
def test_router_endpoints_need_the_token_too(model, path):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": PROMPT}
    body = json.dumps({"model": MODEL, **prompt}).encode()
    request = urllib.request.Request(model.http_url.removesuffix("/v1") + path, data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=60)
    assert error.value.code == 401
    assert json.loads(error.value.read())["error"]["code"] == "invalid_api_key"


def raw_request(port: int, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """(status, whole response) of one HTTP/1.1 exchange on a socket, where `body` may be
    only the start of what the head's Content-Length announces: a server that waited for
    the rest would never answer, and the read times out.

    A server that answers without reading the whole body closes with bytes unread, and its
    kernel resets the connection: the reset may come while this still sends, or after the
    answer arrived. The answer stays readable before the reset is reported (Linux keeps
    what arrived first), so both end the exchange rather than fail it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        try:
            connection.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it answered and closed before taking all of the body
        received = b""
        try:
            while chunk := connection.recv(65536):  # the server closes after answering
                received += chunk
        except ConnectionResetError:
            pass  # the reset after its answer
    return int(received.split(b" ", 2)[1]), received


def test_no_token_is_401_before_the_body_is_read(model):
    # 200 MiB announced, 1 KiB sent: the 401 comes without the server waiting for the rest.
    status, response = raw_request(model.http_port, "POST /v1/completions HTTP/1.1\nHost: x\n"
                                   "Content-Type: application/json\nContent-Length: 209715200\n", b"{" * 1024)
    assert status == 401 and b"missing Authorization header" in response


def test_body_over_max_request_bytes_is_413_before_it_is_read(model, cache):
    head = (f"POST /v1/completions HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n"
            "Content-Type: application/json\n")
    status, response = raw_request(model.http_port, head + "Content-Length: 209715200\n", b"{" * 1024)
    assert status == 413 and b"at most 1,048,576 (--max-request-bytes)" in response
    # Without a length (chunked), the body is read up to the limit: 17 chunks of 64 KiB
    # pass it, and no last chunk is ever sent.
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    status, response = raw_request(model.http_port, head + "Transfer-Encoding: chunked\n", chunk * 17)
    assert status == 413 and b"more than 1,048,576 bytes" in response
    assert leased(cache) == 0


def test_a_refused_body_the_client_is_still_sending_gets_its_answer_not_a_reset(model, cache):
    # A client that sends its whole body before it reads (http.client, under urllib and
    # many scripts) was reset while still sending when the server answered and closed with
    # the body unread, and raised a connection error instead of the 413 (or 401) that says
    # what to fix. (httpx, under the openai SDK, reads the answer after a failed write.)
    def status(body: bytes, token: str) -> tuple[int, bytes]:
        request = urllib.request.Request(f"{model.http_url}/completions", data=body, headers={
            "content-type": "application/json", "authorization": f"Bearer {token}"})
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=120)
        return error.value.code, error.value.read()
    prompt = json.dumps({"model": MODEL, "prompt": "a" * (16 << 20), "max_tokens": 1}).encode()
    code, answer = status(prompt, TOKEN)  # past --max-request-bytes (1 MiB), within the gate's drain
    assert code == 413 and b"--max-request-bytes" in answer
    within = json.dumps({"model": MODEL, "prompt": "a" * (900 << 10), "max_tokens": 1}).encode()
    assert status(within, "wrong")[0] == 401  # a request the server would take, without its token
    assert leased(cache) == 0


def test_invalid_json_and_the_schema_without_a_token_are_401(model):
    for path, data in (("/v1/completions", b"{not json"), ("/openapi.json", None)):
        request = urllib.request.Request(f"http://127.0.0.1:{model.http_port}{path}", data=data,
                                         headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(request, timeout=30)
        assert error.value.code == 401, path
    request = urllib.request.Request(f"http://127.0.0.1:{model.http_port}/openapi.json",
                                     headers={"authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert "/v1/completions" in json.loads(response.read())["paths"]


def test_the_bearer_scheme_is_case_insensitive_on_both_doors(model):
    request = urllib.request.Request(f"{model.http_url}/models", headers={"authorization": f"bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["data"][0]["id"] == MODEL
    channel = grpc.insecure_channel(model.address)
    info = model_pb2_grpc.ModelServiceStub(channel).GetModelInfo(
        model_pb2.GetModelInfoRequest(), timeout=10, metadata=(("authorization", f"BEARER {TOKEN}"),))
    channel.close()
    assert info.vocab_size > 0


@pytest.mark.parametrize(("fields", "param"), [({"prompt": "a\ud800b"}, "prompt"),
                                               ({"prompt": "ok", "stop": ["x", "\udfff"]}, "stop.1")])
def test_lone_surrogate_is_400_naming_its_field(model, cache, fields, param):
    # JSON's own escape for a lone surrogate: no Unicode text, and no proto string can hold it.
    body = '{"model": "%s", "max_tokens": 2, %s}' % (MODEL, json.dumps(fields)[1:-1])
    request = urllib.request.Request(f"{model.http_url}/completions", data=body.encode(), headers={
        "content-type": "application/json", "authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 400
    answer = json.loads(error.value.read())["error"]
    assert answer["param"] == param and "lone UTF-16 surrogate" in answer["message"]
    assert leased(cache) == 0


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert "'gpt-4o' does not exist" in error.value.message and error.value.param == "model"


@pytest.fixture(scope="module")
def limited(cache, tmp_path_factory):
    """The tiny model, one Generate stream at a time."""
    with start_model_service(tmp_path_factory.mktemp("limited"), cache.address, "--auth-token", TOKEN,
                             "--cache-auth-token", TOKEN, "--max-concurrent-streams", "1") as service:
        yield service


def test_stream_limit_is_429_through_http_as_through_grpc(limited, cache):
    client = openai.OpenAI(base_url=limited.http_url, api_key=TOKEN, max_retries=0)
    holding = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(holding))  # the first stream is open and counted
    with pytest.raises(openai.RateLimitError) as error:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert error.value.status_code == 429 and "--max-concurrent-streams 1" in error.value.message
    # One limit for both doors: an HTTP stream counts against gRPC calls too.
    channel = grpc.insecure_channel(limited.address)
    with pytest.raises(grpc.RpcError) as grpc_error:
        list(model_pb2_grpc.ModelServiceStub(channel).Generate(model_pb2.GenerateRequest(prompt=PROMPT), timeout=30,
                                                               metadata=METADATA))
    channel.close()
    assert grpc_error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    holding.close()
    no_block_leased(cache, metadata=METADATA)


def test_not_attached_is_503(tmp_path):
    # Nothing listens where the cache service should be: the model service never attaches.
    with start_model_service(tmp_path, "127.0.0.1:9", wait_serving=False) as detached:
        client = openai.OpenAI(base_url=detached.http_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert error.value.status_code == 503 and "not attached to the cache service" in error.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{detached.http_port}/health", timeout=10)
        assert health.value.code == 503
        with pytest.raises(urllib.error.HTTPError) as reset:
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{detached.http_port}/reset_prefix_cache",
                                                          data=b"", method="POST"), timeout=10)
        assert reset.value.code == 503 and "not attached to the cache service" in reset.value.read().decode()


def test_reset_prefix_cache_needs_the_token_and_drops_this_models_cached_blocks(model, cache, client):
    url = model.http_url.removesuffix("/v1") + "/reset_prefix_cache"
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60)
    assert error.value.code == 401
    client.completions.create(model=MODEL, prompt=PROMPT * 3, max_tokens=2, temperature=0)
    no_block_leased(cache, metadata=METADATA)  # its release registered the prompt's full blocks
    before = stats(cache_stub(cache.address), metadata=METADATA).blocks_cached
    request = urllib.request.Request(url, data=b"", method="POST", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["blocks_dropped"] >= 1 and answer["blocks_kept"] == 0, answer
    after = stats(cache_stub(cache.address), metadata=METADATA).blocks_cached
    assert after == before - answer["blocks_dropped"]  # another model's blocks in this pool stay
    usage = client.completions.create(model=MODEL, prompt=PROMPT * 3, max_tokens=2, temperature=0).usage
    assert usage.prompt_tokens_details.cached_tokens == 0
    no_block_leased(cache, metadata=METADATA)
