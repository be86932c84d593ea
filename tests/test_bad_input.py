"""Every malformed or hostile request, against real processes of both services.

Each row sends one bad request and checks the status code and a phrase of the message
that says what to change; then that the service still serves (a good request succeeds),
that nothing leaked (GetStats: 0 blocks leased) and that no traceback reached the log.
Rows follow the error table in docs/grpc-api.md ("Errors"), plus the limits a hostile client could push on.

The services run once for the module, with --auth-token on (so every row but the
UNAUTHENTICATED ones also goes through the auth interceptor) and small limits:
- cache: 128 blocks of 16 tokens (8 KiB a block for the tiny model), 1 MiB messages;
- model: max_model_len 2048, --max-prompt-tokens 1500, --max-concurrent-streams 2,
  1 MiB messages; a second model service on the same cache with --max-queued-requests 1.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.cache_helpers import allocate, attach, extend, fork, lease, release, truncate, wait_for
from harness.processes import start_cache_service, start_model_service
from pagedkv.cache.v1 import cache_pb2, cache_pb2_grpc
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

TOKEN = "bad-input-token"
AUTH = bearer_metadata(TOKEN)
BLOCK_BYTES = 8192
NUM_BLOCKS = 128
MAX_MODEL_LEN = 2048
MAX_PROMPT_TOKENS = 1500
MESSAGE_BYTES = 1024 * 1024
VOCAB = 260
GENERATE = "/pagedkv.model.v1.ModelService/Generate"
HEARTBEAT = "/pagedkv.cache.v1.CacheService/Heartbeat"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    common = ("--auth-token", TOKEN, "--max-message-bytes", str(MESSAGE_BYTES))
    with start_cache_service(tmp, *common, "--kv-cache-bytes", str(NUM_BLOCKS * BLOCK_BYTES), "--headroom", "0",
                             "--lease-ttl-ms", "60000") as cache:
        model_args = (*common, "--cache-auth-token", TOKEN, "--max-model-len", str(MAX_MODEL_LEN), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS))
        # (Started from this thread: a child dies with the thread that started it, PR_SET_PDEATHSIG.)
        with start_model_service(tmp, cache.address, *model_args, "--max-concurrent-streams", "2") as model, \
                start_model_service(tmp, cache.address, *model_args, "--max-queued-requests", "1") as queue_limited:
            channels = [grpc.insecure_channel(s.address) for s in (cache, model, queue_limited)]
            yield dict(
                cache=cache, model=model, queue_limited=queue_limited,
                cache_channel=channels[0], model_channel=channels[1],
                cache_stub=cache_pb2_grpc.CacheServiceStub(channels[0]),
                model_stub=model_pb2_grpc.ModelServiceStub(channels[1]),
                queue_stub=model_pb2_grpc.ModelServiceStub(channels[2]),
            )
            for channel in channels:
                channel.close()


def stream(stub, metadata=AUTH, **request) -> list[model_pb2.GenerateResponse]:
    return list(stub.Generate(model_pb2.GenerateRequest(**request), timeout=60, metadata=metadata))


def good_request(stub) -> None:
    responses = stream(stub, prompt="still serving?",
                       sampling=model_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert responses[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 4


def assert_healthy(stack) -> None:
    """The services still serve, no block is leased, and no traceback was logged."""
    good_request(stack["model_stub"])
    good_request(stack["queue_stub"])
    cache = stack["cache_stub"]
    wait_for(lambda: cache.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=AUTH).blocks_leased == 0,
             10, "every block back in the pool")
    for service in ("cache", "model", "queue_limited"):
        process = stack[service]
        assert process.returncode is None, f"the {service} service died: {process.logs()[-3000:]}"
        assert "Traceback" not in process.logs(), f"the {service} service logged a traceback"


def expect_error(call, code: grpc.StatusCode, phrase: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    error = raised.value
    assert error.code() == code, f"{error.code()}: {error.details()}"
    assert phrase.lower() in (error.details() or "").lower(), error.details()
    assert "Traceback" not in error.details() and "Unexpected <class" not in error.details()
    return error


# ---------------------------------------------------------------------------------------
# Generate: one row per bad request

def sp(**fields) -> model_pb2.SamplingParams:
    return model_pb2.SamplingParams(**fields)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
GENERATE_ROWS = [
    # (id, request fields, status, phrase in the message)
    ("token-id-equals-vocab", dict(prompt_token_ids=[1, VOCAB]), INVALID, f"vocab_size {VOCAB}"),
    ("token-id-uint32-max", dict(prompt_token_ids=[2**32 - 1]), INVALID, f"vocab_size {VOCAB}"),
    ("empty-prompt", dict(), INVALID, "prompt is empty"),
    ("empty-prompt-text-and-ids", dict(prompt="", prompt_token_ids=[]), INVALID, "prompt is empty"),
    ("prompt-and-ids", dict(prompt="hi", prompt_token_ids=[1, 2]), INVALID, "exactly one of prompt, prompt_token_ids and messages"),
    ("messages-without-chat-template", dict(messages=[model_pb2.ChatMessage(role="user", content="hi")]), INVALID,
     "this model has no chat template"),
    ("over-max-prompt-tokens", dict(prompt_token_ids=[1] * (MAX_PROMPT_TOKENS + 1)), INVALID, "--max-prompt-tokens"),
    ("over-max-model-len", dict(prompt_token_ids=[1] * (MAX_MODEL_LEN + 10)), INVALID, "--max-prompt-tokens"),
    ("huge-text-prompt", dict(prompt="x" * 900_000), INVALID, "--max-prompt-tokens"),
    # Two bytes a character: refused by its UTF-8 length, before it is tokenized.
    ("text-prompt-over-the-byte-limit", dict(prompt="é" * (MAX_PROMPT_TOKENS * 16 + 1)), INVALID,
     f"is at least {MAX_PROMPT_TOKENS * 32 + 2:,} bytes"),
    ("cache-salt-too-long", dict(prompt="hi", cache_salt="s" * 257), INVALID, "cache_salt is 257 characters"),
    ("max-new-tokens-0", dict(prompt="hi", sampling=sp(max_new_tokens=0)), INVALID, "max_new_tokens must be > 0"),
    ("max-new-tokens-negative", dict(prompt="hi", sampling=sp(max_new_tokens=-5)), INVALID, "max_new_tokens must be > 0"),
    ("max-new-tokens-over-max-model-len", dict(prompt="hi", sampling=sp(max_new_tokens=MAX_MODEL_LEN + 1)),
     INVALID, f"exceeds max_model_len={MAX_MODEL_LEN}"),
    ("max-new-tokens-int32-max", dict(prompt="hi", sampling=sp(max_new_tokens=2**31 - 1)),
     INVALID, f"exceeds max_model_len={MAX_MODEL_LEN}"),
    ("prompt-plus-new-over-max-model-len", dict(prompt_token_ids=[1] * 1500, sampling=sp(max_new_tokens=600)),
     INVALID, "ask for at most 548 new tokens"),
    ("temperature-negative", dict(prompt="hi", sampling=sp(temperature=-0.5)), INVALID, "temperature must be"),
    ("temperature-nan", dict(prompt="hi", sampling=sp(temperature=math.nan)), INVALID, "got nan"),
    ("temperature-inf", dict(prompt="hi", sampling=sp(temperature=math.inf)), INVALID, "got inf"),
    ("temperature-minus-inf", dict(prompt="hi", sampling=sp(temperature=-math.inf)), INVALID, "temperature must be"),
    ("top-p-0", dict(prompt="hi", sampling=sp(top_p=0.0)), INVALID, "top_p must be in (0, 1]"),
    ("top-p-over-1", dict(prompt="hi", sampling=sp(top_p=1.5)), INVALID, "top_p must be in (0, 1]"),
    ("top-p-nan", dict(prompt="hi", sampling=sp(top_p=math.nan)), INVALID, "top_p must be in (0, 1]"),
    ("top-p-inf", dict(prompt="hi", sampling=sp(top_p=math.inf)), INVALID, "top_p must be in (0, 1]"),
    ("top-k-negative", dict(prompt="hi", sampling=sp(top_k=-1)), INVALID, "top_k must be >= 0"),
    ("top-k-over-vocab", dict(prompt="hi", sampling=sp(top_k=VOCAB + 1)), INVALID, f"top_k must be <= vocab_size ({VOCAB})"),
    ("thousands-of-stop-strings", dict(prompt="hi", sampling=sp(stop=["stop"] * 5000)), INVALID, "at most 16 stop strings"),
    ("stop-string-too-long", dict(prompt="hi", sampling=sp(stop=["x" * 257])), INVALID, "the limit is 256"),
    ("stop-string-empty", dict(prompt="hi", sampling=sp(stop=[""])), INVALID, "stop strings must be non-empty"),
    ("stop-token-id-out-of-range", dict(prompt="hi", sampling=sp(stop_token_ids=[5, 300])), INVALID,
     f"stop_token_ids must be < vocab_size ({VOCAB})"),
    ("request-id-too-long", dict(prompt="hi", request_id="r" * 129), INVALID, "at most 128"),
    ("request-id-control-characters", dict(prompt="hi", request_id="forged\n{\"event\": \"x\"}"), INVALID,
     "control characters"),
    ("over-message-size-limit", dict(prompt="x" * (MESSAGE_BYTES + 100)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


@pytest.mark.parametrize("fields, code, phrase", [row[1:] for row in GENERATE_ROWS], ids=[row[0] for row in GENERATE_ROWS])
def test_bad_generate_request(stack, fields, code, phrase):
    expect_error(lambda: stream(stack["model_stub"], **fields), code, phrase)
    assert_healthy(stack)


def raw_generate(channel, payload: bytes, metadata=AUTH):
    """Sends `payload` as the serialized GenerateRequest, unchecked by any client library."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    return list(call(payload, timeout=30, metadata=metadata))


