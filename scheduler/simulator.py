"""Discrete-event simulator: the real ``Scheduler``, policy and KV block
accounting, driven by a virtual clock and a cost model instead of a GPU.

It performs exactly the engine's calls, in the engine's order:

    scheduler.add(seq, now)                    for each job that has arrived
    plan = scheduler.schedule(now)
    now += stall + cost_model.step_time(shape of plan)   (the step "runs")
    scheduler.update_from_output(plan, StepOutcome(..., finished=[jobs with all their tokens]))

so no policy and no swap decision has a second implementation here. Time
advances only by steps and by idle jumps to the next arrival. A job may
follow another (a conversation's next turn): it arrives its think time after
that one finishes, so the workload answers the server's speed. ``run`` is
``step`` until no work is left; ``scheduler/cluster.py`` calls ``step`` and
``add_job`` itself to run several replicas on one clock.

A copy engine models the KV moves (FastServe §4.2): one host<->device link
that moves ``block_transfer_time`` seconds per block, copies serialised in
plan order (swap-outs, then swap-ins) and overlapping compute. The forward of
a step waits, as the worker's compute stream does, for every copy of the
previous step (a block freed by a swap-out is reused only once it has left;
a prefetched request's KV has landed) and for this step's own swap-ins when it
runs a request they bring back. That wait is the swap stall.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from fluidserve.kvcache.config import CacheConfig, ConfigTree
from fluidserve.scheduler.budget import safepoint_attention_share, safepoint_interval_share
from fluidserve.scheduler.cost_model import CostModel, plan_shape
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.policies import Policy, make_policy
from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig
from fluidserve.scheduler.workloads import Job


@dataclass(frozen=True)
class SimConfig(ConfigTree):
    """The engine's own scheduler and KV settings, and what only a simulated
    machine has. ``SimConfig.create(num_kv_blocks=..., **flat)`` takes flat
    names as ``EngineConfig.create`` does. ``cache.num_kv_blocks`` must be
    set (the simulator has no memory to size it from); no
    ``num_host_blocks`` means no host tier. The scheduler's policy is the
    one ``Simulator`` is given."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    block_transfer_time: float = 0.0  # seconds to move one KV block over the host link
    # Decoder layers of the simulated model, for the safepoints every
    # ``preemption_safepoint_layers``: the cost model's where it has a
    # model shape, else this (uniform layers).
    model_layers: int = 1
    # An abandoned step is paused, as the engine's worker does: it resumes
    # where it stopped once online work drains (False: its work is lost).
    resume_paused_steps: bool = True
    check_integrity: bool = False  # kv.check_integrity() after every step (tests)


