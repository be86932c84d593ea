"""Fuzzing the two places where client input meets the services, in process.

- `validate_generate_request` with random GenerateRequest fields (NaN and inf floats,
  huge ints within the proto ranges, random unicode, long stop lists), against an oracle
  (`expected_refusal`) that restates the rules independently: a request the oracle calls
  valid must be accepted, with options that satisfy every limit; one it calls invalid must
  be refused with InvalidRequest, or PoolTooSmall when only the pool is too small. So a
  validator that refuses everything fails, as does one that lets a bad field through.
- The same requests over gRPC to a real model service: valid ones are served to a finish
  reason, invalid ones get INVALID_ARGUMENT (RESOURCE_EXHAUSTED for the pool), and none
  leaves a block leased.
- the servicer's lease op path (`apply_proto_op`: decode, apply, encode) with random lease op sequences from several sessions
  on a real Ledger: it never raises, every result has a real status, and the ledger's
  invariants hold after every op.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
import torch
from ledger_cache import apply_proto_op
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from harness.cache_helpers import stats, wait_for
from cache_service.core.ledger import Ledger
from model_service.loading.tiny import tiny_config
from model_service.text.tokenizer import ByteTokenizer
from model_service.sample.params import InvalidRequest, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS
from model_service.sample.sampler import sample
from model_service.api.validation import (
    MAX_REQUEST_ID_CHARS, GenerateLimits, PoolTooSmall, validate_generate_request,
)
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

TOKENIZER = ByteTokenizer()
VOCAB = tiny_config().vocab_size
INT32 = st.integers(-(2**31), 2**31 - 1)
UINT32 = st.integers(0, 2**32 - 1)
# Mostly valid token ids, sometimes the edge of the vocabulary, sometimes far beyond it.
TOKEN_IDS = st.one_of(st.integers(0, VOCAB - 1), st.integers(VOCAB - 2, VOCAB + 2), UINT32)
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
HOSTILE_FLOAT32 = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, -1.0, 1e-45, 1.0000001, 3.4e38]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)


def mostly(draw, valid, hostile):
    """One field's value: valid about seven times in eight, so that most requests get past
    the other fields to the check under test. (Not 0 or 7 for hostile: Hypothesis favours
    the ends of a range; 0, where it shrinks to, keeps a failing example's fields valid.)"""
    return draw(hostile if draw(st.integers(0, 7)) == 5 else valid)


@st.composite
def sampling_params(draw) -> model_pb2.SamplingParams:
    stop = st.text(min_size=1, max_size=8)
    sampling = model_pb2.SamplingParams(
        temperature=mostly(draw, st.floats(0.0, 2.0, width=32), HOSTILE_FLOAT32),
        top_k=mostly(draw, st.integers(0, VOCAB), st.one_of(st.integers(-2, VOCAB + 2), INT32)),
        stop=mostly(draw, st.lists(stop, max_size=3), st.one_of(
            st.lists(st.text(max_size=8), max_size=4),
            st.lists(stop, min_size=MAX_STOP_STRINGS, max_size=40),
            st.lists(st.text(min_size=250, max_size=300), min_size=1, max_size=2),
        )),
        stop_token_ids=mostly(draw, st.lists(st.integers(0, VOCAB - 1), max_size=4), st.lists(TOKEN_IDS, max_size=6)),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        sampling.max_new_tokens = mostly(draw, st.integers(1, 64), st.one_of(st.integers(-2, 600), INT32))
    if draw(st.booleans()):
        sampling.top_p = mostly(draw, st.floats(0.0, 1.0, width=32, exclude_min=True), HOSTILE_FLOAT32)
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    return sampling


@st.composite
def generate_requests(draw) -> model_pb2.GenerateRequest:
    request = model_pb2.GenerateRequest(
        request_id=mostly(draw, st.text(PRINTABLE, max_size=24), st.one_of(
            st.text(max_size=12),
            st.text(PRINTABLE, min_size=MAX_REQUEST_ID_CHARS - 2, max_size=MAX_REQUEST_ID_CHARS + 2),
        )),
        sampling=draw(sampling_params()),
    )
    which = mostly(draw, st.sampled_from(["prompt", "ids"]), st.sampled_from(["both", "neither"]))
    if which in ("prompt", "both"):
        request.prompt = mostly(draw, st.text(min_size=1, max_size=100), st.text(max_size=600))
    if which in ("ids", "both"):
        request.prompt_token_ids.extend(mostly(
            draw, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=100), st.lists(TOKEN_IDS, max_size=600)))
    return request


@st.composite
def generate_limits(draw) -> GenerateLimits:
    max_model_len = mostly(draw, st.integers(128, 512), st.integers(1, 128))
    return GenerateLimits(
        vocab_size=VOCAB,
        max_model_len=max_model_len,
        max_prompt_tokens=mostly(draw, st.just(max(max_model_len - 1, 1)), st.integers(1, max_model_len)),
        default_max_new_tokens=draw(st.integers(1, 600)),
        # 0: not attached yet. Below max_model_len only where a pool is smaller than one
        # sequence, which the cache service refuses, but the guard must hold anyway.
        max_total_tokens=mostly(draw, st.sampled_from([0, 1024]), st.integers(1, 1024)),
    )


def expected_refusal(request: model_pb2.GenerateRequest, limits: GenerateLimits) -> str | None:
    """The rules of the error table in docs/grpc-api.md ("Errors") for the fields the strategies draw, restated
    apart from the validator: "invalid" (INVALID_ARGUMENT), "pool" (RESOURCE_EXHAUSTED:
    larger than the whole pool), or None (valid)."""
    sampling = request.sampling
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        return "invalid"
    if bool(request.prompt) == bool(request.prompt_token_ids):  # both, or neither (empty)
        return "invalid"
    prompt = TOKENIZER.encode(request.prompt) if request.prompt else list(request.prompt_token_ids)
    if not prompt or max(prompt) >= limits.vocab_size or len(prompt) > limits.max_prompt_tokens:
        return "invalid"
    if sampling.HasField("max_new_tokens"):
        max_new_tokens = sampling.max_new_tokens
        if max_new_tokens <= 0:
            return "invalid"
    else:
        max_new_tokens = min(limits.default_max_new_tokens, limits.max_model_len - len(prompt))
        if max_new_tokens <= 0:
            return "invalid"
    if len(prompt) + max_new_tokens > limits.max_model_len:
        return "invalid"
    temperature = sampling.temperature
    if not math.isfinite(temperature) or temperature < 0:
        return "invalid"
    if sampling.HasField("top_p") and not (0 < sampling.top_p <= 1):  # NaN fails both comparisons
        return "invalid"
    if not 0 <= sampling.top_k <= limits.vocab_size:
        return "invalid"
    if len(sampling.stop) > MAX_STOP_STRINGS or any(not 0 < len(stop) <= MAX_STOP_STRING_CHARS for stop in sampling.stop):
        return "invalid"
    if any(t >= limits.vocab_size for t in sampling.stop_token_ids):
        return "invalid"
    if limits.max_total_tokens and len(prompt) + max_new_tokens > limits.max_total_tokens:
        return "pool"
    return None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=generate_requests(), limits=generate_limits())
