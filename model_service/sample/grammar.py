"""Structured output: a request's constraint, compiled once by xgrammar, and the token masks it puts on a step.

`StructuredSpec` (params.py) is what a request asked for. `GrammarCompiler` compiles it against the model's vocabulary, on
threads of its own within the bounds of CompileLimits (the front doors await it before
validation runs), and keeps the result by the spec's text, so the thousandth request with
one schema pays a dictionary lookup. On the engine thread
each constrained completion holds an xgrammar `GrammarMatcher` (its position in the
grammar); `TokenMasks.prepare` fills one bitmask row per constrained row of a step and
`TokenMask.apply` puts all of them on those rows' logits in one call, before temperature,
top-k, top-p and min-p, so a masked token can never be sampled. `accept` advances each matcher
by its sampled token. A step without a constrained row never gets here.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy
import structlog
import torch

from model_service import metrics
from model_service.sample.params import InvalidRequest, StructuredSpec
from pagedkv.thread_names import name_this_thread, threads_named
from pagedkv.thread_priority import idle_threads, lower_this_thread

log = structlog.get_logger()

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Bounds on what one request may ask to compile: the compile time and the memory of a
# compiled grammar grow with the text.
MAX_STRUCTURED_CHARS = 64 * 1024
MAX_CHOICES = 1024
# Compiled grammars kept, at most (their bytes are bounded too: CompileLimits.cache_bytes).
MAX_CACHED_GRAMMARS = 256
# JSON with any whitespace: at most this many whitespace characters between two elements.
# Room for indentation, never a run a small model can loop in until max_new_tokens.
MAX_JSON_WHITESPACE = 12
# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: ": the client needs the rest.
_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?:\d+: ")
_MAX_MESSAGE_CHARS = 400
# Nice value of the compile threads (Linux: per thread), relative to the service's: the
# most there is. On a core the engine keeps busy, a thread 10 nicer still gets about a
# tenth of it, and a tenant can keep a compile running back to back (each spec new);
# at 19 it gets about a seventieth, so compiles take what the engine leaves, while on a
# core with room they run as fast as ever.
COMPILE_NICENESS = 19
# json_depth: every byte but a bracket's (UTF-8 puts no ASCII byte inside another character).
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")


def compile_thread_name(tid: int) -> str:
    """The operating system's name of the compile thread `tid` and of the threads it starts
    (at most 15 characters: a Linux thread id has at most 7 digits)."""
    return f"grammar-{tid}"


class InvalidStructure(InvalidRequest):
    """A structured-output request that cannot be compiled; the message says why."""


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for "exactly one of these strings": JSON string literals are EBNF ones."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Collection[int]):
    """xgrammar's view of the vocabulary: each token's bytes, and which ones end a sequence."""
    import xgrammar as xgr

    from model_service.text.tokenizer import ByteTokenizer, HFTokenizer

    stops = sorted(stop_token_ids)
    if isinstance(tokenizer, HFTokenizer):
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tokenizer)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stops)
    if isinstance(tokenizer, ByteTokenizer):
        # Special tokens have no text: xgrammar never lets the grammar produce them (only stops end it).
        vocab = [bytes([byte]) for byte in range(ByteTokenizer.NUM_BYTES)] + [b""] * len(ByteTokenizer.SPECIAL_TOKENS)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    raise InvalidStructure(f"structured output is not available for a {type(tokenizer).__name__}")


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """What compiling may cost: xgrammar's time grows with a schema's nesting (cubically)
    and with its size, so a request's grammar is compiled on a thread of a small pool of
    its own, never the one that tokenizes, and waited for only so long."""

    threads: int = 2  # compiles at once, stragglers included (--grammar-compile-threads)
    timeout_s: float = 10.0  # --grammar-compile-timeout-s
    max_json_depth: int = 64  # nesting of a JSON schema's objects and arrays (--max-json-schema-depth)
    per_tenant: int = 1  # compiles one tenant may have running (--grammar-compiles-per-tenant)
    # What the compiled grammars kept for reuse may hold (--grammar-cache-bytes): a compiled
    # grammar's token masks grow with the vocabulary and the spec, so a count alone does not
    # bound them. A grammar larger than this is served but not kept.
    cache_bytes: int = 64 << 20


class CompilerBusy(Exception):
    """Every compile thread is taken, or the tenant has its share compiling: retry later."""


@dataclass(slots=True)
class _Compiling:
    future: Future
    tenant: str
    # time.monotonic() past which its waiters give up: set when the compile itself starts,
    # after the vocabulary is read (once, at the first compile: not the request's cost).
    deadline: float = math.inf
    tid: int = 0  # the compile thread's id (threading.get_native_id), once it runs
    abandoned: bool = False  # past its deadline: its threads were moved to SCHED_IDLE

    def remaining_s(self) -> float:
        # While the deadline is unset, waiters look again this often.
        return min(self.deadline - time.monotonic(), 0.25)


class GrammarCompiler:
    """Compiles specs for one model's vocabulary; thread-safe; keeps the most recently used
    compiled grammars, at most MAX_CACHED_GRAMMARS of them and `limits.cache_bytes` in all.

    A compile runs on a daemon thread of its own, at most `limits.threads` at once; its
    waiters give up at its deadline with InvalidStructure naming the limit. Python cannot
    stop a thread, so one that timed out runs on to its end (a straggler) and keeps its
    place: while every place is taken, a new compile is refused (CompilerBusy) rather than
    queued, and a spec that timed out is refused at once when sent again. At its deadline
    a straggler's threads (its own and xgrammar's, found by the name they share) move to
    SCHED_IDLE: nobody waits for it any more, so it runs only on CPU nobody else wants,
    never on the engine's share. (A subprocess could be killed instead, but every compiled
    grammar would cross back serialized, and xgrammar's serialized form of a deeply nested
    schema's grammar is many times the grammar's size and slow to write and read.) A
    grammar that finishes after its deadline is still cached, so the spec costs nothing
    the next time."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], max_threads: int = 2,
                 limits: CompileLimits = CompileLimits()) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._max_threads = max_threads  # xgrammar's own threads, within one compile
        self.limits = limits  # may be replaced before the first compile (server.py)
        self._compiler = None  # made at the first compile
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # held while the vocabulary is read, once
        self._cache: OrderedDict[StructuredSpec, tuple[object, int]] = OrderedDict()  # spec -> (compiled, bytes)
        self.cached_bytes = 0
        self._compiling: dict[StructuredSpec, _Compiling] = {}  # running, stragglers included
        self._too_slow: OrderedDict[StructuredSpec, None] = OrderedDict()  # timed out, not finished since
        self.compiles = 0  # cache misses, for tests and the benchmark

    def compile(self, spec: StructuredSpec, count_hit: bool = True):
        """The spec's xgrammar CompiledGrammar, waited for on this thread; InvalidStructure
        with the compiler's message or the limit it passed; CompilerBusy. count_hit: False
        where the request's lookup was counted already (compile_async at its door)."""
        compiled = self.cached(spec, count_hit)
        if compiled is not None:
            return compiled
        compiling = self.start(spec)
        while (remaining := compiling.remaining_s()) > 0:
            try:
                return compiling.future.result(timeout=remaining)
            except FutureTimeout:
                continue
        if compiling.future.done():
            return compiling.future.result()
        raise self._timed_out(spec)

    async def compile_async(self, spec: StructuredSpec, tenant: str = ""):
        """compile(), awaited on the event loop without holding any thread, and counted
        against `tenant`'s compiles ("": none)."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        compiling = self.start(spec, tenant)
        compiled = asyncio.wrap_future(compiling.future)  # asyncio.wait never cancels it
        while not compiled.done() and (remaining := compiling.remaining_s()) > 0:
            await asyncio.wait([compiled], timeout=remaining)
        if not compiled.done():
            raise self._timed_out(spec)
        return compiled.result()

    def cached(self, spec: StructuredSpec, count_hit: bool = True):
        with self._lock:
            entry = self._cache.get(spec)
            if entry is None:
                return None
            self._cache.move_to_end(spec)
            if count_hit:
                metrics.GRAMMAR_CACHE_HITS.labels(spec.kind).inc()
            return entry[0]

    def start(self, spec: StructuredSpec, tenant: str = "") -> _Compiling:
        """The spec's compile: the one running (another request sent the same spec), or a
        new one on a thread of its own."""
        limits = self.limits
        if spec.kind == "json":
            depth = json_depth(spec.text)
            if depth > limits.max_json_depth:
                raise InvalidStructure(f"structured.json nests objects and arrays {depth} deep; this server "
                                       f"compiles at most {limits.max_json_depth} (--max-json-schema-depth): "
                                       "flatten the schema (use $defs and $ref for repeated parts)")
        with self._lock:
            too_slow = spec in self._too_slow
            running = None if too_slow else self._compiling.get(spec)
            if running is not None:
                metrics.GRAMMAR_CACHE_HITS.labels(spec.kind).inc()
                return running
            if too_slow:
                raise self._timed_out(spec, before=True)
            mine = sum(1 for other in self._compiling.values() if tenant and other.tenant == tenant)
            if tenant and mine >= limits.per_tenant:
                raise CompilerBusy(f"tenant {tenant!r} has {mine} grammars compiling, the limit is "
                                   f"--grammar-compiles-per-tenant {limits.per_tenant}; retry later")
            if len(self._compiling) >= limits.threads:
                raise CompilerBusy(f"{len(self._compiling)} grammars are compiling, the limit is "
                                   f"--grammar-compile-threads {limits.threads}; retry later")
            compiling = self._compiling[spec] = _Compiling(Future(), tenant)
        threading.Thread(target=self._run, args=(spec, compiling), name="grammar-compile", daemon=True).start()
        return compiling

    def _run(self, spec: StructuredSpec, compiling: _Compiling) -> None:
        # A tenant may keep a compile running back to back (each spec new), and xgrammar
        # spreads one over threads of its own (started from this one, so they inherit the
        # priority): on a busy machine the engine and the event loop get the cores first.
        lower_this_thread(COMPILE_NICENESS)
        compiling.tid = threading.get_native_id()
        future = compiling.future
        deadline = None
        try:
            compiler = self._xgrammar_compiler()
            compiling.deadline = time.monotonic() + self.limits.timeout_s
            # Its own thread: the waiters may all be gone (a client that hung up).
            deadline = threading.Timer(self.limits.timeout_s, self._abandon, args=(spec, compiling))
            deadline.name, deadline.daemon = "grammar-deadline", True
            deadline.start()
            # Named by its own id, a name the threads xgrammar starts from it take over (the
            # timer's started before, so it does not): a compile's threads can be found, and
            # their CPU told from the engine's.
            name_this_thread(compile_thread_name(compiling.tid))
            compiled = self._compile(compiler, spec)
        except BaseException as error:  # InvalidStructure, or xgrammar's bad_alloc: the waiters get it
            with self._lock:
                self._ended(spec, compiling, deadline)
            future.set_exception(error)
            return
        with self._lock:
            self.compiles += 1
            self._ended(spec, compiling, deadline)
            self._keep(spec, compiled)
        future.set_result(compiled)

    def _ended(self, spec: StructuredSpec, compiling: _Compiling, deadline: threading.Timer | None) -> None:
        """A compile's thread is done with it; the caller holds the lock."""
        if deadline is not None:
            deadline.cancel()
        self._compiling.pop(spec, None)
        self._too_slow.pop(spec, None)
        if compiling.abandoned:
            metrics.GRAMMAR_COMPILES_STRAGGLING.dec()

    def _abandon(self, spec: StructuredSpec, compiling: _Compiling) -> None:
        """At a compile's deadline, if it still runs: its threads to SCHED_IDLE. Under the
        lock, so the compile thread cannot end meanwhile and its id (in the name its threads
        share) cannot be another's; a thread xgrammar starts after this inherits the policy."""
        with self._lock:
            if self._compiling.get(spec) is not compiling or compiling.abandoned:
                return
            moved = idle_threads(sorted({compiling.tid, *threads_named(compile_thread_name(compiling.tid))}))
            compiling.abandoned = True
            metrics.GRAMMAR_COMPILES_STRAGGLING.inc()
        metrics.GRAMMAR_COMPILES_ABANDONED.inc()
        log.warning("grammar_compile_abandoned", kind=spec.kind, tenant=compiling.tenant, chars=len(spec.text),
                    timeout_s=self.limits.timeout_s, threads=moved)

    def _keep(self, spec: StructuredSpec, compiled) -> None:
        """Caches a compiled grammar, evicting the least recently used past either bound;
        the caller holds the lock. Its bytes: xgrammar's estimate plus the spec's text (the key)."""
        size = compiled.memory_size_bytes + len(spec.text)
        if size <= self.limits.cache_bytes:
            self._cache[spec] = (compiled, size)
            self.cached_bytes += size
        else:
            log.info("grammar_not_cached", kind=spec.kind, bytes=size, cache_bytes=self.limits.cache_bytes)
        while len(self._cache) > MAX_CACHED_GRAMMARS or self.cached_bytes > self.limits.cache_bytes:
            _, (_, evicted) = self._cache.popitem(last=False)
            self.cached_bytes -= evicted
        metrics.GRAMMAR_CACHE_BYTES.set(self.cached_bytes)

    def _timed_out(self, spec: StructuredSpec, before: bool = False) -> InvalidStructure:
        """The error of a compile past its deadline; `before`: one found so at an earlier
        request, the caller holding the lock."""
        if not before:
            with self._lock:
                if spec in self._compiling:  # still running: remembered until it ends
                    self._too_slow[spec] = None
                    while len(self._too_slow) > MAX_CACHED_GRAMMARS:
                        self._too_slow.popitem(last=False)
        metrics.GRAMMAR_COMPILES.labels(spec.kind, "timeout").inc()
        when = "when it was last sent, and it is still compiling" if before else ""
        return InvalidStructure(f"structured.{spec.kind} did not compile within {self.limits.timeout_s:g} s "
                                f"(--grammar-compile-timeout-s){' ' + when if when else ''}: send a smaller or "
                                "less deeply nested schema, regex or grammar")

    def _xgrammar_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # Reading the vocabulary takes about a second: done once, at the first spec.
                info = tokenizer_info(self._tokenizer, self._vocab_size, self._stop_token_ids)
                # xgrammar's own cache has no bound by default and would keep every grammar
                # this one evicts: the cache above is the only one.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._compiler

    def _compile(self, compiler, spec: StructuredSpec):
        started = time.perf_counter()
        try:
            compiled = self._compile_with(compiler, spec)
        except InvalidStructure:
            metrics.GRAMMAR_COMPILES.labels(spec.kind, "invalid").inc()
            raise
        finally:
            seconds = time.perf_counter() - started
            metrics.GRAMMAR_COMPILE_SECONDS.labels(spec.kind).observe(seconds)
        metrics.GRAMMAR_COMPILES.labels(spec.kind, "ok").inc()
        log.info("grammar_compiled", kind=spec.kind, chars=len(spec.text), seconds=round(seconds, 4))
        return compiled

    @staticmethod
    def _compile_with(compiler, spec: StructuredSpec):
        whitespace = MAX_JSON_WHITESPACE if spec.any_whitespace else None
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace,
                                                    strict_mode=spec.strict, max_whitespace_cnt=whitespace)
            if spec.kind == "json_object":
                # Any object: strict mode would allow only {} (the schema names no property).
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace,
                                                    strict_mode=False, max_whitespace_cnt=whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.text)))
            return compiler.compile_grammar(spec.text)
        except Exception as error:  # xgrammar raises RuntimeError, ValueError and its own types
            raise InvalidStructure(f"structured.{spec.kind} does not compile: {compiler_message(error)}") from None


