"""One engine step's round with the cache service: the answer to last step's lease call
collected and applied, the requests that ended told to the scheduler, the step scheduled,
the next lease call sent, and the batch run while that call is on the wire
(step_execution.py); then the step's metrics. A step that admits new sequences while
others run first sends its call and waits for the answer, then schedules again, so the new
prompts start in that step rather than the next.

One of these lives as long as an attachment to the cache service: Engine._connect makes
it for the runner and scheduler built on the pool that attachment lends, and it ends
with the session, lost (`lost`) or closed at shutdown (`close`). It is apart
from Engine (loop.py) because that is the engine thread and its callers: the life cycle,
the inbox, attaching again and failing requests when the cache service goes away. This
knows no threads and no callers, only how lease calls and steps take turns; the engine
hands it the inbox to drain where a step may wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import structlog

from model_service import metrics
from model_service.cache.session import CacheSession
from model_service.engine.live_requests import LiveRequests
from model_service.engine.step_execution import StepExecution, decode_only
from model_service.engine.step_sampler import StepSampler
from model_service.engine.tenant_gauges import TenantBlockGauges
from model_service.sched.lease_ops import LeaseOps
from model_service.sched.scheduler import Scheduler
from model_service.sched.sequence import Finish
from model_service.sched.step import Step
from model_service.worker.runner import ModelRunner

log = structlog.get_logger()


class StepCycle:
    def __init__(self, session: CacheSession, scheduler: Scheduler, runner: ModelRunner, sampler: StepSampler,
                 requests: LiveRequests, tenant_gauges: TenantBlockGauges) -> None:
        self.session = session
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.requests = requests
        self.tenant_gauges = tenant_gauges
        self.execution = StepExecution(runner, scheduler, sampler, requests)  # runs the batches (step_execution.py)

    def step(self, drain: Callable[..., None]) -> None:
        """One step. `drain(block, timeout_s=...)` (Engine._drain_inbox) takes the inbox's
        messages first, waiting for one when there is nothing to do, and again, waiting a
        little, when nothing could run."""
        scheduler = self.scheduler
        idle = not scheduler.has_work() and not self.session.in_flight
        drain(block=idle)
        started = time.perf_counter()
        self.apply_answer()
        self.requests.expire_deadlines()
        self.retire_ended()
        if not scheduler.has_work():
            self.tenant_gauges.set(scheduler.tenant_blocks.take_changed())
            metrics.lora_kv_blocks(scheduler.adapter_blocks.take_changed())
            return
        scheduled = time.perf_counter()
        step = self._schedule()
        if step.lease_ops.allocations and step.batch:
            # Admitted while others run: their blocks would come with this step's call, so
            # their prompts would start a whole step later (a step of every stream). A
            # loopback lease call costs far less than a step: wait for it, and run their
            # first chunks in this step (bench/engine/sched_sim.py --admit-now compares).
            self._send(step.lease_ops)
            self.apply_answer()
            self.retire_ended()
            scheduled = time.perf_counter()
            step = self._schedule()
        self._count_deferred(step)
        self._send(step.lease_ops)
        if step.batch:
            self.session.check_lease_deadline()
            try:
                tokens = self.execution.run(step)
            except Exception as error:  # noqa: BLE001 - one step's fault ends its requests, not the engine
                self.execution.fail(step, error)
            else:
                self._time_whole_step(step, tokens, time.perf_counter() - scheduled)
        elif not self.session.in_flight:
            # Nothing runnable and nothing asked: wait for an event instead of spinning.
            drain(block=True, timeout_s=0.05)
        metrics.ENGINE_STEP_SECONDS.inc(time.perf_counter() - started)
        metrics.QUEUE_LENGTH.set(len(scheduler.waiting))
        metrics.RUNNING.set(len(scheduler.running))
        self.tenant_gauges.set(scheduler.tenant_blocks.take_changed())
        metrics.lora_kv_blocks(scheduler.adapter_blocks.take_changed())

    def _time_whole_step(self, step: Step, tokens: int, seconds: float) -> None:
        """Tells the speculator what a decode-only step brought, timed from its scheduling
        (proposals looked up) to its tokens sampled and verified: what it weighs looking up
        proposals against (spec/pays.py)."""
        speculator = self.scheduler.speculator
        if speculator is not None and decode_only(step):
            speculator.step_done(len(step.batch), step.looked_up, tokens, seconds)

    def apply_answer(self) -> None:
        """Applies the answer to the lease call in flight, if any (waiting for it); ends
        the requests it can never serve."""
        collected = self.session.collect()
        if collected is None:
            return
        for seq, reason in self.scheduler.apply(*collected):
            completion = self.requests.completions.get(seq)
            if completion is not None:
                self.requests.end_request(completion.request, Finish.ABORTED,
                                          error=(grpc.StatusCode.RESOURCE_EXHAUSTED, reason))
        # Forks' copy-on-write, before this step's forward pass writes into a copy.
        self.runner.copy_blocks(self.scheduler.take_copies())

    def _schedule(self) -> Step:
        step = self.scheduler.schedule()
        if step.preempted:
            metrics.PREEMPTIONS.inc(len(step.preempted))
            for seq in step.preempted:
                metrics.TENANT_PREEMPTIONS.labels(metrics.tenant_label(seq.tenant)).inc()
            log.info("preempted", requests=[s.request_id for s in step.preempted])
        return step

    @staticmethod
    def _count_deferred(step: Step) -> None:
        """The tokens tenants' compute budgets held back from the step that runs."""
        for tenant, tokens in step.deferred.items():
            label = metrics.tenant_label(tenant)
            metrics.TENANT_BUDGET_DEFERRED_TOKENS.labels(label).inc(tokens)
            metrics.TENANT_BUDGET_DEFERRED_STEPS.labels(label).inc()

    def _send(self, ops: LeaseOps) -> None:
        if ops:
            self.fence_writes(ops)
            self.session.send(ops)

    def fence_writes(self, ops: LeaseOps) -> None:
        """Waits, before a lease call that releases or commits blocks, for every K/V write
        enqueued so far: both put full blocks in the prefix index, where another request
        (or another model service on the pool) may read them as soon as the call lands,
        and a step with nothing to sample never waits for the device. The scheduler counts
        a token computed once its step is enqueued; this is the one place that makes the
        blocks it commits or releases hold what it counted. Nothing on CPU (a forward pass
        returns after its writes), one event wait on CUDA."""
        if ops.releases or ops.commits:
            self.runner.wait_for_writes()

    def retire_ended(self) -> None:
        """Tells the scheduler which completions ended (a stop string, a cancel, an abort,
        a deadline, a failure); their blocks go back with the next lease call."""
        for completion, finish in self.requests.take_ended():
            self.scheduler.finish(completion.seq, finish)
            self.sampler.release(completion)

    def lost(self, error: BaseException) -> None:
        """The cache service went away (`error`): the session is dropped, and the gauges of
        the blocks it held go to zero."""
        # Losing the session gives its blocks back (a detach, or its TTL), and dropping
        # the runner unmaps the pool: neither while a step's kernels may still write.
        self.runner.wait_for_writes()
        self.session.lost(error)
        self.tenant_gauges.zero()  # the lost session held them
        metrics.LORA_KV_BLOCKS.clear()

    def close(self, error: tuple[grpc.StatusCode, str]) -> None:
        """Shutting down: ends every live request with `error`, and gives every block back
        in a last lease call that detaches."""
        collected = self.session.collect()
        if collected is not None:
            self.scheduler.apply(*collected)
        for request in self.requests:
            self.requests.end_request(request, Finish.ABORTED, error=error)
        self.retire_ended()
        final_ops = self.scheduler.schedule().lease_ops  # only releases remain
        self.fence_writes(final_ops)
        self.session.close(final_ops)
