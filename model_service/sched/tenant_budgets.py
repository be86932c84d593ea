"""Each tenant's compute budget: a token bucket over the tokens the engine computes for it
(--api-keys `max_tokens_per_s`, `burst_tokens`).

A tenant's admitted work takes steps from every other tenant: each prompt chunk and
decode row it puts in a step makes that step, which every stream in it waits for,
longer. Its request limits bound how many of its requests run and its `kv_blocks` share
what they hold of the pool, but not what they compute; this does. What is counted is what
goes through the model: prompt tokens prefilled (again after a preemption), each decoded
token, and the proposals a speculating sequence verifies. Prefix-cache hits cost nothing.

The scheduler opens a step (`open_step`: the buckets refill from the clock), asks
for each of a tenant's sequences how many of the tokens it would run the bucket grants
(`grant`), and charges what a step computed once it ran (`charge`, from
update_from_output: a step scheduled and dropped costs nothing). A sequence granted
nothing is skipped in this step, not preempted: it keeps its blocks and its stream only
gets slower. The tokens refused are the step's `deferred` (Step.deferred, for the
per-tenant metric).

The budget is a rate limit, not a share: a tenant past it waits even while the engine has
room. A share of the step's tokens among tenants with work would give the whole prefill
budget to one tenant's long prompts whenever the others only decode, which is when their
inter-token latency is the step's time. The bucket holds at most `burst_tokens` (default
one second's worth) and starts full. A prompt's chunk waits until it may take `least`
tokens (the scheduler asks a block's worth, or the prompt's rest if shorter), so that a
prompt under a small budget goes in a few chunks of a block or more, not in a few tokens
in every step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.token_bucket import refill


@dataclass(frozen=True, slots=True)
class ComputeBudget:
    tokens_per_s: float
    burst_tokens: float = 0.0  # 0: one second's worth

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0 or self.burst_tokens < 0:
            raise ValueError(f"a compute budget needs tokens_per_s > 0 and burst_tokens >= 0, got {self}")

    @property
    def capacity(self) -> float:
        """The most the bucket holds: at least one token, or nothing could ever run."""
        return max(self.burst_tokens or self.tokens_per_s, 1.0)


def compute_budgets(triples) -> dict[str, ComputeBudget]:
    """Tenant -> ComputeBudget of (tenant, max_tokens_per_s, burst_tokens) triples (ApiKeys.compute_budgets)."""
    return {tenant: ComputeBudget(rate, burst) for tenant, rate, burst in triples}


class TenantBudgets:
    def __init__(self, budgets: Mapping[str, ComputeBudget] | None = None, clock=time.monotonic) -> None:
        # Tenant -> its budget; a tenant without one has no limit.
        self.budgets = dict(budgets or {})
        self._clock = clock
        self._tokens = {tenant: budget.capacity for tenant, budget in self.budgets.items()}
        self._refilled_at = clock() if self.budgets else 0.0
        self._left: dict[str, float] = {}  # what the open step may still grant
        self._deferred: dict[str, int] = {}  # the open step's tokens refused, by tenant

    def update(self, budgets: Mapping[str, ComputeBudget]) -> None:
        """The budgets of a reloaded keys file (SIGHUP), between steps. The time since the
        last step refills at the old rates first; then a tenant whose budget changed keeps
        what it has used (its capacity less what it holds), so a reload neither hands out a
        fresh burst nor takes back what the tenant was owed: under a new capacity it holds
        that less the same use, at least nothing. A tenant new to budgets starts full, as at
        start-up; one taken out has no limit from its next step."""
        self.open_step()  # brings every bucket to now at the rates it had
        tokens = {}
        for tenant, budget in budgets.items():
            old = self.budgets.get(tenant)
            if old is None:
                tokens[tenant] = budget.capacity
            else:
                used = old.capacity - self._tokens[tenant]
                tokens[tenant] = max(0.0, budget.capacity - used)  # used >= 0: never past the capacity
        self.budgets = dict(budgets)
        self._tokens = tokens
        self._refilled_at = max(self._clock(), self._refilled_at)
        self._left = dict(tokens)
        self._deferred = {}

    def open_step(self) -> None:
        """Refills the buckets for the time since the last step and starts a step's grants."""
        if not self.budgets:
            return
        now = max(self._clock(), self._refilled_at)
        for tenant, budget in self.budgets.items():
            self._tokens[tenant] = refill(self._tokens[tenant], self._refilled_at, now, budget.tokens_per_s,
                                          budget.capacity)
        self._refilled_at = now
        self._left = dict(self._tokens)
        self._deferred = {}

    def grant(self, tenant: str, wanted: int, least: int = 1) -> int:
        """Of `wanted` tokens of one of the tenant's sequences, those it may run in the open
        step: all of them without a budget; else as many as the bucket holds, but none
        unless it holds `least` (or `wanted`, if fewer). The rest are deferred."""
        if tenant not in self.budgets or wanted <= 0:
            return wanted
        left = self._left[tenant]
        least = min(least, wanted, int(self.budgets[tenant].capacity))
        granted = min(wanted, int(left)) if left >= least else 0
        self._left[tenant] = left - granted
        if granted < wanted:
            self._deferred[tenant] = self._deferred.get(tenant, 0) + wanted - granted
        return granted

    def spare(self, tenant: str, tokens: int) -> int:
        """Of `tokens` more that a sequence could take (a speculating one's proposals), those
        the tenant's bucket still holds in the open step; taken with `take`."""
        if tenant not in self.budgets:
            return tokens
        return max(0, min(tokens, int(self._left[tenant])))

    def take(self, tenant: str, tokens: int) -> None:
        if tenant in self.budgets:
            self._left[tenant] -= tokens

    def close_step(self) -> dict[str, int]:
        """The open step's deferred tokens by tenant."""
        deferred, self._deferred = self._deferred, {}
        return deferred

    def charge(self, tenant: str, tokens: int) -> None:
        """A step ran `tokens` of the tenant's: they come out of its bucket."""
        if tenant in self.budgets:
            self._tokens[tenant] = max(0.0, self._tokens[tenant] - tokens)

    def tokens(self, tenant: str) -> float | None:
        """What the tenant's bucket holds now (as of the last step); None: no budget."""
        return self._tokens.get(tenant)
