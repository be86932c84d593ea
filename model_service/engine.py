"""The engine: one thread that runs the continuous-batching loop.

Each iteration: collect the answer to the lease call made last step, schedule, send
the next lease call, run the forward pass while that call is on the wire, sample, and
stream tokens out. gRPC handlers talk to it only through submit() and cancel(); it
talks back through each request's sink. If the cache service goes away, every stream
ends with UNAVAILABLE, health goes NOT_SERVING, and the engine re-attaches by itself.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from model_service import metrics
from model_service.cache_client import CacheClient, Heartbeat, LeaseDeadline
from model_service.decode_graphs import DecodeGraphs, cuda_graph_capture
from model_service.detokenizer import IncrementalDetokenizer
from model_service.models.loader import LoadedModel
from model_service.runner import ModelRunner
from model_service.sampling import SamplingOptions, make_generator, sample
from model_service.scheduler import LeaseLost, LeaseOps, Scheduler, SchedulerLimits
from model_service.sequence import Finish, Sequence
from pagedkv import pool_memory
from pagedkv.kv_geometry import KvGeometry

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class EngineSettings:
    max_model_len: int
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    max_queued_requests: int = 256
    client_name: str = "model_service"
    workspace_bytes: int = 0
    # Replay decode steps from CUDA graphs captured per batch-size bucket (CUDA only).
    cuda_graphs: bool = False
    # The checkpoint's content hash (models/fingerprint.py): its prefix cache is its own.
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_batch_tokens", "max_queued_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


@dataclass(slots=True)
class Delta:
    """What a request's stream receives: new tokens and text, and at the end the reason."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # (grpc.StatusCode, message) when the request ends with an error status.
    error: tuple[grpc.StatusCode, str] | None = None


Sink = Callable[[Delta], None]
# Hands a step's deltas to their sinks. The default calls each sink from the engine
# thread; a server passes one that hops to its event loop once per step, not once per token.
Deliver = Callable[[list[tuple[Sink, Delta]]], None]


def deliver_here(deliveries: list[tuple[Sink, Delta]]) -> None:
    for sink, delta in deliveries:
        sink(delta)


class EngineUnavailable(Exception):
    """Not attached to the cache service (starting, or it went away); try again later."""


class QueueFull(Exception):
    """More requests queued than --max-queued-requests."""


@dataclass(slots=True)
class _Live:
    seq: Sequence
    sink: Sink
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    submitted_at: float
    last_token_at: float = 0.0