@example(
    request=model_pb2.GenerateRequest(prompt="hi", sampling=model_pb2.SamplingParams(temperature=math.nan)),
    limits=GenerateLimits(VOCAB, 64, 63, 16),
)
@example(
    request=model_pb2.GenerateRequest(prompt="hi", sampling=model_pb2.SamplingParams(temperature=3.4e38, top_p=1e-45)),
    limits=GenerateLimits(VOCAB, 64, 63, 16),
)
def test_generate_validation_accepts_exactly_what_can_run(request, limits):
    expected = expected_refusal(request, limits)
    event(f"expected: {expected or 'valid'}")  # pytest --hypothesis-show-statistics: both sides are drawn
    try:
        prompt, options = validate_generate_request(request, limits, TOKENIZER)
    except InvalidRequest as error:
        assert expected == "invalid", f"refused a request the rules accept ({expected}): {error}"
        assert str(error), "a rejection must say why"
        return
    except PoolTooSmall as error:
        assert expected == "pool", f"PoolTooSmall for a request the rules call {expected}: {error}"
        assert "max_total_tokens" in str(error)
        return
    assert expected is None, f"accepted a request the rules refuse ({expected})"
    # Accepted: every limit holds.
    assert prompt and all(0 <= t < VOCAB for t in prompt)
    assert len(prompt) <= limits.max_prompt_tokens
    assert options.max_new_tokens >= 1
    assert len(prompt) + options.max_new_tokens <= limits.max_model_len
    if limits.max_total_tokens:
        assert len(prompt) + options.max_new_tokens <= limits.max_total_tokens
    assert math.isfinite(options.temperature) and options.temperature >= 0
    assert 0 < options.top_p <= 1 and 0 <= options.top_k <= VOCAB
    assert len(options.stop) <= MAX_STOP_STRINGS and all(options.stop)
    assert all(0 <= t < VOCAB for t in options.stop_token_ids)
    assert len(request.request_id) <= MAX_REQUEST_ID_CHARS and request.request_id.isprintable()
    # ... and the sampler takes the options as they are.
    generator = None if options.greedy else torch.Generator().manual_seed(0)
    token = sample(torch.randn(1, VOCAB), [options], [generator])
    assert 0 <= int(token[0]) < VOCAB


