"""Data-parallel serving in the simulator: N replicas, each the simulator's
own machinery (``Simulator``: the real scheduler, policy, KV tiers and copy
engine on a cost model), on one virtual clock, with the real ``Router``
choosing a replica for each arrival.

Events, in time order (at equal times in this order):

    notice    a replica's step ended: the router hears ``started`` for the
              requests that got their first token and ``finished`` for those
              done
    report    every ``report_interval`` s each replica reports its load
              (``replica_load``), as the engine does
    arrival   the router routes the job; it joins that replica's next step
    step      the replica whose clock is earliest runs one step

A replica runs a step as soon as it is the earliest, so its scheduler is in
the step's end state while the step is still "running"; a report taken then
counts the requests whose tokens the router has not heard of as they were
before the step (queued, or still running), as the router does. Chunked
prefill progress of the running step shows early.
Layer-wise preemption of offline steps looks ahead at a replica's own future
arrivals, which a router has not routed yet: replicas here never cut a step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from fluidserve.scheduler.cost_model import CostModel
from fluidserve.scheduler.request_state import RequestClass
from fluidserve.scheduler.router import ReplicaLoad, Router
from fluidserve.scheduler.simulator import JobRecord, SimConfig, SimResult, Simulator, percentile
from fluidserve.scheduler.workloads import Job

REPORT_INTERVAL_S = 0.1  # the engine's load report period


def replica_load(sim: Simulator, unseen: tuple[list[Job], list[str]] = ((), ())) -> ReplicaLoad:
    """What a replica's engine reports: prompt tokens waiting for prefill
    (less what its cache holds), requests decoding, device KV in use.
    ``unseen``: the jobs that got their first token and the requests that
    finished in a step still running (the router has not seen its tokens):
    counted as before the step, so the report and the router's own tally
    agree on them."""
    queued = offline = running = 0
    for seq in sim.scheduler.seqs.values():
        if seq.num_output_tokens:
            running += 1
            continue
        left = seq.num_prompt_tokens - max(seq.num_computed_tokens, seq.num_cached_tokens)
        queued += left
        if seq.klass is RequestClass.OFFLINE:
            offline += left
    started, finished = unseen
    for job in started:
        left = job.prompt_tokens - sim.records[job.request_id].cached_tokens
        queued += left
        if job.klass is RequestClass.OFFLINE:
            offline += left
    running += len(finished) - len(started)
    return ReplicaLoad(queued, max(0, running), sim.kv.usage, offline)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


@dataclass
class ClusterResult:
    policy: str
    replicas: list[SimResult]
    routes: dict[str, int]  # request id -> replica
    router_counters: dict
    prefix_stats: list[dict]  # per replica: query, device hit and host hit tokens
    decision_times: list[float] = field(default_factory=list)  # seconds per route() call

    @property
    def records(self) -> list[JobRecord]:
        return [r for res in self.replicas for r in res.records]

    def summary(self, warmup_s: float = 0.0) -> dict:
        """Latency and hit-rate figures of the jobs that arrived at or after
        ``warmup_s`` (the caches start cold); the rest over the whole run."""
        done = [r for r in self.records if r.finish_time is not None and r.arrival_time >= warmup_s]
        ttft = [r.ttft for r in done]
        tpot = [r.tpot for r in done if r.output_tokens > 1]
        prompt = sum(r.prompt_tokens for r in done)
        query = sum(s["query_tokens"] for s in self.prefix_stats)
        host = sum(s["host_hit_tokens"] for s in self.prefix_stats)
        per = [len(res.records) for res in self.replicas]
        makespan = max((res.makespan for res in self.replicas), default=0.0)
        counters = self.router_counters
        return {
            "policy": self.policy,
            "num_replicas": len(self.replicas),
            "num_jobs": sum(per),
            "num_measured": len(done),
            "mean_ttft_s": _mean(ttft),
            "p50_ttft_s": percentile(ttft, 50),
            "p99_ttft_s": percentile(ttft, 99),
            "mean_tpot_s": _mean(tpot),
            "p99_tpot_s": percentile(tpot, 99),
            "mean_e2e_s": _mean([r.e2e for r in done]),
            "prefix_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            "host_hit_share": host / query if query else 0.0,  # whole run: prompt tokens copied from host
            "router_hit_rate": counters["prefix_hit_tokens"] / counters["prompt_tokens"]
                               if counters["prompt_tokens"] else 0.0,
            "routed": dict(counters["routed"]),
            "jobs_per_replica_max_over_mean": max(per) / _mean(per) if per and sum(per) else math.nan,
            "throughput_rps": sum(r.finish_time is not None for r in self.records) / makespan
                              if makespan > 0 else math.nan,
            "num_preemptions": sum(res.num_preemptions for res in self.replicas),
        }


class Cluster:
    """``jobs`` served by ``router.num_replicas`` replicas, each a
    ``Simulator`` of ``config`` running ``policy`` on ``cost_model``."""

    def __init__(self, jobs: list[Job], router: Router, policy: str, cost_model: CostModel, config: SimConfig,
                 policy_options: dict | None = None, report_interval: float = REPORT_INTERVAL_S,
                 time_decisions: bool = False) -> None:
        if report_interval <= 0:
            raise ValueError(f"report_interval must be positive, got {report_interval}")
        if config.cache.block_size != router.block_size:
            raise ValueError(f"the router keys {router.block_size}-token blocks, the replicas "
                             f"{config.cache.block_size}-token ones")
        self.jobs = sorted(jobs, key=lambda j: j.arrival_time)
        if len({j.request_id for j in self.jobs}) != len(self.jobs):
            raise ValueError("duplicate request ids in the workload")
        self.router = router
        self.report_interval = report_interval
        self.time_decisions = time_decisions
        self.sims = [Simulator([], policy, cost_model, config, policy_options)
                     for _ in range(router.num_replicas)]
        capacity = config.cache.num_kv_blocks * config.cache.block_size
        for job in self.jobs:  # the replicas see jobs one at a time: check them all up front
            if job.prompt_tokens < 1 or job.output_tokens < 1:
                raise ValueError(f"job {job.request_id}: lengths must be positive")
            if job.prompt_tokens + job.output_tokens > capacity:
                raise ValueError(f"job {job.request_id} needs {job.prompt_tokens + job.output_tokens} "
                                 f"tokens of KV, the pool holds {capacity}")
        self.policy = router.policy

    def run(self) -> ClusterResult:
        router, sims, jobs = self.router, self.sims, self.jobs
        by_id = {j.request_id: j for j in jobs}
        routes: dict[str, int] = {}
        decisions: list[float] = []
        # Per replica, the step that ran and whose tokens the router has not
        # seen yet: (end time, started, finished), or None.
        unseen: list[tuple[float, list[str], list[str]] | None] = [None] * len(sims)
        nxt, next_report = 0, 0.0
        inf = math.inf
        while True:
            t_arr = jobs[nxt].arrival_time if nxt < len(jobs) else inf
            note_r, t_note = -1, inf
            step_r, t_step = -1, inf
            for r, sim in enumerate(sims):
                if unseen[r] is not None and unseen[r][0] < t_note:
                    note_r, t_note = r, unseen[r][0]
                if sim.now < t_step and sim.has_work():
                    step_r, t_step = r, sim.now
            if t_arr == inf and t_step == inf and t_note == inf:
                break
            if t_note <= min(next_report, t_arr, t_step):
                _, started, finished = unseen[note_r]
                unseen[note_r] = None
                for rid in started:
                    router.started(rid)
                for rid in finished:
                    router.finished(rid)
            elif next_report <= min(t_arr, t_step):
                for r, sim in enumerate(sims):
                    if router.healthy(r):
                        note = unseen[r]
                        router.report(r, replica_load(sim, ([by_id[rid] for rid in note[1]], note[2])
                                                      if note else ((), ())))
                next_report += self.report_interval
            elif t_arr <= t_step:
                job = jobs[nxt]
                nxt += 1
                prompt = job.token_ids()
                t0 = time.perf_counter() if self.time_decisions else 0.0
                route = router.route(job.request_id, prompt, offline=job.klass is RequestClass.OFFLINE)
                if self.time_decisions:
                    decisions.append(time.perf_counter() - t0)
                routes[job.request_id] = route.replica
                sims[route.replica].add_job(job)
            else:
                sim = sims[step_r]
                # A replica steps only once the router has heard of its last
                # step (notices go first at equal times): one unseen step at most.
                if sim.step() and (sim.last_started or sim.last_finished):
                    unseen[step_r] = (sim.now, sim.last_started, sim.last_finished)
        stats = [{"query_tokens": s.kv.prefix_stats.query_tokens, "hit_tokens": s.kv.prefix_stats.hit_tokens,
                  "host_hit_tokens": s.kv.prefix_stats.host_hit_tokens} for s in sims]
        return ClusterResult(self.policy, [s.result() for s in sims], routes, router.counters(), stats, decisions)