class Engine:
    def __init__(self, loaded: LoadedModel, settings: EngineSettings, cache: CacheClient,
                 device: torch.device, dtype: torch.dtype,
                 on_serving: Callable[[bool], None] = lambda serving: None,
                 on_fatal: Callable[[BaseException], None] = lambda error: None,
                 deliver: Deliver = deliver_here) -> None:
        self.loaded = loaded
        self.settings = settings
        self.cache = cache
        self.device = device
        self.geometry = KvGeometry(
            num_layers=loaded.config.num_layers, num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim, dtype=dtype, device=str(device),
        )
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
        self._on_serving = on_serving
        self._on_fatal = on_fatal
        self._deliver = deliver
        self._outbox: list[tuple[Sink, Delta]] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._arrivals = itertools.count()
        self._live: dict[int, _Live] = {}
        self._pending = 0  # submitted and not yet finished; read by submit() for the queue limit
        self._pending_lock = threading.Lock()
        self._stopping = threading.Event()
        self._accepting = True  # False from the moment stop() begins
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # Set while attached:
        self.session_id: str | None = None
        self.sizing = None
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self._heartbeat: Heartbeat | None = None
        self._inflight: Future | None = None
        self._inflight_ops: LeaseOps | None = None
        self._inflight_sent_at = 0.0
        self._lease_deadline: LeaseDeadline | None = None
        self.connected = threading.Event()

    # -- life cycle -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float) -> None:
        """Lets running requests finish for up to grace_s, ends the rest with UNAVAILABLE,
        releases every lease and detaches. Blocking: call from a worker thread."""
        self._accepting = False  # the grace is for requests already in, not for new ones
        deadline = time.monotonic() + grace_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=max(grace_s, 5.0))

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def max_total_tokens(self) -> int:
        return self.sizing.max_total_tokens if self.sizing is not None else 0

    @property
    def block_size(self) -> int:
        return self.sizing.block_size if self.sizing is not None else 0

    # -- the gRPC side ----------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, sink: Sink,
               cache_salt: str = "") -> int:
        """Queues a validated request; returns the key that cancel() takes."""
        if not self._accepting or self._stopping.is_set():
            raise EngineUnavailable("the model service is shutting down; retry elsewhere")
        if not self.connected.is_set():
            raise EngineUnavailable("the model service is not attached to the cache service; retry shortly")
        with self._pending_lock:
            if self._pending >= self.settings.max_queued_requests:
                raise QueueFull(
                    f"{self._pending} requests are queued or running, the limit is "
                    f"--max-queued-requests {self.settings.max_queued_requests}; retry later"
                )
            self._pending += 1
        key = next(self._arrivals)
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       prompt_len=len(prompt_token_ids), options=options, arrival=key, cache_salt=cache_salt)
        live = _Live(
            seq=seq, sink=sink,
            detokenizer=IncrementalDetokenizer(self.loaded.tokenizer, prompt_token_ids, options.stop),
            generator=None if options.greedy else make_generator(options.seed, self.device),
            submitted_at=time.perf_counter(),
        )
        self._inbox.put(("submit", live))
        return key

    def cancel(self, key: int) -> None:
        """The client went away: free the request's blocks with the next lease call."""
        self._inbox.put(("cancel", key))

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self.connected.is_set():
                    self._connect()
                    continue
                try:
                    self._step()
                except (grpc.RpcError, LeaseLost, CacheFailed, LeaseExpired) as error:
                    self._lose_cache(error)
                finally:
                    self._flush()
            self._shutdown()
            self._flush()
        except FatalAttachError as error:
            log.error("attach_refused", error=str(error))
            self._on_fatal(error)
        except Exception as error:
            log.exception("engine_crashed")
            self._fail_all(grpc.StatusCode.INTERNAL, "the engine stopped on an internal error; see the service log")
            self._flush()
            self.connected.clear()
            self._on_serving(False)
            self._on_fatal(error)

    def _connect(self) -> None:
        """Attaches (or re-attaches) to the cache service, retrying until it answers."""
        delay = 0.2
        while not self._stopping.is_set():
            sent_at = time.monotonic()
            try:
                reply = self.cache.attach(self.settings.client_name, self.geometry,
                                          self.settings.workspace_bytes, self.settings.max_model_len,
                                          model_fingerprint=self.settings.model_fingerprint)
                break
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise FatalAttachError(f"the cache service refused Attach: {error.code().name}: {error.details()}")
                log.warning("cache_unreachable", address=self.cache.address, retry_in_s=delay)
                # A request can slip in as the connection drops (it passed submit's check
                # just before): end it now rather than keep it until a re-attach.
                self._fail_queued(grpc.StatusCode.UNAVAILABLE,
                                  f"the cache service at {self.cache.address} is unreachable; retry")
                self._flush()
                self._stopping.wait(delay)
                # At most 1 s between tries: a restarted cache service is re-attached to
                # within about a second (the channel's reconnect backoff is capped alike).
                delay = min(delay * 2, 1.0)
        else:
            return
        kv_pool = pool_memory.map_pool(reply.pool)
        if kv_pool.device.type != self.device.type:
            kv_pool = kv_pool.to(self.device)  # pragma: no cover - a misconfigured deployment
        self.session_id = reply.session_id
        self.sizing = reply.sizing
        graphs = None
        if self.settings.cuda_graphs:
            graphs = DecodeGraphs(self.loaded.model, kv_pool, reply.sizing.block_size, self.settings.max_num_seqs,
                                  self.settings.max_model_len, capture=cuda_graph_capture())
            log.info("decode_graphs_captured", buckets=graphs.buckets, captures=graphs.captures)
        self.runner = ModelRunner(self.loaded.model, kv_pool, reply.sizing.block_size, graphs)
        self.scheduler = Scheduler(
            SchedulerLimits(block_size=reply.sizing.block_size, max_num_seqs=self.settings.max_num_seqs,
                            max_batch_tokens=self.settings.max_batch_tokens),
            blocks_available=reply.sizing.num_blocks,
        )
        self._lease_deadline = LeaseDeadline(reply.lease_ttl_ms / 1000, acked_at=sent_at)
        self._heartbeat = Heartbeat(
            self.cache, reply.session_id, reply.lease_ttl_ms / 3000,
            on_failure=lambda session_id, error: self._inbox.put(("cache_failed", session_id, error)),
            deadline=self._lease_deadline,
        ).start()
        self.connected.set()
        metrics.CACHE_CONNECTED.set(1)
        self._on_serving(True)
        log.info("attached", cache=self.cache.address, session=reply.session_id[:8],
                 num_blocks=reply.sizing.num_blocks, block_size=reply.sizing.block_size,
                 max_total_tokens=reply.sizing.max_total_tokens)

    def _step(self) -> None:
        scheduler = self.scheduler
        idle = not scheduler.has_work() and self._inflight is None
        self._drain_inbox(block=idle)
        started = time.perf_counter()
        if self._inflight is not None:
            outcomes, available = self._inflight.result()
            self._lease_deadline.acked(self._inflight_sent_at)
            metrics.LEASE_WAIT_SECONDS.inc(time.perf_counter() - started)
            ops, self._inflight, self._inflight_ops = self._inflight_ops, None, None
            for seq, reason in scheduler.apply(ops, outcomes, available):
                self._end(seq, Finish.ABORTED, error=(grpc.StatusCode.RESOURCE_EXHAUSTED, reason))
        if not scheduler.has_work():
            return
        step = scheduler.schedule()
        if step.preempted:
            metrics.PREEMPTIONS.inc(len(step.preempted))
            log.info("preempted", requests=[s.request_id for s in step.preempted])
        if step.lease_ops:
            self._inflight_sent_at = time.monotonic()
            self._inflight = self.cache.lease(self.session_id, step.lease_ops)
            self._inflight_ops = step.lease_ops
        if step.batch:
            self._check_lease_deadline()
            due, logits = self.runner.execute(step.batch)
            for seq, new_tokens in step.batch:
                seq.num_computed += new_tokens
            if due:
                lives = [self._live[seq.arrival] for seq in due]
                tokens = sample(logits, [seq.options for seq in due], [live.generator for live in lives])
                self._emit(lives, tokens.tolist())
        elif self._inflight is None:
            # Nothing runnable and nothing asked: wait for an event instead of spinning.
            self._drain_inbox(block=True, timeout_s=0.05)
        metrics.ENGINE_STEP_SECONDS.inc(time.perf_counter() - started)
        metrics.QUEUE_LENGTH.set(len(scheduler.waiting))
        metrics.RUNNING.set(len(scheduler.running))

    def _check_lease_deadline(self) -> None:
        """Fenced writes: no forward pass (which writes K/V into leased blocks) once the
        session may have expired at the cache service, whose blocks may then be someone else's."""
        if self._lease_deadline.expired():
            log.error("lease_deadline_passed", session=self.session_id[:8], ttl_s=self._lease_deadline.ttl_s)
            raise LeaseExpired(
                f"no heartbeat or lease call answered for {self._lease_deadline.ttl_s - self._lease_deadline.margin_s:.2f} s "
                f"(lease TTL {self._lease_deadline.ttl_s:g} s less a margin): the session may have expired, so "
                "this engine stopped writing into its blocks"
            )

    def _drain_inbox(self, block: bool, timeout_s: float = 0.5) -> None:
        try:
            message = self._inbox.get(timeout=timeout_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            live: _Live = message[1]
            self._live[live.seq.arrival] = live
            self.scheduler.add(live.seq)
            metrics.PROMPT_TOKENS.inc(live.seq.prompt_len)
        elif kind == "cancel":
            live = self._live.get(message[1])
            if live is not None:
                self._end(live.seq, Finish.ABORTED)
                log.info("request_cancelled", request_id=live.seq.request_id)
        elif kind == "cache_failed":
            # Both the heartbeat and the lease call see a dying cache service; when the
            # lease call got there first the engine has re-attached since, and a failure
            # of the old session says nothing about the new one.
            if message[1] == self.session_id:
                raise CacheFailed(message[2])

    def _emit(self, lives: list[_Live], tokens: list[int]) -> None:
        now = time.perf_counter()
        max_model_len = self.settings.max_model_len
        for live, token in zip(lives, tokens):
            seq = live.seq
            seq.token_ids.append(token)
            options = seq.options
            finish = None
            if token in self.eos_token_ids and not options.ignore_eos:
                finish = Finish.EOS
            elif token in options.stop_token_ids:
                finish = Finish.STOP
            delta = live.detokenizer.push([token])
            text = delta.text
            if delta.stopped:
                finish = Finish.STOP
            elif finish is None and (seq.num_output >= options.max_new_tokens or len(seq.token_ids) >= max_model_len):
                finish = Finish.LENGTH
            if finish is not None and not delta.stopped:
                text += live.detokenizer.flush()
            if live.last_token_at:
                metrics.INTER_TOKEN_SECONDS.observe(now - live.last_token_at)
            else:
                metrics.TIME_TO_FIRST_TOKEN_SECONDS.observe(now - live.submitted_at)
            live.last_token_at = now
            metrics.GENERATED_TOKENS.inc()
            if finish is None:
                self._outbox.append((live.sink, Delta(token_ids=[token], text=text)))
            else:
                self._end(seq, finish, last=Delta(token_ids=[token], text=text))

    def _end(self, seq: Sequence, finish: Finish, *, last: Delta | None = None,
             error: tuple[grpc.StatusCode, str] | None = None) -> None:
        """Finishes a request: its blocks go back with the next lease call, its stream ends."""
        live = self._live.pop(seq.arrival, None)
        self.scheduler.finish(seq, finish)
        if live is None:
            return
        with self._pending_lock:
            self._pending -= 1
        delta = last or Delta()
        delta.finish = finish
        delta.error = error
        delta.prompt_tokens = seq.prompt_len
        delta.completion_tokens = seq.num_output
        delta.cached_tokens = seq.cached_tokens
        metrics.REQUESTS.labels(finish.value).inc()
        self._outbox.append((live.sink, delta))

    def _flush(self) -> None:
        if self._outbox:
            deliveries, self._outbox = self._outbox, []
            self._deliver(deliveries)

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        for live in list(self._live.values()):
            self._live.pop(live.seq.arrival, None)
            with self._pending_lock:
                self._pending -= 1
            self._outbox.append((live.sink, Delta(finish=Finish.ABORTED, error=(code, message))))

    def _fail_queued(self, code: grpc.StatusCode, message: str) -> None:
        """Fails requests still in the inbox. Without this a request submitted just before
        the cache service went away would wait, stream open, for a re-attach that may
        never come (or until SIGTERM), instead of ending with a status."""
        while True:
            try:
                queued = self._inbox.get_nowait()
            except queue.Empty:
                return
            if queued[0] == "submit":
                with self._pending_lock:
                    self._pending -= 1
                self._outbox.append((queued[1].sink, Delta(finish=Finish.ABORTED, error=(code, message))))
            # Cancels have nothing left to cancel; stale cache failures nothing left to fail.

    def _lose_cache(self, error: BaseException) -> None:
        log.error("cache_service_lost", error=describe_error(error), requests_failed=len(self._live))
        self.connected.clear()
        metrics.CACHE_CONNECTED.set(0)
        self._on_serving(False)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._fail_all(grpc.StatusCode.UNAVAILABLE,
                       f"the cache service at {self.cache.address} went away mid-request ({describe_error(error)}); retry")
        self._fail_queued(grpc.StatusCode.UNAVAILABLE,
                          f"the cache service at {self.cache.address} went away; retry")
        self._inflight = self._inflight_ops = None
        self._detach_if_reachable(error)
        self.scheduler = self.runner = None
        self.session_id = self.sizing = None

    def _detach_if_reachable(self, error: BaseException) -> None:
        """After a failure that was not the cache service going away (a rejected op, an
        internal error), give the old session's leases back now rather than at its TTL."""
        cause = error.args[0] if isinstance(error, CacheFailed) and error.args else error
        if isinstance(cause, grpc.RpcError) and cause.code() in (grpc.StatusCode.UNAVAILABLE,
                                                                 grpc.StatusCode.DEADLINE_EXCEEDED):
            return
        try:
            reclaimed = self.cache.detach(self.session_id)
            log.info("detached_after_failure", session=self.session_id[:8], blocks_reclaimed=reclaimed)
        except grpc.RpcError as detach_error:  # NOT_FOUND: the service already dropped it
            log.info("detach_after_failure_failed", code=detach_error.code().name)

    def _shutdown(self) -> None:
        """SIGTERM: end what is left, give every block back, detach."""
        self._fail_queued(grpc.StatusCode.UNAVAILABLE, "the model service is shutting down; retry elsewhere")
        if not self.connected.is_set():
            self._fail_all(grpc.StatusCode.UNAVAILABLE, "the model service is shutting down")
            return
        try:
            if self._inflight is not None:
                outcomes, available = self._inflight.result()
                self.scheduler.apply(self._inflight_ops, outcomes, available)
                self._inflight = None
            for live in list(self._live.values()):
                self._end(live.seq, Finish.ABORTED,
                          error=(grpc.StatusCode.UNAVAILABLE, "the model service is shutting down; retry elsewhere"))
            step_ops = self.scheduler.schedule().lease_ops  # only releases remain
            if step_ops:
                self.cache.lease(self.session_id, step_ops).result()
            self.cache.detach(self.session_id)
            log.info("detached", session=self.session_id[:8])
        except (grpc.RpcError, LeaseLost) as error:
            log.warning("detach_failed", error=describe_error(error))
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
            self.connected.clear()


class CacheFailed(Exception):
    """The heartbeat thread saw the cache service fail."""


class LeaseExpired(Exception):
    """The local lease deadline passed: the session may be gone at the cache service."""


class FatalAttachError(RuntimeError):
    """Attach was refused for a reason retrying cannot fix (geometry, auth, too little memory)."""


def describe_error(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, CacheFailed) and error.args and isinstance(error.args[0], grpc.RpcError):
        return describe_error(error.args[0])
    return str(error)
