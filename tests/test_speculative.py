"""Speculative decoding (ngram) in the engine against a real cache service: greedy and
seeded sampled output token for token as without it, kept proposals counted, the rejected tails' slots given
back with the lease (the cache service checking its ledger after every call)."""

from __future__ import annotations

import pytest
import torch

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import start_cache_service
from harness.reference_generate import prompt_ids, reference_greedy
from model_service.loading.loader import load_model
from model_service.spec.settings import SpeculativeSettings
from model_service.spec.speculator import Speculator
from test_engine_requests import Streams, greedy, start_engine

# always: these tests check what speculation does, so it must run whatever the steps cost.
NGRAM = SpeculativeSettings(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                           always=True)
# Lengths that adapt up to 12 (spec/adaptive.py), verified whatever the steps cost.
ADAPTIVE = SpeculativeSettings(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=3,
                               max_speculative_tokens=12, always=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint("llama", tmp_path_factory.mktemp("speculative") / "llama")
    return load_model(str(path)), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def settled(monkeypatch):
    """(proposed, accepted, greedy) of every verification the engine ran."""
    seen: list[tuple[int, int, bool]] = []
    original = Speculator.settle

    def record(self, seq, proposed, accepted):
        seen.append((proposed, accepted, seq.options.greedy))
        original(self, seq, proposed, accepted)

    monkeypatch.setattr(Speculator, "settle", record)
    return seen


def run(engine, streams, requests: dict[str, tuple[list[int], object]]) -> dict[str, list[list[int]]]:
    for name, (prompt, options) in requests.items():
        engine.submit(name, prompt, options, streams.sink(name))
    for name, (_, options) in requests.items():
        wait_for(lambda name=name, n=options.n: len(streams.finished(name)) == n, 120, f"{name} to finish")
    return {name: [streams.tokens(name, i) for i in range(options.n)] for name, (_, options) in requests.items()}


def test_greedy_and_seeded_output_is_token_identical_with_ngram_speculation(checkpoint, tmp_path, settled):
    loaded, reference = checkpoint
    # A prompt that repeats itself: the lookup finds its continuation in it.
    looped = prompt_ids(12, seed=3) * 3
    requests = {
        "looped": (looped, greedy(40)),
        "plain": (prompt_ids(20, seed=4), greedy(30)),
        "n2": (looped[:30], greedy(24, n=2)),
        "stop": (looped, greedy(40, stop_token_ids=frozenset({looped[5]}))),
        # Seeded: each token drawn with the uniform a one-token step would have used.
        "sampled": (looped, greedy(30, temperature=0.5, seed=5)),
        "sampled-n2": (looped[:30], greedy(24, n=2, temperature=0.7, top_k=20, top_p=0.9, seed=9)),
        "penalised": (looped, greedy(20, temperature=0.8, seed=5, presence_penalty=0.5)),  # one token a step
    }
    outputs = {}
    for label, spec in (("plain", SpeculativeSettings()), ("ngram", NGRAM), ("adaptive", ADAPTIVE)):
        streams = Streams()
        (tmp_path / label).mkdir()
        with start_cache_service(tmp_path / label, "--kv-cache-bytes", "8MiB", "--check-invariants") as cache:
            engine = start_engine(loaded, cache.address, streams, speculative=spec)
            try:
                outputs[label] = run(engine, streams, requests)
                # Prefix-cache hits: the same prompts again, their blocks now cached.
                outputs[label + "-again"] = run(engine, streams, {k + "2": v for k, v in requests.items()})
                wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
            finally:
                engine.stop(grace_s=0)
    assert outputs["ngram"] == outputs["plain"]
    assert list(outputs["ngram-again"].values()) == list(outputs["plain"].values())
    assert outputs["adaptive"] == outputs["plain"]
    assert list(outputs["adaptive-again"].values()) == list(outputs["plain"].values())
    # The adaptive lengths went past what a fixed length proposes here.
    assert max(p for p, _, _ in settled) > NGRAM.num_speculative_tokens
    assert outputs["ngram"]["looped"][0] == reference_greedy(reference, looped, 40)
    # Speculation ran, and some of it was kept, for greedy and sampled requests both.
    for greedy_rows in (True, False):
        assert sum(p for p, _, g in settled if g is greedy_rows) > 0, greedy_rows
        assert sum(a for _, a, g in settled if g is greedy_rows) > 0, greedy_rows


SUFFIX = SpeculativeSettings(method="suffix", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                            always=True)


def test_suffix_speculation_proposes_from_the_same_tenants_earlier_outputs(checkpoint, tmp_path):
    loaded, reference = checkpoint
    prompt = prompt_ids(20, seed=4)
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB", "--check-invariants") as cache:
        engine = start_engine(loaded, cache.address, streams, speculative=SUFFIX)
        try:
            def one(name: str, tenant: str, salt: str = ""):
                engine.submit(name, prompt, greedy(30), streams.sink(name), tenant=tenant, cache_salt=salt)
                wait_for(lambda: len(streams.finished(name)) == 1, 120, f"{name} to finish")
                return streams.tokens(name), streams.finished(name)[0]

            first, first_end = one("a1", "a")
            again, again_end = one("a2", "a")  # tenant a's first output is in the history now
            other, other_end = one("b1", "b")
            salted, salted_end = one("a3", "a", salt="s")
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)
    assert first == again == other == salted == reference_greedy(reference, prompt, 30)
    assert again_end.spec_accepted_tokens > first_end.spec_accepted_tokens
    # Another tenant, or another salt of the same one, proposes only from its own tokens, as
    # the first request did.
    for end in (other_end, salted_end):
        assert (end.spec_proposed_tokens, end.spec_accepted_tokens) == (
            first_end.spec_proposed_tokens, first_end.spec_accepted_tokens)


