"""Simulator: exact answers on tiny cases, and properties (hypothesis) over
random workloads: no job lost or duplicated, every job finishes with exactly
its tokens, block accounting conserved, same seed -> same result."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel, default_cost_model
from fluidserve.scheduler.policies import POLICIES
from fluidserve.scheduler.request_state import RequestClass
from fluidserve.scheduler.simulator import (
    SimConfig, Simulator, estimate_capacity, percentile, saturated_rate, simulate,
)
from fluidserve.scheduler.workloads import (
    DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, empirical_lengths, gamma_arrivals,
    load_lengths, poisson_arrivals, replay_trace, scale_ratio, synthesize,
)

STEP, PER_TOKEN = 0.01, 0.001
CM = LinearCostModel(LinearCoefficients(base=STEP, per_prefill_token=PER_TOKEN, per_decode_seq=0.0,
                                        per_context_token=0.0, per_attn_pair=0.0))


def test_single_job_timeline_is_exact():
    job = Job("a", 1.0, prompt_tokens=100, output_tokens=5)
    res = simulate([job], "fcfs", CM, SimConfig.create(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64))
    (r,) = res.records
    # prefill in chunks of 64 + 36 tokens, then 4 decode steps
    prefill = (STEP + 64 * PER_TOKEN) + (STEP + 36 * PER_TOKEN)
    assert r.ttft == pytest.approx(prefill)
    assert r.e2e == pytest.approx(prefill + 4 * STEP)
    assert r.max_token_gap == pytest.approx(STEP)
    assert r.num_emitted == 5 and res.num_steps == 6


def test_short_job_overtakes_long_prompt_under_skip_join_not_fcfs():
    jobs = [Job("long", 0.0, 2000, 2), Job("short", 0.001, 10, 2)]
    cfg = SimConfig.create(num_kv_blocks=512, block_size=16, max_num_batched_tokens=128)
    fcfs = {r.request_id: r for r in simulate(jobs, "fcfs", CM, cfg).records}
    sj = {r.request_id: r for r in simulate(jobs, "skip-join-mlfq", CM, cfg,
                                            policy_options={"first_token_slack": None}).records}
    assert sj["short"].finish_time < fcfs["short"].finish_time / 4
    assert sj["short"].finish_time < sj["long"].first_token_time


def test_rejects_jobs_that_can_never_fit():
    with pytest.raises(ValueError, match="KV"):
        Simulator([Job("a", 0.0, 100, 100)], "fcfs", CM, SimConfig.create(num_kv_blocks=4, block_size=16))


jobs_st = st.lists(
    st.tuples(st.floats(0.0, 2.0), st.integers(1, 120), st.integers(1, 24), st.booleans()),
    min_size=1, max_size=14,
)


def build(raw) -> list[Job]:
    return [Job(f"j{i}", t, p, o, RequestClass.OFFLINE if off else RequestClass.ONLINE)
            for i, (t, p, o, off) in enumerate(raw)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=jobs_st,
    policy=st.sampled_from(sorted(POLICIES)),
    block_size=st.sampled_from([4, 8, 16]),
    spare_blocks=st.integers(0, 30),
    budget=st.integers(1, 200),
    cap=st.integers(1, 8),
    chunked=st.booleans(),
    starve_ms=st.sampled_from([None, 5.0, 1000.0]),
    host_blocks=st.sampled_from([0, 3, 40]),
    mode=st.sampled_from(["swap", "recompute"]),
    proactive=st.booleans(),
    swap_cap=st.sampled_from([None, 1, 4]),
    transfer=st.sampled_from([0.0, 2e-3]),
)
def test_every_job_finishes_once_and_blocks_are_conserved(
    raw, policy, block_size, spare_blocks, budget, cap, chunked, starve_ms, host_blocks, mode, proactive,
    swap_cap, transfer,
):
    """Random arrivals through both KV tiers: every job finishes once with
    exactly its tokens, and every block of both pools comes back."""
    jobs = build(raw)
    longest = max(j.prompt_tokens + j.output_tokens for j in jobs)
    if not chunked:
        budget = max(budget, longest)  # a prompt must fit one step unchunked
    cfg = SimConfig.create(num_kv_blocks=-(-longest // block_size) + spare_blocks, block_size=block_size,
                    max_num_batched_tokens=budget, max_num_seqs=cap, enable_chunked_prefill=chunked,
                    num_host_blocks=host_blocks, preemption_mode=mode, proactive_swap=proactive,
                    max_swap_blocks_per_step=swap_cap, block_transfer_time=transfer, check_integrity=True)
    opts = {"starve_limit_ms": starve_ms} if starve_ms else {}
    sim = Simulator(jobs, policy, CM, cfg, opts)
    res = sim.run(max_steps=100_000)
    ids = [r.request_id for r in res.records]
    assert sorted(ids) == sorted(j.request_id for j in jobs)  # none lost, none duplicated
    for job, r in zip(sorted(jobs, key=lambda j: j.arrival_time), res.records):
        assert r.request_id == job.request_id
        assert r.finish_time is not None, r
        assert r.num_emitted == job.output_tokens  # exactly its tokens
        assert job.arrival_time <= r.first_token_time <= r.finish_time
    assert not sim.scheduler.has_unfinished()
    assert sim.kv.num_used_blocks == 0  # every block back on the free list
    assert sim.kv.num_used_host_blocks == 0
    if mode == "recompute" or not host_blocks:
        assert sim.scheduler.counters.num_swap_outs == 0
    sim.kv.check_integrity()
    again = Simulator(jobs, policy, CM, cfg, opts).run()
    assert [dataclasses.astuple(r) for r in again.records] == [dataclasses.astuple(r) for r in res.records]


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), cv=st.sampled_from([1.0, 2.0, 4.0]))
def test_identical_results_for_identical_seeds(seed, cv):
    pairs = [(p, o) for p in (10, 50, 300) for o in (1, 5, 20)]
    def run():
        jobs = synthesize(25, empirical_lengths(pairs), gamma_arrivals(20.0, cv), seed=seed)
        return simulate(jobs, "skip-join-mlfq", CM, SimConfig.create(num_kv_blocks=80, block_size=16,
                                                              max_num_batched_tokens=128)).summary()
    assert run() == run()


def test_workload_generators():
    jobs = synthesize(2000, empirical_lengths([(7, 3)]), poisson_arrivals(10.0), seed=1)
    gaps = [b.arrival_time - a.arrival_time for a, b in zip(jobs, jobs[1:])]
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.1, rel=0.1)
    g = synthesize(4000, empirical_lengths([(7, 3)]), gamma_arrivals(10.0, 4.0), seed=1)
    ggaps = [b.arrival_time - a.arrival_time for a, b in zip(g, g[1:])]
    gm = sum(ggaps) / len(ggaps)
    cv = (sum((x - gm) ** 2 for x in ggaps) / len(ggaps)) ** 0.5 / gm
    assert gm == pytest.approx(0.1, rel=0.25) and 3.0 < cv < 5.0
    pairs = [(100, 10), (300, 30), (200, 20)]
    scaled = scale_ratio(pairs, 1.0)
    mp = sum(p for p, _ in scaled) / 3
    mo = sum(o for _, o in scaled) / 3
    assert mp == pytest.approx(mo, rel=0.02) and mp + mo == pytest.approx(220, rel=0.02)
    assert clamp_lengths([(9000, 500)], 8192) == [(8191, 1)]
    trace = replay_trace([(10.0, 5, 2), (12.0, 6, 3)], speed=2.0)
    assert [j.arrival_time for j in trace] == [0.0, 1.0]


def test_sharegpt_lengths_load_and_simulate():
    pairs = clamp_lengths(load_lengths(DEFAULT_WORKLOAD_DIR / SHAREGPT), 8192)
    assert len(pairs) > 30_000
    cm = default_cost_model()
    cfg = SimConfig.create(num_kv_blocks=cm.num_kv_blocks(16))
    cap = estimate_capacity(pairs, cm, cfg, num_jobs=60)
    assert 1.0 < cap < 100.0
    assert percentile([1, 2, 3, 4], 50) == 2


def test_shared_prefixes_hit_in_both_tiers_and_shorten_ttft():
    """Jobs from more system prompts than a small device pool keeps cached:
    with the host tier caching too, some prompts come back from the host,
    blocks stay conserved every step, and mean TTFT is no worse than with a
    device-only cache, which is no worse than no cache."""
    cost = default_cost_model()
    # One hot system prompt (every other job) and a cycle of six cold ones.
    jobs = [Job(f"j{i}", 0.02 * i, 96 + (i % 5), 4, shared_prefix=(0 if i % 2 else 1 + i % 6, 80)) for i in range(60)]
    cfg = SimConfig.create(num_kv_blocks=40, block_size=8, max_num_batched_tokens=256, num_host_blocks=200,
                    block_transfer_time=1e-5, check_integrity=True)
    ttft = {}
    for label, caching, on_host in (("off", False, False), ("device", True, False), ("both", True, True)):
        sim = Simulator(jobs, "skip-join-mlfq", cost, cfg.replace(enable_prefix_caching=caching,
                                                                  cache_on_host=on_host))
        res = sim.run()
        assert all(r.finish_time is not None for r in res.records)
        st = sim.kv.prefix_stats
        assert (st.host_hit_tokens > 0) == (label == "both")
        assert (st.hit_tokens > 0) == caching
        ttft[label] = sum(r.ttft for r in res.records) / len(res.records)
        assert sim.kv.num_used_blocks == 0 and sim.kv.num_used_host_blocks == 0
    assert ttft["both"] <= ttft["device"] <= ttft["off"]


def test_a_conversations_turns_find_their_history_in_the_prefix_cache():
    """Each turn's prompt extends the previous turn's: with the cache on, a
    later turn finds the earlier prompt's full blocks and computes only the
    rest, while another conversation's turn of the same length finds
    nothing; so the same jobs run faster saturated than if no turn shared."""
    turns = [Job("c0t0", 0.0, 100, 20, conversation=0), Job("c1t0", 0.0, 100, 20, conversation=1),
             Job("c0t1", 5.0, 150, 20, conversation=0), Job("c2t0", 5.0, 150, 20, conversation=2)]
    assert turns[2].token_ids()[:120] == turns[0].token_ids(0, 120)  # its prompt and reply
    assert not set(turns[3].token_ids()) & set(turns[0].token_ids() + turns[1].token_ids())
    cfg = SimConfig.create(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, check_integrity=True)
    cached = {r.request_id: r.cached_tokens for r in simulate(turns, "fcfs", CM, cfg).records}
    # The first turn's prompt and the reply's first 12 tokens: 7 full blocks
    # (as the engine keys generated tokens: the 8th holds only 8 of the reply).
    assert cached == {"c0t0": 0, "c1t0": 0, "c0t1": 112, "c2t0": 0}
    # Saturated, the second turns (queued behind every first turn) reuse
    # the first turns' prompts; without the conversations nothing is shared.
    chats = [Job(f"c{c}t{k}", 0.0, 400 + 200 * k, 8, conversation=c) for k in range(2) for c in range(20)]
    alone = [dataclasses.replace(j, conversation=None) for j in chats]
    big = cfg.replace(num_kv_blocks=1024)  # every first turn stays cached
    assert saturated_rate(chats, CM, big) > 1.3 * saturated_rate(alone, CM, big)
    assert saturated_rate(chats, CM, big.replace(enable_prefix_caching=False)) == pytest.approx(
        saturated_rate(alone, CM, big))


def test_a_turn_that_follows_a_reply_arrives_its_think_time_after_it_ends():
    """Closed-loop conversations: a follow-up turn arrives ``think_time``
    after the reply it answers has finished, so its timeline is the one it
    would have had as a job arriving then; a chain of turns waits link by
    link; a follower of a request not in the workload, or one handed over at
    its arrival, is refused."""
    cfg = SimConfig.create(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64)
    first = Job("a", 1.0, 100, 5)
    turns = [first, Job("b", 0.0, 120, 3, follows="a", think_time=2.0), Job("c", 0.0, 60, 2, follows="b",
                                                                           think_time=0.5)]
    rec = {r.request_id: r for r in simulate(turns, "fcfs", CM, cfg).records}
    assert rec["b"].arrival_time == pytest.approx(rec["a"].finish_time + 2.0)
    assert rec["c"].arrival_time == pytest.approx(rec["b"].finish_time + 0.5)
    (alone,) = simulate([Job("b", rec["b"].arrival_time, 120, 3)], "fcfs", CM, cfg).records
    assert (rec["b"].ttft, rec["b"].e2e) == pytest.approx((alone.ttft, alone.e2e))
    with pytest.raises(ValueError, match="not in the workload"):
        Simulator([Job("x", 0.0, 10, 2, follows="nobody")], "fcfs", CM, cfg)
    sim = Simulator([first], "fcfs", CM, cfg)
    with pytest.raises(ValueError, match="follows"):
        sim.add_job(Job("y", 2.0, 10, 2, follows="a"))


def test_demoting_freed_cached_blocks_never_makes_a_step_wait():
    """Freed cached blocks go to the host on the link's spare credit only:
    their copies fit behind the step that carries them, so where memory
    never binds a run of unique prompts demotes blocks and no step waits on
    the link. (Demotions took the whole credit, two steps' worth, and the
    next step waited for them.)"""
    dt = 2.0**-6  # every step, whatever it runs
    cost = LinearCostModel(LinearCoefficients(base=dt, per_prefill_token=0.0, per_decode_seq=0.0,
                                              per_context_token=0.0, per_attn_pair=0.0))
    jobs = [Job(f"j{i}", 0.1 * i, 64, 8) for i in range(24)]
    cfg = SimConfig.create(num_kv_blocks=256, block_size=4, max_num_batched_tokens=64, num_host_blocks=512,
                           block_transfer_time=dt / 4, max_swap_blocks_per_step=4, check_integrity=True)
    sim = Simulator(jobs, "skip-join-mlfq", cost, cfg)
    res = sim.run()
    assert sim.kv.prefix_stats.demoted_blocks > 0
    assert res.summary()["swap_stall_s"] == 0.0


def test_a_policy_object_runs_as_its_registered_name_does():
    """Benchmarks pass reference policies the engine does not offer as
    objects: an object of a registered policy must run exactly as its name."""
    from fluidserve.scheduler.policies import SkipJoinMLFQPolicy

    cost = default_cost_model()
    jobs = [Job(f"j{i}", 0.01 * i, 40 + 30 * (i % 4), 3 + 5 * (i % 3)) for i in range(30)]
    cfg = SimConfig.create(num_kv_blocks=24, block_size=8, max_num_batched_tokens=128, num_host_blocks=64,
                           block_transfer_time=1e-5, check_integrity=True)
    by_name = simulate(jobs, "skip-join-mlfq", cost, cfg)
    by_object = simulate(jobs, SkipJoinMLFQPolicy(cost_model=cost), cost, cfg)
    assert by_object.policy == by_name.policy == "skip-join-mlfq"
    assert [(r.request_id, r.first_token_time, r.finish_time) for r in by_object.records] == \
        [(r.request_id, r.first_token_time, r.finish_time) for r in by_name.records]


def test_prefix_cache_benchmark_runs(tmp_path):
    """benchmarks/prefix_cache_sim.py --quick end to end: it builds its
    configs through the same API as the simulator (a rename there once broke
    it unnoticed), and its cache variants hit where they should."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_cache_sim.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "prefix_cache_sim_quick.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"cache off", "device cache", "device + host cache"}
    for r in rows:
        assert r["num_finished"] == r["num_jobs"]
        assert (r["device_hit_rate"] > 0) == (r["variant"] != "cache off")
        assert (r["host_hit_rate"] > 0) == (r["variant"] == "device + host cache")


