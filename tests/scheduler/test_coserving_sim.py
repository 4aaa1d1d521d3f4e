"""Co-serving in the scheduler and the simulator: an online arrival never
waits on the copy budget for offline KV (an offline victim that cannot move
now is discarded), and an offline-only step is abandoned at the first layer
safepoint after an online arrival (ConServe §4.3), its work redone later."""

from __future__ import annotations

import pytest

from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig
from fluidserve.scheduler.simulator import SimConfig, simulate
from fluidserve.scheduler.workloads import Job

CM = LinearCostModel(LinearCoefficients(base=0.01, per_prefill_token=0.001, per_decode_seq=0.0,
                                        per_context_token=0.0, per_attn_pair=0.0))


def _full_of_offline(klass_of_arrival: RequestClass) -> tuple[Scheduler, SeqState]:
    kv = KVCacheManager(16, 4, num_host_blocks=64)
    s = Scheduler(SchedulerConfig(max_swap_blocks_per_step=1, kv_watermark=0.0, kv_checkpoint_threshold=None,
                                  proactive_swap=False), kv)
    for i in range(2):  # 8 blocks each: the device is full
        s.add(SeqState(f"off{i}", 32, 8, 0.0, RequestClass.OFFLINE), 0.0)
    plan = s.schedule(0.0)
    s.update_from_output(plan, StepOutcome(0.01, 0.01))
    assert kv.num_free_blocks == 0
    arrival = SeqState("new", 8, 4, 0.02, klass_of_arrival)
    s.add(arrival, 0.02)
    return s, arrival


def test_online_arrival_discards_offline_kv_rather_than_wait_for_the_copy_budget():
    s, online = _full_of_offline(RequestClass.ONLINE)
    plan = s.schedule(0.02)  # a swap-out of 8 blocks would take 8 steps of budget
    assert "new" in [i.request_id for i in plan.scheduled]
    assert s.counters.num_recomputes == 1 and plan.preempted
    s.kv.check_integrity()


def test_offline_arrival_waits_for_room_instead():
    s, offline = _full_of_offline(RequestClass.OFFLINE)
    plan = s.schedule(0.02)
    assert "new" not in [i.request_id for i in plan.scheduled]
    assert s.counters.num_recomputes == 0


def test_layer_wise_preemption_in_the_simulator_cuts_online_ttft():
    """Long offline prompts run in offline-only steps; an online request
    arrives in the middle of one. With safepoints every 1/8 of a step it
    runs right after the next safepoint; without, after the whole step."""
    offline = [Job(f"off{i}", 0.0, 2000, 4, RequestClass.OFFLINE) for i in range(3)]
    online = [Job("on", 0.5, 16, 4)]
    # The TPOT budget keeps offline chunks out of the online request's step.
    cfg = SimConfig.create(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=2048, online_tpot_slo_ms=50.0,
                           check_integrity=True, model_layers=8, preemption_safepoint_layers=0)
    plain = simulate(offline + online, "skip-join-mlfq", CM, cfg)
    cut = simulate(offline + online, "skip-join-mlfq", CM,
                   cfg.replace(preemption_safepoint_layers=1))
    ttft = {name: next(r.ttft for r in res.records if r.request_id == "on") for name, res in
            (("plain", plain), ("cut", cut))}
    step = 0.01 + 2000 * 0.001  # one offline prefill step
    assert cut.swap_stats["num_steps_abandoned"] >= 1 and plain.swap_stats["num_steps_abandoned"] == 0
    assert ttft["cut"] < ttft["plain"] - step / 4
    assert ttft["cut"] <= step / 8 + 0.05 + 1e-9  # one safepoint slice, then a step within the budget
    assert all(r.finish_time is not None for r in cut.records)
    # The stopped step resumed where it stopped: no compute was lost, and
    # the device was busy exactly as long as without preemption. Thrown away
    # instead (no resume), the same arrivals cost the part before the cut.
    assert cut.swap_stats["num_resumes"] == cut.swap_stats["num_steps_abandoned"]
    assert cut.busy_time == pytest.approx(plain.busy_time, rel=1e-9)
    lost = simulate(offline + online, "skip-join-mlfq", CM,
                    cfg.replace(preemption_safepoint_layers=1, resume_paused_steps=False))
    assert lost.swap_stats["num_resumes"] == 0 and lost.busy_time > plain.busy_time + step / 8


def test_an_arrival_interrupts_whatever_the_ttft_slo():
    """A TTFT SLO the running step could meet still lets the arrival stop it
    at the next safepoint (the step resumes: no compute is lost)."""
    offline = [Job(f"off{i}", 0.0, 2000, 4, RequestClass.OFFLINE) for i in range(3)]
    online = [Job("on", 0.5, 16, 4)]
    cfg = SimConfig.create(num_kv_blocks=1024, block_size=16, max_num_batched_tokens=2048,
                           model_layers=8, preemption_safepoint_layers=1, online_ttft_slo_ms=5000.0)
    res = simulate(offline + online, "skip-join-mlfq", CM, cfg)
    assert res.swap_stats["num_steps_abandoned"] >= 1
    assert res.swap_stats["num_resumes"] == res.swap_stats["num_steps_abandoned"]


