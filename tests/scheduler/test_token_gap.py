"""Token deadlines under swapping (scheduler/token_gap.py): the TPOT slack
and the gap bound hold in the simulator (the real Scheduler) where they can,
a request swapped in is not evicted again before its quantum, and where
memory does not bind deadlines change no schedule."""

from __future__ import annotations

import argparse

import pytest

from fluidserve.engine import SamplingParams
from fluidserve.kvcache.config import add_flags
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.cost_model import (
    DeviceSpec, LinearCoefficients, LinearCostModel, ModelShape, RooflineCostModel, tokens_for_time,
)
from fluidserve.scheduler.simulator import SimConfig, Simulator, simulate
from fluidserve.scheduler.token_gap import TokenDeadlines
from fluidserve.scheduler.workloads import Job

from token_paths import PROMPTS, hf_greedy

DT = 2.0**-6  # one step, whatever it runs: a request's own pace


def cost(per_prefill_token: float = 0.0) -> LinearCostModel:
    return LinearCostModel(LinearCoefficients(base=DT, per_prefill_token=per_prefill_token, per_decode_seq=0.0,
                                              per_context_token=0.0, per_attn_pair=0.0))


def jobs() -> list[Job]:
    """Two long decodes, then a stream of short jobs that skip-join ranks
    above them once they are demoted; the device holds the two long jobs
    and about two short ones."""
    return ([Job("long0", 0.0, 8, 60), Job("long1", 0.0, 8, 60)]
            + [Job(f"s{i}", 0.3 + 0.05 * i, 40, 12) for i in range(24)])


def config(**kw) -> SimConfig:
    # Copies take no time: a step's length is DT, so a request's TPOT over DT
    # is its slowdown against running every step. The deadlines bound
    # FastServe's own rule (a request ranked higher may evict any stream):
    # KV loans, on by default, keep streams in place by other means.
    kw.setdefault("swap_loan_tokens", -1)
    return SimConfig.create(num_kv_blocks=64, block_size=4, num_host_blocks=400, block_transfer_time=0.0,
                            max_swap_blocks_per_step=64, check_integrity=True, **kw)


def test_tpot_slack_holds_every_stream_to_its_own_pace():
    slack = 1.5
    free = simulate(jobs(), "skip-join-mlfq", cost(), config())
    assert free.swap_stats["num_swap_outs"] > 0
    assert max(r.tpot for r in free.records) > slack * DT  # evicted for the arrivals, long away
    held = simulate(jobs(), "skip-join-mlfq", cost(), config(swap_tpot_slack=slack))
    assert all(r.finish_time is not None for r in held.records)
    assert held.swap_stats["num_swap_outs"] > 0  # slack is spent on evictions, not hoarded
    assert max(r.tpot for r in held.records) <= slack * DT * (1 + 1e-9)


def test_the_gap_bound_holds_where_it_is_feasible():
    bound = 6 * DT  # a round trip (three steps) and more fit in it
    free = simulate(jobs(), "skip-join-mlfq", cost(), config())
    assert max(r.max_token_gap for r in free.records) > 2 * bound
    bounded = simulate(jobs(), "skip-join-mlfq", cost(), config(max_token_gap_ms=bound * 1e3))
    assert all(r.finish_time is not None for r in bounded.records)
    assert max(r.max_token_gap for r in bounded.records) <= bound * (1 + 1e-9)
    assert bounded.summary()["max_latency_bound_s"] <= bound * (1 + 1e-9)
    assert bounded.swap_stats["num_deadline_promotions"] > 0


def test_a_request_swapped_in_is_not_evicted_again_before_its_quantum():
    # A watermark leaves running requests room to grow: a request that must
    # grow with nothing else to evict may still take one inside its quantum.
    sim = Simulator(jobs(), "skip-join-mlfq", cost(), config(swap_tpot_slack=4.0, kv_watermark=0.1))
    sched = sim.scheduler
    due: dict[str, int] = {}  # computed tokens each must reach after its swap-in
    early: list[tuple[str, int, int]] = []
    schedule = sched.schedule

    def watch(now):
        before = {rid: s.num_computed_tokens for rid, s in sched.seqs.items()}
        plan = schedule(now)
        for rid in plan.swapped_out:
            g = due.pop(rid, None)
            if g is not None and before[rid] < g:
                early.append((rid, before[rid], g))
        for rid in plan.swapped_in:
            seq = sched.seqs[rid]
            due[rid] = seq.num_tokens - 1 + sched.policy.quantum_tokens(seq)
        return plan

    sched.schedule = watch
    res = sim.run()
    assert res.swap_stats["num_swap_ins"] > 0 and res.swap_stats["num_swap_outs"] > 0
    assert max(due.values(), default=0) > 1  # quanta longer than a step were asked for
    assert early == []