def boundary_request(*, ids=(5,), **sampling) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(prompt_token_ids=list(ids), sampling=model_pb2.SamplingParams(**sampling))


BOUNDARY_LIMITS = GenerateLimits(VOCAB, max_model_len=64, max_prompt_tokens=63, default_max_new_tokens=16,
                                 max_total_tokens=1024)
# Each limit just inside and just outside: random draws land on an exact edge only by luck.
BOUNDARIES = {
    "top_k = vocab": (boundary_request(top_k=VOCAB), None),
    "top_k = vocab + 1": (boundary_request(top_k=VOCAB + 1), "invalid"),
    "top_k = -1": (boundary_request(top_k=-1), "invalid"),
    "prompt id vocab - 1": (boundary_request(ids=[VOCAB - 1]), None),
    "prompt id vocab": (boundary_request(ids=[VOCAB]), "invalid"),
    "stop id vocab": (boundary_request(stop_token_ids=[VOCAB]), "invalid"),
    "prompt fills max_prompt_tokens": (boundary_request(ids=[5] * 63, max_new_tokens=1), None),
    "prompt over max_prompt_tokens": (boundary_request(ids=[5] * 64, max_new_tokens=1), "invalid"),
    "prompt + max_new_tokens = max_model_len": (boundary_request(ids=[5] * 14, max_new_tokens=50), None),
    "prompt + max_new_tokens = max_model_len + 1": (boundary_request(ids=[5] * 14, max_new_tokens=51), "invalid"),
    "max_new_tokens 0": (boundary_request(max_new_tokens=0), "invalid"),
    "16 stop strings": (boundary_request(stop=["x"] * MAX_STOP_STRINGS), None),
    "17 stop strings": (boundary_request(stop=["x"] * (MAX_STOP_STRINGS + 1)), "invalid"),
    "stop of the longest length": (boundary_request(stop=["y" * MAX_STOP_STRING_CHARS]), None),
    "stop one character longer": (boundary_request(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), "invalid"),
    "top_p 1": (boundary_request(top_p=1.0), None),
    "top_p just above 1": (boundary_request(top_p=1.0000001), "invalid"),
    "top_p 0": (boundary_request(top_p=0.0), "invalid"),
    "temperature -0.0": (boundary_request(temperature=-0.0), None),
    "temperature inf": (boundary_request(temperature=math.inf), "invalid"),
    "request_id of the longest length": (
        model_pb2.GenerateRequest(request_id="r" * MAX_REQUEST_ID_CHARS, prompt_token_ids=[5]), None),
    "request_id one character longer": (
        model_pb2.GenerateRequest(request_id="r" * (MAX_REQUEST_ID_CHARS + 1), prompt_token_ids=[5]), "invalid"),
    "request_id with a newline": (model_pb2.GenerateRequest(request_id="a\nb", prompt_token_ids=[5]), "invalid"),
    "both prompts": (model_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[5]), "invalid"),
    "no prompt": (model_pb2.GenerateRequest(), "invalid"),
}
SMALL_POOL = dataclasses.replace(BOUNDARY_LIMITS, max_total_tokens=60)
POOL_BOUNDARIES = {
    "prompt + max_new_tokens = the pool": (boundary_request(ids=[5] * 40, max_new_tokens=20), None),
    "one token more than the pool": (boundary_request(ids=[5] * 40, max_new_tokens=21), "pool"),
    "over the pool and over max_model_len": (boundary_request(ids=[5] * 40, max_new_tokens=30), "invalid"),
}


