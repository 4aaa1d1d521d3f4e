"""Unit tests of each scheduling rule, on a cost model with exact (power of
two) times so "exactly when the quantum is used" is exact."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.mlfq import MLFQPolicy, SkipJoinMLFQPolicy
from fluidserve.scheduler.options import add_cli_args, options_from_args
from fluidserve.scheduler.policies import POLICIES, FCFSPolicy, FixedPriorityPolicy, make_policy
from fluidserve.scheduler.request_state import RequestClass, SeqState, SeqStatus
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig

MS = 1e-3
DT = 2.0**-6  # one decode iteration: 15.625 ms, exact in binary


def cost(per_prefill_token: float = DT / 8) -> LinearCostModel:
    """decode iteration = DT at any context; prefill of n tokens = DT + n*p."""
    return LinearCostModel(LinearCoefficients(base=DT, per_prefill_token=per_prefill_token,
                                              per_decode_seq=0.0, per_context_token=0.0, per_attn_pair=0.0))


def seq(rid: str, prompt: int = 4, out: int = 8, t: float = 0.0,
        klass: RequestClass = RequestClass.ONLINE) -> SeqState:
    return SeqState(rid, prompt, out, t, klass)


def decode_once(policy, s: SeqState, now: float) -> None:
    """What the scheduler does after a step that ran one decode of ``s``."""
    s.num_computed_tokens += 1
    policy.on_step_done(s, 1, DT, now)
    s.num_output_tokens += 1


def make_decoding(policy, rid: str, t: float = 0.0, prompt: int = 4) -> SeqState:
    """A job whose prompt is cached and first token sampled, service reset."""
    s = seq(rid, prompt=prompt, out=1000, t=t)
    policy.on_arrival(s, t)
    s.num_computed_tokens, s.num_output_tokens = prompt, 1
    s.policy_state["mlfq"].attained = 0.0
    return s


# -- skip-join ------------------------------------------------------------------
def test_quanta_double_from_min_iteration_time():
    p = SkipJoinMLFQPolicy(cost(), num_queues=5)
    assert p.quanta == [DT, 2 * DT, 4 * DT, 8 * DT, 16 * DT]


def test_skip_join_picks_highest_queue_covering_the_prefill():
    p = SkipJoinMLFQPolicy(cost(), num_queues=8)
    # prefill(n) = DT + n*DT/8: 40 tokens -> 6*DT, above q3 = 4*DT, within q4 = 8*DT
    long = seq("long", prompt=40)
    p.on_arrival(long, 0.0)
    assert p.level(long) == 3
    # 8 tokens -> 2*DT = q2 exactly (quantum >= t_init joins)
    mid = seq("mid", prompt=8)
    p.on_arrival(mid, 0.0)
    assert p.level(mid) == 1
    # a prompt longer than every quantum joins the last queue
    huge = seq("huge", prompt=100_000)
    p.on_arrival(huge, 0.0)
    assert p.level(huge) == 7


def test_naive_mlfq_puts_every_job_in_q1():
    p = MLFQPolicy(cost(), num_queues=8)
    long = seq("long", prompt=4000)
    p.on_arrival(long, 0.0)
    assert p.level(long) == 0


def test_skip_join_ranks_short_prompt_ahead_of_earlier_long_one():
    # FastServe's skip-join alone: the first-token guard would keep arrival
    # order here, the long prompt having no slack to give (tested below).
    p = make_policy("skip-join-mlfq", cost_model=cost(), first_token_slack=None)
    long, short = seq("long", prompt=4000, t=0.0), seq("short", prompt=4, t=1.0)
    p.on_arrival(long, 0.0)
    p.on_arrival(short, 1.0)
    assert [s.request_id for s in p.order([long, short], 1.0)] == ["short", "long"]
    fcfs = make_policy("fcfs", cost_model=cost())
    assert [s.request_id for s in fcfs.order([short, long], 1.0)] == ["long", "short"]


# -- demotion -------------------------------------------------------------------
def test_demotion_exactly_when_the_quantum_is_used():
    p = MLFQPolicy(cost(), num_queues=4, base_quantum_ms=4 * DT / MS, starve_limit_ms=1e9)
    s = make_decoding(p, "a")
    for i in range(3):  # 3 iterations of DT < q1 = 4*DT
        decode_once(p, s, now=i)
        assert p.level(s) == 0, i
    decode_once(p, s, now=3)  # attained = 4*DT = q1: used up
    assert p.level(s) == 1
    assert s.policy_state["mlfq"].attained == 0.0
    for i in range(7):  # q2 = 8*DT
        decode_once(p, s, now=10 + i)
        assert p.level(s) == 1
    decode_once(p, s, now=20)
    assert p.level(s) == 2


def test_last_queue_never_demotes():
    p = MLFQPolicy(cost(), num_queues=2, base_quantum_ms=DT / MS, starve_limit_ms=1e9)
    s = make_decoding(p, "a")
    for i in range(20):
        decode_once(p, s, now=i)
    assert p.level(s) == 1


def test_skip_join_demotion_skips_levels_the_next_iteration_would_use_up():
    p = SkipJoinMLFQPolicy(cost(), num_queues=8, starve_limit_ms=1e9)
    s = seq("a", prompt=400)  # prefill(400) = 51*DT -> joins level 6 (q7 = 64*DT)
    p.on_arrival(s, 0.0)
    assert p.level(s) == 6
    e = s.policy_state["mlfq"]
    e.level = 0  # as after a starvation promotion
    # A 16-token chunk (3*DT) uses up q1; the rest of the prompt, 384 tokens,
    # would take 49*DT > q6 = 32*DT, so it skips to level 6, not level 1.
    s.num_computed_tokens = 16
    p.on_step_done(s, 16, 3 * DT, now=1.0)
    assert p.level(s) == 6
    naive = MLFQPolicy(cost(), num_queues=8, starve_limit_ms=1e9)
    t = seq("b", prompt=400)
    naive.on_arrival(t, 0.0)
    t.num_computed_tokens = 16
    naive.on_step_done(t, 16, 3 * DT, now=1.0)
    assert naive.level(t) == 1


# -- first-token guard ------------------------------------------------------------
def guarded(step_tokens: int = 64, slack: int = 0) -> SkipJoinMLFQPolicy:
    p = SkipJoinMLFQPolicy(cost(), num_queues=8, starve_limit_ms=1e9, first_token_slack=slack)
    p.set_step_tokens(step_tokens)
    return p


def test_guard_lifts_a_prompt_whose_fcfs_turn_is_a_step_away():
    """The long prompt came first: FCFS would start it now, within one
    256-token step, so it leads; FCFS would start the later long prompt 400
    tokens on, so the short one passes it."""
    p = guarded(step_tokens=256)
    first, second, short = seq("first", prompt=400, t=0.0), seq("second", prompt=400, t=0.1), seq("short", t=0.2)
    for s in (first, second, short):
        p.on_arrival(s, s.arrival_time)
    assert [s.request_id for s in p.order([first, second, short], 0.3)] == ["first", "short", "second"]
    assert p.level(first) == 0 and p.level(second) == 6 and p.num_lifted == 1
    # Off, FastServe's skip-join ranks by predicted prefill alone.
    off = SkipJoinMLFQPolicy(cost(), num_queues=8, starve_limit_ms=1e9, first_token_slack=None)
    for s in (first, second, short):
        off.on_arrival(s, s.arrival_time)
    assert [s.request_id for s in off.order([first, second, short], 0.3)] == ["short", "first", "second"]


def test_guard_stands_aside_while_an_online_request_is_held_off_the_device():
    p = guarded(step_tokens=256)
    long, short, away = seq("long", prompt=400), seq("short", t=0.1), seq("away")
    away.num_computed_tokens, away.num_output_tokens = 4, 1  # streaming: no first token to guard
    for s in (away, long, short):
        p.on_arrival(s, s.arrival_time)
    away.status = SeqStatus.SWAPPED  # memory binds: skip-join's ranking decides
    assert [s.request_id for s in p.order([long, short, away], 0.2)][:2] == ["away", "short"]
    assert p.num_lifted == 0
    away.status = SeqStatus.RUNNING
    p.age([long, short, away], 0.3)
    assert p.level(long) == 0 and p.num_lifted == 1


def test_a_lifted_prompt_is_not_demoted_before_its_first_token():
    p = guarded(step_tokens=256)
    s = seq("long", prompt=400)
    p.on_arrival(s, 0.0)
    p.order([s], 0.0)
    s.num_computed_tokens = 200  # a chunk far beyond Q1's quantum
    p.on_step_done(s, 200, DT, 0.1)
    assert p.level(s) == 0
    s.num_computed_tokens = 400  # the last chunk samples its first token: MLFQ's rules again
    p.on_step_done(s, 200, DT, 0.2)
    assert p.level(s) > 0 and p.prefilled == 400 and p.backlog == 0


def test_guard_deadlines_count_the_online_prompts_ahead_and_forget_aborted_ones():
    p = guarded(slack=10)
    a, b = seq("a", prompt=100), seq("b", prompt=50, t=0.1)
    off = seq("off", prompt=1000, t=0.05, klass=RequestClass.OFFLINE)
    for s in (a, off, b):
        p.on_arrival(s, s.arrival_time)
    assert "first" not in off.policy_state  # offline work has no first token to guard
    assert a.policy_state["first"].deadline == 110 and b.policy_state["first"].deadline == 160
    p.on_finish(a)  # aborted: its tokens no longer stand ahead of later arrivals
    c = seq("c", prompt=20, t=0.2)
    p.on_arrival(c, 0.2)
    assert p.backlog == 70 and c.policy_state["first"].deadline == 80


def test_first_token_slack_option_and_flag():
    assert SkipJoinMLFQPolicy(cost()).first_token_slack == 0  # on by default
    assert MLFQPolicy(cost()).first_token_slack is None  # naive MLFQ joins Q1 already
    with pytest.raises(ValueError, match="first_token_slack"):
        SkipJoinMLFQPolicy(cost(), first_token_slack=-5)
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert options_from_args(parser.parse_args(["--mlfq-first-token-slack", "off"]))[1] == {"first_token_slack": None}
    assert options_from_args(parser.parse_args(["--mlfq-first-token-slack", "2048"]))[1] == {
        "first_token_slack": 2048}
    with pytest.raises(ValueError, match="first-token-slack"):
        options_from_args(parser.parse_args(["--mlfq-first-token-slack", "-1"]))
    assert make_policy("skip-join-mlfq", first_token_slack=None).first_token_slack is None


def test_the_scheduler_tells_the_policy_its_token_budget():
    s = sched("skip-join-mlfq", blocks=64, max_num_batched_tokens=96)
    assert s.policy.step_tokens == 96


# -- starvation -----------------------------------------------------------------
def test_promotion_to_q1_after_the_starve_limit():
    alpha = 0.5
    p = SkipJoinMLFQPolicy(cost(), num_queues=8, starve_limit_ms=alpha / MS, first_token_slack=None)
    s = seq("long", prompt=400, t=0.0)
    p.on_arrival(s, 0.0)
    assert p.level(s) == 6
    p.order([s], now=alpha - 1e-6)
    assert p.level(s) == 6
    p.order([s], now=alpha + 1e-6)
    assert p.level(s) == 0
    assert p.num_promotions == 1
    # being served restarts the clock
    d = make_decoding(p, "d")
    d.policy_state["mlfq"].level = 3
    decode_once(p, d, now=10.0)
    p.order([d], now=10.0 + alpha - 1e-6)
    assert p.level(d) == 3


def test_default_starve_limit_scales_with_the_model():
    fast, slow = cost(DT / 8), cost(DT)
    a_fast = SkipJoinMLFQPolicy(fast).starve_limit
    a_slow = SkipJoinMLFQPolicy(slow).starve_limit
    assert a_slow > a_fast > 0
    assert SkipJoinMLFQPolicy(fast, starve_limit_ms=300).starve_limit == pytest.approx(0.3)


# -- FCFS inside a queue, class priority -------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_fcfs_inside_a_queue(name):
    p = make_policy(name, cost_model=cost())
    arrivals = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    seqs = [seq(f"r{t}", prompt=4, t=t) for t in arrivals]
    for s in sorted(seqs, key=lambda s: s.arrival_time):
        p.on_arrival(s, s.arrival_time)
    ranked = p.order(list(seqs), now=9.0)
    assert [s.arrival_time for s in ranked] == sorted(arrivals)
    assert sorted(map(id, ranked)) == sorted(map(id, seqs))  # each exactly once


def test_fixed_priority_orders_by_prompt_length():
    p = FixedPriorityPolicy(cost())
    a, b, c = seq("a", prompt=50, t=0), seq("b", prompt=5, t=1), seq("c", prompt=20, t=2)
    assert [s.request_id for s in p.order([a, b, c], 3.0)] == ["b", "c", "a"]


def sched(policy: str = "skip-join-mlfq", blocks: int = 64, block_size: int = 4, **cfg) -> Scheduler:
    config = SchedulerConfig(scheduling_policy=policy, kv_watermark=0.0, **cfg)
    return Scheduler(config, KVCacheManager(blocks, block_size), cost_model=cost())


def run_step(s: Scheduler, now: float):
    plan = s.schedule(now)
    s.update_from_output(plan, StepOutcome(step_time=DT, now=now + DT))
    return plan


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_kept_ranking_is_what_sorting_every_request_gives(policy):
    """The scheduler keeps its ranking between steps (filtering out finished
    requests, sorting again on arrivals, demotions and promotions): at every
    step it must equal a fresh sort of every unfinished request."""
    import random

    rng = random.Random(7)
    s = sched(policy, blocks=96, max_num_seqs=4, max_num_batched_tokens=32,
              policy_options={"starve_limit_ms": 6 * DT / MS} if "mlfq" in policy else {})
    now, n = 0.0, 0
    for _ in range(400):
        if rng.random() < 0.25:
            klass = RequestClass.OFFLINE if rng.random() < 0.3 else RequestClass.ONLINE
            t = now - DT * rng.randrange(3)  # ties in arrival time too
            s.add(seq(f"r{n}", prompt=rng.randrange(1, 60), out=rng.randrange(1, 30), t=t, klass=klass), now)
            n += 1
        if s.seqs and rng.random() < 0.08:
            s.finish(rng.choice(sorted(s.seqs)))
        kept = [x.request_id for x in s.ranked(now)]
        online = [x for x in s.seqs.values() if x.klass is RequestClass.ONLINE]
        offline = [x for x in s.seqs.values() if x.klass is RequestClass.OFFLINE]
        assert kept == [x.request_id for x in s.policy.order(online, now) + s.policy.order(offline, now)]
        plan = s.schedule(now)
        finished = [i.request_id for i in plan.scheduled
                    if i.samples and s.seqs[i.request_id].num_output_tokens + 1 >= s.seqs[i.request_id].max_new_tokens]
        s.update_from_output(plan, StepOutcome(step_time=DT, now=now, finished=finished))
        now += DT
    assert n > 60
    if "mlfq" in policy:  # the cases that re-sort were all met
        assert s.policy.num_demotions > 10 and s.policy.num_promotions > 10


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy_cls", [MLFQPolicy, SkipJoinMLFQPolicy])
def test_decodes_charged_later_change_nothing(policy_cls, mode):
    """MLFQ is not called for most decodes (``SeqState.policy_due``) and
    charges them when it next looks at the job. Against the same policy told
    of every step, on costs that are not exact in binary (so any other order
    of additions would show): the same plans, levels, demotions and
    promotions, and the same service attained to the last bit, through
    arrivals, finishes, evictions (recompute or swap) and starvation."""
    import random

    class EveryStep(policy_cls):
        def _decode_due(self, seq, e, last):
            return seq.num_computed_tokens  # the next step is always reported

    costs = LinearCostModel(LinearCoefficients(base=0.0137, per_prefill_token=3.1e-5, per_decode_seq=1.3e-4,
                                               per_context_token=7.7e-7, per_attn_pair=1.1e-9))
    options = {"cost_model": costs, "base_quantum_ms": 40.0, "starve_limit_ms": 400.0}
    config = SchedulerConfig(kv_watermark=0.0, max_num_seqs=6, max_num_batched_tokens=48, preemption_mode=mode)
    host = 64 if mode == "swap" else 0
    lazy = Scheduler(config, KVCacheManager(40, 4, host), policy=policy_cls(**options))
    eager = Scheduler(config, KVCacheManager(40, 4, host), policy=EveryStep(**options))
    rng = random.Random(11)
    now, n, skipped = 0.0, 0, 0
    for k in range(600):
        if rng.random() < 0.15:
            prompt, out = rng.randrange(1, 40), rng.randrange(1, 80)
            for s in (lazy, eager):
                s.add(seq(f"r{n}", prompt=prompt, out=out, t=now), now)
            n += 1
        plans = [s.schedule(now) for s in (lazy, eager)]
        assert plans[0] == plans[1]
        skipped += sum(1 for i in plans[0].scheduled
                       if i.num_tokens == 1 and lazy.seqs[i.request_id].num_computed_tokens + 1
                       <= lazy.seqs[i.request_id].policy_due)
        finished = [i.request_id for i in plans[0].scheduled
                    if i.samples
                    and lazy.seqs[i.request_id].num_output_tokens + 1 >= lazy.seqs[i.request_id].max_new_tokens]
        step = 0.0137 + 0.001 * rng.random()
        for s, plan in zip((lazy, eager), plans):
            s.update_from_output(plan, StepOutcome(step_time=step, now=now, finished=finished))
        now += step
        if k % 25:  # settling is itself a charge: looked at every step, none would be left owed
            continue
        for rid, a in lazy.seqs.items():
            lazy.policy.settle(a)
            ea, eb = a.policy_state["mlfq"], eager.seqs[rid].policy_state["mlfq"]
            assert (ea.level, ea.earned, ea.attained) == (eb.level, eb.earned, eb.attained)
    assert n > 60 and skipped > 500
    assert (lazy.policy.num_demotions, lazy.policy.num_promotions) == (eager.policy.num_demotions,
                                                                        eager.policy.num_promotions)
    assert lazy.policy.num_demotions > 20 and lazy.policy.num_promotions > 5
    assert lazy.num_preemptions == eager.num_preemptions > 5


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_online_always_ahead_of_offline(policy):
    s = sched(policy, max_num_seqs=1)
    # The offline job came first with the shorter prompt: it still waits.
    s.add(seq("off", prompt=2, t=0.0, klass=RequestClass.OFFLINE), 0.0)
    s.add(seq("on", prompt=40, t=1.0), 1.0)
    for step in range(6):
        plan = run_step(s, 2.0 + step)
        assert [i.request_id for i in plan.scheduled] == ["on"]
        assert not plan.preemptible
    # once the online job is gone the offline one runs, in a preemptible step
    s.finish("on")
    plan = run_step(s, 10.0)
    assert [i.request_id for i in plan.scheduled] == ["off"] and plan.preemptible


def test_job_not_taken_keeps_its_kv():
    s = sched("fixed-priority", max_num_seqs=1)
    s.add(seq("a", prompt=8, t=0.0), 0.0)
    run_step(s, 0.0)  # a prefills alone
    s.add(seq("b", prompt=4, t=1.0), 1.0)  # shorter prompt: ranks first
    plan = run_step(s, 1.0)
    assert [i.request_id for i in plan.scheduled] == ["b"]
    # a is preempted for this iteration only: its KV stays where it is
    assert s.kv.holds("a") and s.seqs["a"].status is SeqStatus.RUNNING
    assert s.seqs["a"].num_computed_tokens == 8 and not plan.preempted
    assert s.num_preemptions == 0
    s.kv.check_integrity()


def test_prefill_does_not_starve_lower_ranked_decodes():
    s = sched("fcfs", max_num_batched_tokens=16, blocks=256)
    for i in range(4):
        s.add(seq(f"d{i}", prompt=2, out=100, t=float(i)), float(i))
    run_step(s, 5.0)  # all four prefill (2 tokens each)
    s.add(seq("p", prompt=200, t=-1.0), 6.0)  # ranks first under FCFS
    plan = run_step(s, 6.0)
    by_id = {i.request_id: i.num_tokens for i in plan.scheduled}
    assert by_id["p"] == 12 and all(by_id[f"d{i}"] == 1 for i in range(4))
    assert plan.num_batched_tokens == 16


def test_new_request_is_admitted_for_its_whole_prompt():
    s = sched("fcfs", max_num_batched_tokens=8, blocks=64, block_size=4)
    s.add(seq("a", prompt=40, t=0.0), 0.0)
    plan = run_step(s, 0.0)
    assert plan.scheduled[0].num_tokens == 8
    assert len(s.kv.block_table("a")) == 10  # all 40 prompt tokens reserved at admission


def test_running_request_preempts_lowest_priority_by_recompute():
    s = sched("fcfs", blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add(seq("old", prompt=7, out=20, t=0.0), 0.0)
    s.add(seq("new", prompt=7, out=20, t=1.0), 1.0)
    run_step(s, 1.0)  # both admitted: 2 blocks each, pool full
    for k in range(4):
        plan = run_step(s, 2.0 + k)
        s.kv.check_integrity()
        if plan.preempted:
            break
    assert plan.preempted == ["new"] and not s.kv.holds("new")
    assert s.seqs["new"].num_computed_tokens == 0 and s.seqs["new"].status is SeqStatus.WAITING


# -- paused steps (layer-wise preemption that keeps its work) --------------------
def _pause_offline_step(s: Scheduler, now: float):
    """Schedule an offline-only step and report it stopped with its state kept."""
    plan = s.schedule(now)
    assert plan.preemptible
    s.update_from_output(plan, StepOutcome(step_time=DT, now=now, abandoned=True, paused=True))
    return plan


def test_a_paused_step_holds_its_requests_until_online_work_drains():
    """While paused, its requests neither run nor lose their KV; online work
    runs alone; when none is left the same plan comes back, marked as
    resuming, and completing it counts its tokens once."""
    s = sched("fcfs", blocks=64, max_num_batched_tokens=16)
    s.add(seq("off", prompt=12, out=4, klass=RequestClass.OFFLINE), 0.0)
    paused = _pause_offline_step(s, 0.0)
    assert s.seqs["off"].num_computed_tokens == 0 and s.paused_requests == 1
    s.add(seq("on", prompt=4, out=2, t=1.0), 1.0)
    for k in range(3):
        plan = run_step(s, 1.0 + k)
        assert [i.request_id for i in plan.scheduled] == ["on"] and not plan.resumes
        assert s.kv.holds("off")
    s.finish("on")
    plan = s.schedule(5.0)
    assert plan.resumes and plan.preemptible and plan.scheduled == paused.scheduled and not plan.has_copies
    s.update_from_output(plan, StepOutcome(step_time=DT, now=5.0))
    assert s.seqs["off"].num_computed_tokens == 12 and s.paused_requests == 0
    assert s.counters.num_resumes == 1 and s.counters.num_dropped_pauses == 0
    assert [i.request_id for i in run_step(s, 6.0).scheduled] == ["off"]  # its decodes run as usual


def test_online_work_that_needs_the_held_kv_gives_the_pause_up():
    """The paused step's blocks are the only ones left: an online arrival
    takes them (the offline request recomputes that chunk later)."""
    s = Scheduler(SchedulerConfig(scheduling_policy="fcfs", kv_watermark=0.0, max_num_batched_tokens=16),
                  KVCacheManager(4, 4, 16), cost_model=cost())  # with a host pool: online may evict
    s.add(seq("off", prompt=14, out=2, klass=RequestClass.OFFLINE), 0.0)
    _pause_offline_step(s, 0.0)
    s.add(seq("on", prompt=8, out=2, t=1.0), 1.0)
    plan = run_step(s, 1.0)
    assert [i.request_id for i in plan.scheduled] == ["on"] and plan.preempted == ["off"]
    assert s.paused_requests == 0 and s.counters.num_dropped_pauses == 1
    assert s.counters.dropped_pause_tokens == 14 and s.seqs["off"].num_computed_tokens == 0
    s.kv.check_integrity()


def test_aborting_a_held_request_gives_the_pause_up():
    s = sched("fcfs", blocks=64, max_num_batched_tokens=32)
    s.add(seq("a", prompt=8, out=2, klass=RequestClass.OFFLINE), 0.0)
    s.add(seq("b", prompt=8, out=2, klass=RequestClass.OFFLINE), 0.0)
    _pause_offline_step(s, 0.0)
    s.finish("a")  # its blocks are free now: the paused forward must never write them
    plan = s.schedule(1.0)
    assert not plan.resumes and [i.request_id for i in plan.scheduled] == ["b"]
    assert s.counters.num_dropped_pauses == 1
    s.kv.check_integrity()


def test_a_pause_that_online_traffic_never_lets_resume_is_given_up(monkeypatch):
    import fluidserve.scheduler.scheduler as mod

    monkeypatch.setattr(mod, "_MAX_PAUSED_STEPS", 3)
    s = sched("fcfs", blocks=64, max_num_batched_tokens=16)
    s.add(seq("off", prompt=8, out=2, klass=RequestClass.OFFLINE), 0.0)
    _pause_offline_step(s, 0.0)
    s.add(seq("on", prompt=4, out=100, t=1.0), 1.0)
    ran = [[i.request_id for i in run_step(s, 1.0 + k).scheduled] for k in range(5)]
    assert ran[:3] == [["on"]] * 3 and "off" in ran[3]  # given up after 3 steps: it runs beside "on"
    assert s.counters.num_dropped_pauses == 1 and s.counters.num_resumes == 0


# -- options and packaging --------------------------------------------------------
def test_cli_options_round_trip():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    name, opts = options_from_args(parser.parse_args([]))
    assert name == "skip-join-mlfq" and opts == {}
    name, opts = options_from_args(parser.parse_args([
        "--scheduling-policy", "mlfq", "--mlfq-num-queues", "4",
        "--mlfq-base-quantum-ms", "5", "--mlfq-starve-limit-ms", "300"]))
    assert name == "mlfq"
    assert opts == {"num_queues": 4, "base_quantum_ms": 5.0, "starve_limit_ms": 300.0}
    p = make_policy(name, **opts)
    assert p.quanta[:2] == [0.005, 0.010] and p.starve_limit == pytest.approx(0.3)
    assert isinstance(make_policy("fcfs", **opts), FCFSPolicy)  # MLFQ knobs ignored
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="num_queue"):
        make_policy("mlfq", num_queue=3)
    with pytest.raises(ValueError, match="num_queues"):
        make_policy("mlfq", num_queues=0)


def test_default_policy_is_skip_join():
    assert SchedulerConfig().scheduling_policy == "skip-join-mlfq"
    s = Scheduler(SchedulerConfig(), KVCacheManager(8, 16))
    assert isinstance(s.policy, SkipJoinMLFQPolicy)


def test_scheduler_modules_import_no_torch():
    code = (
        "import sys\n"
        "import fluidserve.scheduler.scheduler, fluidserve.scheduler.policies, fluidserve.scheduler.mlfq\n"
        "import fluidserve.scheduler.simulator, fluidserve.scheduler.workloads, fluidserve.scheduler.options\n"
        "import fluidserve.scheduler.cost_model, fluidserve.kvcache.manager, fluidserve.kvcache.allocator\n"
        "import fluidserve.engine.profiler\n"
        "bad = [m for m in ('torch', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_counts_report_each_request_by_class_status_and_queue():
    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4),
                  policy=SkipJoinMLFQPolicy(cost(), num_queues=8))
    s.add(seq("long", prompt=40), 0.0)
    s.add(seq("short", prompt=8), 0.0)
    s.add(seq("batch", prompt=8, klass=RequestClass.OFFLINE), 0.0)
    assert s.counts() == {
        ("online", "waiting", "q4"): 1,
        ("online", "waiting", "q2"): 1,
        ("offline", "waiting", "q2"): 1,
    }
    assert Scheduler(SchedulerConfig(), KVCacheManager(8, 4), policy=FCFSPolicy()).policy.queue_label(
        seq("x")) == "all"