def json_depth(text: str) -> int:
    """How deep a JSON text nests objects and arrays, in linear time and without a Python
    step a character (json.loads would recurse, and raise RecursionError on a deep enough
    one). Every schema sent is scanned, refusals included. In valid JSON a backslash is
    only ever inside a string: with the escaped backslashes and quotes gone, every other
    quote opens a string (an unterminated one runs to the end), so the text outside them
    is every other piece between quotes; of that, the brackets' running sum peaks at the depth."""
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2])
    brackets = outside.encode("utf-8", "surrogatepass").translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = numpy.frombuffer(brackets, dtype=numpy.uint8)
    steps = numpy.where((codes == ord("{")) | (codes == ord("[")), 1, -1)
    return max(int(numpy.cumsum(steps).max()), 0)


def compiler_message(error: BaseException) -> str:
    message = _XGRAMMAR_PREFIX.sub("", str(error).strip())
    return message if len(message) <= _MAX_MESSAGE_CHARS else message[:_MAX_MESSAGE_CHARS] + "..."


def new_matcher(compiled, stop_token_ids: Collection[int]):
    """A completion's position in its grammar, at the start. `stop_token_ids` (EOS and the
    request's stop ids) are what may end the output, and only where the grammar is complete."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))


class TokenMask:
    """One step's masks: the bitmask rows of the constrained rows of the logits, in row order."""

    __slots__ = ("bitmask", "rows")

    def __init__(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        self.bitmask = bitmask  # [C, ceil(V / 32)] int32, on the logits' device
        self.rows = rows  # the logits rows they belong to

    def apply(self, constrained: torch.Tensor) -> torch.Tensor:
        """constrained: the constrained rows' float32 logits [C, V], a tensor of the caller's;
        every token a row's grammar forbids becomes -inf, in place. Returns it."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(constrained, self.bitmask)
        return constrained


class TokenMasks:
    """Fills the bitmask of each step's constrained rows; the buffer is reused across steps."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._words = (vocab_size + 31) // 32
        self._host = torch.empty(0, self._words, dtype=torch.int32)  # filled on the CPU, where xgrammar writes

    def prepare(self, matchers: Sequence[object | None]) -> TokenMask | None:
        """The masks of this step's rows (None: unconstrained row), or None when no row is constrained."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        if self._host.shape[0] < len(matchers):
            self._host = torch.empty(max(len(matchers), 2 * self._host.shape[0]), self._words, dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        for index, row in enumerate(rows):
            matchers[row].fill_next_token_bitmask(self._host, index)
        bitmask = self._host[:len(rows)]
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)
        return TokenMask(bitmask, rows)


def accept(matchers: Sequence[object | None], tokens: Sequence[int]) -> None:
    """Advances each constrained row's matcher by the token sampled for it."""
    for matcher, token in zip(matchers, tokens):
        if matcher is not None and not matcher.accept_token(token):
            # The mask allowed only what the matcher accepts: this is a bug, not a client's error.
            log.error("grammar_rejected_sampled_token", token_id=token)
