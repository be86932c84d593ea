"""The engine in-process against a real cache service: n completions on forked blocks,
Abort, deadlines, a constrained request across preemption. A deliver hook can hold the
engine thread between two steps, so what the cache service holds mid-run is read at a
known moment, not raced for."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from recorded_events import recording_events
from prometheus_client import REGISTRY

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.hf_checkpoints import write_checkpoint
from harness.processes import start_cache_service
from harness.reference_generate import prompt_ids, reference_greedy
from model_service.cache.client import CacheClient
from model_service.engine import live_requests
from model_service.engine.loop import Engine
from model_service.engine.settings import EngineSettings
from model_service.loading.loader import load_model
from model_service.sample.params import SamplingOptions
from model_service.sched.sequence import Finish

BLOCK = 16


class Streams:
    """Collects every request's deltas; `hold_when(predicate)` stops the engine thread
    right after a step whose deltas make the predicate true, until `resume()`."""

    def __init__(self) -> None:
        self.deltas: dict[str, list] = {}
        self.lock = threading.Lock()
        self._hold = None
        self.held = threading.Event()
        self._resume = threading.Event()

    def sink(self, name: str):
        self.deltas[name] = []
        return self.deltas[name].append

    def deliver(self, deliveries) -> None:
        for sink, delta in deliveries:
            sink(delta)
        if self._hold is not None and self._hold():
            self._hold = None
            self.held.set()
            self._resume.wait(30)

    def hold_when(self, predicate) -> None:
        self.held.clear()
        self._resume.clear()
        self._hold = predicate

    def resume(self) -> None:
        self._resume.set()

    def tokens(self, name: str, index: int = 0) -> list[int]:
        return [t for d in self.deltas[name] if d.index == index for t in d.token_ids]

    def finished(self, name: str) -> list:
        return [d for d in self.deltas[name] if d.finish is not None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint("llama", tmp_path_factory.mktemp("engine-requests") / "llama")
    return load_model(str(path)), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def block_bytes(loaded) -> int:
    config = loaded.config
    return 2 * config.num_layers * BLOCK * config.num_kv_heads * config.head_dim * 4


def start_engine(loaded, cache_address, streams, max_model_len=256, **settings) -> Engine:
    engine = Engine(loaded, EngineSettings(max_model_len=max_model_len, **settings), CacheClient(cache_address),
                    torch.device("cpu"), torch.float32, deliver=streams.deliver)
    engine.start()
    assert engine.connected.wait(30)
    return engine


def greedy(max_new_tokens: int, **fields) -> SamplingOptions:
    return SamplingOptions(max_new_tokens=max_new_tokens, ignore_eos=True, **fields)


def test_n_completions_lease_the_prompts_full_blocks_once(checkpoint, tmp_path):
    loaded, reference = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        # Leasing ahead off: the count below is of what the completions need, exactly.
        engine = start_engine(loaded, cache.address, streams, lease_ahead_blocks=0)
        try:
            prompt = prompt_ids(40, seed=1)  # 2 full blocks and 8 tokens of a third
            # Hold once every completion has 2 tokens: the forks are done, none has finished.
            streams.hold_when(lambda: all(len(streams.tokens("n4", i)) >= 2 for i in range(4)))
            engine.submit("n4", prompt, greedy(12, n=4), streams.sink("n4"))
            assert streams.held.wait(60)
            held = stats(cache_stub(cache.address))
            streams.resume()
            # 4 completions of at most 43 tokens: 3 blocks each, the 2 full prompt blocks
            # shared. Without sharing it would be 12.
            assert held.sequences == 4
            assert held.blocks_leased == 2 + 4 * 1
            wait_for(lambda: len(streams.finished("n4")) == 4, 60, "the 4 completions to finish")
            expected = reference_greedy(reference, prompt, 12)
            assert all(streams.tokens("n4", i) == expected for i in range(4))
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)


def count_computed_tokens(engine) -> list[int]:
    """Every step's forward-pass token counts, as the scheduler is told them."""
    counts: list[int] = []
    update = engine.scheduler.update_from_output

    def counting(step, output):
        counts.extend(new_tokens for _, new_tokens in step.batch)
        return update(step, output)

    engine.scheduler.update_from_output = counting
    return counts