# Field 2 (prompt), wire type 2 (length-delimited): bytes that are not UTF-8.
INVALID_UTF8_PROMPT = b"\x12\x04\xff\xfe\x41\x80"
# Field 2 announces 5 bytes and 2 follow.
TRUNCATED = b"\x12\x05ab"
# A lone surrogate (U+D800) as WTF-8 would write it: not UTF-8 either.
SURROGATE_PROMPT = b"\x12\x04a\xed\xa0\x80"


@pytest.mark.parametrize("payload", [INVALID_UTF8_PROMPT, TRUNCATED, SURROGATE_PROMPT],
                         ids=["invalid-utf8-prompt", "truncated", "surrogate-prompt"])
def test_unparseable_generate_request_is_invalid_argument(stack, payload):
    # Without the service's MalformedRequestInterceptor gRPC answers UNKNOWN
    # ("Unexpected <class 'DecodeError'>") and logs a traceback.
    expect_error(lambda: raw_generate(stack["model_channel"], payload), INVALID, "malformed request")
    assert_healthy(stack)


@pytest.mark.parametrize("metadata, phrase", [((), "missing authorization"),
                                              (bearer_metadata("wrong"), "wrong token")], ids=["no-token", "wrong-token"])
def test_model_service_without_the_token_is_unauthenticated(stack, metadata, phrase):
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    expect_error(lambda: stream(stack["model_stub"], metadata=metadata, prompt="hi"), unauthenticated, phrase)
    expect_error(lambda: stack["model_stub"].GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=10,
                                                          metadata=metadata), unauthenticated, phrase)
    # Bad bytes without the token: auth is checked first, and says nothing about the request.
    expect_error(lambda: raw_generate(stack["model_channel"], INVALID_UTF8_PROMPT, metadata), unauthenticated, phrase)
    assert_healthy(stack)


