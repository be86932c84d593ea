"""Structured output without a server: specs, the grammar cache, the mask in the sampler, tool-call parsing.

The byte tokenizer of the `tiny` model stands in for a real vocabulary (every byte a
token), so the grammars compile in milliseconds.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from model_service.api.openai_http.errors import ApiError
from model_service.api.openai_http.protocol import ChatCompletionRequest
from model_service.api.openai_http.tools import parse_hermes, plan_tools
from model_service.api.sampling_proto import structured_from_proto
from model_service.sample.grammar import (COMPILE_NICENESS, CompileLimits, GrammarCompiler, InvalidStructure, TokenMasks, accept, json_depth,
                                          new_matcher)
from model_service.sample.params import InvalidRequest, SamplingOptions, StructuredSpec
from model_service.sample.sampler import make_generator, sample
from model_service.text.tokenizer import ByteTokenizer
from pagedkv.model.v1 import model_pb2

EOS = ByteTokenizer.EOS
VOCAB = ByteTokenizer().vocab_size


@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(ByteTokenizer(), VOCAB, {EOS})


def test_a_spec_is_compiled_once_even_when_asked_for_at_once(grammars):
    spec = StructuredSpec("regex", "[0-9]{4}")
    before = grammars.compiles
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(lambda _: grammars.compile(spec), range(8)))
    assert grammars.compiles == before + 1 and all(c is compiled[0] for c in compiled)


def test_the_grammar_cache_is_bounded_by_bytes_and_xgrammar_keeps_no_second_copy():
    grammars = GrammarCompiler(ByteTokenizer(), VOCAB, {EOS})
    specs = [StructuredSpec("regex", f"[0-9]{{4}}x{index}") for index in range(6)]
    one = grammars.compile(specs[0]).memory_size_bytes + len(specs[0].text)
    grammars.limits = CompileLimits(cache_bytes=3 * one + one // 2)  # room for three
    for spec in specs[1:]:
        grammars.compile(spec)
    assert grammars.cached_bytes <= grammars.limits.cache_bytes
    assert 0 < len(grammars._cache) <= 3
    assert grammars._xgrammar_compiler().get_cache_size_bytes() == 0
    before = grammars.compiles
    grammars.compile(specs[-1])  # the most recent is kept
    assert grammars.compiles == before
    grammars.compile(specs[0])  # the oldest was evicted: compiled again
    assert grammars.compiles == before + 1

    grammars.limits = CompileLimits(cache_bytes=one // 2)  # smaller than any grammar
    spec = StructuredSpec("regex", "[a-z]{3}")
    assert grammars.compile(spec) is not None  # served, not kept
    assert spec not in grammars._cache and grammars.cached_bytes <= one // 2


def test_spec_from_proto_checks_its_shape():
    spec = structured_from_proto(model_pb2.StructuredOutputs(choice=["a", "b"], disable_any_whitespace=True))
    assert spec == StructuredSpec("choice", '["a", "b"]', any_whitespace=False, strict=True)
    assert not structured_from_proto(model_pb2.StructuredOutputs(json="{}", disable_additional_properties=False)).strict
    with pytest.raises(InvalidRequest, match="not json and regex"):
        structured_from_proto(model_pb2.StructuredOutputs(json="{}", regex="a"))
    with pytest.raises(InvalidStructure, match="structured.grammar does not compile"):
        GrammarCompiler(ByteTokenizer(), VOCAB, {EOS}).compile(StructuredSpec("grammar", "root ::= ("))


def test_the_mask_bites_before_sampling_and_leaves_the_raw_logits(grammars):
    compiled = grammars.compile(StructuredSpec("regex", "(yes|no)"))
    options = [SamplingOptions(max_new_tokens=8, temperature=1.0), SamplingOptions(max_new_tokens=8)]
    masks = TokenMasks(VOCAB, torch.device("cpu"))
    for seed in range(8):
        matchers = [new_matcher(compiled, {EOS}), None]  # row 1 is unconstrained
        generators = [make_generator(seed, "cpu"), None]
        texts = b""
        logits = torch.randn(2, VOCAB)
        raw = logits.clone()
        while True:
            tokens = sample(logits, options, generators, mask=masks.prepare(matchers)).tolist()
            assert torch.equal(logits, raw)
            assert tokens[1] == int(raw[1].argmax())  # the unconstrained greedy row: untouched
            accept(matchers, tokens)
            if tokens[0] == EOS:
                break
            texts += bytes([tokens[0]])
        assert texts in (b"yes", b"no") and matchers[0].is_terminated()


def test_hermes_tool_calls_parse():
    content, calls = parse_hermes('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
                                  '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                                 ("g", {})]
    assert parse_hermes("no calls") == ("no calls", [])
    # Arguments written as JSON text (some models do) come out as the same object.
    _, [call] = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>\n')
    assert json.loads(call["function"]["arguments"]) == {"x": [1, 2]}
    _, [call] = parse_hermes('<tool_call>{"name": "f"}</tool_call>')  # no arguments: an empty object
    assert call["function"]["arguments"] == "{}"


@pytest.mark.parametrize("text", [
    "<tool_call>{broken</tool_call>",
    '<tool_call>{"name": "f", "arguments": {}}',  # never closed (EOS came first)
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"',  # the second never closed
    '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then I changed my mind',  # text after the calls
    '<tool_call>{"name": "f", "arguments": {}}</tool_call>so<tool_call>{"name": "g"}</tool_call>',  # text between
    '<tool_call>["f", {}]</tool_call>',  # not an object
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',  # arguments text that is not JSON
    '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
    "<tool_call></tool_call>",
    "<tool_call>",
], ids=["not-json", "unclosed", "second-unclosed", "text-after", "text-between", "array", "no-name", "name-number",
        "name-empty", "arguments-array", "arguments-text", "arguments-text-array", "empty", "bare-tag"])
def test_malformed_hermes_output_is_content(text):
    assert parse_hermes(text) == (text, [])


def body(**fields) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, **fields)


def test_tool_choice_plans():
    assert plan_tools(body(tool_choice="none"), None) is None
    required = plan_tools(body(tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(required.structured.json)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["f"]
    named = plan_tools(body(tool_choice={"type": "function", "function": {"name": "f"}}), None)
    assert named.mode == "named" and json.loads(named.structured.json) == {"type": "object"}
    hermes = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>"
    auto = plan_tools(body(), hermes)
    assert auto.mode == "auto"
    content, [call] = auto.parse('Sure.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "Sure." and call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    unknown = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'  # g is not among the tools
    assert auto.parse(unknown) == (unknown, [])
    with pytest.raises(ApiError, match='tool_choice "auto"'):
        plan_tools(body(), "{{ messages }}")
    with pytest.raises(ApiError, match="names the function 'g'"):
        plan_tools(body(tool_choice={"type": "function", "function": {"name": "g"}}), None)


@pytest.mark.parametrize("text, depth", [
    ('{"a": [[1], {"b": []}]}', 4),
    ('{"a": "{[[[ not nesting: inside a string", "b": [1]}', 2),
    ('["\\"[[", ["\\\\"], "\\u005b"]', 2),  # escaped quotes and backslashes end no string early
    ('[[["unterminated [[[[', 3),  # an unterminated string runs to the end
    ("]]] [[", 0), ("", 0), ("plain", 0),
])
def test_json_depth_counts_objects_and_arrays_outside_strings(text, depth):
    assert json_depth(text) == depth


def test_json_depth_takes_no_python_step_a_character():
    """Every schema sent is scanned for its depth on the event loop, refused ones included:
    the scan's Python lines must not grow with the text (the characters are C's to walk)."""
    def lines_run(text: str) -> int:
        count = 0

        def trace(frame, event, _):
            nonlocal count
            if frame.f_code is json_depth.__code__ and event == "line":
                count += 1
            return trace

        sys.settrace(trace)
        try:
            json_depth(text)
        finally:
            sys.settrace(None)
        return count

    small = json.dumps({"a": [{"b": "x" * 10}] * 10})
    large = json.dumps({"a": [{"b": "x" * 10}] * 10_000})
    assert json_depth(small) == json_depth(large) == 3
    assert lines_run(large) == lines_run(small)


def test_grammars_compile_at_a_lower_priority_than_the_caller(monkeypatch):
    """A tenant can keep a compile running back to back: it must give way to the engine
    and the event loop on a busy machine (Linux keeps a nice value per thread)."""
    import os
    import threading

    seen = []
    compile_with = GrammarCompiler._compile_with

    def recording(compiler, spec):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return compile_with(compiler, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile_with", staticmethod(recording))
    grammars = GrammarCompiler(ByteTokenizer(), VOCAB, {EOS})
    assert grammars.compile(StructuredSpec("regex", "[a-c]{2}nice")) is not None
    assert seen == [min(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + COMPILE_NICENESS, 19)]


def test_a_compile_past_its_deadline_runs_on_at_idle_priority_with_the_threads_it_started(monkeypatch):
    """A straggler (nobody waits for it) must not take CPU from the engine: its thread and
    the threads it started (xgrammar's pool) move to SCHED_IDLE at the deadline, and so
    does a thread it starts afterwards; its grammar is still kept when it ends."""
    import os
    import threading

    from harness.cache_helpers import wait_for
    from model_service import metrics

    release, started = threading.Event(), threading.Event()
    tids: dict[str, int] = {}
    compile_with = GrammarCompiler._compile_with

    def stuck(compiler, spec):  # stands for a compile that runs long, over threads of its own
        tids["compile"] = threading.get_native_id()
        pool = threading.Thread(target=lambda: (tids.__setitem__("pool", threading.get_native_id()), release.wait()))
        pool.start()
        started.set()
        release.wait()
        late = threading.Thread(target=lambda: tids.__setitem__("late", os.sched_getscheduler(0)))
        late.start()
        late.join()
        pool.join()
        return compile_with(compiler, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile_with", staticmethod(stuck))
    grammars = GrammarCompiler(ByteTokenizer(), VOCAB, {EOS}, limits=CompileLimits(timeout_s=0.05))
    straggling = metrics.GRAMMAR_COMPILES_STRAGGLING._value.get()
    spec = StructuredSpec("regex", "[a-c]{2}late")
    try:
        with pytest.raises(InvalidStructure, match="did not compile within"):
            grammars.compile(spec)
        started.wait()
        wait_for(lambda: "pool" in tids and os.sched_getscheduler(tids["compile"]) == os.SCHED_IDLE, 30,
                 "the straggler to move to SCHED_IDLE")
        assert os.sched_getscheduler(tids["pool"]) == os.SCHED_IDLE
        assert metrics.GRAMMAR_COMPILES_STRAGGLING._value.get() == straggling + 1
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own thread keeps its policy
    finally:
        release.set()
    wait_for(lambda: grammars.cached(spec) is not None, 30, "the straggler to end and be cached")
    assert tids["late"] == os.SCHED_IDLE
    assert metrics.GRAMMAR_COMPILES_STRAGGLING._value.get() == straggling


def test_a_compile_within_its_deadline_keeps_its_priority(monkeypatch):
    import os
    import threading

    seen = []
    compile_with = GrammarCompiler._compile_with

    def recording(compiler, spec):
        seen.append(os.sched_getscheduler(threading.get_native_id()))
        return compile_with(compiler, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile_with", staticmethod(recording))
    grammars = GrammarCompiler(ByteTokenizer(), VOCAB, {EOS}, limits=CompileLimits(timeout_s=60))
    assert grammars.compile(StructuredSpec("regex", "[a-c]{2}soon")) is not None
    assert seen == [os.SCHED_OTHER] and grammars._compiling == {}
