"""bench_spec.py's parts that a long run would find broken too late: the grounded workload
(deterministic, answerable, sized as asked), the proposer replay, and the completions' spec
usage coming back through bench_vs_vllm.pagedkv_services with at most `concurrency` in flight."""

from __future__ import annotations

import argparse

from bench.serve import spec_workloads
from bench.serve.bench_spec import decode_rate, proposer_cost, spec_flags, spec_paths_of, spec_totals
from bench.serve.bench_vs_vllm import pagedkv_services


def words(text: str) -> int:
    return len(text.split())


def test_grounded_workload_is_deterministic_sized_and_answerable():
    requests = spec_workloads.grounded(words, 6, seed=3)
    assert requests == spec_workloads.grounded(words, 6, seed=3)
    assert requests != spec_workloads.grounded(words, 6, seed=4)
    assert [kind for _, kind in requests] == list(spec_workloads.KINDS) * 2
    for messages, kind in requests:
        ask, text = messages[0]["content"].split("\n\n", 1)
        assert 300 <= words(text) <= 1500 + 60  # grown until it reaches a size drawn from 300-1,500
        assert "Invoice INV-" in text
        if kind == "quote":  # the question names an invoice the document holds
            name = ask.split("What did ", 1)[1].split(" of ", 1)[0]
            assert f"by {name} of" in text
        if kind == "rewrite":
            assert ask.split("change the city ", 1)[1].split(" to ", 1)[0] in text


def test_chat_workload_is_deterministic_and_asks_open_questions_without_repeats():
    requests = spec_workloads.chat(40, 1)
    assert requests == spec_workloads.chat(40, 1)
    questions = [messages[0]["content"] for messages, _ in requests]
    assert len(set(questions)) == 40 and {kind for _, kind in requests} == {"chat"}
    # the next draw asks none of them again (a repeat would find its answer in the suffix history)
    assert not set(questions) & {messages[0]["content"] for messages, _ in spec_workloads.chat(40, 2)}
    assert all(any(topic in question for topic in spec_workloads.TOPICS) for question in questions)
    first = spec_workloads.for_round(requests, 0)[0][0]
    assert first["role"] == "system" and "Copy names" not in first["content"]  # not the grounded ask


def test_each_round_gets_its_own_system_message():
    requests = spec_workloads.grounded(words, 2)
    first, second = spec_workloads.for_round(requests, 0), spec_workloads.for_round(requests, 1)
    assert [m[1:] for m in first] == [m[1:] for m in second] == [m for m, _ in requests]
    assert first[0][0]["role"] == "system" and first[0][0] != second[0][0]


def options(k: int = 3) -> argparse.Namespace:
    return argparse.Namespace(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=5)


def test_adaptive_paths_come_beside_the_fixed_ones_one_per_longest_length():
    args = argparse.Namespace(**vars(options()), skip_fixed=False, speculative_max_tokens="16,32")
    paths = spec_paths_of(["ngram", "suffix"], args)
    assert [name for name, _, _ in paths] == ["pagedkv ngram", "pagedkv suffix", "pagedkv ngram adaptive 16",
                                              "pagedkv suffix adaptive 16", "pagedkv ngram adaptive 32",
                                              "pagedkv suffix adaptive 32"]
    assert paths[4][2][-2:] == ["--speculative-max-tokens", "32"] and "--speculative-max-tokens" not in paths[0][2]
    args.skip_fixed, args.speculative_max_tokens = True, "16"
    assert [name for name, _, _ in spec_paths_of(["suffix"], args)] == ["pagedkv suffix adaptive"]


def test_the_decode_rate_leaves_each_requests_first_token_out():
    assert decode_rate({"decode": [(9, 1.0), (3, 0.5)]}) == 8.0
    assert decode_rate({"tokens": 5}) is None  # vLLM's rows carry no per-request times


def test_proposer_replay_times_every_token():
    sequences = [([5, 6, 7, 8] * 10, [5, 6, 7, 8] * 4), ([9, 10, 11], [12, 13])]
    for method in ("ngram", "suffix"):
        assert proposer_cost(method, options(), sequences) > 0
    assert proposer_cost("ngram", options(), []) == 0


def test_spec_usage_comes_back_per_completion(tmp_path):
    prompt = [5, 6, 7, 8] * 12  # its own repetition gives the ngram proposer a match at once
    requests = [(prompt, 12), (prompt[1:], 12), (prompt[2:], 12)]
    runs = {}
    for name, flags in (("plain", []), ("ngram", [*spec_flags("ngram", options()), "--speculative-always"])):
        (tmp_path / name).mkdir()
        with pagedkv_services("tiny", "float32", tmp_path / name, 1, flags) as run:
            runs[name] = run(requests, concurrency=2)
    assert runs["plain"]["spec"] == [(0, 0)] * 3
    assert spec_totals(runs["plain"]) == (0, 0)
    proposed, accepted = spec_totals(runs["ngram"])
    assert proposed > 0 and 0 <= accepted <= proposed
    assert all(p > 0 for p, _ in runs["ngram"]["spec"])
    assert runs["ngram"]["outputs"] == runs["plain"]["outputs"]  # greedy: the same tokens
    assert spec_totals({"spec_totals": (7, 3)}) == (7, 3)  # vLLM's, per job