def long_stream(stub):
    """A Generate that runs for seconds, once its first token is out: 1000 tokens, EOS
    ignored, in 63 blocks (two fit in the pool at once)."""
    call = stub.Generate(model_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=sp(max_new_tokens=1000, ignore_eos=True)), timeout=120, metadata=AUTH)
    next(call)
    return call


def test_streams_beyond_max_concurrent_streams_are_resource_exhausted(stack):
    stub = stack["model_stub"]
    open_calls = [long_stream(stub), long_stream(stub)]
    try:
        expect_error(lambda: stream(stub, prompt="one too many"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "--max-concurrent-streams 2")
    finally:
        for call in open_calls:
            call.cancel()
    assert_healthy(stack)


def test_requests_beyond_max_queued_requests_are_resource_exhausted(stack):
    stub = stack["queue_stub"]
    running = long_stream(stub)
    try:
        expect_error(lambda: stream(stub, prompt="one too many"), grpc.StatusCode.RESOURCE_EXHAUSTED,
                     "--max-queued-requests 1")
    finally:
        running.cancel()
    # The cancel reaches the server in its own time; until it has, the stream holds the
    # one queued slot and a request is refused as the one above was.
    wait_for(lambda: slot_free(stub), 30, "the cancelled stream's queued slot given back")
    assert_healthy(stack)


def slot_free(stub) -> bool:
    try:
        good_request(stub)
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return False
    return True


def test_pool_momentarily_full_queues_instead_of_failing(stack):
    # Each request needs 69 of the 128 blocks: the second waits (or preempts), and both finish.
    stub = stack["model_stub"]
    sampling = sp(max_new_tokens=80, ignore_eos=True)
    prompts = [[(t + shift) % 255 + 1 for t in range(1020)] for shift in (0, 100)]  # no shared prefix
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda prompt: stream(stub, prompt_token_ids=prompt, sampling=sampling), prompts))
    for responses in results:
        assert responses[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 80
    assert_healthy(stack)


# ---------------------------------------------------------------------------------------
# The cache service

@pytest.fixture(scope="module")
def sessions(stack):
    stub = stack["cache_stub"]
    owner = attach(stub, "owner", metadata=AUTH).session_id
    intruder = attach(stub, "intruder", metadata=AUTH).session_id
    yield owner, intruder
    for session in (owner, intruder):
        stub.Detach(cache_pb2.DetachRequest(session_id=session), timeout=10, metadata=AUTH)


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request):
    """Every test of this module shares the services: afterwards no block or sequence may
    be leased and no session it opened may stay attached, so one test's leak fails that
    test, not a later one."""
    if "stack" not in request.fixturenames:
        yield
        return
    stub = request.getfixturevalue("stack")["cache_stub"]
    if "sessions" in request.fixturenames:
        request.getfixturevalue("sessions")  # the shared sessions exist before counting
    sessions_before = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=AUTH).sessions
    yield

    def clean():
        after = stub.GetStats(cache_pb2.GetStatsRequest(), timeout=10, metadata=AUTH)
        return (after.blocks_leased, after.sequences, after.sessions) == (0, 0, sessions_before)
    wait_for(clean, 60, "this test's blocks, sequences and sessions to be gone")


