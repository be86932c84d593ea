import math

import pytest
import torch

from model_service.sample.params import InvalidRequest, SamplingOptions
from model_service.api.sampling_proto import options_from_proto
from model_service.sample.sampler import argmax_rows, make_generator, sample
from pagedkv.model.v1 import model_pb2

VOCAB = 64


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def from_proto(prompt_tokens=10, max_model_len=128, vocab_size=VOCAB, default=32, **fields):
    return options_from_proto(
        model_pb2.SamplingParams(**fields),
        prompt_tokens=prompt_tokens,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        default_max_new_tokens=default,
    )


# --- sample ----------------------------------------------------------------------------


def test_greedy_batch_equals_argmax():
    logits = random_logits(8)
    options = [SamplingOptions(max_new_tokens=4)] * 8
    token_ids = sample(logits, options, [None] * 8)
    assert token_ids.dtype == torch.int64
    assert torch.equal(token_ids, logits.argmax(dim=-1))


def test_argmax_rows_agrees_with_torch_on_ties_nan_and_strided_input():
    logits = random_logits(6, vocab=10)
    logits[0] = 1.0  # all tied: the first index
    logits[1, 3] = logits[1, 7] = 50.0  # tied maxima: the first one
    logits[2, 5] = float("nan")  # NaN counts as the largest, as in torch.argmax
    logits[3, 2] = float("inf")
    strided = torch.randn(10, 6).t()  # a transposed view, not contiguous
    for rows in (logits, strided, logits[:, ::2], logits.to(torch.bfloat16)):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64
        assert torch.equal(got, rows.argmax(dim=-1))