@pytest.mark.parametrize("case", list(BOUNDARIES) + list(POOL_BOUNDARIES))
def test_limits_on_both_sides(case):
    request, expected = BOUNDARIES.get(case) or POOL_BOUNDARIES[case]
    limits = BOUNDARY_LIMITS if case in BOUNDARIES else SMALL_POOL
    assert expected_refusal(request, limits) == expected, "the oracle itself is wrong here"
    try:
        validate_generate_request(request, limits, TOKENIZER)
    except InvalidRequest:
        assert expected == "invalid", f"{case}: refused"
    except PoolTooSmall:
        assert expected == "pool", f"{case}: PoolTooSmall"
    else:
        assert expected is None, f"{case}: accepted"


# A real model service (tiny model, byte tokenizer like TOKENIZER) with small limits, so
# that the drawn requests fall on both sides of them and every valid one finishes quickly.
SERVED_MAX_MODEL_LEN = 96
SERVED_DEFAULT_MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from harness.cache_helpers import cache_stub
    from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service

    tmp_path = tmp_path_factory.mktemp("fuzz")
    with start_cache_service(tmp_path, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp_path, cache.address, "--max-model-len", SERVED_MAX_MODEL_LEN,
                                "--default-max-new-tokens", SERVED_DEFAULT_MAX_NEW_TOKENS) as model:
        channel = grpc.insecure_channel(model.address)
        stub = model_pb2_grpc.ModelServiceStub(channel)
        info = stub.GetModelInfo(model_pb2.GetModelInfoRequest(), timeout=30)
        limits = GenerateLimits(
            vocab_size=info.vocab_size, max_model_len=info.max_model_len,
            max_prompt_tokens=info.max_model_len - 1, default_max_new_tokens=SERVED_DEFAULT_MAX_NEW_TOKENS,
            max_total_tokens=info.max_total_tokens,
        )
        assert (info.vocab_size, info.max_model_len) == (VOCAB, SERVED_MAX_MODEL_LEN)
        yield stub, limits, cache_stub(cache.address)
        channel.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(request=generate_requests())
def test_served_requests_get_tokens_or_the_right_status(served, request):
    stub, limits, cache = served
    expected = expected_refusal(request, limits)
    event(f"expected: {expected or 'valid'}")
    try:
        responses = list(stub.Generate(request, timeout=60))
    except grpc.RpcError as error:
        wanted = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "pool": grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert expected is not None, f"a valid request failed: {error.code().name}: {error.details()}"
        assert error.code() == wanted[expected], f"{error.code().name} for a request the rules call {expected}"
        assert error.details(), "a refusal must say why"
    else:
        assert expected is None, f"served a request the rules refuse ({expected})"
        last = responses[-1]
        assert last.finish_reason != model_pb2.FINISH_REASON_UNSPECIFIED
        generated = sum(len(r.token_ids) for r in responses)
        max_new_tokens = (request.sampling.max_new_tokens if request.sampling.HasField("max_new_tokens")
                          else SERVED_DEFAULT_MAX_NEW_TOKENS)
        assert 1 <= generated <= max_new_tokens and last.usage.completion_tokens == generated
    # Refused or finished, the request holds no block afterwards.
    wait_for(lambda: stats(cache).blocks_leased == 0, 60, "the request's blocks to be released")


def test_a_request_larger_than_the_pool_is_pool_too_small():
    # Unreachable over gRPC (a pool always holds one max_model_len sequence, or the cache
    # service refuses the Attach), so the guard is tested here.
    limits = GenerateLimits(VOCAB, max_model_len=256, max_prompt_tokens=255, default_max_new_tokens=16,
                            max_total_tokens=128)
    request = model_pb2.GenerateRequest(prompt_token_ids=[1] * 100, sampling=model_pb2.SamplingParams(max_new_tokens=50))
    with pytest.raises(PoolTooSmall, match="max_total_tokens=128"):
        validate_generate_request(request, limits, TOKENIZER)


# ------------------------------------------------------------------ lease ops

NUM_BLOCKS, BLOCK_SIZE = 24, 4
OWNERS = ("a#1", "b#2", "c#3")
VALID_STATUSES = {
    cache_pb2.LEASE_STATUS_OK, cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS, cache_pb2.LEASE_STATUS_NOT_FOUND,
    cache_pb2.LEASE_STATUS_PERMISSION_DENIED, cache_pb2.LEASE_STATUS_INVALID_ARGUMENT, cache_pb2.LEASE_STATUS_LIMIT_EXCEEDED,
}
# A small token alphabet, so that prompts share prefixes and the prefix cache is exercised.
PROMPT = st.lists(st.integers(0, 3), max_size=3 * BLOCK_SIZE + 2)
NUM_TOKENS = st.integers(1, 3 * BLOCK_SIZE + 2)
HOSTILE_NUM_TOKENS = st.one_of(st.just(0), st.integers(0, 200), UINT32)