def lease_one(stub, session, op) -> cache_pb2.LeaseResult:
    (result,) = lease(stub, session, op, metadata=AUTH).results
    return result


def assert_cache_healthy(stack, session) -> None:
    stub = stack["cache_stub"]
    result = lease_one(stub, session, allocate(16))
    assert result.status == cache_pb2.LEASE_STATUS_OK, result
    assert lease_one(stub, session, release(result.sequence_id)).status == cache_pb2.LEASE_STATUS_OK
    assert_healthy(stack)


NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("session_id", ["0" * 32, "", "not-a-session"], ids=["unknown", "empty", "garbage"])
def test_unknown_session_is_not_found_on_every_rpc(stack, sessions, session_id):
    stub = stack["cache_stub"]
    for call, request in [
        (stub.Heartbeat, cache_pb2.HeartbeatRequest(session_id=session_id)),
        (stub.Detach, cache_pb2.DetachRequest(session_id=session_id)),
        (stub.Lease, cache_pb2.LeaseRequest(session_id=session_id, ops=[allocate(16)])),
    ]:
        expect_error(lambda: call(request, timeout=10, metadata=AUTH), NOT_FOUND, "Attach again")
    assert_cache_healthy(stack, sessions[0])


OP_STATUS_ROWS = [
    # (id, op builder given the owner's live sequence (16 tokens), status, phrase)
    ("extend-unknown-sequence", lambda seq: extend(987654321, 32), cache_pb2.LEASE_STATUS_NOT_FOUND, "not leased"),
    ("fork-unknown-sequence", lambda seq: fork(2**64 - 1), cache_pb2.LEASE_STATUS_NOT_FOUND, "not leased"),
    ("release-unknown-sequence", lambda seq: release(0), cache_pb2.LEASE_STATUS_NOT_FOUND, "not leased"),
    ("empty-op", lambda seq: cache_pb2.LeaseOp(), cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, "empty lease op"),
    ("extend-shrinking", lambda seq: extend(seq, 8), cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, "cannot shrink"),
    ("truncate-unknown-sequence", lambda seq: truncate(987654321, 1), cache_pb2.LEASE_STATUS_NOT_FOUND, "not leased"),
    ("truncate-growing", lambda seq: truncate(seq, 17), cache_pb2.LEASE_STATUS_INVALID_ARGUMENT,
     "must keep from 1 to its 16 tokens"),
    ("truncate-to-0-tokens", lambda seq: truncate(seq, 0), cache_pb2.LEASE_STATUS_INVALID_ARGUMENT,
     "must keep from 1 to its 16 tokens"),
    ("allocate-0-tokens", lambda seq: allocate(0), cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, "num_tokens must be >= 1"),
    ("allocate-prompt-longer-than-tokens", lambda seq: allocate(4, list(range(8))),
     cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, "must cover the prompt"),
    ("allocate-more-than-the-pool", lambda seq: allocate(NUM_BLOCKS * 16 + 1), cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS,
     f"of {NUM_BLOCKS} are free"),
    ("allocate-uint32-max", lambda seq: allocate(2**32 - 1), cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS,
     f"of {NUM_BLOCKS} are free"),
    ("extend-beyond-the-pool", lambda seq: extend(seq, 2**32 - 1), cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS,
     f"of {NUM_BLOCKS} are free"),
    ("release-more-token-ids-than-blocks-hold", lambda seq: release(seq, cache_prefix=True, token_ids=list(range(40))),
     cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, "hold at most 16 tokens"),
]


