"""The suffix proposer over the request's own tokens (spec/request_trie.py), and its choice
between that and the history of earlier outputs by the tokens each expects kept."""

from __future__ import annotations

import random

from model_service.sample.params import SamplingOptions
from model_service.sched.sequence import Sequence
from model_service.spec.request_trie import RequestTrie
from model_service.spec.settings import SpeculativeSettings
from model_service.spec.speculator import Speculator, namespace
from model_service.spec.suffix import SuffixTrie


def test_tokens_taken_in_one_by_one_count_every_suffix_as_a_whole_add_does():
    rng = random.Random(5)
    for depth in (1, 2, 5, 9):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 80))]
        grown = RequestTrie(depth)
        cut = rng.randrange(len(tokens) + 1)
        grown.extend(tokens[:cut])
        grown.extend(tokens[cut:])
        whole = SuffixTrie(depth)
        whole.add(tokens)
        assert grown.paths() == whole.paths(), depth
        assert grown.nodes == whole.nodes and grown.taken == len(tokens)


def test_the_most_frequent_continuation_is_proposed_with_its_expected_kept_tokens():
    trie = RequestTrie(8)
    trie.extend([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    # After "1 2": 3 twice, 4 once; the last "1 2" is where the proposal goes on from.
    tokens, shares = trie.propose_scored([1, 2], 1, 2, 2)
    assert tokens == [3, 1]
    assert shares == [2 / 3, 2 / 3 * 2 / 2]


def sequence(tokens: list[int]) -> Sequence:
    seq = Sequence("r", list(tokens), prompt_len=len(tokens) - 1, arrival=0,
                   options=SamplingOptions(max_new_tokens=100))
    seq.block_table = list(range(16))
    seq.num_computed = len(tokens) - 1
    return seq


def test_the_suffix_method_takes_the_likelier_of_its_own_text_and_earlier_outputs():
    speculator = Speculator(SpeculativeSettings(method="suffix", num_speculative_tokens=4, prompt_lookup_min=1,
                                                prompt_lookup_max=3), block_size=4, max_model_len=0)
    # Its own text saw "7 8" go on as "9" once and as "5" once: a weak guess.
    seq = sequence([7, 8, 9, 0, 7, 8, 5, 7, 8])
    for _ in range(3):  # earlier outputs went on from "7 8" as "1 2 3 4" every time
        speculator.history.add(namespace(seq), [7, 8, 1, 2, 3, 4])
    assert speculator.propose(seq, 99) == [1, 2, 3, 4]
    # A sure continuation of its own beats the history's.
    own = sequence([7, 8, 6, 6, 6, 6, 0, 7, 8, 6, 6, 6, 6, 0, 7, 8])
    assert speculator.propose(own, 99) == [6, 6, 6, 6]
    # Nothing in the history: its own text alone, as the ngram method would find it.
    alone = sequence([3, 4, 5, 6, 3, 4])
    assert speculator.propose(alone, 99) == [5, 6, 3, 4]


def test_a_long_sequences_own_index_is_over_its_last_tokens_and_stays_bounded():
    """A prompt past twice the window is indexed from its last window on; as the sequence
    grows the index is made again rather than growing past twice the window."""
    from model_service.spec.ngram import NgramIndex
    from model_service.spec.speculator import OWN_TEXT_WINDOW

    for method in ("ngram", "suffix"):
        spec = Speculator(SpeculativeSettings(method=method), block_size=16, max_model_len=0)
        seq = Sequence.__new__(Sequence)
        seq.token_ids = list(range(3 * OWN_TEXT_WINDOW))
        make = (lambda: NgramIndex(2, 5)) if method == "ngram" else (lambda: RequestTrie(8))
        index = spec._own_index(seq, make)
        assert spec._indexes[seq][0] == 2 * OWN_TEXT_WINDOW and index.taken == OWN_TEXT_WINDOW
        seq.token_ids += list(range(OWN_TEXT_WINDOW))  # the window's length more: 2 x the window held
        assert spec._own_index(seq, make) is index and index.taken == 2 * OWN_TEXT_WINDOW
        seq.token_ids.append(7)  # one past: made again over the last window
        again = spec._own_index(seq, make)
        assert again is not index and again.taken == OWN_TEXT_WINDOW
        assert spec._indexes[seq][0] == len(seq.token_ids) - OWN_TEXT_WINDOW