def test_n_completions_under_a_small_pool_preempt_and_stay_exact(checkpoint, tmp_path):
    loaded, reference = checkpoint
    streams = Streams()
    # 10 blocks: 4 completions of 40 + 40 tokens hold 2 shared + 4 x 3 = 14.
    with start_cache_service(tmp_path, "--kv-cache-bytes", str(10 * block_bytes(loaded)), "--headroom", "0") as cache:
        engine = start_engine(loaded, cache.address, streams, max_model_len=96)
        computed = count_computed_tokens(engine)
        try:
            prompt = prompt_ids(40, seed=2)
            engine.submit("small", prompt, greedy(40, n=4), streams.sink("small"))
            wait_for(lambda: len(streams.finished("small")) == 4, 120, "the 4 completions to finish")
            assert engine.scheduler.preemptions > 0, "the small pool forced no preemption"
            expected = reference_greedy(reference, prompt, 40)
            assert all(streams.tokens("small", i) == expected for i in range(4))
            assert all(d.error is None for d in streams.finished("small"))
            # Each completion's usage: the 5 blocks of its 79 written positions (none is
            # leased past prompt + max_new_tokens), and what preemption made it compute again:
            # every position the forward passes computed past the first time. Completion 0
            # computes positions 0-78 once, each fork 40-78 (it shares the prompt's).
            assert [d.peak_kv_blocks for d in streams.finished("small")] == [5] * 4
            recomputed = sum(d.recomputed_tokens for d in streams.finished("small"))
            assert recomputed == sum(computed) - (79 + 3 * 39) > 0
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)


def test_abort_of_queued_and_running_requests(checkpoint, tmp_path):
    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, max_num_seqs=1)
        try:
            streams.hold_when(lambda: len(streams.tokens("running")) >= 1)
            engine.submit("running", prompt_ids(10, 3), greedy(200), streams.sink("running"))
            assert streams.held.wait(60)
            engine.submit("queued", prompt_ids(10, 4), greedy(5), streams.sink("queued"))
            assert engine.abort(["queued", "running", "unknown"]) == 2
            streams.resume()
            wait_for(lambda: streams.finished("queued") and streams.finished("running"), 30, "both to end")
            for name in ("queued", "running"):
                last = streams.finished(name)[0]
                assert last.finish is Finish.ABORTED and last.error is None
            assert streams.tokens("queued") == [] and len(streams.tokens("running")) < 200
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
            assert engine.pending == 0
        finally:
            engine.stop(grace_s=0)


def test_a_prompt_admitted_while_another_decodes_starts_in_that_step(checkpoint, tmp_path):
    """Its allocation is waited for, not left on the wire while the step runs: its first
    token comes with the decoding stream's next token, not one step after it."""
    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams)
        try:
            streams.hold_when(lambda: len(streams.tokens("decoding")) >= 3)
            engine.submit("decoding", prompt_ids(10, 5), greedy(40), streams.sink("decoding"))
            assert streams.held.wait(60)
            decoded_before = len(streams.tokens("decoding"))
            decoded_at_first_token = []
            collect = streams.sink("new")

            def new_sink(delta) -> None:
                if delta.token_ids and not decoded_at_first_token:
                    decoded_at_first_token.append(len(streams.tokens("decoding")))
                collect(delta)

            engine.submit("new", prompt_ids(20, 6), greedy(2), new_sink)
            streams.resume()
            wait_for(lambda: streams.finished("decoding") and streams.finished("new"), 30, "both to end")
            # A step delivers its decodes' tokens before its prefills'.
            assert decoded_at_first_token == [decoded_before + 1]
        finally:
            engine.stop(grace_s=0)


