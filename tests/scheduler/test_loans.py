"""KV loans under swapping (scheduler/loans.py): a request that has streamed
keeps its place against requests that have not, a request whose max_tokens
bounds its stay borrows KV from streams that can afford it, and the streams
it evicts keep close to their own pace."""

from __future__ import annotations

import argparse

import pytest

from fluidserve.kvcache.config import CacheConfig, add_flags
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel
from fluidserve.scheduler.loans import INF, LEND_SHARE, ROUND_TRIP_STEPS, STARVING_WAITS, KVLoans
from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.scheduler.scheduler import Scheduler
from fluidserve.scheduler.simulator import SimConfig, Simulator, simulate
from fluidserve.scheduler.workloads import Job

DT = 2.0**-6  # one step, whatever it runs: a request's own pace


def cost() -> LinearCostModel:
    return LinearCostModel(LinearCoefficients(base=DT, per_prefill_token=0.0, per_decode_seq=0.0,
                                              per_context_token=0.0, per_attn_pair=0.0))


def jobs() -> list[Job]:
    """Three long streams fill most of the device; then one-token jobs with
    long prompts (borrowers under a cap of 4) and 30-token jobs (not
    borrowers) arrive in turn."""
    return ([Job(f"long{i}", 0.0, 8, 80) for i in range(3)]
            + [Job(f"s{i}", 0.5 + 0.1 * i, 40, 1) for i in range(8)]
            + [Job(f"m{i}", 0.55 + 0.1 * i, 40, 30) for i in range(4)])


def config(**kw) -> SimConfig:
    # Copies take no time and every step takes DT: a request's TPOT over DT
    # is its slowdown against running every step.
    return SimConfig.create(num_kv_blocks=64, block_size=4, num_host_blocks=400, block_transfer_time=0.0,
                            max_swap_blocks_per_step=64, check_integrity=True, **kw)


def run(**kw) -> dict:
    res = simulate(jobs(), "skip-join-mlfq", cost(), config(**kw))
    assert all(r.finish_time is not None and r.num_emitted == r.output_tokens for r in res.records)
    return {r.request_id: r for r in res.records}


def test_borrowers_pass_the_queue_and_streams_keep_their_pace():
    free, kept, loans = run(swap_loan_tokens=-1), run(swap_loan_tokens=0), run(swap_loan_tokens=4)
    short = [f"s{i}" for i in range(8)]
    streams = [r for r in loans.values() if r.output_tokens > 1]
    # Without loans streams are evicted for every arrival and stay away long.
    assert max(free[r.request_id].tpot for r in streams) > (1 + LEND_SHARE) * DT
    # Keeping their place, the one-token jobs wait for streams to end ...
    assert sum(kept[s].ttft for s in short) > 10 * len(short) * DT
    # ... borrowing, they pass: a few steps each.
    assert sum(loans[s].ttft for s in short) < 4 * len(short) * DT
    # The streams that lent stay within their share of their own pace.
    assert max(r.tpot for r in streams) <= (1 + LEND_SHARE) * DT * (1 + 1e-9)


def test_a_stream_keeps_its_place_against_requests_without_a_bound():
    for loans in (run(swap_loan_tokens=0), run(swap_loan_tokens=4)):
        # Nothing that arrives after them may evict the 30-token streams.
        assert all(loans[f"m{i}"].tpot == pytest.approx(DT) for i in range(4))
    assert max(run()[f"m{i}"].tpot for i in range(4)) > 1.2 * DT


def test_no_stream_lends_beyond_its_share():
    # The borrowers come while the streams are young (few tokens to lend on)
    # and do not fit beside them.
    early = [Job(f"long{i}", 0.0, 40, 80) for i in range(4)] + [Job(f"s{i}", 0.05 + 0.05 * i, 100, 1)
                                                                for i in range(12)]
    sim = Simulator(early, "skip-join-mlfq", cost(), config(swap_loan_tokens=4))
    loans, lent = sim.scheduler.loans, 0
    while sim.has_work():
        sim.step()
        for rid, steps in loans.lent.items():
            assert steps <= LEND_SHARE * sim.scheduler.seqs[rid].num_output_tokens
        lent = max(lent, len(loans.lent))
    assert lent  # some did lend, once they could


