"""Speculative decoding's pure parts: the n-gram proposer, the settings' checks, and the
verification (greedy token for token; sampled by the distribution it must follow, and a
seeded completion token for token as without speculation)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from model_service.sample.params import SamplingOptions
from model_service.sample.sampler import sample
from model_service.spec.accept import accept_matching
from model_service.spec.ngram import NgramIndex
from model_service.spec.settings import MAX_LOOKUP_N, MAX_SPECULATIVE_TOKENS, MAX_SUFFIX_CACHE_TOKENS, SpeculativeSettings
from model_service.spec.verify import verify


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    # The definition, scanned: the longest suffix (max_n..min_n) with an earlier
    # occurrence that has a follower; its latest such occurrence; the k tokens after it.
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposes_what_followed_the_suffix_last_time():
    index = NgramIndex(1, 3, [5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert index.propose(3) == [8, 9, 1]
    index.extend([4])  # suffix 7 4 / 4: never seen before
    assert index.propose(3) == []
    index.extend([5, 6])  # 4 5 6 unseen, 5 6 seen at 0
    assert index.propose(2) == [7, 8]
    assert index.propose(0) == []


def test_ngram_prefers_the_longest_suffix_then_the_latest_occurrence():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 1, 2, 3]
    # "1 2 3" recurs at 0 (followed by 9); "2 3" more recently at 4 (followed by 8): the longer wins.
    assert NgramIndex(2, 3, tokens).propose(1) == [9]
    assert NgramIndex(2, 2, tokens).propose(1) == [8]


def test_ngram_matches_the_scan_on_random_sequences():
    rng = random.Random(7)
    for _ in range(300):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
        index = NgramIndex(min_n, max_n)
        for cut in range(len(tokens) + 1):  # as the tokens arrive, one by one
            assert index.propose(k) == brute_force(tokens[:cut], min_n, max_n, k), (tokens[:cut], min_n, max_n, k)
            if cut < len(tokens):
                index.extend([tokens[cut]])


@pytest.mark.parametrize("min_n, max_n", [(0, 3), (3, 2), (-1, 1)])
def test_ngram_index_refuses_bad_lengths(min_n, max_n):
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramIndex(min_n, max_n)


@pytest.mark.parametrize("fields, phrase", [
    ({"method": "draft"}, "--speculative-method must be one of ngram, suffix, got 'draft'"),
    ({"num_speculative_tokens": 0}, f"--num-speculative-tokens must be from 1 to {MAX_SPECULATIVE_TOKENS}, got 0"),
    ({"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, "--num-speculative-tokens must be from 1"),
    ({"prompt_lookup_min": 0}, f"--prompt-lookup-min must be from 1 to {MAX_LOOKUP_N}, got 0"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3},
     f"--prompt-lookup-max must be from --prompt-lookup-min \\(4\\) to {MAX_LOOKUP_N}, got 3"),
    ({"prompt_lookup_max": MAX_LOOKUP_N + 1}, "--prompt-lookup-max must be from"),
    ({"suffix_cache_tokens": 0}, f"--suffix-cache-tokens must be from 1 to {MAX_SUFFIX_CACHE_TOKENS}, got 0"),
    ({"suffix_cache_tokens": MAX_SUFFIX_CACHE_TOKENS + 1}, "--suffix-cache-tokens must be from 1"),
])
def test_bad_speculative_settings_say_which_flag(fields, phrase):
    with pytest.raises(ValueError, match=phrase):
        SpeculativeSettings(**{"method": "ngram", **fields})


def test_speculation_is_off_by_default():
    assert not SpeculativeSettings().enabled
    assert SpeculativeSettings(method="ngram").enabled


def test_the_matching_prefix_and_the_draw_after_it_are_kept():
    assert accept_matching([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all kept, plus the bonus
    assert accept_matching([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the target's token at the first mismatch
    assert accept_matching([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_matching([], [3]) == [3]
    with pytest.raises(ValueError, match="need 3 target rows"):
        accept_matching([1, 2], [1, 2])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    # Over the outcomes the target allows; one it rules out must never be drawn.
    allowed = probs > 0
    assert counts[~allowed].sum() == 0
    expected = probs[allowed] * counts.sum()
    return float(((counts[allowed] - expected) ** 2 / expected).sum())


# Chi-square at 4 degrees of freedom (5 outcomes: top-k 5 of 6): P(X > 18.47) = 0.001. The
# seeds are fixed, so the test is deterministic; the bound says how far from the target a
# correct sampler lands once in a thousand seeds, and a rule that always kept the proposal
# lands far beyond it (checked below).
CHI2_DF4_P001 = 18.47
SAMPLED = SamplingOptions(max_new_tokens=100, temperature=0.7, top_k=5)


def target(probs: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits that SAMPLED turns into `probs` with its least likely token cut by top-k,
    that distribution computed here by hand: temperature, top-k, renormalised)."""
    p = torch.tensor(probs, dtype=torch.float64)
    exact = p.clone()
    exact[p.argmin()] = 0.0
    return (p.log() * SAMPLED.temperature).float(), exact / exact.sum()