@pytest.mark.parametrize("build, status, phrase", [row[1:] for row in OP_STATUS_ROWS], ids=[row[0] for row in OP_STATUS_ROWS])
def test_bad_lease_op_gets_its_own_status(stack, sessions, build, status, phrase):
    stub, owner = stack["cache_stub"], sessions[0]
    sequence = lease_one(stub, owner, allocate(16)).sequence_id
    # The bad op rides between two good ones: it fails alone.
    good_before, bad, good_after = lease(stub, owner, allocate(16), build(sequence), allocate(16), metadata=AUTH).results
    assert bad.status == status, bad
    assert phrase in bad.message, bad.message
    assert good_before.status == good_after.status == cache_pb2.LEASE_STATUS_OK
    # ... and the refused op changed nothing: the owner's sequence is still there to release.
    for sequence_id in (good_before.sequence_id, good_after.sequence_id, sequence):
        assert lease_one(stub, owner, release(sequence_id)).status == cache_pb2.LEASE_STATUS_OK
    assert_cache_healthy(stack, owner)


def test_double_release_is_not_found(stack, sessions):
    stub, owner = stack["cache_stub"], sessions[0]
    sequence = lease_one(stub, owner, allocate(40)).sequence_id
    first, second = lease(stub, owner, release(sequence), release(sequence), metadata=AUTH).results
    assert first.status == cache_pb2.LEASE_STATUS_OK and first.blocks_released == 3
    assert second.status == cache_pb2.LEASE_STATUS_NOT_FOUND and "already released" in second.message
    assert lease_one(stub, owner, release(sequence)).status == cache_pb2.LEASE_STATUS_NOT_FOUND
    assert_cache_healthy(stack, owner)