@pytest.mark.parametrize("hold", [32, 0])
def test_prompts_that_arrive_together_compute_their_shared_prefix_once(checkpoint, tmp_path, hold):
    """Two prompts on one 96-token prefix reach the engine in the same step (it is held
    while they are submitted). With --prefix-hold-min-tokens, the second waits for the
    first's blocks to be committed and finds them cached; with 0 it computes them again
    beside the first. Both generate what transformers does either way."""
    loaded, reference = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, prefix_hold_min_tokens=hold)
        try:
            streams.hold_when(lambda: len(streams.tokens("decoding")) >= 2)
            engine.submit("decoding", prompt_ids(10, 7), greedy(30), streams.sink("decoding"))
            assert streams.held.wait(60)
            prefix = prompt_ids(96, seed=8)
            prompts = {"first": prefix + [11, 12, 13], "second": prefix + [21, 22, 23, 24]}
            for name, prompt in prompts.items():
                engine.submit(name, prompt, greedy(4), streams.sink(name))
            streams.resume()
            wait_for(lambda: all(streams.finished(name) for name in ("decoding", *prompts)), 60, "all three to end")
            cached = {name: streams.finished(name)[0].cached_tokens for name in prompts}
            assert cached == ({"first": 0, "second": 96} if hold else {"first": 0, "second": 0})
            for name, prompt in prompts.items():
                assert streams.tokens(name) == reference_greedy(reference, prompt, 4)
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)


def test_a_request_shares_the_prefix_of_one_still_running(checkpoint, tmp_path):
    """Full blocks are committed to the prefix cache while their sequence runs: a request
    submitted while the first one decodes (the engine held, so it has not finished) gets
    them as cached_tokens, ends while the first still runs, and generates what transformers
    does from the whole prompt."""
    loaded, reference = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams)
        try:
            prefix = prompt_ids(96, seed=9100)
            streams.hold_when(lambda: len(streams.tokens("long")) >= 1)
            engine.submit("long", prefix, greedy(150), streams.sink("long"))
            assert streams.held.wait(60)
            late = prefix + [7, 8, 9, 10, 11]
            engine.submit("late", late, greedy(4), streams.sink("late"))
            streams.hold_when(lambda: bool(streams.finished("late")))
            streams.resume()
            assert streams.held.wait(60)
            long_tokens = len(streams.tokens("long"))
            assert 1 < long_tokens < 150 and not streams.finished("long")
            # Aborted while the engine is still held: however fast the machine, it cannot
            # have run its remaining tokens meanwhile.
            assert engine.abort(["long"]) == 1
            streams.resume()
            assert streams.finished("late")[0].cached_tokens == 96  # the 6 full blocks of the prefix
            assert streams.tokens("late") == reference_greedy(reference, late, 4)
            wait_for(lambda: streams.finished("long"), 30, "the long request to end")
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)


def test_deadlines_in_the_queue_and_mid_stream(checkpoint, tmp_path, monkeypatch):
    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, max_num_seqs=1)
        try:
            # Deadlines an hour away, then the engine's clock moved past them while it is
            # held: however slow the machine, neither passes early and both pass then.
            hour = time.monotonic() + 3600
            streams.hold_when(lambda: len(streams.tokens("running")) >= 1)
            engine.submit("running", prompt_ids(10, 5), greedy(200), streams.sink("running"), deadline=hour)
            assert streams.held.wait(60)
            # Queued behind it (one sequence at a time).
            engine.submit("queued", prompt_ids(10, 6), greedy(5), streams.sink("queued"), deadline=hour)
            monkeypatch.setattr(live_requests, "time", SimpleNamespace(
                monotonic=lambda: time.monotonic() + 7200, perf_counter=time.perf_counter))
            streams.resume()
            wait_for(lambda: streams.finished("queued") and streams.finished("running"), 30, "both to end")
            for name in ("queued", "running"):
                last = streams.finished(name)[0]
                assert last.error is not None and last.error[0] == grpc.StatusCode.DEADLINE_EXCEEDED, name
            assert streams.tokens("queued") == [] and 1 <= len(streams.tokens("running")) < 200
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
            assert engine.pending == 0
        finally:
            engine.stop(grace_s=0)