def test_where_memory_does_not_bind_deadlines_change_nothing():
    """A pool that holds every job: no eviction, and the same token times
    with deadlines as with the default flags (none), prompts long enough
    that steps differ in length."""
    work = [Job(f"j{i}", 0.02 * i, 30 + 17 * (i % 5), 6 + 11 * (i % 3)) for i in range(30)]

    def run(**kw):
        cfg = SimConfig.create(num_kv_blocks=2000, block_size=4, num_host_blocks=400, block_transfer_time=DT / 64,
                               max_swap_blocks_per_step=64, max_num_batched_tokens=64, **kw)
        return simulate(work, "skip-join-mlfq", cost(DT / 32), cfg)

    held, default = run(swap_tpot_slack=1.25, max_token_gap_ms=1e3 * 8 * DT), run()
    assert held.swap_stats["num_swap_outs"] == 0
    key = [(r.first_token_time, r.finish_time, r.max_token_gap) for r in held.records]
    assert key == [(r.first_token_time, r.finish_time, r.max_token_gap) for r in default.records]
    # Where memory binds, the deadlines change the schedule (this test can fail).
    assert ([r.finish_time for r in simulate(jobs(), "skip-join-mlfq", cost(), config(swap_tpot_slack=1.25)).records]
            != [r.finish_time for r in simulate(jobs(), "skip-join-mlfq", cost(), config()).records])


def test_budgets_from_the_config():
    assert TokenDeadlines.from_config(SchedulerConfig(), 0.01) is None  # the default: no deadlines
    d = TokenDeadlines.from_config(SchedulerConfig(swap_tpot_slack=1.25), 0.01)
    assert d.slack == 1.25 and d.tpot_s is None and d.gap_s is None
    d = TokenDeadlines.from_config(SchedulerConfig(online_tpot_slo_ms=50.0, max_token_gap_ms=200.0), 0.01)
    assert d.slack is None and d.tpot_s == 0.05 and d.gap_s == 0.2  # the SLO replaces the relative budget
    assert SchedulerConfig(swap_tpot_slack=0).swap_tpot_slack is None  # 0: off
    with pytest.raises(ValueError, match="swap_tpot_slack"):
        SchedulerConfig(swap_tpot_slack=0.5)
    with pytest.raises(ValueError, match="max_token_gap_ms"):
        SchedulerConfig(max_token_gap_ms=0.0)


def test_the_budgets_are_serve_flags():
    parser = argparse.ArgumentParser()
    add_flags(parser, SchedulerConfig)
    args = parser.parse_args(["--max-token-gap-ms", "150", "--swap-tpot-slack", "2"])
    assert args.max_token_gap_ms == 150.0 and args.swap_tpot_slack == 2.0
    args = parser.parse_args([])
    assert args.max_token_gap_ms is None and args.swap_tpot_slack is None


def test_the_engine_under_deadlines_generates_the_same_tokens(tiny_model, make_llm):
    """The real engine, a device pool that holds two requests at a time and
    eight requests, token deadlines on: requests still move to the host and
    back, every KV block comes back, and greedy tokens equal transformers'."""
    path = tiny_model("llama")
    llm = make_llm(path, num_kv_blocks=10, block_size=8, max_model_len=64, num_host_blocks=64,
                   swap_tpot_slack=2.0, max_token_gap_ms=60_000.0)
    assert llm.engine.scheduler.deadlines is not None
    prompts = [p[:20] for p in PROMPTS] * 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    c = llm.engine.scheduler.counters
    assert c.num_swap_outs > 0 and c.num_swap_ins == c.num_swap_outs
    assert not llm.engine.scheduler.deadlines.first_token  # finished requests leave no state behind


def _h100() -> RooflineCostModel:
    return RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())


