"""The CLI against a fake model service: a real gRPC server on a free loopback port."""

import contextlib
import json
import socket
from concurrent import futures

import grpc
import pytest

from model_service import client
from pagedkv.model.v1 import model_pb2, model_pb2_grpc


class FakeModelService(model_pb2_grpc.ModelServiceServicer):
    def __init__(self) -> None:
        self.requests: list[model_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.responses: list[model_pb2.GenerateResponse] = []
        self.abort_with: tuple[grpc.StatusCode, str] | None = None

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        yield from self.responses
        if self.abort_with:
            context.abort(*self.abort_with)

    def Abort(self, request, context):
        self.requests.append(request)
        return model_pb2.AbortResponse(aborted=len([i for i in request.request_ids if i.startswith("live")]))

    def GetModelInfo(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return model_pb2.GetModelInfoResponse(
            model_id="tiny", architecture="LlamaForCausalLM", vocab_size=260,
            eos_token_ids=[257], max_total_tokens=4096, block_size=16, max_model_len=512,
            dtype="float32", device="cpu",
        )


@pytest.fixture(scope="module")
def server():
    service = FakeModelService()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    model_pb2_grpc.add_ModelServiceServicer_to_server(service, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield service, f"127.0.0.1:{port}"
    grpc_server.stop(grace=None)


@pytest.fixture
def fake(server, monkeypatch):
    service, address = server
    service.__init__()  # fresh state for each test, one server for the module
    monkeypatch.delenv(client.AUTH_TOKEN_ENV, raising=False)
    return service, address


STREAM = [
    model_pb2.GenerateResponse(token_ids=[72, 105], text="Hi", request_id="r1"),
    model_pb2.GenerateResponse(token_ids=[32, 226, 130, 172], text=" €", request_id="r1"),
    model_pb2.GenerateResponse(
        token_ids=[33], text="!", request_id="r1",
        finish_reason=model_pb2.FINISH_REASON_LENGTH,
        usage=model_pb2.Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=3),
    ),
]


def test_streams_text_and_prints_usage(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["Hello", "--max-new-tokens", "7", "--address", address]) == 0
    out, err = capsys.readouterr()
    assert out == "Hi €!"
    assert "prompt_tokens=5 completion_tokens=7 cached_tokens=3 finish_reason=LENGTH" in err
    request = service.requests[0]
    assert request.prompt == "Hello" and not request.prompt_token_ids
    assert request.sampling.max_new_tokens == 7
    assert request.sampling.temperature == 0.0  # greedy by default
    assert not request.sampling.HasField("top_p") and not request.sampling.HasField("seed")
    assert "authorization" not in service.metadata[0]


def test_sampling_flags_reach_the_request(fake, capsys):
    service, address = fake
    service.responses = STREAM
    argv = [
        "--token-ids", "1,2,3", "--max-new-tokens", "4", "--temperature", "0.5",
        "--top-k", "40", "--top-p", "0.9", "--seed", "7", "--stop", "\n\n", "--stop", "END",
        "--stop-token-id", "9", "--ignore-eos", "--request-id", "abc", "--timeout", "5",
        "--address", address,
    ]
    assert client.main(argv) == 0
    request = service.requests[0]
    assert list(request.prompt_token_ids) == [1, 2, 3] and request.prompt == ""
    assert request.request_id == "abc"
    sampling = request.sampling
    assert (sampling.max_new_tokens, sampling.top_k, sampling.seed) == (4, 40, 7)
    assert sampling.temperature == pytest.approx(0.5) and sampling.top_p == pytest.approx(0.9)
    assert list(sampling.stop) == ["\n\n", "END"] and list(sampling.stop_token_ids) == [9]
    assert sampling.ignore_eos


def test_generation_api_flags_reach_the_request(fake, capsys):
    service, address = fake
    service.responses = STREAM
    argv = [
        "Hi", "--n", "3", "--logprobs", "5", "--prompt-logprobs", "0", "--presence-penalty", "0.5",
        "--frequency-penalty", "-1", "--repetition-penalty", "1.3", "--min-p", "0.1", "--min-tokens", "2",
        "--logit-bias", "42=-100", "--logit-bias", "7=2.5", "--include-stop-str", "--keep-special-tokens",
        "--priority", "-4", "--address", address,
    ]
    assert client.main(argv) == 0
    request = service.requests[0]
    sampling = request.sampling
    assert (sampling.n, sampling.logprobs, sampling.prompt_logprobs, sampling.min_tokens) == (3, 5, 0, 2)
    assert sampling.HasField("prompt_logprobs")
    assert sampling.presence_penalty == pytest.approx(0.5) and sampling.frequency_penalty == pytest.approx(-1)
    assert sampling.repetition_penalty == pytest.approx(1.3) and sampling.min_p == pytest.approx(0.1)
    assert dict(sampling.logit_bias) == {42: -100.0, 7: 2.5}
    assert sampling.include_stop_str_in_output and sampling.HasField("skip_special_tokens")
    assert not sampling.skip_special_tokens and request.priority == -4


def test_unset_generation_api_flags_leave_the_service_defaults(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["Hi", "--address", address]) == 0
    sampling = service.requests[0].sampling
    for name in ("logprobs", "prompt_logprobs", "repetition_penalty", "skip_special_tokens"):
        assert not sampling.HasField(name), name
    assert sampling.n == 0 and not sampling.logit_bias
    assert not service.requests[0].HasField("stream")  # unset: the service streams


def test_no_stream_asks_for_whole_completions(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["Hi", "--no-stream", "--address", address]) == 0
    request = service.requests[0]
    assert request.HasField("stream") and not request.stream


def test_n_completions_and_logprobs_are_printed_per_completion(fake, capsys):
    service, address = fake
    top = [model_pb2.TopLogprob(token_id=5, logprob=-0.1)]
    service.responses = [
        model_pb2.GenerateResponse(index=0, token_ids=[5], text="a",
                                   logprobs=[model_pb2.TokenLogprob(token_id=5, logprob=-0.1, top=top)]),
        model_pb2.GenerateResponse(index=1, token_ids=[6], text="b", finish_reason=model_pb2.FINISH_REASON_STOP,
                                   usage=model_pb2.Usage(completion_tokens=1), matched_stop_token_id=6,
                                   logprobs=[model_pb2.TokenLogprob(token_id=6, logprob=-2.5)]),
        model_pb2.GenerateResponse(index=0, token_ids=[7], text="c", finish_reason=model_pb2.FINISH_REASON_LENGTH,
                                   usage=model_pb2.Usage(prompt_tokens=4, completion_tokens=2),
                                   logprobs=[model_pb2.TokenLogprob(token_id=7, logprob=-0.5)]),
    ]
    assert client.main(["Hi", "--n", "2", "--logprobs", "1", "--address", address]) == 0
    out, err = capsys.readouterr()
    assert out == "--- completion 0 ---\nac\n--- completion 1 ---\nb\n"
    assert "[0] token=5 logprob=-0.1000 top=5:-0.1000" in err and "[1] token=6 logprob=-2.5000" in err
    assert "prompt_tokens=4 completion_tokens=3 cached_tokens=0 finish_reason=LENGTH,STOP" in err


def test_abort_names_requests_and_prints_how_many_were_live(fake, capsys):
    service, address = fake
    assert client.main(["--abort", "live-1", "--abort", "gone", "--address", address]) == 0
    assert list(service.requests[0].request_ids) == ["live-1", "gone"]
    assert capsys.readouterr().out == "aborted: 1 of 2\n"


def test_chat_sends_one_user_message(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["--chat", "What is the capital of France?", "--address", address]) == 0
    request = service.requests[0]
    assert [(m.role, m.content) for m in request.messages] == [("user", "What is the capital of France?")]
    assert request.prompt == "" and not request.prompt_token_ids


def test_system_puts_a_system_message_first_and_implies_chat(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["--system", "Answer in French.", "Capital of France?", "--address", address]) == 0
    request = service.requests[0]
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "Answer in French."), ("user", "Capital of France?")]
    assert request.prompt == ""


