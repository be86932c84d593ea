"""The engine thread's record of its requests, from arrival to their last delta.

It holds each live request by key, each unfinished completion by its sequence, the
requests' deadlines, and the deltas of the current step waiting to go out: flush()
hands them over in one delivery a step, not one a token. It knows no scheduler and no
sampler: the completions that ended are kept until the engine takes them (`take_ended`)
to tell the scheduler and free their sampler state; ending a request calls
`on_request_end` (the engine frees its id). Engine thread only.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import structlog

from model_service import metrics
from model_service.engine.deltas import Delta, Sink, join_into
from model_service.sample.logprobs import TokenLogprob
from model_service.engine.output import Completion, RequestOutput
from model_service.sample.params import SamplingOptions
from model_service.sched.step import Finished
from model_service.sched.sequence import Finish, Sequence

# Hands a step's deltas to their sinks. The engine's default calls each sink on the engine
# thread; a server passes one that hops to its event loop once per step, not once per token.
Deliver = Callable[[list[tuple[Sink, Delta]]], None]
ErrorStatus = tuple[grpc.StatusCode, str]

log = structlog.get_logger()


def holds_back(options: SamplingOptions, unsent: Delta, generated: int) -> bool:
    """Whether a completion's unsent tokens wait for more: all of them when the request
    does not stream; otherwise fewer than its stream_interval, except its first token,
    which goes at once (time to first token is what a streaming client watches)."""
    if not options.stream:
        return True
    return len(unsent.token_ids) < options.stream_interval and generated > 1


class LiveRequests:
    def __init__(self, deliver: Deliver, on_request_end: Callable[[RequestOutput], None]) -> None:
        self._deliver = deliver
        self._on_request_end = on_request_end
        self._ended: list[tuple[Completion, Finish]] = []
        self.completions: dict[Sequence, Completion] = {}  # the unfinished ones
        self._by_key: dict[int, RequestOutput] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, key)
        self._outbox: list[tuple[Sink, Delta]] = []

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(list(self._by_key.values()))  # a copy: ending requests while iterating is the point

    def get(self, key: int) -> RequestOutput | None:
        return self._by_key.get(key)

    def add(self, request: RequestOutput) -> None:
        self._by_key[request.key] = request
        for completion in request.completions:
            self.completions[completion.seq] = completion
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.key))

    def emit(self, completions: list[Completion], tokens: list[int], logprobs: list[TokenLogprob | None],
             finished: dict[Sequence, Finished]) -> None:
        """Queues the delta of each completion's sampled token (the scheduler has appended
        it, and `finished` says which it ended); a completion that ended, by the scheduler's
        verdict or a stop string, ends here."""
        now = time.perf_counter()
        # A speculating completion has several tokens in a row (spec/verify.py).
        to_come = Counter(map(id, completions)) if len(set(map(id, completions))) < len(completions) else None
        for completion, token, logprob in zip(completions, tokens, logprobs):
            if to_come is not None:
                to_come[id(completion)] -= 1
                completion.still_to_emit = to_come[id(completion)]
            if completion.finished:
                continue
            request = completion.request
            # The scheduler's verdict belongs to the completion's last token of the step.
            delta = completion.on_token(token, logprob,
                                        finished.get(completion.seq) if not completion.still_to_emit else None)
            if completion.last_token_at:
                metrics.INTER_TOKEN_SECONDS.observe(now - completion.last_token_at)
            elif completion.index == 0:
                metrics.TIME_TO_FIRST_TOKEN_SECONDS.observe(now - request.submitted_at)
            completion.last_token_at = now
            metrics.GENERATED_TOKENS.inc()
            if completion.held is not None:
                delta, completion.held = join_into(completion.held, delta), None
            if delta.finish is not None:
                self.end_completion(completion, delta.finish, delta)
            elif holds_back(request.options, delta, completion.seq.num_output):
                completion.held = delta
            else:
                self._outbox.append((request.sink, request.first(delta)))

    def end_completion(self, completion: Completion, finish: Finish, delta: Delta | None = None,
                       error: ErrorStatus | None = None) -> None:
        """Finishes one completion and queues its last delta; the request ends with its
        last completion."""
        if completion.finished:
            return
        if completion.held is not None:  # held back (stream_interval, or no streaming): out with the end
            delta = completion.held if delta is None else join_into(completion.held, delta)
            completion.held = None
        seq = completion.seq
        self._ended.append((completion, finish))
        self.completions.pop(seq, None)
        request = completion.request
        if seq.index == 0:
            request.cached_tokens = seq.cached_tokens
            request.cached_tokens_tiers = seq.cached_tokens_tiers
        self._outbox.append((request.sink, request.finished(completion, finish, delta, error)))
        metrics.REQUESTS.labels(finish.value).inc()
        if request.unfinished == 0:
            self._by_key.pop(request.key, None)
            self._drop_ended_deadlines()
            self._on_request_end(request)

    def take_ended(self) -> list[tuple[Completion, Finish]]:
        """The completions ended since the last call, for the engine to tell the scheduler."""
        ended, self._ended = self._ended, []
        return ended

    def end_request(self, request: RequestOutput, finish: Finish, error: ErrorStatus | None = None) -> None:
        for completion in request.completions:
            self.end_completion(completion, finish, error=error)

    def expire_deadlines(self) -> None:
        """Ends, with DEADLINE_EXCEEDED, every request whose deadline has passed."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            request = self._by_key.get(key)
            if request is not None:
                log.info("deadline_exceeded", request_id=request.request_id)
                self.end_request(request, Finish.ABORTED, error=(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    "the request's deadline passed before it finished; its blocks are freed"))

    def _drop_ended_deadlines(self) -> None:
        """A request that ends before its deadline leaves its heap entry behind, to be
        popped when the deadline passes: with clients' timeouts of hours, hours of
        entries. Rebuilt without them whenever they outnumber the live requests, so the
        heap holds at most about twice the live requests at any time (amortized O(1) an
        ending)."""
        if len(self._deadlines) > 2 * len(self._by_key) + 16:
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._by_key]
            heapq.heapify(self._deadlines)

    def record_counts(self) -> dict[str, int]:
        """How many entries each of its per-request records holds: all bounded by the
        live requests (tests/test_request_memory.py checks that none grows with the
        requests served)."""
        return {"live_requests": len(self._by_key), "unfinished_completions": len(self.completions),
                "deadlines": len(self._deadlines), "ended_untold": len(self._ended), "outbox": len(self._outbox)}

    def fail_all(self, code: grpc.StatusCode, message: str) -> None:
        """Ends every request with an error status and forgets them, without touching
        their blocks (their session is gone or going)."""
        for request in list(self._by_key.values()):
            self._by_key.pop(request.key, None)
            self._on_request_end(request)
            for completion in request.completions:  # what was held back, before the error
                if completion.held is not None:
                    self.send(request.sink, request.first(completion.held))
                    completion.held = None
            self.send(request.sink, Delta(finish=Finish.ABORTED, error=(code, message)))
        self.completions.clear()
        self._deadlines.clear()
        self._ended.clear()

    def send(self, sink: Sink, delta: Delta) -> None:
        """Queues a delta for the next flush."""
        self._outbox.append((sink, delta))

    def flush(self) -> None:
        if self._outbox:
            deliveries, self._outbox = self._outbox, []
            self._deliver(deliveries)