def test_the_gap_bound_cuts_prompt_chunks_beside_streams():
    """A gap bound shorter than a full-budget step: a stream's next token
    waits for the step's end, so a prompt arriving beside streams is cut
    into chunks whose steps keep the bound, and every stream's gaps keep
    it; without the bound the prompt's full-budget chunk breaks it. The
    prompt alone (no stream beside it) still takes the whole budget."""
    cm = _h100()
    full = cm.step_time(2048, 4, 4 * 64)
    bound = full / 2
    work = [Job(f"s{i}", 0.0, 32, 200) for i in range(4)] + [Job("p", 0.2, 6000, 4)]

    def run(**kw):
        cfg = SimConfig.create(num_kv_blocks=4096, block_size=16, num_host_blocks=64, max_num_batched_tokens=2048,
                               block_transfer_time=1e-5, **kw)
        return {r.request_id: r for r in simulate(work, "skip-join-mlfq", cm, cfg).records}

    free, bounded = run(), run(max_token_gap_ms=bound * 1e3)
    assert max(free[f"s{i}"].max_token_gap for i in range(4)) > bound
    assert all(r.finish_time is not None for r in bounded.values())
    assert max(bounded[f"s{i}"].max_token_gap for i in range(4)) <= bound * (1 + 1e-9)
    # Cut finer, the prompt's first token comes later, but within a few steps more.
    assert free["p"].ttft < bounded["p"].ttft < free["p"].ttft + 8 * bound
    alone = simulate([Job("p", 0.0, 6000, 4)], "skip-join-mlfq", cm,
                     SimConfig.create(num_kv_blocks=4096, block_size=16, num_host_blocks=64,
                                      max_num_batched_tokens=2048, max_token_gap_ms=bound * 1e3)).records[0]
    assert alone.ttft == pytest.approx(sum(cm.prefill_time(n, c) for n, c in ((2048, 0), (2048, 2048), (1904, 4096))))


def test_a_gap_bound_the_decodes_alone_break_still_lets_prompts_progress():
    """Where the decodes alone take longer than the bound, the bound gives
    way: prompts are cut to the chunk whose fixed cost is half its time
    (scheduler.GAP_FLOOR_OVERHEAD), not finer, so they keep up at half
    their full-chunk rate or better and every request finishes."""
    from fluidserve.scheduler import scheduler as scheduler_module

    cm = _h100()
    floor = tokens_for_time(cm, cm.min_iteration_time() / scheduler_module.GAP_FLOOR_OVERHEAD)
    assert 64 < floor < 2048
    bound = cm.min_iteration_time() / 2  # shorter than any step
    work = [Job(f"s{i}", 0.0, 32, 100) for i in range(8)] + [Job("p", 0.05, 3000, 4)]
    cfg = SimConfig.create(num_kv_blocks=4096, block_size=16, num_host_blocks=64, max_num_batched_tokens=2048,
                           block_transfer_time=1e-5, max_token_gap_ms=bound * 1e3)
    sim = Simulator(work, "skip-join-mlfq", cm, cfg)
    chunks: list[int] = []
    schedule = sim.scheduler.schedule

    def watch(now):
        plan = schedule(now)
        chunks.extend(item.num_tokens for item in plan.scheduled if item.request_id == "p" and item.num_tokens > 1)
        return plan

    sim.scheduler.schedule = watch
    res = sim.run()
    assert all(r.finish_time is not None for r in res.records)
    assert chunks[:-1] == [floor] * (len(chunks) - 1) and sum(chunks) == 3000


def test_the_engine_cuts_prompts_beside_streams_and_keeps_its_tokens(tiny_model, make_llm):
    """The real engine under a gap bound no step can keep, with the floor
    set to 4 tokens: prompts admitted beside streams are computed in
    chunks of 4, and greedy tokens still equal transformers'."""
    path = tiny_model("llama")
    llm = make_llm(path, num_kv_blocks=24, block_size=8, max_model_len=160, num_host_blocks=64,
                   max_token_gap_ms=1e-3)
    sched = llm.engine.scheduler
    sched._gap_floor = 4
    cut: list[int] = []
    schedule = sched.schedule

    def watch(now):
        plan = schedule(now)
        decodes = sum(1 for item in plan.scheduled if item.num_tokens == 1)
        for item in plan.scheduled:
            seq = sched.seqs[item.request_id]
            if decodes and 1 < item.num_tokens < seq.num_prompt_tokens - seq.num_computed_tokens:
                cut.append(item.num_tokens)
        return plan

    sched.schedule = watch
    prompts = [f"request {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 16)
    assert len(cut) >= 4 and set(cut) == {4}
    assert sched.kv.num_used_blocks == 0