def test_another_sessions_sequence_is_permission_denied_and_its_id_stays_secret(stack, sessions):
    stub, (owner, intruder) = stack["cache_stub"], sessions
    sequence = lease_one(stub, owner, allocate(20)).sequence_id
    for op in (extend(sequence, 40), fork(sequence), truncate(sequence, 1), release(sequence)):
        result = lease_one(stub, intruder, op)
        assert result.status == cache_pb2.LEASE_STATUS_PERMISSION_DENIED, op
        assert "belongs to session 'owner#" in result.message, result.message
        # The session id is the capability to the owner's blocks: never in a message.
        assert owner not in result.message and intruder not in result.message
    assert lease_one(stub, owner, release(sequence)).status == cache_pb2.LEASE_STATUS_OK
    assert_cache_healthy(stack, owner)


def test_too_many_ops_in_one_call_is_invalid_argument(stack, sessions):
    request = cache_pb2.LeaseRequest(session_id=sessions[0], ops=[cache_pb2.LeaseOp()] * 65537)
    expect_error(lambda: stack["cache_stub"].Lease(request, timeout=30, metadata=AUTH), INVALID, "at most 65536")
    assert_cache_healthy(stack, sessions[0])


def test_a_lease_call_without_ops_does_nothing(stack, sessions):
    reply = lease(stack["cache_stub"], sessions[0], metadata=AUTH)
    assert list(reply.results) == [] and reply.blocks_available == NUM_BLOCKS
    assert_cache_healthy(stack, sessions[0])