def seq(rid: str = "r", prompt: int = 100, max_new: int = 4, out: int = 0, computed: int = 0,
        klass: RequestClass = RequestClass.ONLINE) -> SeqState:
    s = SeqState(rid, prompt, max_new, 0.0, klass)
    s.num_output_tokens, s.num_computed_tokens = out, computed
    return s


def test_stay_bounds_a_borrower_by_its_prefill_and_cap():
    loans = KVLoans(max_tokens=8, step_tokens=64)
    assert loans.stay(seq(prompt=100, max_new=4)) == 2 + 3  # two prefill steps, three decodes after the first token
    assert loans.stay(seq(prompt=100, max_new=4, computed=64)) == 1 + 3
    assert loans.stay(seq(prompt=10, max_new=8)) == 1 + 7
    assert loans.stay(seq(prompt=10, max_new=9)) == INF  # not a borrower
    # Not a borrower, its cap bounds its stay all the same (backfilling reads it).
    assert loans.steps_left(seq(prompt=10, max_new=9)) == 1 + 8
    assert loans.steps_left(seq(prompt=10, max_new=9, out=3, computed=12)) == 9 - 3  # decoding: a token a step


def test_a_stream_lends_only_what_its_tokens_cover():
    loans = KVLoans(max_tokens=8, step_tokens=64)
    away = 5.0
    need = (ROUND_TRIP_STEPS + away) / LEND_SHARE  # tokens a stream must have streamed to lend once
    young, old = seq("young", out=int(need) - 1), seq("old", out=int(need))
    assert not loans.can_lend(young, away)
    assert loans.can_lend(old, away)
    loans.note_lent(old, away)
    assert not loans.can_lend(old, away)  # its share is spent ...
    old.num_output_tokens = 2 * int(need)
    assert loans.can_lend(old, away)  # ... and earned again as it streams
    loans.forget("old")
    assert loans.lent == {}
    # No TPOT to keep: offline work always lends; a request with no token
    # out lends while it has computed nothing (no copy wasted).
    assert loans.can_lend(seq(out=1, klass=RequestClass.OFFLINE), INF)
    assert loans.can_lend(seq(), INF)
    assert not loans.can_lend(seq(computed=16), 0.0)


def test_starving_is_judged_against_the_mean_wait_and_its_floor():
    loans = KVLoans(max_tokens=8, step_tokens=64, min_wait=0.5)
    for _ in range(200):  # admissions that waited 1 s each
        loans.note_admitted(seq(), 1.0)
    assert loans.mean_wait == pytest.approx(1.0, rel=1e-3)
    n = STARVING_WAITS
    assert not loans.starving(seq(), n - 0.1)
    assert loans.starving(seq(), n + 0.1)
    loans.mean_wait = 0.01  # the policy's own limit is the floor
    assert not loans.starving(seq(), n * 0.5 - 0.1) and loans.starving(seq(), n * 0.5 + 0.1)


def test_the_flag_its_default_and_off():
    """On by default (cap 32); 0 keeps streams in place with no borrower; a
    negative cap, on the command line too, turns loans off."""
    assert SchedulerConfig().swap_loan_tokens == 32
    assert SchedulerConfig(swap_loan_tokens=0).swap_loan_tokens == 0
    assert SchedulerConfig(swap_loan_tokens=-1).swap_loan_tokens is None
    assert SchedulerConfig(swap_loan_tokens=None).swap_loan_tokens is None
    ap = argparse.ArgumentParser()
    add_flags(ap, SchedulerConfig)
    assert ap.parse_args([]).swap_loan_tokens == 32
    assert ap.parse_args(["--swap-loan-tokens", "8"]).swap_loan_tokens == 8
    off = ap.parse_args(["--swap-loan-tokens", "-1"]).swap_loan_tokens
    assert SchedulerConfig(swap_loan_tokens=off).swap_loan_tokens is None
    assert Scheduler.create(SchedulerConfig(swap_loan_tokens=off), CacheConfig(block_size=4), 64, 64).loans is None
    assert Scheduler.create(SchedulerConfig(), CacheConfig(block_size=4), 64, 64).loans is not None