def test_top_k_one_equals_greedy():
    logits = random_logits(6)
    options = [SamplingOptions(max_new_tokens=4, temperature=1.5, top_k=1)] * 6
    generators = [make_generator(row, "cpu") for row in range(6)]
    assert torch.equal(sample(logits, options, generators), logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy():
    logits = random_logits(6)
    options = [SamplingOptions(max_new_tokens=4, temperature=2.0, top_p=1e-6)] * 6
    generators = [make_generator(row, "cpu") for row in range(6)]
    assert torch.equal(sample(logits, options, generators), logits.argmax(dim=-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(4)
    greedy = SamplingOptions(max_new_tokens=4)
    hot = SamplingOptions(max_new_tokens=4, temperature=5.0)
    options = [greedy, hot, greedy, hot]
    generators = [None, make_generator(1, "cpu"), None, make_generator(2, "cpu")]
    token_ids = sample(logits, options, generators)
    assert token_ids[0] == logits[0].argmax() and token_ids[2] == logits[2].argmax()


@pytest.mark.parametrize(("top_k", "top_p"), [(20, 0.9), (0, 0.9), (0, 1.0), (5, 1.0)])
def test_same_seed_same_tokens_whatever_shares_the_batch(top_k, top_p):
    target_logits = random_logits(1, seed=42)[0]
    target = SamplingOptions(max_new_tokens=16, temperature=1.0, top_k=top_k, top_p=top_p, seed=7)

    def run(batch_size: int, row: int, others_seed: int) -> list[int]:
        generators = [make_generator(others_seed + i, "cpu") for i in range(batch_size)]
        generators[row] = make_generator(target.seed, "cpu")
        others = [
            SamplingOptions(max_new_tokens=16, temperature=0.5 + i, top_k=i, seed=i)
            for i in range(batch_size)
        ]
        options = list(others)
        options[row] = target
        tokens = []
        for step in range(16):
            logits = random_logits(batch_size, seed=1000 * others_seed + step)
            logits[row] = target_logits
            tokens.append(int(sample(logits, options, generators)[row]))
        return tokens

    alone = run(1, 0, 0)
    assert run(5, 3, 11) == alone
    assert run(8, 0, 99) == alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_distribution_matches_softmax_with_fixed_seed():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    options = [SamplingOptions(max_new_tokens=1, temperature=1.0)]
    generator = make_generator(1234, "cpu")
    draws = 4000
    counts = torch.zeros(4)
    for _ in range(draws):
        counts[sample(logits, options, [generator])[0]] += 1
    expected = torch.softmax(logits[0], dim=-1) * draws
    # Every cell within 5 standard deviations of its binomial expectation.
    sigma = (expected * (1 - expected / draws)).sqrt()
    assert torch.all((counts - expected).abs() < 5 * sigma), (counts, expected)


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    generator = make_generator(5, "cpu")
    top_k = [SamplingOptions(max_new_tokens=1, temperature=10.0, top_k=2)]
    seen = {int(sample(logits, top_k, [generator])[0]) for _ in range(300)}
    assert seen == {0, 1}
    # softmax([4, 3, 2, ...]) ≈ [0.64, 0.23, 0.09, ...]: top_p 0.8 keeps the first two.
    top_p = [SamplingOptions(max_new_tokens=1, temperature=1.0, top_p=0.8)]
    seen = {int(sample(logits, top_p, [generator])[0]) for _ in range(300)}
    assert seen == {0, 1}


def test_tiny_temperature_is_greedy_not_nan():
    logits = random_logits(2) * 1e30
    options = [SamplingOptions(max_new_tokens=1, temperature=1e-30)] * 2
    assert torch.equal(sample(logits, options, [None, None]), logits.argmax(dim=-1))


def test_unseeded_generators_differ():
    logits = torch.zeros(1, 1000)
    options = [SamplingOptions(max_new_tokens=1, temperature=1.0)]
    draws = {int(sample(logits, options, [make_generator(None, "cpu")])[0]) for _ in range(8)}
    assert len(draws) > 1


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="2 rows"):
        sample(random_logits(2), [SamplingOptions(max_new_tokens=1)], [None])


# --- from_proto ------------------------------------------------------------------------


def test_from_proto_defaults():
    options = from_proto()
    assert options == SamplingOptions(max_new_tokens=32)
    assert options.top_p == 1.0 and options.seed is None and options.greedy


def test_from_proto_copies_fields():
    options = from_proto(
        max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.25, seed=2**64 - 1,
        stop=["\n\n", "END"], stop_token_ids=[1, 2], ignore_eos=True,
    )
    assert options == SamplingOptions(
        max_new_tokens=5, temperature=0.5, top_k=3, top_p=0.25, seed=2**64 - 1,
        stop=("\n\n", "END"), stop_token_ids=frozenset({1, 2}), ignore_eos=True,
    )
    make_generator(options.seed, "cpu")  # the full uint64 range seeds a generator


def test_unset_max_new_tokens_is_capped_by_room_left():
    assert from_proto(prompt_tokens=120, max_model_len=128, default=32).max_new_tokens == 8


@pytest.mark.parametrize(
    ("fields", "kwargs", "message"),
    [
        ({"temperature": -0.1}, {}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, {}, "temperature"),
        ({"temperature": math.inf}, {}, "temperature"),
        ({"top_p": 0.0}, {}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, {}, "top_p"),
        ({"top_p": -0.5}, {}, "top_p"),
        ({"top_p": math.nan}, {}, "top_p"),
        ({"top_k": -1}, {}, "top_k must be >= 0"),
        ({"top_k": VOCAB + 1}, {}, f"top_k must be <= vocab_size \\({VOCAB}\\)"),
        ({"max_new_tokens": 0}, {}, "max_new_tokens must be > 0"),
        ({"max_new_tokens": -3}, {}, "max_new_tokens must be > 0"),
        ({"max_new_tokens": 100}, {"prompt_tokens": 40, "max_model_len": 128},
         r"prompt_tokens \(40\) \+ max_new_tokens \(100\) = 140 exceeds max_model_len=128"),
        ({}, {"prompt_tokens": 128, "max_model_len": 128}, "leaves no room"),
        ({"stop": ["x"] * 17}, {}, "at most 16 stop strings"),
        ({"stop": ["ok", "y" * 257]}, {}, r"stop\[1\] is 257 characters long; the limit is 256"),
        ({"stop": ["ok", ""]}, {}, r"stop\[1\] is empty"),
        ({"stop_token_ids": [3, VOCAB]}, {}, f"stop_token_ids must be < vocab_size \\({VOCAB}\\)"),
    ],
)
def test_from_proto_rejects(fields, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        from_proto(**fields, **kwargs)


def test_limits_are_inclusive():
    assert from_proto(top_k=VOCAB, top_p=1.0, stop=["y" * 256] * 16,
                      stop_token_ids=[VOCAB - 1]).top_k == VOCAB
    assert from_proto(max_new_tokens=118, prompt_tokens=10, max_model_len=128).max_new_tokens == 118


def test_invalid_request_is_a_value_error():
    assert issubclass(InvalidRequest, ValueError)


def test_top_p_over_a_flat_distribution_beyond_the_candidate_window():
    # Nearly flat over 4096 tokens: the nucleus for top_p=0.5 holds about 2000 of them,
    # more than the 1024 candidates looked at first, so the full-sort path decides.
    vocab = 4096
    logits = (-torch.arange(vocab, dtype=torch.float32) * 1e-4).unsqueeze(0)
    probs = torch.softmax(logits[0].double(), dim=-1)
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())
    assert 1024 < nucleus < vocab
    options = [SamplingOptions(max_new_tokens=1, temperature=1.0, top_p=0.5)]
    generator = make_generator(3, "cpu")
    draws = torch.stack([sample(logits, options, [generator])[0] for _ in range(2000)])
    assert int(draws.max()) < nucleus + 2  # float32 rounding may move the edge by one
    assert int(draws.max()) > 1024  # tokens past the candidate window are drawn too


def test_rows_with_and_without_filters_in_one_batch():
    logits = random_logits(4)
    tiny_p = SamplingOptions(max_new_tokens=1, temperature=3.0, top_p=1e-6)
    hot = SamplingOptions(max_new_tokens=1, temperature=3.0)
    top_1 = SamplingOptions(max_new_tokens=1, temperature=3.0, top_k=1)
    generators = [make_generator(row, "cpu") for row in range(4)]
    for _ in range(20):
        token_ids = sample(logits, [tiny_p, hot, top_1, hot], generators)
        assert token_ids[0] == logits[0].argmax() and token_ids[2] == logits[2].argmax()


# --- one host sync a step: the nucleus sorted in full off the CPU ----------------------


def spread_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows from peaked to nearly flat (whose top-p nucleus outruns the 1024 candidates),
    one with ties at the nucleus's edge."""
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([3.0, 1.0, 0.3, 0.01, 1e-4, 0.0, 2.0, 0.05])[torch.arange(batch) % 8]
    logits = torch.randn(batch, vocab, generator=generator) * scales.unsqueeze(1)
    logits[batch // 2, : vocab // 2] = 1.0  # half the vocabulary tied
    return logits


SAMPLED_ROWS = [
    dict(top_p=0.9), dict(top_p=0.5), dict(top_p=0.999), dict(top_p=0.05), dict(top_p=0.9, top_k=40),
    dict(top_p=0.7, top_k=2000), dict(top_k=5), dict(min_p=0.1), dict(top_p=0.8, min_p=0.05),
    dict(top_p=0.95, temperature=0.3), dict(temperature=2.0), dict(top_p=0.6, top_k=1500, min_p=0.01),
]


@pytest.mark.parametrize("greedy_rows", [0, 3])
@pytest.mark.parametrize("seed", range(2))
def test_sorting_every_row_in_full_draws_what_the_candidate_window_drew(monkeypatch, seed, greedy_rows):
    # Off the CPU the nucleus is found by sorting each row in full (finding which rows
    # outrun the 1024 candidates would read the device); the tokens are those the CPU's
    # candidate window (and its per-row full sort for flat rows) draws, for fixed seeds.
    from model_service.sample import sampler as sampler_module

    vocab = 4096
    options = [SamplingOptions(max_new_tokens=1, **{"temperature": 1.0, **row}) for row in SAMPLED_ROWS]
    options += [SamplingOptions(max_new_tokens=1)] * greedy_rows
    logits = spread_logits(len(options), vocab, seed)
    drawn = {}
    for in_full in (False, True):
        monkeypatch.setattr(sampler_module, "_nucleus_in_full", lambda device, in_full=in_full: in_full)
        generators = [make_generator(1000 * seed + row, "cpu") for row in range(len(options))]
        drawn[in_full] = torch.stack([sample(logits, options, generators) for _ in range(12)])
    assert torch.equal(drawn[True], drawn[False])
    # The same thresholds, too, for the top-p rows without top-k (whose nucleus may be
    # anywhere in the row): the flat ones sort in full either way, the others see the
    # same prefix sums (the CPU's cumsum accumulates in order).
    probs = torch.softmax(logits[:4].float(), dim=-1)
    top_p = torch.tensor([[0.9], [0.5], [0.999], [0.05]])
    thresholds = {}
    for in_full in (False, True):
        monkeypatch.setattr(sampler_module, "_nucleus_in_full", lambda device, in_full=in_full: in_full)
        thresholds[in_full] = sampler_module._nucleus_threshold(probs, top_p, vocab)
    assert torch.equal(thresholds[True], thresholds[False])


def test_a_sampling_step_reads_nothing_back_from_the_device(monkeypatch):
    # Run on CPU with the CUDA branches (tests/host_waits.py): no value read back and no
    # list copied with torch.tensor(..., device=...); the step's one read is its caller's.
    from host_waits import HostWaits

    from model_service.sample import logits_processing, sampler as sampler_module
    from model_service.sample.logits_processing import RowAdjustment, TokenHistory, prepare

    monkeypatch.setattr(sampler_module, "_nucleus_in_full", lambda device: True)
    monkeypatch.setattr(sampler_module, "argmax_rows", lambda logits: logits.argmax(dim=-1))  # CUDA's
    vocab = 4096
    options = [SamplingOptions(max_new_tokens=1, **{"temperature": 1.0, **row}) for row in SAMPLED_ROWS]
    options += [SamplingOptions(max_new_tokens=1), SamplingOptions(max_new_tokens=1, temperature=0.8, top_p=0.9,
                                                                   repetition_penalty=1.3, logit_bias=((7, 5.0),))]
    logits = spread_logits(len(options), vocab, seed=5)
    history = TokenHistory(vocab, "cpu")
    slot = history.open([1, 2, 3])
    rows = [None] * (len(options) - 1) + [RowAdjustment(history_slot=slot, repetition_penalty=1.3,
                                                        logit_bias=((7, 5.0),), suppressed_token_ids=(0,))]
    generators = [make_generator(row, "cpu") for row in range(len(options))]
    with HostWaits(monkeypatch, sampler_module, logits_processing) as waits:
        adjustments = prepare(rows, "cpu")
        token_ids = sample(logits, options, generators, adjustments, history)
    assert waits.found == [] and token_ids.shape == (len(options),)
    assert waits.sent, "the per-row parameters did not go through to_device"
