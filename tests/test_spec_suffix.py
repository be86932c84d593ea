"""The suffix proposer's history (model_service/spec/suffix.py): the likeliest continuation
from earlier outputs, one namespace (tenant and cache salt) never fed by another's, and
the memory it may take bounded however a tenant floods it."""

from __future__ import annotations

import random

from model_service.spec.suffix import SuffixHistory, SuffixTrie

A, B = ("tenant-a", ""), ("tenant-b", "")


def test_the_most_frequent_continuation_of_the_longest_match_is_proposed():
    history = SuffixHistory(depth=8, max_tokens=1000)
    history.add(A, [1, 2, 3, 4, 5])
    history.add(A, [1, 2, 3, 4, 5])
    history.add(A, [9, 2, 3, 7, 8])
    assert history.propose(A, [0, 2, 3], 1, 3, 3) == [4, 5]  # "2 3": 4 twice, 7 once
    assert history.propose(A, [9, 2, 3], 1, 3, 3) == [7, 8]  # the longer match "9 2 3" wins
    assert history.propose(A, [9, 2, 3], 1, 3, 1) == [7]
    assert history.propose(A, [6, 6], 1, 3, 3) == []  # never seen
    assert history.propose(A, [4], 2, 3, 3) == []  # shorter than --prompt-lookup-min


def test_a_rare_continuation_is_not_proposed():
    history = SuffixHistory(depth=4, max_tokens=1000)
    for tail in range(11):  # after "1", eleven different tokens once each: none reaches a tenth
        history.add(A, [1, 100 + tail])
    assert history.propose(A, [1], 1, 1, 2) == []


def test_one_tenants_outputs_never_feed_another_tenants_proposals():
    history = SuffixHistory(depth=6, max_tokens=1000)
    secret = [5, 6, 7, 8, 9]
    history.add(A, secret)
    assert history.propose(A, [5, 6], 1, 2, 3) == [7, 8, 9]
    for other in (B, ("tenant-a", "salt"), ("", "")):  # another tenant, another salt, no tenant
        assert history.propose(other, [5, 6], 1, 2, 3) == [], other
    history.add(B, [5, 6, 1, 1])
    assert history.propose(A, [5, 6], 1, 2, 3) == [7, 8, 9]
    assert history.propose(B, [5, 6], 1, 2, 3) == [1, 1]


def test_a_flood_of_outputs_stays_within_the_bound_and_the_oldest_go_first():
    depth, budget = 6, 500
    history = SuffixHistory(depth=depth, max_tokens=budget)
    history.add(B, [5, 6, 7, 8])
    rng = random.Random(1)
    for _ in range(300):  # one tenant, many requests and cache salts, random outputs
        history.add(("tenant-a", str(rng.randrange(50))), [rng.randrange(1000) for _ in range(rng.randrange(1, 40))])
        assert history.tokens <= budget
        assert history.nodes <= budget * depth
        assert history.namespaces <= budget
    assert history.propose(B, [5, 6], 1, 2, 2) == []  # B's old output left with its namespace
    history.add(A, list(range(10 * budget)))  # one output past the whole budget: its last tokens held
    assert history.tokens == budget and history.namespaces == 1
    assert history.propose(A, [10 * budget - 3], 1, 1, 2) == [10 * budget - 2, 10 * budget - 1]
    assert history.propose(A, [0], 1, 1, 2) == []


def test_counting_outputs_out_leaves_the_trie_that_the_held_ones_make():
    rng = random.Random(3)
    history = SuffixHistory(depth=5, max_tokens=120)
    held: list[list[int]] = []
    for _ in range(200):
        output = [rng.randrange(4) for _ in range(rng.randrange(1, 15))]
        history.add(A, output)
        held.append(output)
        while sum(map(len, held)) > 120:
            held.pop(0)
        fresh = SuffixTrie(5)
        for kept in held:
            fresh.add(kept)
        assert history.nodes == fresh.nodes
        context = [rng.randrange(4) for _ in range(3)]
        assert history.propose(A, context, 1, 3, 4) == fresh.propose(context, 1, 3, 4)


def test_the_history_gives_the_garbage_collector_nothing_to_walk():
    # A trie of node objects held a million of them at the default bound, and every full
    # collection walked them all while the model service stood still.
    import gc

    rng = random.Random(7)
    history = SuffixHistory(depth=21, max_tokens=20_000)
    history.add(A, [rng.randrange(500) for _ in range(50)])
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(200):
        history.add(A, [rng.randrange(500) for _ in range(128)])  # past the bound: evictions too
    gc.collect()
    assert history.nodes > 100_000
    # the outputs held (about 150 of them) may be tracked; the trie's nodes, none
    assert len(gc.get_objects()) - before < 1_000
