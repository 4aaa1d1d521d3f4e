"""Scheduling policies: the order in which requests are offered the step.

A policy only ranks requests and keeps its own bookkeeping; the token budget,
the request cap and KV admission live in ``Scheduler``, which fills each step
from the top of the ranking down (a request not reached is preempted for that
iteration; its KV stays where it is). Contract: ``order`` returns every request
it is given exactly once, highest priority first, and never mutates the list.

Every policy is built by ``make_policy(name, cost_model=..., **options)``; the
cost model (``scheduler/cost_model.py``) is what the time-aware ones (MLFQ)
consult, and defaults to the analytic Llama-3-8B/H100 roofline.

Registered policies:

* ``fcfs``: Orca/vLLM behaviour, arrival order.
* ``fixed-priority``: shortest prompt first (FastServe's first strawman).
* ``mlfq``: naive MLFQ, every job enters Q1 (FastServe's second strawman).
* ``skip-join-mlfq``: FastServe §4.1, the default.
"""

from __future__ import annotations

from fluidserve.scheduler.cost_model import CostModel
from fluidserve.scheduler.mlfq import MLFQPolicy, SkipJoinMLFQPolicy
from fluidserve.scheduler.policy_base import Policy
from fluidserve.scheduler.request_state import SeqState

__all__ = ["Policy", "FCFSPolicy", "FixedPriorityPolicy", "MLFQPolicy", "SkipJoinMLFQPolicy",
           "POLICIES", "DEFAULT_POLICY", "make_policy"]


def _arrival_key(seq: SeqState) -> tuple[float, int]:
    return seq.arrival_time, seq.arrival_index


class FCFSPolicy(Policy):
    """Orca/vLLM behaviour: first come, first served, no preemption by age."""

    name = "fcfs"
    sort_key = staticmethod(_arrival_key)  # fixed at arrival

    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        return sorted(seqs, key=_arrival_key)  # stable: ties keep arrival order


def _prompt_key(seq: SeqState) -> tuple[int, float, int]:
    return seq.num_prompt_tokens, seq.arrival_time, seq.arrival_index


class FixedPriorityPolicy(Policy):
    """Priority fixed at arrival by input length, shortest first (FastServe's
    strawman: near SRPT when the prefill dominates, blind to long outputs)."""

    name = "fixed-priority"
    sort_key = staticmethod(_prompt_key)  # fixed at arrival

    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        return sorted(seqs, key=_prompt_key)

    def priority(self, seq: SeqState) -> float:
        return float(seq.num_prompt_tokens)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FCFSPolicy, FixedPriorityPolicy, MLFQPolicy, SkipJoinMLFQPolicy)
}
DEFAULT_POLICY = SkipJoinMLFQPolicy.name


def make_policy(name: str, cost_model: CostModel | None = None, **options) -> Policy:
    """Build policy ``name``; ``options`` are its knobs (see each class).
    Knobs that only the MLFQ policies take are ignored by the others, so one
    options dict from the CLI works for every policy."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}") from None
    unknown = set(options) - set(MLFQPolicy.OPTIONS)
    if unknown:
        raise ValueError(f"unknown scheduling policy option(s) {sorted(unknown)}; known: {sorted(MLFQPolicy.OPTIONS)}")
    if not issubclass(cls, MLFQPolicy):
        options = {}
    return cls(cost_model=cost_model, **options)
