"""The step record: what the scheduler hands the engine and what the engine hands back.

`Step` (this step's batch and the lease ops it needs) goes out of `Scheduler.schedule`;
the runner executes it and the sampler samples; `StepOutput` comes back to
`Scheduler.update_from_output`, which applies it with `append_token`, the rule for what
a sampled token ends. As in vLLM v1 (SchedulerOutput, ModelRunnerOutput,
update_from_output): only the scheduler writes a Sequence.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from model_service.sched.lease_ops import LeaseOps
from model_service.sched.sequence import Finish, Sequence


@dataclass(slots=True)
class Step:
    # (sequence, new tokens this step); decodes first, then prefill chunks.
    batch: list[tuple[Sequence, int]]
    lease_ops: LeaseOps
    preempted: list[Sequence]
    # Speculating sequences' proposed tokens: each one's batch entry is 1 + len(proposal)
    # tokens, its last token then the proposal (model_service/spec/speculator.py).
    proposals: dict[Sequence, list[int]] = field(default_factory=dict)
    # Tokens each tenant's compute budget held back from this step (tenant_budgets.py).
    deferred: dict[str, int] = field(default_factory=dict)
    # Whether the speculator looked up proposals for this step's decodes (spec/pays.py).
    looked_up: bool = False


@dataclass(slots=True)
class StepOutput:
    """What executing and sampling a Step produced: all the scheduler is told back."""

    # (sequence, its sampled token) in row order; a completion that forks at this step
    # comes right after its parent (they sample from the same row). A speculating sequence
    # has one pair for each token its verification kept, in order.
    sampled: list[tuple[Sequence, int]] = field(default_factory=list)
    # Sequences whose prompt logprobs are now all collected (a recompute may reuse cached blocks).
    prompt_logprobs_done: list[Sequence] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Finished:
    """A sequence that a sampled token ended, and why."""

    seq: Sequence
    reason: Finish
    stop_token: int | None = None  # the stop_token_ids entry that ended it


def append_token(seq: Sequence, token: int, eos_token_ids: Collection[int], max_model_len: int) -> Finished | None:
    """Appends a sampled token to `seq`; a Finished when EOS, a stop token or a length
    limit (max_new_tokens, or max_model_len unless 0) ends it there. Stop strings are
    matched in the text, by the engine's output (text/detokenizer.py)."""
    seq.token_ids.append(token)
    options = seq.options
    if token in eos_token_ids and not options.ignore_eos:
        return Finished(seq, Finish.EOS)
    if token in options.stop_token_ids:
        return Finished(seq, Finish.STOP, token)
    if seq.num_output >= options.max_new_tokens or (max_model_len and len(seq.token_ids) >= max_model_len):
        return Finished(seq, Finish.LENGTH)
    return None