def test_priority_policy_runs_the_urgent_request_first(checkpoint, tmp_path):
    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, max_num_seqs=1, scheduling_policy="priority")
        try:
            streams.hold_when(lambda: len(streams.tokens("first")) >= 1)
            engine.submit("first", prompt_ids(8, 7), greedy(4), streams.sink("first"))
            assert streams.held.wait(60)
            order = []
            for name, priority in (("later", 5), ("urgent", -3), ("normal", 0)):
                engine.submit(name, prompt_ids(8, 8), greedy(2), lambda d, name=name: order.append((name, d)),
                              priority=priority)
            streams.resume()
            wait_for(lambda: sum(1 for _, d in order if d.finish is not None) == 3, 30, "all three to finish")
            firsts = []
            for name, _ in order:
                if name not in firsts:
                    firsts.append(name)
            assert firsts == ["urgent", "normal", "later"]
        finally:
            engine.stop(grace_s=0)


def test_duplicate_live_request_id_is_refused(checkpoint, tmp_path):
    from model_service.engine.admission import DuplicateRequest

    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams)
        try:
            streams.hold_when(lambda: len(streams.tokens("same")) >= 1)
            engine.submit("same", prompt_ids(8, 9), greedy(50), streams.sink("same"))
            assert streams.held.wait(60)
            with pytest.raises(DuplicateRequest, match="'same' is already queued or running"):
                engine.submit("same", prompt_ids(8, 9), greedy(5), lambda d: None)
            assert engine.abort(["same"]) == 1
            streams.resume()
            wait_for(lambda: streams.finished("same"), 30, "the request to end")
        finally:
            engine.stop(grace_s=0)


def test_leasing_ahead_makes_fewer_lease_calls_for_the_same_tokens(checkpoint, tmp_path):
    """Eight streams against the real cache service, with --lease-ahead-blocks 0 and 1:
    the same greedy tokens, every block back at the end, and with top-ups well under half
    the lease calls (without, some stream crosses a block boundary nearly every step)."""
    loaded, _ = checkpoint
    prompts = [prompt_ids(5 + 3 * i, seed=10 + i) for i in range(8)]
    runs = {}
    for ahead in (0, 1):
        streams = Streams()
        (tmp_path / str(ahead)).mkdir()
        with start_cache_service(tmp_path / str(ahead), "--kv-cache-bytes", "8MiB") as cache:
            engine = start_engine(loaded, cache.address, streams, lease_ahead_blocks=ahead)
            try:
                calls_before, top_ups_before = lease_counters()
                for i, prompt in enumerate(prompts):
                    engine.submit(f"r{i}", prompt, greedy(48), streams.sink(f"r{i}"))
                wait_for(lambda: all(streams.finished(f"r{i}") for i in range(8)), 60, "every stream to finish")
                wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
                calls, top_ups = lease_counters()
                runs[ahead] = ([streams.tokens(f"r{i}") for i in range(8)], calls - calls_before,
                               top_ups - top_ups_before)
            finally:
                engine.stop(grace_s=0)
    (tokens_exact, calls_exact, top_ups_exact), (tokens_ahead, calls_ahead, top_ups_ahead) = runs[0], runs[1]
    assert tokens_ahead == tokens_exact and all(len(t) == 48 for t in tokens_ahead)
    assert top_ups_exact == 0 < top_ups_ahead
    assert calls_ahead * 2 < calls_exact, (calls_ahead, calls_exact)


def lease_counters() -> tuple[float, float]:
    """The engine's lease calls and top-ups so far (this process's Prometheus registry)."""
    value = REGISTRY.get_sample_value
    return value("pagedkv_model_lease_calls_total") or 0.0, value("pagedkv_model_lease_top_ups_total") or 0.0


