"""Each stage of the logits pipeline against transformers' own processors or a plain
reference, and the batched pass against row-by-row application."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from model_service.sample.logits_processing import (
    RowAdjustment,
    TokenHistory,
    apply_logit_bias,
    apply_min_p,
    apply_presence_frequency,
    apply_repetition_penalty,
    prepare,
    suppress_tokens,
)
from model_service.sample.params import SamplingOptions
from model_service.sample.sampler import make_generator, sample

VOCAB = 50


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def random_ids(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_repetition_penalty_equals_transformers():
    logits, ids = random_logits(4), random_ids(4, 12)
    for penalty in (0.5, 1.0, 1.3, 2.0):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        seen = torch.zeros(4, VOCAB, dtype=torch.bool).scatter_(1, ids, True)
        got = apply_repetition_penalty(logits.clone(), seen, torch.full((4, 1), penalty))
        torch.testing.assert_close(got, expected)  # x * (1 / p) for x / p: within an ulp


def test_min_p_equals_transformers():
    logits = random_logits(6)
    for min_p in (0.05, 0.3, 0.9, 1.0):
        expected = MinPLogitsWarper(min_p)(None, logits.clone())
        got = apply_min_p(logits.clone(), torch.full((6, 1), min_p))
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), min_p
        torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_min_p_zero_keeps_everything():
    logits = random_logits(3)
    assert torch.equal(apply_min_p(logits.clone(), torch.zeros(3, 1)), logits)


def test_min_tokens_suppression_equals_transformers():
    logits, ids = random_logits(2), random_ids(2, 3)
    expected = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=1, min_new_tokens=5,
                                                 eos_token_id=[4, 9])(ids, logits.clone())
    got = suppress_tokens(logits.clone(), torch.tensor([0, 0, 1, 1]), torch.tensor([4, 9, 4, 9]))
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_follow_openais_definition():
    logits, ids = random_logits(3), random_ids(3, 20)
    counts = torch.zeros(3, VOCAB).scatter_add_(1, ids, torch.ones(3, 20))
    presence = torch.tensor([[0.5], [-1.0], [0.0]])
    frequency = torch.tensor([[0.2], [1.5], [-2.0]])
    expected = logits.clone()
    for row in range(3):
        for token in range(VOCAB):
            count = int((ids[row] == token).sum())
            expected[row, token] -= float(frequency[row]) * count + float(presence[row]) * (count > 0)
    torch.testing.assert_close(apply_presence_frequency(logits.clone(), counts, presence, frequency), expected)


def test_logit_bias_adds_to_the_named_tokens():
    logits = random_logits(2)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[1, 7] -= 100.0
    got = apply_logit_bias(logits.clone(), torch.tensor([0, 1]), torch.tensor([3, 7]), torch.tensor([5.0, -100.0]))
    torch.testing.assert_close(got, expected)


def test_history_kept_incrementally_equals_a_recount():
    history = TokenHistory(VOCAB, "cpu", rows=2)  # grows past 2 rows below
    prompts = [[1, 2, 3], [4], [5, 5, 6], [7, 8]]
    slots = [history.open(p) for p in prompts]
    generated = random_ids(4, 9, seed=3).tolist()
    for step in range(9):
        history.record(slots, [row[step] for row in generated])
    for slot, prompt, out in zip(slots, prompts, generated):
        counts = torch.zeros(VOCAB)
        for token in out:
            counts[token] += 1
        assert torch.equal(history.counts[slot], counts)
        assert set(history.seen[slot].nonzero().flatten().tolist()) == set(prompt) | set(out)
    history.close(slots[1])
    reopened = history.open([9])
    assert reopened == slots[1] and history.counts[reopened].sum() == 0
    assert history.seen[reopened].nonzero().flatten().tolist() == [9]


def test_rows_without_adjustments_build_nothing():
    assert prepare([None, RowAdjustment(), None], "cpu") is None


def test_the_batched_pass_equals_each_row_alone():
    history = TokenHistory(VOCAB, "cpu")
    prompt = [[1, 2], [3], [4, 4], [5]]
    slots = [history.open(p) for p in prompt]
    history.record(slots, [6, 7, 8, 9])
    rows = [
        RowAdjustment(history_slot=slots[0], repetition_penalty=1.5),
        None,
        RowAdjustment(history_slot=slots[2], presence_penalty=0.7, frequency_penalty=0.3,
                      logit_bias=((1, 2.0),), suppressed_token_ids=(0,)),
        RowAdjustment(logit_bias=((2, -3.0), (3, 1.0))),
    ]
    logits = random_logits(4)
    batched = prepare(rows, "cpu").apply(logits, history)
    for row, adjustment in enumerate(rows):
        alone = logits[row:row + 1]
        if adjustment is not None:
            alone = prepare([adjustment], "cpu").apply(alone, history)
        torch.testing.assert_close(batched[row:row + 1], alone)
    assert not torch.equal(batched, logits)


def test_sample_applies_adjustments_to_greedy_rows_and_leaves_logits_alone():
    logits = random_logits(2)
    best = logits.argmax(dim=-1)
    adjustments = prepare([RowAdjustment(suppressed_token_ids=(int(best[0]),)), None], "cpu")
    before = logits.clone()
    tokens = sample(logits, [SamplingOptions(max_new_tokens=1)] * 2, [None, None], adjustments)
    assert int(tokens[0]) == int(logits[0].topk(2).indices[1]) and int(tokens[1]) == int(best[1])
    assert torch.equal(logits, before)


def test_min_p_in_sample_only_draws_tokens_transformers_keeps():
    logits = random_logits(1, seed=5) / 3
    options = [SamplingOptions(max_new_tokens=1, temperature=1.0, min_p=0.2)]
    allowed = ~torch.isinf(MinPLogitsWarper(0.2)(None, logits.clone())[0])
    drawn = {int(sample(logits, options, [make_generator(seed, "cpu")])[0]) for seed in range(200)}
    assert drawn and all(allowed[token] for token in drawn)
    assert len(drawn) > 1, "min_p 0.2 should leave more than one token here"