def test_swapping_benchmark_splits_the_mean_above_its_floor(tmp_path):
    """benchmarks/swapping.py --quick, one seed and no sweeps, end to end:
    every run finishes its jobs, each mean normalized latency is its
    first-token share plus its decode share, and each job alone on an idle
    device is a floor under every variant of its preset (none for the chat
    mix, whose turns find earlier turns in the prefix cache)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "swapping.py"
    none = ["--slack-sweep", "", "--loan-sweep", "", "--starving-sweep", "", "--growth-sweep", "", "--guard-sweep",
            "", "--cache-sweep", "", "--gap-sweep", ""]
    # Two workers: the simulator's runs split across CI's two cores (beside the other test worker's test).
    done = subprocess.run([sys.executable, str(script), "--quick", "--seeds", "0", "--workers", "2",
                           "--out-dir", str(tmp_path), *none], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "swapping_quick.json").read_text())["rows"]
    alone = {r["preset"]: r for r in rows if r["variant"].startswith("each job alone")}
    presets = {r["preset"] for r in rows}
    assert set(alone) == {p for p in presets if not p.endswith(" chat")}
    for r in rows:
        assert r["mean_ttft_share_s"] + r["mean_decode_share_s"] == pytest.approx(r["mean_norm_latency_s"])
        if r in alone.values():
            continue
        assert r["num_finished"] == r["num_jobs"]
        if r["preset"] in alone:
            assert r["mean_norm_latency_s"] >= alone[r["preset"]]["mean_norm_latency_s"]
    md = (tmp_path / "swapping_quick.md").read_text()
    shares = md.split("## Where the mean goes")[1].split("\n## ")[0]
    for p in presets:
        assert (f"| {p} | each job alone" in shares) == (p in alone and "arxiv" not in p and "does not bind" not in p)


def test_token_budget_benchmark_runs_both_sides_at_each_budget(tmp_path):
    """benchmarks/token_budget.py --quick on the 1/8 pool, end to end: both
    variants run at both budgets on the same jobs and finish them; a
    smaller budget cuts fcfs + recompute's prompts into more steps and
    lowers its P99 TPOT (each step carrying a chunk is shorter); and the
    knee it reports is where a chunk beside a decode starts to cost it: half
    the knee leaves the step within 5% of the decode alone, four knees make
    it over 2.5x."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "token_budget.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--presets", "pool/8 sharegpt", "--budgets", "512",
                           "--workers", "1", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "token_budget_quick.json").read_text())
    rows = {(r["budget"], r["variant"]): r for r in data["rows"]}
    assert {b for b, _ in rows} == {512, 2048} and len(rows) == 4
    assert all(r["num_steps"] > 0 for r in rows.values())
    fcfs = {b: r for (b, v), r in rows.items() if v.startswith("fcfs")}
    assert fcfs[512]["num_steps"] > fcfs[2048]["num_steps"]
    assert fcfs[512]["p99_tpot_s"] < fcfs[2048]["p99_tpot_s"]
    (small,) = [s for s in data["summary"] if s["budget"] == 512]
    assert small["fcfs_vs_fcfs_base"][2] == pytest.approx(fcfs[512]["p99_tpot_s"] / fcfs[2048]["p99_tpot_s"])
    knee = next(iter(data["presets"].values()))["knee_tokens"]
    cm = RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())
    alone = cm.step_time(0, 1, 512)
    assert cm.step_time(knee // 2, 1, 512) < 1.05 * alone
    assert cm.step_time(4 * knee, 1, 512) > 2.5 * alone
    assert "| 512 |" in (tmp_path / "token_budget_quick.md").read_text()


def test_first_token_guard_keeps_arrival_order_only_without_slack():
    """The engine's skip-join with its first-token guard (the default, slack
    0): a long prompt that arrived first has no slack to give, so a short
    prompt after it waits as under FCFS; with a slack of thousands of tokens
    it passes, as under FastServe's skip-join."""
    jobs = [Job("long", 0.0, 2000, 2), Job("short", 0.001, 10, 2)]
    cfg = SimConfig.create(num_kv_blocks=512, block_size=16, max_num_batched_tokens=128)
    fcfs = {r.request_id: r for r in simulate(jobs, "fcfs", CM, cfg).records}
    tight = {r.request_id: r for r in simulate(jobs, "skip-join-mlfq", CM, cfg).records}
    loose = {r.request_id: r for r in simulate(jobs, "skip-join-mlfq", CM, cfg,
                                               policy_options={"first_token_slack": 4096}).records}
    for rid in ("long", "short"):
        assert tight[rid].first_token_time == pytest.approx(fcfs[rid].first_token_time)
    assert tight["short"].first_token_time >= tight["long"].first_token_time
    assert loose["short"].finish_time < loose["long"].first_token_time


def test_a_request_swapped_out_of_a_pool_it_fills_comes_back_once_alone():
    """A job whose KV fills the whole pool is swapped out for a short one
    that arrives as it decodes; once that ends, the pool is empty and it must
    come back: the watermark guards the growth of running requests, and
    with none running it keeps no block from it."""
    cm = default_cost_model()
    jobs = [Job("big", 0.0, 2606, 21), Job("small", 0.03125, 17, 2)]  # 2627 tokens: 165 blocks of 16
    cfg = SimConfig.create(num_kv_blocks=165, block_size=16, max_num_batched_tokens=512, num_host_blocks=400,
                           preemption_mode="swap", proactive_swap=True,
                           block_transfer_time=cm.transfer_time(16 * cm.model.kv_bytes_per_token))
    res = simulate(jobs, "fixed-priority", cm, cfg)
    assert res.swap_stats["num_swap_outs"] == 1  # the case: "big" did leave the pool
    assert all(r.num_emitted == r.output_tokens for r in res.records)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(1, 3000), st.integers(1, 40)), min_size=2, max_size=12),
    policy=st.sampled_from(sorted(POLICIES)),
    mode=st.sampled_from(["swap", "recompute"]),
    spare_blocks=st.integers(0, 40),
)
def test_no_job_finishes_sooner_in_company_than_alone(raw, policy, mode, spare_blocks):
    """On the roofline model every step a job shares costs at least what its
    own part would alone, and sharing only splits its prefill into more
    chunks: so no policy serves a job faster than an idle device does. The
    floor ``benchmarks/swapping.py`` reports under every variant rests on it.
    Up to a hair: a job beside it can move where its prompt's chunks end.
    513 tokens alone run as 512 + 1, beside a five-token prompt as 507 + 6;
    the 5 tokens moved take their attention over the context out of a
    compute-bound step into a memory-bound one, where it is free. At most
    the other jobs' tokens of attention over the job's whole length, and of
    context read in each of its steps."""
    cm = default_cost_model()
    jobs = [Job(f"j{i}", t, p, o) for i, (t, p, o) in enumerate(raw)]
    blocks = max(-(-(j.prompt_tokens + j.output_tokens) // 16) for j in jobs) + spare_blocks
    cfg = SimConfig.create(num_kv_blocks=blocks, block_size=16, max_num_batched_tokens=512, num_host_blocks=400,
                           preemption_mode=mode, proactive_swap=mode == "swap",
                           block_transfer_time=cm.transfer_time(16 * cm.model.kv_bytes_per_token))
    together = {r.request_id: r for r in simulate(jobs, policy, cm, cfg).records}
    m, d = cm.model, cm.device
    pair_time = 4 * m.num_layers * m.num_heads * m.hd / (d.peak_flops * d.flops_efficiency)  # QK^T and PV
    token_read_time = m.kv_bytes_per_token / (d.hbm_bandwidth * d.memory_efficiency)
    for j in jobs:
        (alone,) = simulate([dataclasses.replace(j, arrival_time=0.0)], policy, cm, cfg).records
        r = together[j.request_id]
        others = sum(o.prompt_tokens + o.output_tokens for o in jobs if o is not j)
        length, steps = j.prompt_tokens + j.output_tokens, -(-j.prompt_tokens // 512) + j.output_tokens
        hair = others * (length * pair_time + steps * token_read_time)
        assert r.ttft >= alone.ttft - hair, (j, r, alone)
        assert r.e2e >= alone.e2e - hair, (j, r, alone)


def _swapping_module():
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    import swapping

    return swapping


def test_size_blind_reference_follows_the_lengths_shape():
    """benchmarks/swapping.py's size-blind reference (the Gittins index for
    mean normalized latency on a known length distribution): on half
    1-token and half 100-token jobs, a new job's index is the 1-token half's
    (1/2 done per decode, 1/2 weight each), and one that has emitted a token
    is a 100-token job for sure, (1/100 weight)/(99 decodes) of it: served
    least first, as skip-join does. Where the hazard rises (lengths 100-200
    uniform) the index rises with the tokens emitted: it keeps serving who
    started. A prompt still to compute lowers a new job's index."""
    sw = _swapping_module()
    cm = default_cost_model()
    d = cm.min_iteration_time() / 16
    two = sw.SizeBlindPolicy(cm, [1, 100])
    assert two.index(0, 0.0) == pytest.approx(0.5 / d)
    assert two.index(1, 0.0) == pytest.approx(0.5 / 100 / (0.5 * 99 * d))
    assert two.index(100, 0.0) == math.inf
    rising = sw.SizeBlindPolicy(cm, range(100, 201))
    marks = [rising.index(a, 0.0) for a in (0, 50, 100, 150, 199)]
    assert marks == sorted(marks) and marks[0] < marks[-1]
    assert two.index(0, cm.prefill_time(512)) < two.index(0, 0.0)
    # mean_remaining: what the markdown's table reports.
    assert sw.mean_remaining([1, 100], [0, 1, 100]) == [(0, 1.0, 50.5), (1, 0.5, 99.0), (100, 0.0, 0.0)]


def test_size_blind_reference_orders_by_the_lengths_shape():
    """Its ranking (what the simulator asks of a policy object): a job that
    has emitted 150 tokens ranks above a new one where every length is
    100-200 tokens (it is nearer its end), below it where nine in ten jobs
    end at their first token (the new one is likely one of them)."""
    from fluidserve.scheduler.request_state import SeqState

    sw = _swapping_module()
    cm = default_cost_model()

    def seqs():
        started = SeqState("started", 32, 400, 0.0, num_output_tokens=150, num_computed_tokens=181, arrival_index=0)
        new = SeqState("new", 32, 400, 1.0, arrival_index=1)
        return [started, new]

    rising = sw.SizeBlindPolicy(cm, range(100, 201))
    falling = sw.SizeBlindPolicy(cm, [1] * 90 + [200] * 10)
    assert [s.request_id for s in rising.order(seqs(), 1.0)] == ["started", "new"]
    assert [s.request_id for s in falling.order(seqs(), 1.0)] == ["new", "started"]