def test_a_step_that_raises_ends_its_requests_and_the_engine_runs_on(checkpoint, tmp_path):
    loaded, reference = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams)
        try:
            # A fault in any step that holds "victim" (as an allocation or a kernel error
            # there would be): that step's requests end, the engine does not.
            execute = engine.runner.execute

            def failing(batch, *args, **kwargs):
                if any(seq.request_id == "victim" for seq, _ in batch):
                    raise RuntimeError("injected fault")
                return execute(batch, *args, **kwargs)

            engine.runner.execute = failing
            engine.submit("victim", prompt_ids(10, 5), greedy(5), streams.sink("victim"))
            wait_for(lambda: any(d.error for d in streams.deltas["victim"]), 30, "the victim to end")
            code, message = next(d.error for d in streams.deltas["victim"] if d.error)
            assert code == grpc.StatusCode.INTERNAL and "RuntimeError" in message and "others run on" in message
            prompt = prompt_ids(12, 6)
            engine.submit("after", prompt, greedy(6), streams.sink("after"))
            wait_for(lambda: streams.finished("after"), 60, "the next request to finish")
            assert streams.tokens("after") == reference_greedy(reference, prompt, 6) and engine.connected.is_set()
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)


def test_prompt_logprobs_of_a_long_chunk_are_computed_a_slice_of_rows_at_a_time(checkpoint, tmp_path):
    from model_service.engine.step_sampler import PROMPT_LOGPROB_ROWS

    loaded, _ = checkpoint
    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        engine = start_engine(loaded, cache.address, streams, max_model_len=1024)
        try:
            rows_at_once: list[int] = []
            compute_logits = engine.runner.model.compute_logits

            def counting(hidden, *args, **kwargs):
                rows_at_once.append(hidden.shape[0])
                return compute_logits(hidden, *args, **kwargs)

            engine.runner.model.compute_logits = counting
            prompt = prompt_ids(600, 7)  # one prefill chunk of 600 positions
            engine.submit("long", prompt, greedy(2, prompt_logprobs=1), streams.sink("long"))
            wait_for(lambda: streams.finished("long"), 60, "the request to finish")
            logprobs = [lp for d in streams.deltas["long"] if d.prompt_logprobs for lp in d.prompt_logprobs]
            assert [lp.token_id for lp in logprobs] == prompt[1:]
            # 400 MB of float32 logits for a 2,048-token chunk at vocab 49,152 were made at once.
            assert max(rows_at_once) <= PROMPT_LOGPROB_ROWS, rows_at_once
        finally:
            engine.stop(grace_s=0)


def test_no_block_enters_the_prefix_index_before_the_writes_behind_it(checkpoint, tmp_path):
    """The runner records an event behind every step (as on CUDA, where a step with nothing
    to sample never waits for the device); every lease call that commits full blocks or
    releases them (both put blocks in the prefix index, readable by others at once) is
    sent only after the latest step's event was waited for, and no other call waits."""
    loaded, reference = checkpoint
    streams = Streams()
    log: list = []
    with start_cache_service(tmp_path, "--kv-cache-bytes", "8MiB") as cache:
        # Chunks of 16: the 48-token prompt runs in 3 steps, the first two sample nothing,
        # and the call made after the second (an extend for the third) commits 2 blocks.
        engine = start_engine(loaded, cache.address, streams, max_batch_tokens=16, lease_ahead_blocks=0)
        try:
            engine.runner.new_event = recording_events(log)
            lease = engine.cache.lease

            def recording_lease(session_id, ops):
                log.append(("lease", [tokens for _, tokens in ops.commits], len(ops.releases)))
                return lease(session_id, ops)

            engine.cache.lease = recording_lease
            prompt = prompt_ids(48, seed=7)
            engine.submit("r", prompt, greedy(20), streams.sink("r"))
            wait_for(lambda: streams.finished("r"), 60, "the request to finish")
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
            assert streams.tokens("r") == reference_greedy(reference, prompt, 20)
        finally:
            engine.stop(grace_s=0)
    unwaited = None  # the latest recorded event not yet waited for
    fenced_calls = 0
    for i, entry in enumerate(log):
        match entry:
            case ("record", number):
                unwaited = number
            case ("synchronize", number):
                assert number == unwaited, f"waited for event {number}, not the latest ({unwaited}): {log}"
                unwaited = None
                # One wait a fenced call, none for calls that carry neither.
                assert log[i + 1][0] == "lease" and (log[i + 1][1] or log[i + 1][2]), log
            case ("lease", commits, releases) if commits or releases:
                assert unwaited is None, f"call {entry} sent before the writes of step {unwaited} landed: {log}"
                fenced_calls += 1
    commit_calls = [commits for kind, commits, releases in (e for e in log if e[0] == "lease") if commits and not releases]
    assert commit_calls and commit_calls[0] == [32], log  # the prompt's first 2 blocks, before the 3rd chunk ran
    assert any(e[0] == "lease" and e[2] for e in log) and fenced_calls >= 2, log