def test_a_verification_step_is_decode_rows_in_the_decode_stack_with_plain_decodes_bits(checkpoint, monkeypatch):
    """A speculating sequence's last token and proposal run as decode rows, each attending up
    to its own position: the step stays one call of the C decode stack, and each proposed
    position's logits are the very bits a plain decode step there gives."""
    from model_service.models.cpu_decode_stack import DecodeStack
    from model_service.sched.sequence import Sequence
    from model_service.worker.runner import ModelRunner

    loaded, _ = checkpoint
    model = loaded.model
    stacked = []
    original = DecodeStack.run

    def run(self, hidden, *args, **kwargs):
        out = original(self, hidden, *args, **kwargs)
        stacked.append((hidden.shape[0], out is not None))
        return out

    monkeypatch.setattr(DecodeStack, "run", run)
    config, block_size = model.config, 16
    prompt, proposal = prompt_ids(20, seed=6), prompt_ids(4, seed=7)

    def prefilled():
        pool = torch.zeros((config.num_layers, 2, 4, block_size, config.num_kv_heads, config.head_dim))
        seq = Sequence(request_id="s", token_ids=list(prompt), prompt_len=len(prompt), options=None, arrival=0,
                       block_table=[0, 1, 2, 3])
        runner = ModelRunner(model, pool, block_size)
        runner.execute([(seq, len(prompt))])
        seq.num_computed = len(prompt) - 1  # its last prompt token runs again, as the decode below
        return runner, seq

    runner, seq = prefilled()  # plain decodes through the proposal, a step each
    plain = []
    for token in [None, *proposal]:
        if token is not None:
            seq.token_ids.append(token)
            seq.num_computed += 1
        plain.append(runner.execute([(seq, 1)])[1][0])
    stacked.clear()
    runner, seq = prefilled()
    due, logits = runner.execute([(seq, 1 + len(proposal))], proposals={seq: proposal})
    assert due == [seq] and stacked == [(1 + len(proposal), True)]
    assert torch.equal(logits[0], plain[0])
    for position, verified in enumerate(runner.verified[seq]):
        assert torch.equal(verified, plain[position + 1]), position


def test_the_engine_times_its_decode_steps_by_rows_for_the_speculator(checkpoint, tmp_path, monkeypatch):
    loaded, _ = checkpoint
    timed: list[tuple[int, float]] = []
    monkeypatch.setattr(Speculator, "step_took", lambda self, rows, seconds: timed.append((rows, seconds)))
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, speculative=NGRAM)
        try:
            # Its output repeats a few of its own bigrams: three verifications.
            run(engine, streams, {"plain": (prompt_ids(20, seed=4), greedy(30))})
        finally:
            engine.stop(grace_s=0)
    rows = [count for count, _ in timed]
    # One sequence: its decode steps, verifications among them (its token and up to four
    # proposed), and never its 20-token prompt's step.
    assert rows and max(rows) > 1 and all(1 <= count <= 5 for count in rows), rows
    assert all(seconds > 0 for _, seconds in timed)
