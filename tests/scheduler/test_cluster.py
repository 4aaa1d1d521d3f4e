"""Cluster simulation: N simulated replicas on one clock behind the real
router. One replica reproduces the single simulator exactly; every job is
served once with all its tokens; prefix-aware routing finds more of a
shared-prefix workload cached than round-robin; the benchmark's quick mode
runs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fluidserve.scheduler.cluster import Cluster, replica_load
from fluidserve.scheduler.cost_model import default_cost_model
from fluidserve.scheduler.router import make_router
from fluidserve.scheduler.simulator import SimConfig, Simulator
from fluidserve.scheduler.workloads import Job

CM = default_cost_model()
BS = 16
REPO = Path(__file__).resolve().parents[2]


def tenant_jobs(n: int, tenants: int, rate: float, seed: int = 0) -> list[Job]:
    """Each prompt: one of ``tenants`` 1024-token system prompts + its own turn."""
    rng = random.Random(seed)
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        g = rng.randrange(tenants)
        jobs.append(Job(f"j{i}", t, 1024 + rng.randint(16, 200), rng.randint(4, 40), shared_prefix=(g, 1024)))
    return jobs


def config(**kw) -> SimConfig:
    return SimConfig.create(**{"num_kv_blocks": 2000, "block_size": BS, "num_host_blocks": 0, **kw})


def run(jobs: list[Job], policy: str, replicas: int, cfg: SimConfig, **router_kw):
    router = make_router(policy, replicas, block_size=BS, cost_model=CM, **router_kw)
    cluster = Cluster(jobs, router, "skip-join-mlfq", CM, cfg)
    return cluster, cluster.run()


def test_one_replica_is_the_single_simulator():
    jobs = tenant_jobs(60, 4, rate=20.0)
    single = {r.request_id: r for r in Simulator(jobs, "skip-join-mlfq", CM, config()).run().records}
    _, res = run(jobs, "round-robin", 1, config())
    assert len(res.records) == len(single)
    for r in res.records:
        s = single[r.request_id]
        assert (r.first_token_time, r.finish_time, r.cached_tokens) == (s.first_token_time, s.finish_time,
                                                                         s.cached_tokens)


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "prefix-aware"])
def test_every_job_served_once_with_all_its_tokens(policy):
    jobs = tenant_jobs(120, 6, rate=60.0)
    cluster, res = run(jobs, policy, 4, config(check_integrity=True))
    assert sorted(res.routes) == sorted(j.request_id for j in jobs)
    by_replica = [{r.request_id for r in rep.records} for rep in res.replicas]
    assert sum(map(len, by_replica)) == len(jobs)
    for rid, replica in res.routes.items():
        assert rid in by_replica[replica]
    assert all(r.num_emitted == r.output_tokens and r.finish_time is not None for r in res.records)
    # Every start and finish reached the router: nothing left in flight, and
    # the last report of an idle cluster says so.
    assert cluster.router.num_in_flight == 0
    assert all(replica_load(sim).queued_prefill_tokens == 0 for sim in cluster.sims)
    assert sum(res.router_counters["routed"].values()) == len(jobs)


def test_prefix_aware_finds_more_cached_than_round_robin():
    jobs = tenant_jobs(200, 8, rate=40.0, seed=1)
    cfg = config()
    _, rr = run(jobs, "round-robin", 4, cfg)
    _, pa = run(jobs, "prefix-aware", 4, cfg)
    rr_s, pa_s = rr.summary(), pa.summary()
    assert pa_s["prefix_hit_rate"] > rr_s["prefix_hit_rate"] + 0.05
    assert pa_s["routed"].get("prefix", 0) > len(jobs) // 2
    # Most of a tenant's requests land on one replica.
    by_tenant: dict[int, list[int]] = {}
    for job in jobs:
        by_tenant.setdefault(job.shared_prefix[0], []).append(pa.routes[job.request_id])
    top_share = [max(map(reps.count, set(reps))) / len(reps) for reps in by_tenant.values()]
    assert sum(top_share) / len(top_share) > 0.7
    # Less prefill: a lower mean TTFT.
    assert pa_s["mean_ttft_s"] < rr_s["mean_ttft_s"]


def test_no_sharing_prefix_aware_routes_as_least_loaded():
    rng = random.Random(2)
    jobs, t = [], 0.0
    for i in range(80):
        t += rng.expovariate(40.0)
        jobs.append(Job(f"r{i}", t, rng.randint(100, 1500), rng.randint(4, 40)))
    _, ll = run(jobs, "least-loaded", 3, config())
    _, pa = run(jobs, "prefix-aware", 3, config())
    assert pa.routes == ll.routes
    assert pa.summary()["routed"] == {"least-loaded": len(jobs)}


def test_rejects_a_block_size_the_router_does_not_key():
    router = make_router("round-robin", 2, block_size=32)
    with pytest.raises(ValueError, match="block"):
        Cluster(tenant_jobs(4, 1, 10.0), router, "fcfs", CM, config())


def test_routing_benchmark_quick(tmp_path):
    out = subprocess.run([sys.executable, "routing.py", "--quick", "--out-dir", str(tmp_path)],
                         cwd=REPO / "benchmarks", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "routing_quick.json").read_text())
    policies = {(r["workload"], r["policy"]) for r in data["rows"]}
    assert policies == {(w, p) for w in ("tenants", "sharegpt")
                        for p in ("round-robin", "least-loaded", "prefix-aware")}
    assert all(r["num_measured"] > 0 for r in data["rows"])
    assert {t["workload"] for t in data["targets"]} == {"tenants", "sharegpt"}
    assert set(data["decision_time"]) == {"round-robin", "least-loaded", "prefix-aware"}
    assert "Decision time" in (tmp_path / "routing_quick.md").read_text()