def test_chat_requests_keep_their_priority(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["--chat", "Hi", "--priority", "3", "--address", address]) == 0
    assert service.requests[0].priority == 3


def test_json_prints_one_line_per_message(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["Hello", "--json", "--address", address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    messages = [json.loads(line) for line in lines]
    assert messages[0] == {"token_ids": [72, 105], "text": "Hi", "request_id": "r1"}
    assert messages[2]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "cached_tokens": 3}


def test_error_prints_status_and_exits_1(fake, capsys):
    service, address = fake
    service.responses = STREAM[:1]
    service.abort_with = (grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2.0")
    assert client.main(["Hello", "--top-p", "2", "--address", address]) == 1
    out, err = capsys.readouterr()
    assert out == "Hi"  # what streamed before the error stays
    assert "INVALID_ARGUMENT: top_p must be in (0, 1], got 2.0" in err


def test_unreachable_server_is_unavailable(capsys):
    with socket_on_free_port() as port:  # bound, never listening: connection refused
        code = client.main(["Hello", "--address", f"127.0.0.1:{port}", "--timeout", "5"])
    assert code == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_auth_token_sent_as_bearer_metadata(fake, capsys):
    service, address = fake
    service.responses = STREAM
    assert client.main(["Hi", "--auth-token", "s3cret", "--address", address]) == 0
    assert service.metadata[-1]["authorization"] == "Bearer s3cret"


def test_auth_token_from_environment(fake, capsys, monkeypatch):
    service, address = fake
    service.responses = STREAM
    monkeypatch.setenv(client.AUTH_TOKEN_ENV, "from-env")
    assert client.main(["Hi", "--address", address]) == 0
    assert service.metadata[-1]["authorization"] == "Bearer from-env"


def test_info(fake, capsys):
    service, address = fake
    assert client.main(["--info", "--address", address, "--auth-token", "t"]) == 0
    out = capsys.readouterr().out
    assert "model_id: tiny" in out and "eos_token_ids: 257" in out
    assert "max_model_len: 512" in out and "block_size: 16" in out
    assert service.metadata[-1]["authorization"] == "Bearer t"


def test_info_json(fake, capsys):
    _, address = fake
    assert client.main(["--info", "--json", "--address", address]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_id"] == "tiny" and info["max_total_tokens"] == "4096"  # uint64: string


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "exactly one of a prompt or --token-ids"),
        (["text", "--token-ids", "1,2"], "exactly one of a prompt or --token-ids"),
        (["--token-ids", "1,x"], "comma-separated integers"),
        (["--token-ids", "1,-2"], "token ids must be in"),
        (["text", "--timeout", "0"], "must be > 0"),
        (["text", "--temperature", "hot"], "invalid float value"),
        (["text", "--logit-bias", "42"], "expected TOKEN_ID=BIAS"),
        (["text", "--logit-bias", "x=1"], "expected TOKEN_ID=BIAS"),


        (["--chat", "--token-ids", "1,2"], "--chat and --system take a text prompt"),
        (["--system", "be brief", "--token-ids", "1,2"], "--chat and --system take a text prompt"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert client.main(argv) == 2
    assert message in capsys.readouterr().err


def test_missing_tls_ca_file(capsys, tmp_path):
    missing = tmp_path / "ca.pem"
    assert client.main(["text", "--tls-ca", str(missing)]) == 1
    assert f"cannot read --tls-ca {missing}" in capsys.readouterr().err


@contextlib.contextmanager
def socket_on_free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