def test_recompute_mode_has_no_loans():
    cfg = SchedulerConfig(preemption_mode="recompute", swap_loan_tokens=4)
    assert Scheduler.create(cfg, CacheConfig(block_size=4), 64, 0).loans is None
    assert Scheduler.create(SchedulerConfig(swap_loan_tokens=4), CacheConfig(block_size=4), 64, 64).loans is not None


def test_online_requests_take_the_blocks_of_offline_streams_on_the_host():
    """Co-serving with loans (the default): offline streams fill the device
    and checkpoint their KV; online arrivals with no bound on their stay
    (40 tokens, above the cap) evict them to the host, and the next arrival
    is not kept from the freed blocks as if they were owed to those offline
    streams (it was: up to 10 steps). Online first tokens come as fast as
    with loans off."""
    offline = [Job(f"off{i}", 0.0, 16, 120, RequestClass.OFFLINE) for i in range(12)]
    online = [Job(f"on{i}", 0.3 + 0.2 * i, 24, 40) for i in range(8)]

    def ttfts(**kw) -> list[float]:
        res = simulate(offline + online, "skip-join-mlfq", cost(), config(**kw))
        assert res.swap_stats["num_swap_outs"] > 0
        return [r.ttft for r in res.records if r.request_id.startswith("on")]

    with_loans, without = ttfts(), ttfts(swap_loan_tokens=-1)
    assert max(with_loans) <= max(without) + 2 * DT
    assert max(with_loans) < 4 * DT


@pytest.mark.parametrize("gap,burst", [(0.2, 1), (0.2, 2), (0.4, 1), (0.4, 2)])
def test_offline_prefetch_leaves_the_arrival_reserve_as_without_loans(gap, burst):
    """Offline streams on the host are owed nothing: bringing them back
    leaves free the blocks kept for online bursts, as with loans off. (They
    were prefetched into that reserve as if owed, and online first tokens
    and the batch's progress both moved.) Copies cost time here, so where
    the reserve goes shows."""
    offline = [Job(f"off{i}", 0.0, 16, 120, RequestClass.OFFLINE) for i in range(12)]
    online = [Job(f"on{b}_{k}", 0.3 + gap * b, 24, 12) for b in range(6) for k in range(burst)]

    def run(**kw):
        cfg = SimConfig.create(num_kv_blocks=64, block_size=4, num_host_blocks=400, block_transfer_time=DT / 8,
                               max_swap_blocks_per_step=8, check_integrity=True, **kw)
        res = simulate(offline + online, "skip-join-mlfq", cost(), cfg)
        return [(r.request_id, r.first_token_time, r.finish_time) for r in res.records], res.swap_stats

    (default, swaps), (off, _) = run(), run(swap_loan_tokens=-1)
    assert swaps["num_swap_ins"] > 0
    assert default == off


def test_offline_work_alone_runs_as_without_loans():
    """Loans protect what a user watches stream: offline requests neither
    keep a place nor borrow, so a batch alone, memory-bound, swaps and
    finishes exactly as with loans off."""
    batch = [Job(f"off{i}", 0.05 * i, 16 + 8 * (i % 3), 10 + 30 * (i % 4), RequestClass.OFFLINE) for i in range(16)]

    def run(**kw):
        res = simulate(batch, "skip-join-mlfq", cost(), config(**kw))
        return [(r.request_id, r.first_token_time, r.finish_time) for r in res.records], res.swap_stats

    (default, swaps), (off, _) = run(), run(swap_loan_tokens=-1)
    assert swaps["num_swap_outs"] > 0
    assert default == off