# A constrained output long enough that 4 of them overflow a 10-block pool: {"word": "<41
# letters>", "n": <2 digits>} is 62 bytes, a token each with the tiny model's byte tokenizer.
WORD_SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "pattern": "^[a-z]{41}$"},
                                                "n": {"type": "integer", "minimum": 10, "maximum": 99}},
               "required": ["word", "n"]}


def test_a_constrained_request_preempted_and_recomputed_keeps_its_grammar(tmp_path):
    """n=4 JSON-schema completions at temperature 1 on the tiny model, in a 10-block pool
    where they want 2 shared + 4 x 4 blocks: they are preempted and recomputed, and each
    output still validates and is token for token what its seed gives alone (one at a
    time, each fits: no preemption). So each completion's grammar matcher stays where its
    tokens left it across the recompute."""
    import json

    import jsonschema

    from model_service.engine.output import completion_seed
    from model_service.sample.grammar import GrammarCompiler
    from model_service.sample.params import StructuredSpec

    loaded = load_model("tiny")
    spec = StructuredSpec("json", json.dumps(WORD_SCHEMA), any_whitespace=False)
    compiled = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids).compile(spec)
    prompt = list(b"Describe one word and one number as JSON.")  # 41 bytes: 2 full blocks and 9 tokens

    def constrained(n: int, seed: int) -> SamplingOptions:
        return SamplingOptions(max_new_tokens=80, temperature=1.0, seed=seed, n=n, structured=spec, grammar=compiled)

    def run(name: str, options: SamplingOptions) -> list[list[int]]:
        engine.submit(name, prompt, options, streams.sink(name))
        wait_for(lambda: len(streams.finished(name)) == options.n, 120, f"{name}'s completions to finish")
        assert all(d.error is None and d.finish is Finish.EOS for d in streams.finished(name))
        return [streams.tokens(name, i)[:-1] for i in range(options.n)]  # EOS ends each

    streams = Streams()
    with start_cache_service(tmp_path, "--kv-cache-bytes", str(10 * block_bytes(loaded)), "--headroom", "0") as cache:
        engine = start_engine(loaded, cache.address, streams, max_model_len=128)
        try:
            alone = [run(f"alone{i}", constrained(1, completion_seed(7, i)))[0] for i in range(4)]
            assert engine.scheduler.preemptions == 0
            together = run("together", constrained(4, 7))
            assert engine.scheduler.preemptions > 0, "the small pool forced no preemption"
            wait_for(lambda: stats(cache_stub(cache.address)).blocks_leased == 0, 10, "every block released")
        finally:
            engine.stop(grace_s=0)
    for tokens in together:
        jsonschema.validate(json.loads(bytes(tokens)), WORD_SCHEMA)
    assert together == alone
    assert len({bytes(tokens) for tokens in together}) == 4  # four seeds: not one output four times