def test_online_arrival_takes_offline_kv_before_online_kv():
    # The device holds a demoted online request and an offline one; the
    # arrival's room comes from the offline request alone, whatever order
    # the policy would evict them in.
    kv = KVCacheManager(16, 4, num_host_blocks=64)
    s = Scheduler(SchedulerConfig(kv_watermark=0.0, kv_checkpoint_threshold=None, proactive_swap=False), kv)
    s.add(SeqState("on0", 12, 16, 0.0, RequestClass.ONLINE), 0.0)
    s.add(SeqState("off0", 32, 8, 0.0, RequestClass.OFFLINE), 0.0)
    now = 0.0
    for _ in range(4):  # on0 decodes: its MLFQ level drops below an arrival's
        plan = s.schedule(now)
        now += 0.01
        s.update_from_output(plan, StepOutcome(0.01, now))
    prompt = 4 * (kv.num_free_blocks + 2)  # it fits only if someone leaves
    s.add(SeqState("on1", prompt, 4, now, RequestClass.ONLINE), now)
    plan = s.schedule(now)
    ran = [i.request_id for i in plan.scheduled]
    assert "on1" in ran and "on0" in ran and "off0" not in ran
    assert kv.holds("on0") and not kv.holds("off0")
    s.kv.check_integrity()


@pytest.mark.parametrize("beside_online", [True, False])
def test_checkpoint_copies_stay_out_of_online_steps_where_copies_delay_the_step(beside_online):
    """On the CPU a KV copy runs before the forward and lengthens its step:
    there (``copies_beside_online=False``) a step carrying online work
    takes no checkpoint copy, and the next offline-only step takes them all."""
    kv = KVCacheManager(64, 4, num_host_blocks=64)
    s = Scheduler(SchedulerConfig(kv_watermark=0.0, kv_checkpoint_threshold=0.0, proactive_swap=False,
                                  copies_beside_online=beside_online), kv)
    s.add(SeqState("off", 16, 8, 0.0, RequestClass.OFFLINE), 0.0)
    s.add(SeqState("on", 4, 2, 0.0), 0.0)
    plan = s.schedule(0.0)  # both prefill: the offline prompt fills 4 blocks
    assert {i.request_id for i in plan.scheduled} == {"off", "on"}
    s.update_from_output(plan, StepOutcome(0.01, 0.0))
    plan = s.schedule(0.01)  # both decode: the online request is still running
    assert {i.request_id for i in plan.scheduled} == {"off", "on"}
    assert bool(plan.swap_out) is beside_online
    s.update_from_output(plan, StepOutcome(0.01, 0.01, finished=["on"]))
    plan = s.schedule(0.02)  # offline only
    assert [i.request_id for i in plan.scheduled] == ["off"]
    assert s.counters.checkpoint_blocks == 4 and (beside_online or len(plan.swap_out) == 4)


@pytest.mark.parametrize("beside_online", [True, False])
def test_no_offline_swap_out_for_the_reserve_in_online_steps_where_copies_delay_the_step(beside_online):
    """The arrival reserve is refilled by swapping an idle offline request
    out; where that copy would lengthen a step online work waits on, it waits
    for an offline-only step (an online arrival takes offline blocks at once
    anyway)."""
    kv = KVCacheManager(12, 4, num_host_blocks=64)
    s = Scheduler(SchedulerConfig(kv_watermark=0.0, kv_checkpoint_threshold=None, max_num_seqs=1,
                                  copies_beside_online=beside_online), kv)
    s.add(SeqState("off", 24, 8, 0.0, RequestClass.OFFLINE), 0.0)
    plan = s.schedule(0.0)
    s.update_from_output(plan, StepOutcome(0.01, 0.0))
    s.add(SeqState("on", 16, 8, 0.01), 0.01)  # its 4 blocks leave 2 free, below the 4-block reserve
    plan = s.schedule(0.01)
    assert [i.request_id for i in plan.scheduled] == ["on"]
    assert plan.swapped_out == (["off"] if beside_online else [])


@pytest.mark.parametrize("beside_online", [True, False])
def test_no_offline_admission_the_budget_leaves_no_token_where_copies_delay_the_step(beside_online):
    """Admitting takes KV and may swap others out for it; where that copy
    would lengthen a step online work waits on, an offline request the SLO
    budget gives no token this step is not admitted in it."""
    kv = KVCacheManager(16, 4, num_host_blocks=16)
    s = Scheduler(SchedulerConfig(kv_watermark=0.0, kv_checkpoint_threshold=None, online_tpot_slo_ms=10.5,
                                  copies_beside_online=beside_online), kv, cost_model=CM)
    s.add(SeqState("on", 4, 8, 0.0), 0.0)
    plan = s.schedule(0.0)
    s.update_from_output(plan, StepOutcome(0.01, 0.0))
    s.add(SeqState("off", 8, 8, 0.01, RequestClass.OFFLINE), 0.01)
    plan = s.schedule(0.01)  # the decode alone takes 10 ms of the 10.5: no offline token fits
    assert [i.request_id for i in plan.scheduled] == ["on"]
    assert kv.holds("off") is beside_online
