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
from .cost_model import CostModel
from .plan import ScheduledSeq, StepPlan
from .policies import DEFAULT_POLICY, Policy, make_policy
from .request_state import RequestClass, SeqState, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # request cap of one step
    enable_chunked_prefill: bool = True
    # Fraction of the device pool a *new* request may not take: room for the
    # running ones to grow before anyone is preempted (vLLM's watermark).
    kv_watermark: float = 0.01
    policy: str = DEFAULT_POLICY
    policy_options: dict = field(default_factory=dict)  # make_policy(policy, **policy_options)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")


class Scheduler:
    """``policy`` overrides ``config.policy``; otherwise the policy is built
    from the config with ``cost_model`` (None: the analytic default)."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policy: Policy | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or make_policy(config.policy, cost_model=cost_model, **config.policy_options)
        self.seqs: dict[str, SeqState] = {}
        self.num_preemptions = 0
        self._watermark_blocks = int(config.kv_watermark * kv.num_blocks)

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
        """Fill one step from the top of the ranking down. A prefill chunk
        never takes the token that a lower-ranked running decode needs: a
        decode adds one token to a step another request's prefill makes
        compute-bound, so it rides along almost free, and only the request
        cap or KV memory preempts it (FastServe's batch-slot semantics).
        Without this a demoted job's decodes starve behind every new
        prompt and the lost free rides cost throughput (measured in
        benchmarks/scheduling.py)."""
        cfg = self.config
        plan = StepPlan()
        budget = cfg.max_num_batched_tokens
        ranked = self.ranked(now)
        # decodes_below[i]: running decodes ranked after position i.
        decodes_below = [0] * (len(ranked) + 1)
        for i in range(len(ranked) - 1, -1, -1):
            s = ranked[i]
            is_decode = s.status is SeqStatus.RUNNING and s.num_uncomputed_tokens == 1
            decodes_below[i] = decodes_below[i + 1] + is_decode
        preempted: set[str] = set()
        for i, seq in enumerate(ranked):
            slots = cfg.max_num_seqs - len(plan.scheduled)
            if slots <= 0 or budget <= 0:
                break
            if seq.request_id in preempted:  # gave its KV away this step
                continue
            n = seq.num_uncomputed_tokens
            if n > 1:
                if not cfg.enable_chunked_prefill:
                    if n > budget:
                        continue
                else:
                    # Hold back a token per lower-ranked decode, at most half
                    # of the step's budget, so the top prefill always progresses.
                    held = min(decodes_below[i + 1], slots - 1, cfg.max_num_batched_tokens // 2)
                    n = min(n, budget - held)
                    if n <= 0:
                        continue
            if not self._reserve(seq, seq.num_computed_tokens + n, ranked, i, plan, preempted):
                continue
            plan.scheduled.append(ScheduledSeq(seq.request_id, n, samples=n == seq.num_uncomputed_tokens))
            budget -= n
        plan.preemptible = bool(plan.scheduled) and all(
            self.seqs[s.request_id].klass is RequestClass.OFFLINE for s in plan.scheduled
        )
        return plan

    def _reserve(
        self, seq: SeqState, num_tokens: int, ranked: list[SeqState], pos: int,
        plan: StepPlan, preempted: set[str],
    ) -> bool:
        """Make room for ``seq`` (``ranked[pos]``) to hold ``num_tokens`` tokens
        of KV. A request already running may take the blocks of lower-priority
        requests (``ranked[pos+1:]``, lowest first). A waiting one is admitted
        only into free blocks, above the watermark, and for its whole
        (re)prefill at once: a priority policy that starts many prompts must
        not commit memory chunk by chunk and then evict to finish them."""
        rid = seq.request_id
        if seq.status is not SeqStatus.RUNNING:
            need = self.kv.num_new_blocks(rid, seq.num_tokens)
            # The watermark only guards running requests; with none, any
            # request that fits the pool at all must be admitted.
            reserve = self._watermark_blocks if self.kv.num_used_blocks else 0
            if need + reserve > self.kv.num_free_blocks:
                return False
            return self.kv.allocate(rid, seq.num_tokens)
        j = len(ranked)  # victims are searched from the bottom up, once
        while not self.kv.can_allocate(rid, num_tokens):
            j -= 1
            while j > pos and not self.kv.holds(ranked[j].request_id):
                j -= 1
            if j <= pos:
                # Nothing below it holds KV: give way to the requests above.
                self._preempt(seq, plan, preempted)
                return False
            self._preempt(ranked[j], plan, preempted)
        return self.kv.allocate(rid, num_tokens)

    def _preempt(self, seq: SeqState, plan: StepPlan, preempted: set[str]) -> None:
        preempted.add(seq.request_id)
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
    def counts(self) -> dict[tuple[str, str, str], int]:
        """Number of unfinished requests by (class, status, policy queue)."""
        out: dict[tuple[str, str, str], int] = {}
        for s in self.seqs.values():
            key = (s.klass.value, s.status.value, self.policy.queue_label(s))
            out[key] = out.get(key, 0) + 1
        return out