@pytest.fixture
def one_thread():
    # Thousands of draws from rows of 6 tokens: a thread pool's wake-up per softmax would
    # cost more than the work, many times over on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sampled_verification_follows_the_target_distribution(one_thread):
    (l0, p0), (l1, p1), (l2, _) = (target([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]),
                                   target([0.05, 0.10, 0.15, 0.20, 0.20, 0.30]),
                                   target([0.5, 0.1, 0.1, 0.1, 0.1, 0.1]))
    generator = torch.Generator().manual_seed(1234)
    first, second = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    accepted = 0
    trials = 3_000
    for _ in range(trials):
        # As in a step: the step sampler draws the last token's row, verify the proposal's rows.
        token = int(sample(l0[None], [SAMPLED], [generator])[0])
        kept = verify(token, [2, 5], torch.stack([l1, l2]), SAMPLED, generator)
        first[kept[0]] += 1
        if kept[0] == 2:  # the second row is the target's only after the first proposal stood
            second[kept[1]] += 1
        accepted += len(kept) - 1
    assert chi_square(first, p0) < CHI2_DF4_P001
    assert chi_square(second, p1) < CHI2_DF4_P001
    # Expected accepted proposals per step: p0(2) + p0(2) p1(5).
    expected = float(p0[2] + p0[2] * p1[5])
    assert abs(accepted / trials - expected) < 0.04  # about 4 standard errors at 3,000 steps
    # What the bound rules out: a rule that always keeps the proposal.
    always = torch.zeros(6, dtype=torch.float64)
    always[2] = trials
    assert chi_square(always, p0) > CHI2_DF4_P001


def test_a_seeded_completion_draws_the_same_tokens_whatever_is_proposed(one_thread):
    # A bigram model: the next token's logits depend on the last token only.
    vocab = 8
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3)) * 2.5
    options = SamplingOptions(max_new_tokens=100, temperature=0.9, top_p=0.9, seed=11)
    proposer = random.Random(5)
    kept_total = rejected = 0
    for seed in range(20):
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [0]
        while len(plain) < 41:  # one token a step
            plain.append(int(sample(table[plain[-1]][None], [options], [plain_gen])[0]))
        spec_gen = torch.Generator().manual_seed(seed)
        spec = [0]
        while len(spec) < 41:
            token = int(sample(table[spec[-1]][None], [options], [spec_gen])[0])
            # Proposals that follow the likeliest chain (often kept) or are random (mostly not).
            proposal, last = [], token
            for _ in range(proposer.randint(1, 4)):
                last = int(table[last].argmax()) if proposer.random() < 0.7 else proposer.randrange(vocab)
                proposal.append(last)
            rows = table[torch.tensor(proposal)]  # row i: after the proposal's first i + 1 tokens
            kept = verify(token, proposal, rows, options, spec_gen)
            kept_total += len(kept) - 1
            rejected += len(kept) - 1 < len(proposal)
            spec.extend(kept)
        assert spec[:41] == plain, seed
    assert kept_total > 50 and rejected > 50  # both paths ran


def test_greedy_verification_keeps_the_argmax_chain():
    rows = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    greedy_options = SamplingOptions(max_new_tokens=10)
    assert verify(1, [1, 1, 0], rows, greedy_options, None) == [1, 1, 0, 2]  # argmaxes: 1, 0, 2
    assert verify(2, [1, 1, 0], rows, greedy_options, None) == [2]
    assert verify(1, [1, 2, 0], rows, greedy_options, None) == [1, 1]


def speculating_sequence(tokens: list[int], blocks: int, max_new_tokens: int = 100):
    from model_service.sched.sequence import Sequence

    seq = Sequence("r", list(tokens), prompt_len=len(tokens) - 1, arrival=0,
                   options=SamplingOptions(max_new_tokens=max_new_tokens))
    seq.block_table = list(range(blocks))
    seq.num_computed = len(tokens) - 1
    return seq


def test_a_proposal_fits_the_blocks_held_and_the_tokens_left():
    from model_service.spec.speculator import Speculator

    speculator = Speculator(SpeculativeSettings(method="ngram", num_speculative_tokens=8, prompt_lookup_min=1),
                            block_size=4, max_model_len=0)
    looped = [1, 2, 3, 4, 5, 6] * 2 + [1]  # 13 tokens: 12 computed, the 13th runs this step
    assert speculator.propose(speculating_sequence(looped, blocks=4), spare_tokens=99) == [2, 3, 4]  # 16 slots
    assert speculator.propose(speculating_sequence(looped, blocks=5), spare_tokens=99) == [2, 3, 4, 5, 6, 1]  # all that followed
    assert speculator.propose(speculating_sequence(looped, blocks=5), spare_tokens=2) == [2, 3]
    assert speculator.propose(speculating_sequence(looped, blocks=5, max_new_tokens=3), spare_tokens=99) == [2]
    seq = speculating_sequence(looped, blocks=5)
    seq.options = dataclasses.replace(seq.options, speculate=False)  # the request turned it off
    assert speculator.propose(seq, spare_tokens=99) == []


def test_a_sequence_whose_proposals_are_rarely_kept_stops_speculating():
    from model_service.spec.speculator import LOW_ACCEPTANCE_AFTER, Speculator

    speculator = Speculator(SpeculativeSettings(method="ngram", prompt_lookup_min=1), block_size=4, max_model_len=0)
    looped = [1, 2, 3, 4, 5, 6] * 2 + [1]
    kept_often, kept_rarely = speculating_sequence(looped, 5), speculating_sequence(looped, 5)
    speculator.settle(kept_often, LOW_ACCEPTANCE_AFTER, LOW_ACCEPTANCE_AFTER // 2)
    speculator.settle(kept_rarely, LOW_ACCEPTANCE_AFTER, 1)
    assert speculator.propose(kept_often, spare_tokens=99) != []
    assert speculator.propose(kept_rarely, spare_tokens=99) == []
