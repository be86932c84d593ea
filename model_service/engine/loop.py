"""The engine: one thread that runs the continuous-batching loop.

Each step: collect the answer to the lease call made last step and apply it, schedule,
send the next lease call, and run the batch while that call is on the wire (step_cycle.py;
the batch itself is step_execution.py: the forward pass, sampling, the scheduler told what
came out, and each token's delta queued); then stream what the tokens made. Callers talk
to it only through submit(), cancel() and abort(), which post typed messages (inbox.py;
admission.py keeps the ids and the queue limit they share with it); it talks back through
each request's sink. Its record of live requests, their deadlines and the deltas going
out is live_requests.py; what a stream receives is built in output.py (detokenizing, stop
strings, logprobs, the n completions of a request); the session with the cache service,
from Attach to Detach, is cache/session.py. A request whose deadline passes, queued or
running, ends with DEADLINE_EXCEEDED and frees its blocks. If the cache service goes away,
every stream ends with UNAVAILABLE, health goes NOT_SERVING, and the engine re-attaches by
itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import grpc
import structlog
import torch

from model_service import metrics
from model_service.cache.attachment import AttachSettings, FatalAttachError
from model_service.cache.client import CacheClient
from model_service.cache.session import CacheFailed, CacheSession, LeaseExpired, describe_error
from model_service.engine.admission import Admission
from model_service.engine.attach_builds import build_runner, build_scheduler
from model_service.engine.deltas import Delta, Sink
from model_service.engine.inbox import Abort, Cancel, ComputeBudgets, Inbox, Message, SessionFailed, Submit, Wake
from model_service.engine.live_requests import Deliver, LiveRequests
from model_service.engine.output import RequestOutput, new_request
from model_service.engine.settings import EngineSettings
from model_service.engine.step_cycle import StepCycle
from model_service.engine.step_sampler import StepSampler
from model_service.engine.tenant_gauges import TenantBlockGauges
from model_service.loading.loader import LoadedModel
from model_service.sample.params import SamplingOptions
from model_service.sched.lease_ops import LeaseLost
from model_service.sched.scheduler import Scheduler
from model_service.sched.sequence import Finish
from model_service.sched.tenant_budgets import compute_budgets
from model_service.worker.decode_graphs import DecodeGraphPool
from model_service.worker.runner import ModelRunner
from model_service.worker.torch_threads import use_device
from pagedkv.kv_geometry import KvGeometry
from pagedkv.thread_names import name_this_thread

log = structlog.get_logger()

__all__ = ["Delta", "Engine", "EngineUnavailable", "Sink"]


def deliver_here(deliveries: list[tuple[Sink, Delta]]) -> None:
    """The default Deliver: each sink called on the engine thread."""
    for sink, delta in deliveries:
        sink(delta)


class EngineUnavailable(Exception):
    """Not attached to the cache service (starting, or it went away); try again later."""


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
        self.dtype = dtype  # compute (weights, activations); the pool's is geometry.dtype
        self.geometry = KvGeometry(
            num_layers=loaded.config.num_layers, num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim, dtype=settings.kv_cache_dtype or dtype, device=str(device),
        )
        self.eos_token_ids = frozenset(loaded.config.eos_token_ids) | frozenset(loaded.tokenizer.eos_token_ids)
        self._sampler = StepSampler(loaded.config.vocab_size, self.eos_token_ids, device)
        self._on_serving = on_serving
        self._on_fatal = on_fatal
        self._inbox = Inbox()
        self._admission = Admission(settings.max_queued_requests)
        self._requests = LiveRequests(deliver, on_request_end=self._release)
        self._stopping = threading.Event()
        self._accepting = True  # False from the moment stop() begins
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        # The count the caller set (--threads); a new thread would start from libgomp's
        # default (every core) until its first torch op, and the C kernels ask it first.
        self._torch_threads = torch.get_num_threads()
        # Decode graphs are captured once now, before the first Attach, so that their
        # memory is reserved when the cache service sizes the pool, and reported with
        # the workspace; every Attach recaptures them into the same memory pool.
        self.decode_graph_pool: DecodeGraphPool | None = None
        self.workspace_bytes = settings.workspace_bytes
        if settings.cuda_graphs:
            self.decode_graph_pool = DecodeGraphPool(loaded.model, settings.max_num_seqs, settings.max_model_len,
                                                     workspace_bytes=settings.workspace_bytes)
            self.workspace_bytes += self.decode_graph_pool.memory_bytes
            metrics.DECODE_GRAPH_MEMORY_BYTES.set(self.decode_graph_pool.memory_bytes)
            log.info("decode_graphs_reserved", buckets=self.decode_graph_pool.graphs.buckets,
                     memory_bytes=self.decode_graph_pool.memory_bytes, workspace_bytes=self.workspace_bytes)
        self._session = CacheSession(cache, AttachSettings(
            client_name=settings.client_name, geometry=self.geometry, workspace_bytes=self.workspace_bytes,
            max_model_len=settings.max_model_len, model_fingerprint=settings.model_fingerprint,
            served_model_name=settings.served_model_name,
            weights_bytes_by_type=tuple(loaded.weights_bytes_by_type.items()),
            lora_slot_bytes=settings.lora_slot_bytes, lora_resident_bytes=settings.lora_resident_bytes,
        ), device)
        # Set while attached:
        self.sizing = None
        self.scheduler: Scheduler | None = None
        self.runner: ModelRunner | None = None
        self._cycle: StepCycle | None = None  # runs the steps on them (step_cycle.py)
        self.connected = threading.Event()
        self._tenant_gauges = TenantBlockGauges()  # outlives attachments: the peaks are across them

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
        self._inbox.put(Wake())
        self._thread.join(timeout=max(grace_s, 5.0))

    @property
    def pending(self) -> int:
        return self._admission.pending

    @property
    def session_id(self) -> str | None:
        return self._session.session_id

    @property
    def max_total_tokens(self) -> int:
        return self.sizing.max_total_tokens if self.sizing is not None else 0

    @property
    def block_size(self) -> int:
        return self.sizing.block_size if self.sizing is not None else 0

    @property
    def bytes_per_block(self) -> int:
        """What one block of the pool holds, in bytes (0 while not attached)."""
        block_size = self.block_size
        return self.geometry.bytes_per_block(block_size) if block_size else 0

    # -- the callers' side ------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, sink: Sink, *,
               deadline: float | None = None, priority: int = 0, cache_salt: str = "", tenant: str = "",
               lora: object | None = None) -> int:
        """Queues a validated request; returns the key that cancel() takes. `deadline` is a
        time.monotonic() by which it must end (DEADLINE_EXCEEDED otherwise); `tenant` names
        whose it is (--api-keys; "": no tenant); `lora` the LoRA adapter it runs with (None:
        the base; its namespace must be in cache_salt)."""
        if not self._accepting or self._stopping.is_set():
            raise EngineUnavailable("the model service is shutting down; retry elsewhere")
        if not self.connected.is_set():
            raise EngineUnavailable("the model service is not attached to the cache service; retry shortly")
        key = self._admission.admit(request_id, tenant)
        request = new_request(key, request_id, prompt_token_ids, options, sink, self.loaded.tokenizer,
                              self.device, deadline, priority, arrival=key, cache_salt=cache_salt,
                              bytes_per_block=self.bytes_per_block, tenant=tenant, lora=lora)
        self._inbox.put(Submit(request))
        return key

    def cancel(self, key: int) -> None:
        """The client went away: free the request's blocks with the next lease call."""
        self._inbox.put(Cancel(key))

    def abort(self, request_ids: list[str], tenant: str = "") -> int:
        """Ends each named live request of `tenant` with FINISH_REASON_ABORT; returns how
        many were live. Another tenant's requests of the same ids are not touched."""
        keys = self._admission.keys_of(request_ids, tenant)
        if keys:
            self._inbox.put(Abort(tuple(keys)))
        return len(keys)

    def set_compute_budgets(self, budgets: tuple[tuple[str, int, int], ...]) -> None:
        """Tenants' compute budgets (tenant, max_tokens_per_s, burst_tokens) from a reloaded
        keys file: the scheduler takes them between steps, and every later attach starts with them."""
        self._inbox.put(ComputeBudgets(tuple(budgets)))

    def record_counts(self) -> dict[str, int]:
        """Entries in each of the engine's per-request records. None outlives its request
        for long: each is bounded by the live requests (docs/operations.md, "Memory"), and what
        tests/test_request_memory.py checks does not grow with requests served. Read
        from any thread between requests; a snapshot, not a consistent one, while they run."""
        return {**self._requests.record_counts(), "admitted_ids": len(self._admission),
                "admitted_pending": self._admission.pending}

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        name_this_thread("engine")  # so that its CPU can be told from the other threads' (harness/cpu_use.py)
        # This thread's OpenMP pool is the process's only one, and it launches on the
        # model's CUDA device, not cuda:0 (torch_threads.py).
        torch.set_num_threads(self._torch_threads)
        use_device(self.device)
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
        """Attaches (or re-attaches) to the cache service, retrying until it answers, and
        builds what runs on the pool it lends: the runner and the scheduler."""

        def unreachable() -> None:
            # A request can slip in as the connection drops (it passed submit's check
            # just before): end it now rather than keep it until a re-attach.
            self._fail_queued(grpc.StatusCode.UNAVAILABLE,
                              f"the cache service at {self.cache.address} is unreachable; retry")
            self._flush()

        attachment = self._session.open(
            stopping=self._stopping, on_unreachable=unreachable,
            on_heartbeat_failure=lambda session_id, error: self._inbox.put(SessionFailed(session_id, error)))
        if attachment is None:
            return
        self.sizing = attachment.sizing
        self.runner = build_runner(self.loaded.model, attachment, self.device, self.decode_graph_pool)
        self.scheduler = build_scheduler(self.settings, attachment, self.eos_token_ids)
        self._cycle = StepCycle(self._session, self.scheduler, self.runner, self._sampler, self._requests,
                                self._tenant_gauges)
        self.connected.set()
        metrics.CACHE_CONNECTED.set(1)
        self._on_serving(True)
        log.info("attached", cache=self.cache.address, session=attachment.session_id[:8],
                 num_blocks=attachment.sizing.num_blocks, block_size=attachment.sizing.block_size,
                 max_total_tokens=attachment.sizing.max_total_tokens,
                 lora_slot_bytes=attachment.sizing.lora_slot_bytes,
                 lora_resident_bytes=attachment.sizing.lora_resident_bytes)

    def _step(self) -> None:
        self._cycle.step(self._drain_inbox)

    def _drain_inbox(self, block: bool, timeout_s: float = 0.5) -> None:
        for message in self._inbox.drain(block, timeout_s):
            self._handle(message)
        self._cycle.retire_ended()

    def _handle(self, message: Message) -> None:
        match message:
            case Submit(request):
                self._requests.add(request)
                self.scheduler.add(request.completions[0].seq)
                metrics.PROMPT_TOKENS.inc(request.prompt_len)
            case Cancel(key):
                request = self._requests.get(key)
                if request is not None:
                    self._requests.end_request(request, Finish.ABORTED)
                    log.info("request_cancelled", request_id=request.request_id)
            case Abort(keys):
                for key in keys:
                    request = self._requests.get(key)
                    if request is not None:
                        self._requests.end_request(request, Finish.ABORTED)
                        log.info("request_aborted", request_id=request.request_id)
            case SessionFailed(session_id, error):
                # Both the heartbeat and the lease call see a dying cache service; when the
                # lease call got there first the engine has re-attached since, and a failure
                # of the old session says nothing about the new one.
                if session_id == self._session.session_id:
                    raise CacheFailed(error)
            case ComputeBudgets(budgets):
                self.settings = replace(self.settings, tenant_compute_budgets=budgets)
                if self.scheduler is not None:
                    self.scheduler.budgets.update(compute_budgets(budgets))
                log.info("compute_budgets_reloaded", budgets=[list(budget) for budget in budgets])
            case Wake():
                pass

    # -- output and failures ----------------------------------------------------------

    def _flush(self) -> None:
        self._requests.flush()

    def _fail_all(self, code: grpc.StatusCode, message: str) -> None:
        self._requests.fail_all(code, message)
        self._sampler.reset()

    def _release(self, request: RequestOutput) -> None:
        """The request ended: its id is free again (any thread)."""
        self._admission.release(request.request_id, request.key, request.tenant)

    def _fail_queued(self, code: grpc.StatusCode, message: str) -> None:
        """Fails requests still in the inbox. Without this a request submitted just before
        the cache service went away would wait, stream open, for a re-attach that may
        never come (or until SIGTERM), instead of ending with a status."""
        for message_ in self._inbox.drain(block=False):
            if isinstance(message_, Submit):
                request = message_.request
                self._release(request)
                self._requests.send(request.sink, Delta(finish=Finish.ABORTED, error=(code, message)))
            elif isinstance(message_, ComputeBudgets):  # the next attach's scheduler starts with them
                self._handle(message_)
            # Cancels have nothing left to cancel; stale session failures nothing left to fail.

    def _lose_cache(self, error: BaseException) -> None:
        log.error("cache_service_lost", error=describe_error(error), requests_failed=len(self._requests))
        self.connected.clear()
        metrics.CACHE_CONNECTED.set(0)
        self._on_serving(False)
        self._fail_all(grpc.StatusCode.UNAVAILABLE,
                       f"the cache service at {self.cache.address} went away mid-request ({describe_error(error)}); retry")
        self._fail_queued(grpc.StatusCode.UNAVAILABLE,
                          f"the cache service at {self.cache.address} went away; retry")
        self._cycle.lost(error)
        self.scheduler = self.runner = self._cycle = None
        if self.decode_graph_pool is not None:
            self.decode_graph_pool.drop()  # its graphs would replay into the lost pool
        self.sizing = None

    def _shutdown(self) -> None:
        """SIGTERM: end what is left, give every block back, detach."""
        self._fail_queued(grpc.StatusCode.UNAVAILABLE, "the model service is shutting down; retry elsewhere")
        if not self.connected.is_set():
            self._fail_all(grpc.StatusCode.UNAVAILABLE, "the model service is shutting down")
            return
        try:
            self._cycle.close((grpc.StatusCode.UNAVAILABLE, "the model service is shutting down; retry elsewhere"))
        except (grpc.RpcError, LeaseLost) as error:
            log.warning("detach_failed", error=describe_error(error))
            self._session.attachment.heartbeat.stop()
        finally:
            self.connected.clear()