def test_admission_leaves_room_for_the_residents_that_grow_soon(monkeypatch):
    """A request with no bound waits for free blocks beyond one for each
    resident that needs a new block within ``GROWTH_STEPS`` decodes. When it
    arrives, stream ``b`` is 2 tokens short of its next block and ``a`` 12:
    at the default (8) only ``b`` is owed one, and the 7 blocks ``w`` needs
    plus that one are free; covering every resident (16) ``w`` waits for a
    stream to end."""
    import fluidserve.scheduler.scheduler as mod

    jobs = [Job("a", 0.0, 20, 100), Job("b", 0.0, 30, 100), Job("w", 0.5, 100, 100)]

    def run(growth: int) -> dict:
        monkeypatch.setattr(mod, "GROWTH_STEPS", growth)
        cfg = SimConfig.create(num_kv_blocks=16, block_size=16, num_host_blocks=400, block_transfer_time=0.0,
                               max_swap_blocks_per_step=64, check_integrity=True)
        res = simulate(jobs, "skip-join-mlfq", cost(), cfg)
        assert all(r.num_emitted == r.output_tokens for r in res.records)
        return {r.request_id: r for r in res.records}

    assert mod.GROWTH_STEPS == 8
    soon, every = run(8), run(16)
    assert soon["w"].ttft == pytest.approx(DT)  # admitted on arrival
    assert every["w"].ttft > 60 * DT  # after a stream ends
    assert every["a"].tpot == pytest.approx(DT) and every["b"].tpot < 1.05 * DT


def test_a_request_that_ends_first_takes_the_blocks_owed_to_a_stream_meanwhile():
    """Streams ``a`` and ``b`` fill the pool; ``a`` grows and evicts ``b``,
    which is owed its blocks but cannot come back until ``a`` ends (step
    150). ``w`` arrives at step 60 and fits the blocks that are free: with 8
    tokens to stream it leaves long before ``a`` does, so it takes them at
    once (without backfilling it waits for ``a``); ``b`` comes back and
    streams exactly as it would have. With 200 tokens ``w`` would outstay
    ``a``: it waits either way."""

    def run(w_tokens: int, backfill: bool) -> tuple[dict, dict]:
        jobs = [Job("a", 0.0, 100, 150), Job("b", 0.0, 100, 150), Job("w", 60 * DT, 16, w_tokens)]
        cfg = SimConfig.create(num_kv_blocks=16, block_size=16, num_host_blocks=400, block_transfer_time=0.0,
                               max_swap_blocks_per_step=64, check_integrity=True, swap_loan_tokens=4,
                               swap_backfill=backfill)
        res = simulate(jobs, "skip-join-mlfq", cost(), cfg)
        assert all(r.num_emitted == r.output_tokens for r in res.records)
        return {r.request_id: r for r in res.records}, res.swap_stats

    (on, on_stats), (off, off_stats) = run(8, True), run(8, False)
    assert on["b"].num_preemptions == 1 and on["b"].max_token_gap > 100 * DT  # the case: b waits for a
    assert on_stats["num_backfills"] == 1 and off_stats["num_backfills"] == 0
    assert on["w"].ttft == pytest.approx(DT)
    assert off["w"].ttft > 80 * DT
    for rid in ("a", "b"):
        assert (on[rid].first_token_time, on[rid].finish_time, on[rid].max_token_gap) == \
            (off[rid].first_token_time, off[rid].finish_time, off[rid].max_token_gap)
    (on, on_stats), (off, _) = run(200, True), run(200, False)
    assert on_stats["num_backfills"] == 0
    assert on["w"].ttft == off["w"].ttft > 80 * DT


def test_backfill_growth_check_by_bisection_matches_counting_every_stay():
    """``Backfill.fits`` finds once the shortest stay through which the
    residents grow into every free block and answers each request from
    it: the same answers as summing the residents' growth for each stay."""
    import random

    from fluidserve.scheduler.loans import Backfill

    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 4, 16])
        residents = [(t, -(-t // bs) + rng.randrange(2), rng.randrange(0, 300))
                     for t in (rng.randrange(1, 400) for _ in range(rng.randrange(0, 12)))]
        free = rng.randrange(0, 60)
        fill = Backfill((0, 0), free, INF, residents, bs)
        for _ in range(20):
            blocks, stay = rng.randrange(1, 20), rng.randrange(0, 400)  # a request needs a block at least
            grown = sum(max(0, -(-(t + min(stay, left)) // bs) - held) for t, held, left in residents)
            assert fill.fits(blocks, stay) == (blocks + grown <= free)