@dataclass
class JobRecord:
    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    first_token_time: float | None = None
    finish_time: float | None = None
    last_token_time: float | None = None
    max_token_gap: float = 0.0  # latency bound: longest wait between two tokens
    num_emitted: int = 0  # tokens sampled for it (must end equal to output_tokens)
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens its admission found in the prefix cache (either tier)

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def normalized_latency(self) -> float:
        return self.e2e / self.output_tokens

    @property
    def tpot(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


@dataclass
class SimResult:
    policy: str
    records: list[JobRecord]
    num_steps: int
    makespan: float
    busy_time: float
    num_preemptions: int
    policy_stats: dict = field(default_factory=dict)
    swap_stats: dict = field(default_factory=dict)
    # (step end, compute seconds, tokens computed, of which offline, or of
    # the simulator's tracked jobs) of every step that ran a forward to the
    # end: work done by time, by class.
    steps_log: list[tuple[float, float, int, int]] = field(default_factory=list)

    def work_until(self, t: float) -> tuple[float, int, int]:
        """(busy seconds, tokens, offline tokens) of the steps ended by ``t``."""
        busy = tokens = offline = 0
        for end, compute, n, n_off in self.steps_log:
            if end > t:
                break
            busy, tokens, offline = busy + compute, tokens + n, offline + n_off
        return busy, tokens, offline

    def summary(self) -> dict:
        done = [r for r in self.records if r.finish_time is not None]
        norm = [r.normalized_latency for r in done]
        tpots = [r.tpot for r in done if r.output_tokens > 1]
        gaps = [r.max_token_gap for r in done]
        return {
            "policy": self.policy,
            "num_jobs": len(self.records),
            "num_finished": len(done),
            "mean_norm_latency_s": sum(norm) / len(norm) if norm else math.nan,
            "p95_norm_latency_s": percentile(norm, 95),
            "mean_ttft_s": sum(r.ttft for r in done) / len(done) if done else math.nan,
            "p99_ttft_s": percentile([r.ttft for r in done], 99),
            "p99_tpot_s": percentile(tpots, 99),
            "p99_latency_bound_s": percentile(gaps, 99),
            "max_latency_bound_s": max(gaps) if gaps else math.nan,
            "mean_e2e_s": sum(r.e2e for r in done) / len(done) if done else math.nan,
            "throughput_rps": len(done) / self.makespan if self.makespan > 0 else math.nan,
            "utilization": self.busy_time / self.makespan if self.makespan > 0 else math.nan,
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            **self.swap_stats,
            **self.policy_stats,
        }


class Simulator:
    def __init__(
        self, jobs: list[Job], policy: str | Policy, cost_model: CostModel, config: SimConfig,
        policy_options: dict | None = None, tracked: set[str] | None = None,
    ) -> None:
        """``policy``: a registered policy's name, or a policy object (a
        reference the engine does not offer, for benchmarks)."""
        # Whose tokens the step log counts apart: these jobs, or (None) the offline class.
        self.tracked = tracked
        cache = config.cache
        if cache.num_kv_blocks is None:
            raise ValueError("num_kv_blocks: the simulator needs a device pool size")
        capacity = cache.num_kv_blocks * cache.block_size
        for job in jobs:
            if job.prompt_tokens < 1 or job.output_tokens < 1:
                raise ValueError(f"job {job.request_id}: lengths must be positive")
            if job.prompt_tokens + job.output_tokens > capacity:
                raise ValueError(f"job {job.request_id} needs {job.prompt_tokens + job.output_tokens} "
                                 f"tokens of KV, the pool holds {capacity}")
        # Turns that answer a reply arrive when it has finished (Job.follows).
        self._followers: dict[str, list[Job]] = {}
        for job in jobs:
            if job.follows is not None:
                self._followers.setdefault(job.follows, []).append(job)
        ids = {j.request_id for j in jobs}
        if not ids.issuperset(self._followers):
            raise ValueError(f"jobs follow requests not in the workload: {sorted(set(self._followers) - ids)}")
        self.jobs = sorted((j for j in jobs if j.follows is None), key=lambda j: j.arrival_time)  # stable
        # A conversation's replies are keyed as the engine keys generated
        # tokens: its next turn repeats them (other jobs' replies never recur).
        self._replies = {j.request_id: j for j in jobs if j.conversation is not None}
        self.cost = cost_model
        self.config = config
        named = isinstance(policy, str)
        sched_cfg = replace(config.scheduler, policy_options=dict(policy_options or {}),
                            **({"scheduling_policy": policy} if named else {}))
        # The longest stretch between two safepoints, of the cost model's
        # model (uniform layers where it names none).
        shape = getattr(cost_model, "model", None)
        shape = shape if hasattr(shape, "layer_params") else None
        layers = shape.num_layers if shape else config.model_layers
        self.safepoint_share = safepoint_interval_share(
            sched_cfg.preemption_safepoint_layers, layers,
            shape.feed_forward_share if shape else 0.5)
        self.scheduler = Scheduler.create(
            sched_cfg, cache, cache.num_kv_blocks, cache.num_host_blocks or 0,
            policy=make_policy(policy, cost_model=cost_model, **sched_cfg.policy_options) if named else policy,
            safepoint_interval_share=self.safepoint_share,
            safepoint_attention_share=safepoint_attention_share(sched_cfg.preemption_safepoint_layers, layers))
        self.kv = self.scheduler.kv
        self.policy_name = policy if named else policy.name
        self._start_run()

    def run(self, max_steps: int | None = None) -> SimResult:
        while self.has_work():
            if self.step() and max_steps is not None and self.num_steps >= max_steps:
                break
        return self.result()

    # -- one step at a time (scheduler/cluster.py drives several replicas so) --
    def _start_run(self) -> None:
        # A follower's arrival is set when the reply it answers ends.
        jobs = [*self.jobs, *(j for group in self._followers.values() for j in group)]
        self.records = {j.request_id: JobRecord(j.request_id, math.nan if j.follows else j.arrival_time,
                                                j.prompt_tokens, j.output_tokens) for j in jobs}
        if len(self.records) != len(jobs):
            raise ValueError("duplicate request ids in the workload")
        self.now, self.busy, self.num_steps, self._nxt = 0.0, 0.0, 0, 0
        self._copies_done, self._swap_stall, self._abandoned_steps = 0.0, 0.0, 0
        self._paused_done = 0.0  # share of the paused step's compute done before it stopped
        self.steps_log: list[tuple[float, float, int, int]] = []
        # Request ids of the last step: those that got their first token, and those that finished.
        self.last_started: list[str] = []
        self.last_finished: list[str] = []

    def add_job(self, job: Job) -> None:
        """A job that arrives after the run began (a router hands it over at
        its arrival time, never earlier than the jobs already added)."""
        if job.request_id in self.records:
            raise ValueError(f"duplicate request id {job.request_id!r}")
        if job.follows is not None:
            raise ValueError("a job handed over at its arrival cannot wait for another (Job.follows)")
        if self.jobs and job.arrival_time < self.jobs[-1].arrival_time:
            raise ValueError("jobs must be added in arrival order")
        self.jobs.append(job)
        self.records[job.request_id] = JobRecord(job.request_id, job.arrival_time, job.prompt_tokens,
                                                 job.output_tokens)

    def has_work(self) -> bool:
        """Jobs not yet arrived or not finished."""
        return self._nxt < len(self.jobs) or self.scheduler.has_unfinished()

    def step(self) -> bool:
        """Admit the jobs arrived by ``now`` and run one step (``now``
        advances to its end), or jump idle to the next arrival. True when a
        step was planned."""
        sched, cfg, jobs = self.scheduler, self.config, self.jobs
        self.last_started, self.last_finished = [], []
        while self._nxt < len(jobs) and jobs[self._nxt].arrival_time <= self.now:
            j = jobs[self._nxt]
            keys = sched.prompt_block_keys(j.token_ids())
            sched.add(SeqState(j.request_id, j.prompt_tokens, j.output_tokens, j.arrival_time, j.klass,
                               block_keys=keys), self.now)
            self._nxt += 1
        if not sched.has_unfinished():
            self.now = jobs[self._nxt].arrival_time  # idle until the next arrival
            return False
        now = self.now
        plan = sched.schedule(now)
        if plan.is_empty:
            if self._nxt < len(jobs):
                self.now = max(now, jobs[self._nxt].arrival_time)
                return False
            raise RuntimeError(f"scheduler made no progress at t={now:.3f} with "
                               f"{len(sched.seqs)} requests left")
        start = now
        wait_until = self._copies_done  # every copy of the previous step
        copy_free = max(now, self._copies_done) + cfg.block_transfer_time * (len(plan.swap_out) + len(plan.swap_in))
        running = {item.request_id for item in plan.scheduled}
        if any(rid in running for rid in plan.swapped_in):
            wait_until = copy_free  # reactive swap-in: this step reads it
        self._copies_done = copy_free
        stall = max(0.0, wait_until - now) if plan.scheduled else 0.0
        full = compute = self.cost.step_time(*plan_shape(plan, sched.seqs))
        if plan.resumes:  # only the layers after the safepoint it stopped at
            compute = full * (1.0 - self._paused_done)
        cut = self._safepoint_cut(plan, self._nxt, now + stall, compute, full)
        abandoned = cut is not None
        if abandoned:  # the work up to the safepoint is kept (paused) or thrown away
            self._paused_done = 1.0 - (now + stall + compute - cut) / full
            self.busy += cut - (now + stall)
            now = cut
            self._abandoned_steps += 1
        elif plan.scheduled:
            now += stall + compute
            self.busy += compute
            offline = sum(i.num_tokens for i in plan.scheduled
                          if (i.request_id in self.tracked if self.tracked is not None
                              else sched.seqs[i.request_id].klass is RequestClass.OFFLINE))
            self.steps_log.append((now, compute, plan.num_batched_tokens, offline))
        else:  # only copies: time passes until they are done
            now = max(now, copy_free)
        self._swap_stall += stall
        self.num_steps += 1
        finished, bs = self.last_finished, self.kv.block_size
        for item in () if abandoned else plan.scheduled:
            if not item.samples:
                continue
            seq = sched.seqs[item.request_id]
            rec = self.records[item.request_id]
            rec.num_emitted += 1
            job = self._replies.get(item.request_id)
            if job is not None and not (n := rec.prompt_tokens + rec.num_emitted) % bs:
                sched.block_filled(seq, job.token_ids(n - bs, n), n)
            if rec.first_token_time is None:
                rec.first_token_time = now
                rec.cached_tokens = seq.num_cached_tokens
                self.last_started.append(item.request_id)
            else:
                rec.max_token_gap = max(rec.max_token_gap, now - rec.last_token_time)
            rec.last_token_time = now
            if seq.num_output_tokens + 1 >= seq.max_new_tokens:
                rec.finish_time = now
                rec.num_preemptions = seq.num_preemptions
                finished.append(item.request_id)
                self._release_followers(item.request_id, now)
        self.now = now
        sched.update_from_output(plan, StepOutcome(step_time=now - start, now=now, finished=finished,
                                                   abandoned=abandoned,
                                                   paused=abandoned and cfg.resume_paused_steps))
        if cfg.check_integrity:
            self.kv.check_integrity()
        return True

    def _release_followers(self, request_id: str, now: float) -> None:
        """The turns answering ``request_id``'s reply join the arrivals, each
        its think time after ``now`` (never before an arrival already let in)."""
        for job in self._followers.pop(request_id, ()):
            job = replace(job, arrival_time=now + job.think_time, follows=None)
            self.records[job.request_id].arrival_time = job.arrival_time
            bisect.insort(self.jobs, job, lo=self._nxt, key=lambda j: j.arrival_time)

    def result(self) -> SimResult:
        sched = self.scheduler
        stats = {}
        for attr in ("num_promotions", "num_demotions"):
            if hasattr(sched.policy, attr):
                stats[attr] = getattr(sched.policy, attr)
        c = sched.counters
        swap_stats = {
            "num_recomputes": c.num_recomputes, "num_swap_outs": c.num_swap_outs, "num_swap_ins": c.num_swap_ins,
            "swap_blocks": c.swap_out_blocks + c.swap_in_blocks, "swap_stall_s": self._swap_stall,
            # Freed cached blocks copied to the host: the link's other traffic.
            "demoted_blocks": self.kv.prefix_stats.demoted_blocks,
            "num_checkpoint_evictions": c.num_checkpoint_evictions, "checkpoint_blocks": c.checkpoint_blocks,
            "num_steps_abandoned": self._abandoned_steps, "num_resumes": c.num_resumes,
            "num_dropped_pauses": c.num_dropped_pauses, "num_deadline_promotions": sched.num_deadline_promotions,
            "num_backfills": c.num_backfills,
        }
        return SimResult(self.policy_name, list(self.records.values()), self.num_steps, self.now, self.busy,
                         sched.num_preemptions, stats, swap_stats, self.steps_log)

    def _safepoint_cut(self, plan, nxt: int, begin: float, compute: float, full: float) -> float | None:
        """When a preemptible step starting its compute (``compute`` seconds
        of a ``full`` step's) at ``begin`` is abandoned: the first safepoint
        after an online arrival (None: it runs through)."""
        frac = self.safepoint_share
        if not (frac and plan.preemptible and plan.scheduled):
            return None
        end, slice_ = begin + compute, full * frac
        for job in self.jobs[nxt:]:
            if job.arrival_time >= end:
                return None
            if job.klass is not RequestClass.ONLINE:
                continue
            # Any online arrival stops the step (engine.preemption.PreemptionPolicy).
            at = max(job.arrival_time, begin)
            cut = begin + math.ceil((at - begin) / slice_) * slice_
            return cut if cut < end else None
        return None


def simulate(jobs: list[Job], policy: str | Policy, cost_model: CostModel, config: SimConfig,
             policy_options: dict | None = None, tracked: set[str] | None = None) -> SimResult:
    return Simulator(jobs, policy, cost_model, config, policy_options, tracked).run()


def estimate_capacity(
    lengths: list[tuple[int, int]], cost_model: CostModel, config: SimConfig, num_jobs: int = 400,
    seed: int = 0,
) -> float:
    """Saturated throughput (requests/s) of a length mix: ``num_jobs`` jobs
    all present at t = 0, served FCFS; the middle 80% of completions are
    timed so the ramp-up and the drain do not count. Load 1.0 = this rate."""
    import random

    rng = random.Random(seed)
    jobs = [Job(f"c{i}", 0.0, *lengths[rng.randrange(len(lengths))]) for i in range(num_jobs)]
    return saturated_rate(jobs, cost_model, config)


def saturated_rate(jobs: list[Job], cost_model: CostModel, config: SimConfig) -> float:
    """Requests/s of ``jobs`` all present at t = 0 in their order, served
    FCFS, timed over the middle 80% of completions (``estimate_capacity`` for
    jobs whose prompts share tokens, which a length mix cannot say). A turn
    that follows another is queued with the rest: saturated, the server
    never waits on a user."""
    jobs = [replace(j, arrival_time=0.0, follows=None, think_time=0.0) for j in jobs]
    res = simulate(jobs, "fcfs", cost_model, config)
    ends = sorted(r.finish_time for r in res.records)
    lo, hi = int(0.1 * len(jobs)), int(0.9 * len(jobs)) - 1
    return (hi - lo) / (ends[hi] - ends[lo])