def test_cache_message_over_the_size_limit_is_resource_exhausted(stack, sessions):
    ops = [allocate(16, list(range(16)))] * 60_000
    request = cache_pb2.LeaseRequest(session_id=sessions[0], ops=ops)
    assert request.ByteSize() > MESSAGE_BYTES
    expect_error(lambda: stack["cache_stub"].Lease(request, timeout=30, metadata=AUTH),
                 grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")
    assert_cache_healthy(stack, sessions[0])


ATTACH_ROWS = [
    # (id, AttachRequest fields beyond a matching geometry, status, phrase)
    ("wrong-geometry", dict(num_layers=3), grpc.StatusCode.FAILED_PRECONDITION, "restart the cache service"),
    ("wrong-dtype", dict(dtype=cache_pb2.DTYPE_BFLOAT16), grpc.StatusCode.FAILED_PRECONDITION, "bfloat16"),
    ("zero-layers", dict(num_layers=0), INVALID, "num_layers is 0"),
    ("dtype-unspecified", dict(dtype=cache_pb2.DTYPE_UNSPECIFIED), INVALID, "DTYPE_UNSPECIFIED"),
    ("dtype-unknown-enum", dict(dtype=99), INVALID, "unknown DType 99"),
    ("device-unknown", dict(device="tpu"), INVALID, "unsupported device"),
    ("device-empty", dict(device=""), INVALID, "device is empty"),
    ("max-model-len-beyond-the-pool", dict(max_model_len=NUM_BLOCKS * 16 + 1), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "needs 129 blocks but the live pool has 128"),
]


@pytest.mark.parametrize("fields, code, phrase", [row[1:] for row in ATTACH_ROWS], ids=[row[0] for row in ATTACH_ROWS])
def test_bad_attach(stack, sessions, fields, code, phrase):
    expect_error(lambda: attach(stack["cache_stub"], "bad", metadata=AUTH, **fields), code, phrase)
    assert_cache_healthy(stack, sessions[0])


def test_attach_with_an_overlong_model_fingerprint_is_invalid_argument(stack, sessions):
    request = cache_pb2.AttachRequest(client_name="bad", model_fingerprint="f" * 257, geometry=cache_pb2.Geometry(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype=cache_pb2.DTYPE_FLOAT32, device="cpu"))
    expect_error(lambda: stack["cache_stub"].Attach(request, timeout=10, metadata=AUTH), INVALID,
                 "model_fingerprint is 257 characters")
    assert_cache_healthy(stack, sessions[0])


@pytest.mark.parametrize("weights, phrase", [
    (dict(weights_bytes=10, weights_bytes_by_type={"float32": 4, "Q8_0": 5}),
     "weights_bytes 10 is not the sum of weights_bytes_by_type (9)"),
    (dict(weights_bytes=33, weights_bytes_by_type={f"type{i}": 1 for i in range(33)}),
     "weights_bytes_by_type has 33 entries; at most 32"),
    (dict(weights_bytes=1, weights_bytes_by_type={"x" * 33: 1}), "weights_bytes_by_type has 1 entries"),
], ids=["not-the-sum", "too-many-types", "type-name-too-long"])
def test_attach_with_bad_weights_bytes_is_invalid_argument(stack, sessions, weights, phrase):
    request = cache_pb2.AttachRequest(client_name="bad", geometry=cache_pb2.Geometry(
        num_layers=2, num_kv_heads=2, head_dim=16, dtype=cache_pb2.DTYPE_FLOAT32, device="cpu"), **weights)
    expect_error(lambda: stack["cache_stub"].Attach(request, timeout=10, metadata=AUTH), INVALID, phrase)
    assert_cache_healthy(stack, sessions[0])


def test_attach_without_max_model_len_is_served(stack, sessions):
    """Attach's max_model_len is optional: a client that leaves it 0 gets a session."""
    reply = attach(stack["cache_stub"], "old-client", metadata=AUTH, max_model_len=0)
    assert reply.session_id and reply.sizing.num_blocks == NUM_BLOCKS  # the live pool, as made by the first Attach
    stack["cache_stub"].Detach(cache_pb2.DetachRequest(session_id=reply.session_id), timeout=10, metadata=AUTH)
    assert_cache_healthy(stack, sessions[0])


def test_attach_without_geometry_is_invalid_argument(stack, sessions):
    request = cache_pb2.AttachRequest(client_name="no geometry")
    expect_error(lambda: stack["cache_stub"].Attach(request, timeout=10, metadata=AUTH), INVALID, "geometry is required")
    assert_cache_healthy(stack, sessions[0])


def test_unparseable_cache_request_is_invalid_argument(stack, sessions):
    call = stack["cache_channel"].unary_unary(HEARTBEAT, request_serializer=None, response_deserializer=None)
    # Field 1 (session_id) with bytes that are not UTF-8.
    expect_error(lambda: call(b"\x0a\x02\xc3\x28", timeout=10, metadata=AUTH), INVALID, "malformed request")
    assert_cache_healthy(stack, sessions[0])


@pytest.mark.parametrize("metadata, phrase", [((), "missing authorization"),
                                              (bearer_metadata("wrong"), "wrong token")], ids=["no-token", "wrong-token"])
def test_cache_service_without_the_token_is_unauthenticated(stack, sessions, metadata, phrase):
    stub = stack["cache_stub"]
    for call, request in [
        (stub.Lease, cache_pb2.LeaseRequest(session_id=sessions[0], ops=[allocate(16)])),
        (stub.GetStats, cache_pb2.GetStatsRequest()),
        (stub.Attach, cache_pb2.AttachRequest(client_name="x")),
        (stub.Detach, cache_pb2.DetachRequest(session_id=sessions[0])),
    ]:
        expect_error(lambda: call(request, timeout=10, metadata=metadata), grpc.StatusCode.UNAUTHENTICATED, phrase)
    assert_cache_healthy(stack, sessions[0])


def test_default_bind_address_is_loopback():
    from cache_service.api.server import build_parser as cache_parser
    from model_service.server import build_parser as model_parser

    for build_parser in (cache_parser, model_parser):
        assert build_parser().parse_args([]).host == "127.0.0.1"


def test_listening_address_is_loopback_in_the_logs(stack):
    for service in ("cache", "model"):
        (event,) = [e for e in stack[service].log_events() if e.get("event") == "grpc_listening"]
        assert event["address"].startswith("127.0.0.1:")


@pytest.mark.parametrize("raw", ["48", "0", "2048", "-16"])
def test_a_block_size_the_triton_kernel_cannot_take_is_refused_at_parsing(raw, capsys, monkeypatch):
    # Powers of two up to 1024 compile for sm_80/sm_90 without spills (tests/test_kernels_compile.py).
    from cache_service.core.pool import PoolSettings
    from cache_service.api.server import build_parser as cache_parser

    monkeypatch.delenv("PAGEDKV_BLOCK_SIZE", raising=False)
    with pytest.raises(SystemExit) as exited:
        cache_parser().parse_args(["--block-size", raw])
    assert exited.value.code == 2
    assert f"--block-size must be a power of two from 1 to 1024 (the Triton decode kernel reads blocks in " \
           f"power-of-two tiles), got {int(raw)}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="power of two"):
        PoolSettings(block_size=int(raw))
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", raw)
    with pytest.raises(SystemExit):
        cache_parser()
    assert f"PAGEDKV_BLOCK_SIZE='{raw}' is not valid for --block-size" in capsys.readouterr().err


def test_every_power_of_two_block_size_up_to_1024_is_accepted(monkeypatch):
    from cache_service.api.server import build_parser as cache_parser

    monkeypatch.delenv("PAGEDKV_BLOCK_SIZE", raising=False)
    assert [cache_parser().parse_args(["--block-size", str(1 << n)]).block_size for n in range(11)] == \
        [1 << n for n in range(11)]


def test_every_settings_flag_reaches_the_settings(monkeypatch):
    # The settings are filled from the flags by field name: each flag given a value other
    # than its default must arrive in its field (a renamed flag or field fails here).
    from cache_service.api.server import build_parser as cache_parser, event_settings, pool_settings

    for name in list(os.environ):
        if name.startswith("PAGEDKV_"):
            monkeypatch.delenv(name)
    args = cache_parser().parse_args([
        "--block-size", "32", "--memory-fraction", "0.5", "--headroom", "0.1", "--kv-cache-bytes", "1MiB",
        "--max-blocks", "9", "--lease-ttl-ms", "700", "--shm-dir", "/tmp", "--max-session-sequences", "3",
        "--max-session-blocks", "4", "--reclaim-grace-ms", "6", "--host-cache-bytes", "2MiB",
        "--disk-cache-dir", "/tmp/d", "--disk-cache-bytes", "3MiB", "--disk-cache-key-file", "/tmp/k",
        "--check-invariants", "--kv-events-subscriber-buffer-bytes", "1MiB", "--kv-events-replay-buffer-bytes", "5MiB",
        "--kv-events-replay-max-batches", "7", "--kv-events-replay-rate", "2.5", "--kv-events-replay-batches-per-s", "30",
        "--kv-events-curve-secret-key", "/tmp/s", "--kv-events-curve-clients", "/tmp/c",
    ])
    settings = pool_settings(args)
    assert (settings.block_size, settings.memory_fraction, settings.headroom, settings.kv_cache_bytes,
            settings.max_blocks, settings.lease_ttl_ms, settings.shm_dir, settings.reclaim_grace_ms,
            settings.check_invariants) == (32, 0.5, 0.1, 1 << 20, 9, 700, "/tmp", 6, True)
    assert (settings.session_limits.max_sequences, settings.session_limits.max_blocks) == (3, 4)
    tiers = settings.tiers
    assert (tiers.host_cache_bytes, tiers.disk_cache_dir, tiers.disk_cache_bytes, tiers.disk_cache_key_file) == \
        (2 << 20, "/tmp/d", 3 << 20, "/tmp/k")
    events = event_settings(args)
    assert (events.subscriber_buffer_bytes, events.replay_buffer_bytes, events.replay_max_batches,
            events.replay_requests_per_s, events.replay_batches_per_s, events.curve_secret_key, events.curve_clients) == \
        (1 << 20, 5 << 20, 7, 2.5, 30.0, "/tmp/s", "/tmp/c")
