"""Scheduler: turns the set of unfinished requests into one StepPlan per step.

Owns admission into the step: the per-step token budget, the request cap and
KV-block reservation. The *order* in which requests are offered comes from a
``Policy``; the online class always goes ahead of the offline class. A request
that does not fit is simply not run this step (its KV stays where it is); when
the device pool runs dry a lower-priority request's KV is released and it is
recomputed later (swapping to host replaces that in the KV-manager work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kvcache.manager import KVCacheManager
from .plan import ScheduledSeq, StepPlan
from .policies import Policy, make_policy
from .request_state import RequestClass, SeqState, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # request cap of one step
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    policy_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, policy: Policy | None = None) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or make_policy(config.policy, **config.policy_options)
        self.seqs: dict[str, SeqState] = {}
        self.num_preemptions = 0

    # -- membership -------------------------------------------------------
    def add(self, seq: SeqState, now: float) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self.seqs[seq.request_id] = seq
        self.policy.on_arrival(seq, now)

    def finish(self, request_id: str) -> None:
        """Remove a finished or aborted request and release its KV blocks."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        seq.status = SeqStatus.FINISHED
        self.kv.free(request_id)
        self.policy.on_finish(seq)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # -- one step ---------------------------------------------------------
    def ranked(self, now: float) -> list[SeqState]:
        """Every unfinished request, highest priority first: online ahead of
        offline, the policy's order inside each class."""
        online = [s for s in self.seqs.values() if s.klass is RequestClass.ONLINE]
        offline = [s for s in self.seqs.values() if s.klass is RequestClass.OFFLINE]
        return self.policy.order(online, now) + self.policy.order(offline, now)

    def schedule(self, now: float) -> StepPlan:
        cfg = self.config
        plan = StepPlan()
        budget = cfg.max_num_batched_tokens
        ranked = self.ranked(now)
        for i, seq in enumerate(ranked):
            if len(plan.scheduled) >= cfg.max_num_seqs or budget <= 0:
                break
            if seq.request_id in plan.preempted:  # gave its KV away this step
                continue
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    continue
                n = budget
            if not self._reserve(seq, seq.num_computed_tokens + n, ranked[i + 1 :], plan):
                continue
            plan.scheduled.append(ScheduledSeq(seq.request_id, n, samples=n == seq.num_uncomputed_tokens))
            budget -= n
        plan.preemptible = bool(plan.scheduled) and all(
            self.seqs[s.request_id].klass is RequestClass.OFFLINE for s in plan.scheduled
        )
        return plan

    def _reserve(self, seq: SeqState, num_tokens: int, lower: list[SeqState], plan: StepPlan) -> bool:
        """Make room for ``seq`` to hold ``num_tokens`` tokens of KV. A request
        already running may take the blocks of lower-priority requests; a
        waiting one only takes free blocks, so admission never thrashes."""
        rid = seq.request_id
        while not self.kv.can_allocate(rid, num_tokens):
            if seq.status is not SeqStatus.RUNNING:
                return False
            victim = next((v for v in reversed(lower) if self.kv.holds(v.request_id)), None)
            if victim is None:
                # Nothing below it holds KV: give way to the requests above.
                self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        return self.kv.allocate(rid, num_tokens)

    def _preempt(self, seq: SeqState, plan: StepPlan) -> None:
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(seq.request_id)

    def step_done(self, plan: StepPlan, step_time: float, now: float) -> None:
        """Account a finished step: computed tokens and the policy's service."""
        for item in plan.scheduled:
            seq = self.seqs.get(item.request_id)
            if seq is None:  # aborted while the step ran
                continue
            seq.num_computed_tokens += item.num_tokens
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            seq.last_scheduled_time = now
            self.policy.on_step_done(seq, item.num_tokens, step_time, now)

    # -- figures ----------------------------------------------------------
    def counts(self) -> dict[tuple[str, str], int]:
        """Number of unfinished requests by (class, status)."""
        out: dict[tuple[str, str], int] = {}
        for s in self.seqs.values():
            key = (s.klass.value, s.status.value)
            out[key] = out.get(key, 0) + 1
        return out