@st.composite
def lease_steps(draw) -> list[tuple[str, str, dict]]:
    """(owner, kind, fields); which sequence an op names is settled when the step runs."""
    steps = []
    for _ in range(draw(st.integers(1, 40))):
        owner = draw(st.sampled_from(OWNERS))
        kind = draw(st.sampled_from(["allocate", "allocate", "extend", "extend", "fork", "release", "release", "empty"]))
        fields = dict(
            num_tokens=mostly(draw, NUM_TOKENS, HOSTILE_NUM_TOKENS),
            prompt=draw(PROMPT),
            pick=draw(st.integers(0, 2**16)),
            # Mostly a live sequence of the op's owner; sometimes another owner's (to be
            # refused), a released one (double release) or any id at all.
            target=mostly(draw, st.just("own"), st.sampled_from(["other", "released", "any"])),
            any_id=draw(st.integers(0, 2**64 - 1)),
            cache_prefix=draw(st.booleans()),
        )
        steps.append((owner, kind, fields))
    return steps


def pick_sequence(owner: str, fields: dict, live: dict[int, str], released: list[int]) -> tuple[str, int]:
    """(the op's owner, the sequence it names)."""
    target, pick = fields["target"], fields["pick"]
    if target in ("own", "other") and live:
        sequence_id = sorted(live)[pick % len(live)]
        holder = live[sequence_id]
        if target == "own":
            return holder, sequence_id
        return OWNERS[(OWNERS.index(holder) + 1 + pick % 2) % len(OWNERS)], sequence_id
    if target == "released" and released:
        return owner, released[pick % len(released)]
    return owner, fields["any_id"]


def build_op(kind: str, fields: dict, sequence_id: int) -> cache_pb2.LeaseOp:
    num_tokens, prompt = fields["num_tokens"], fields["prompt"]
    if kind == "allocate":
        return cache_pb2.LeaseOp(allocate=cache_pb2.AllocateOp(num_tokens=num_tokens, prompt_token_ids=prompt))
    if kind == "extend":
        return cache_pb2.LeaseOp(extend=cache_pb2.ExtendOp(sequence_id=sequence_id, num_tokens=num_tokens))
    if kind == "fork":
        return cache_pb2.LeaseOp(fork=cache_pb2.ForkOp(sequence_id=sequence_id))
    if kind == "release":
        return cache_pb2.LeaseOp(release=cache_pb2.ReleaseOp(
            sequence_id=sequence_id, cache_prefix=fields["cache_prefix"], token_ids=prompt))
    return cache_pb2.LeaseOp()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=lease_steps())
def test_random_lease_ops_never_raise_and_keep_the_ledger_consistent(steps):
    ledger = Ledger(NUM_BLOCKS, BLOCK_SIZE)
    live: dict[int, str] = {}  # sequence id -> owner
    released: list[int] = []
    for owner, kind, fields in steps:
        owner, sequence_id = pick_sequence(owner, fields, live, released)
        result = apply_proto_op(ledger, owner, build_op(kind, fields, sequence_id))
        assert result.status in VALID_STATUSES, result
        if result.status == cache_pb2.LEASE_STATUS_OK:
            if kind in ("allocate", "fork"):
                assert result.sequence_id not in live
                live[result.sequence_id] = owner
                assert all(0 <= b < NUM_BLOCKS for b in result.block_ids)
            elif kind == "release":
                assert live.pop(sequence_id) == owner
                released.append(sequence_id)
        else:
            assert result.message, f"a refused {kind} must say why"
            if kind in ("extend", "fork", "release") and sequence_id in live and live[sequence_id] != owner:
                assert result.status == cache_pb2.LEASE_STATUS_PERMISSION_DENIED
            if kind in ("extend", "fork", "release") and sequence_id not in live:
                assert result.status == cache_pb2.LEASE_STATUS_NOT_FOUND
        ledger.check_invariants()
    assert ledger.stats().sequences == len(live)
    # Every owner goes away: nothing stays leased.
    for owner in OWNERS:
        ledger.release_owner(owner)
    ledger.check_invariants()
    assert ledger.stats().blocks_leased == 0 and ledger.stats().sequences == 0
