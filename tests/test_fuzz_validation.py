"""Fuzzing the two places where client input meets the services, in process.

- `validate_generate_request` with random GenerateRequest fields (NaN and inf floats,
  huge ints within the proto ranges, random unicode, long stop lists): it returns options
  that satisfy every limit, or raises InvalidRequest / PoolTooSmall; never anything else.
- `cache_service.servicer.apply_op` with random lease op sequences from several sessions
  on a real Ledger: it never raises, every result has a real status, and the ledger's
  invariants hold after every op.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cache_service.ledger import Ledger
from cache_service.servicer import apply_op
from model_service.models.tiny import tiny_config
from model_service.tokenizer import ByteTokenizer
from model_service.sampling import MAX_STOP_STRINGS, InvalidRequest, sample
from model_service.validation import (
    MAX_REQUEST_ID_CHARS, GenerateLimits, PoolTooSmall, validate_generate_request,
)
from pagedkv.cache.v1 import cache_pb2
from pagedkv.model.v1 import model_pb2

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
def test_generate_validation_accepts_only_what_can_run(request, limits):
    try:
        prompt, options = validate_generate_request(request, limits, TOKENIZER)
    except (InvalidRequest, PoolTooSmall) as error:
        assert str(error), "a rejection must say why"
        return
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
        result = apply_op(ledger, owner, build_op(kind, fields, sequence_id))
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
