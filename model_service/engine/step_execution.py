"""One scheduled step's batch on the model: the forward pass, the prompts' logprobs,
sampling and the verification of proposals, the scheduler told what came out (it is the
one writer of sequences), and each token's delta queued for its stream. A step whose
forward pass or sampling raised ends its own requests with a status (failures.py), and
leaves every other request and the engine running.

One of these lives as long as an attachment to the cache service: the runner and the
scheduler it drives are built for the pool that attachment lends.
"""

from __future__ import annotations

import time

import structlog

from model_service.engine.failures import step_failure_status
from model_service.engine.live_requests import LiveRequests
from model_service.engine.step_sampler import StepSampler
from model_service.sched.scheduler import Scheduler
from model_service.sched.sequence import Finish
from model_service.sched.step import Step, StepOutput
from model_service.spec.verify import keep_verified
from model_service.worker.runner import ModelRunner

log = structlog.get_logger()


class StepExecution:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: StepSampler,
                 requests: LiveRequests) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.requests = requests

    def run(self, step: Step) -> int:
        """Runs the step's batch, samples the rows that are due, lets the scheduler write the
        results into its sequences, and queues each token's delta; returns the tokens appended."""
        completions = self.requests.completions
        output = StepOutput()
        prompt_logits = self.sampler.prompt_logits_wanted(step.batch, completions)
        started = time.perf_counter()
        due, logits = self.runner.execute(step.batch, prompt_logits, step.proposals)
        if prompt_logits:
            output.prompt_logprobs_done = self.sampler.collect_prompt_logprobs(prompt_logits, completions,
                                                                            self.runner.model.compute_logits)
        sampled = ([], [], [])
        if due:
            # At the first token of an n-request's completion 0, its other completions
            # sample theirs from the same row (and are forked by the scheduler).
            sampled = keep_verified(*self.sampler.sample(due, logits, completions), step.proposals,
                                    self.runner.verified)
            output.sampled = [(completion.seq, token) for completion, token in zip(sampled[0], sampled[1])]
        self._time_decode_step(step, time.perf_counter() - started)
        finished = self.scheduler.update_from_output(step, output)
        if due:
            self.requests.emit(*sampled, {ended.seq: ended for ended in finished})
        return len(output.sampled)

    def _time_decode_step(self, step: Step, seconds: float) -> None:
        """Tells the speculator what a step of only decoding sequences (and their proposals)
        cost, by its rows: what it weighs proposals against (spec/step_costs.py)."""
        speculator = self.scheduler.speculator
        if speculator is not None and decode_only(step):
            speculator.step_took(sum(new_tokens for _, new_tokens in step.batch), seconds)

    def fail(self, step: Step, error: Exception) -> None:
        """Ends the requests of a step whose forward pass or sampling raised, with a status;
        their blocks go back with the next lease call."""
        requests = {}
        for seq, _ in step.batch:
            completion = self.requests.completions.get(seq)
            if completion is not None:
                requests[completion.request.key] = completion.request
        log.exception("step_failed", requests=[request.request_id for request in requests.values()])
        status = step_failure_status(error)
        for request in requests.values():
            self.requests.end_request(request, Finish.ABORTED, error=status)


def decode_only(step: Step) -> bool:
    """Whether every row of the step decodes (a token, or a token and its proposal)."""
    return all(new_tokens == 1 or seq in step.proposals for seq, new_tokens in step.batch)
