"""The two KV tiers: block accounting across the device and host pools,
bit-exact swap copies, generation unchanged when requests are swapped out
and back, aborts of swapped requests, and the same swap decisions in the
simulator and the real engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluidserve.engine import SamplingParams
from fluidserve.engine.cache_engine import CacheEngine, block_runs
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.request_state import SeqStatus

from token_paths import PROMPTS, hf_greedy

# -- accounting ----------------------------------------------------------------

ops_st = st.lists(st.tuples(st.sampled_from(["grow", "out", "in", "free", "step"]), st.integers(0, 5),
                            st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, device=st.integers(1, 12), host=st.integers(0, 12), bs=st.sampled_from([1, 4]))
def test_blocks_conserved_across_both_pools(ops, device, host, bs):
    """Random grows, swaps, frees and step ends: every block is owned once,
    pending or free in its pool; moves map every block; 0 used at the end."""
    kv = KVCacheManager(device, bs, host)
    tokens: dict[str, int] = {}
    for op, r, n in ops:
        rid = f"r{r}"
        if op == "grow" and not kv.is_swapped(rid):
            before = list(kv.block_table(rid))
            if kv.allocate(rid, tokens.get(rid, 0) + n):
                tokens[rid] = tokens.get(rid, 0) + n
                assert kv.block_table(rid)[:len(before)] == before  # a table only grows at its end
        elif op == "out" and kv.holds(rid) and kv.can_swap_out(rid):
            table = list(kv.block_table(rid))
            moves = kv.swap_out(rid)
            assert [d for d, _ in moves] == table and len({h for _, h in moves}) == len(table)
            assert kv.is_swapped(rid) and not kv.holds(rid)
        elif op == "in" and kv.is_swapped(rid) and kv.can_swap_in(rid):
            n_blocks = kv.num_blocks_of(rid)
            moves = kv.swap_in(rid)
            assert len(moves) == n_blocks and [d for _, d in moves] == kv.block_table(rid)
        elif op == "free":
            kv.free(rid)
            tokens.pop(rid, None)
        elif op == "step":
            kv.release_pending()
        kv.check_integrity()
    for rid in list(tokens):
        kv.free(rid)
    kv.release_pending()
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0


def test_blocks_freed_by_a_swap_are_reusable_only_after_the_step():
    kv = KVCacheManager(4, 4, num_host_blocks=4)
    assert kv.allocate("a", 16)  # the whole pool
    kv.swap_out("a")
    assert kv.num_free_blocks == 0 and not kv.can_allocate("b", 1)  # the copy still reads them
    kv.release_pending()
    assert kv.can_allocate("b", 16)
    with pytest.raises(ValueError, match="swapped out"):
        kv.allocate("a", 20)


# -- copies ----------------------------------------------------------------------


def test_block_runs_coalesce_adjacent_pairs():
    assert block_runs([(3, 7), (1, 5), (2, 6), (9, 0)]) == [(1, 5, 3), (9, 0, 1)]
    assert block_runs([(1, 5), (2, 9)]) == [(1, 5, 1), (2, 9, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_round_trip_is_bit_identical(dtype):
    """Device -> host -> other device blocks, through the same maps the
    scheduler makes: every byte comes back, and nothing else is touched."""
    torch.manual_seed(0)
    ce = CacheEngine(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                     device=torch.device("cpu"), num_blocks=10, num_host_blocks=6)
    for k, v in ce.device_caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    kv = KVCacheManager(10, 4, num_host_blocks=6)
    kv.allocate("x", 4 * 4)  # blocks 0..3
    kv.allocate("y", 2 * 4)  # blocks 4, 5
    src = [(k[[0, 1, 2, 3]].clone(), v[[0, 1, 2, 3]].clone()) for k, v in ce.device_caches]
    other = [(k[[4, 5]].clone(), v[[4, 5]].clone()) for k, v in ce.device_caches]
    out = kv.swap_out("x")
    ce.swap(out, [], wait=False)
    kv.release_pending()
    kv.allocate("z", 3 * 4)  # takes x's old blocks: the copy must not care
    for k, v in ce.device_caches:
        k[kv.block_table("z")] = 0
        v[kv.block_table("z")] = 0
    back = kv.swap_in("x")
    assert {d for _, d in back}.isdisjoint({0, 1, 2, 3} & set(kv.block_table("z")))
    ce.swap([], back, wait=True)
    table = kv.block_table("x")
    for (k, v), (sk, sv), (ok, ov) in zip(ce.device_caches, src, other):
        assert torch.equal(k[table], sk) and torch.equal(v[table], sv)
        assert torch.equal(k[[4, 5]], ok) and torch.equal(v[[4, 5]], ov)  # y untouched


# -- the engine ------------------------------------------------------------------


def _spy_swaps(engine) -> tuple[set, set]:
    """Record which requests the real scheduler swaps out and in."""
    outs, ins = set(), set()
    sched = engine.scheduler
    swap_out, swap_in = sched._swap_out, sched._swap_in

    def spy_out(seq, step):
        outs.add(seq.request_id)
        swap_out(seq, step)

    def spy_in(seq, step, *a, **kw):
        ins.add(seq.request_id)
        swap_in(seq, step, *a, **kw)

    sched._swap_out, sched._swap_in = spy_out, spy_in
    return outs, ins


SMALL_POOL = dict(num_kv_blocks=10, block_size=8, max_model_len=64, num_host_blocks=64)


@pytest.mark.parametrize("policy, proactive", [("skip-join-mlfq", True), ("skip-join-mlfq", False),
                                               ("fcfs", True)])
def test_swapped_requests_generate_the_same_tokens(tiny_model, make_llm, policy, proactive):
    """A device pool that holds two requests at a time and eight requests:
    requests are swapped out and back, greedy tokens equal transformers'."""
    path = tiny_model("llama")
    llm = make_llm(path, scheduling_policy=policy, proactive_swap=proactive, **SMALL_POOL)
    outs_, ins_ = _spy_swaps(llm.engine)
    prompts = [p[:20] for p in PROMPTS] * 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    c = llm.engine.scheduler.counters
    assert c.num_swap_outs > 0 and c.num_swap_ins == c.num_swap_outs and c.num_recomputes == 0
    assert len(outs_) >= len(prompts) // 2 and ins_ == outs_  # most were swapped, each came back
    stats = llm.engine.stats()
    assert stats.swap_out_bytes == c.swap_out_blocks * llm.engine.bytes_per_block > 0
    assert llm.engine.kv.num_used_host_blocks == 0


def test_recompute_mode_never_touches_the_host(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path, preemption_mode="recompute", **SMALL_POOL)
    prompts = [p[:20] for p in PROMPTS] * 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    c = llm.engine.scheduler.counters
    assert c.num_recomputes > 0 and c.num_swap_outs == 0


def test_running_set_larger_than_device_kv(tiny_model, make_llm):
    """More requests hold KV at once than the device pool can: the rest live
    on the host, and all finish."""
    path = tiny_model("llama")
    llm = make_llm(path, **SMALL_POOL)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate([p[:20] for p in PROMPTS] * 2):
        engine.add_request(f"r{i}", p, params)
    most_holding = 0
    while engine.has_unfinished_requests():
        engine.step()
        holding = sum(engine.kv.holds(r) or engine.kv.is_swapped(r) for r in engine.scheduler.seqs)
        most_holding = max(most_holding, holding)
        engine.kv.check_integrity()
    assert most_holding * 3 > engine.kv.num_blocks  # at 3+ blocks each, more than the device holds


def test_abort_while_swapped_or_just_swapped_in_frees_both_pools(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path, proactive_swap=True, **SMALL_POOL)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate([p[:20] for p in PROMPTS] * 2):
        engine.add_request(f"r{i}", p, params)
    aborted = {"swapped": None, "swapped_in": None}
    last_plan = None
    schedule = engine.scheduler.schedule

    def keep_plan(now):
        nonlocal last_plan
        last_plan = schedule(now)
        return last_plan

    engine.scheduler.schedule = keep_plan
    for _ in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        seqs = engine.scheduler.seqs
        if aborted["swapped"] is None:
            swapped = [rid for rid, s in seqs.items() if s.status is SeqStatus.SWAPPED]
            if swapped:
                aborted["swapped"] = swapped[0]
                engine.abort(swapped[0].split("#")[0])
        if aborted["swapped_in"] is None and last_plan is not None:
            back = [rid for rid in last_plan.swapped_in if rid in seqs]
            if back:
                aborted["swapped_in"] = back[0]
                engine.abort(back[0].split("#")[0])
        engine.kv.check_integrity()
    assert all(aborted.values()), aborted
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_used_host_blocks == 0


def _record_moves(scheduler) -> list[tuple[list, list]]:
    """(swapped out, swapped in) request ids of every non-empty plan the real
    scheduler makes from now on."""
    moves: list[tuple[list, list]] = []
    schedule = scheduler.schedule

    def record(now):
        plan = schedule(now)
        if not plan.is_empty:
            moves.append((list(plan.swapped_out), list(plan.swapped_in)))
        return plan

    scheduler.schedule = record
    return moves


def test_simulator_and_engine_make_the_same_swap_decisions(tiny_model, make_llm):
    """The same jobs through the simulator and the real engine (same
    scheduler config, a cost model that only orders): the same sequence of
    swap-outs and swap-ins, step by step."""
    from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel
    from fluidserve.scheduler.simulator import SimConfig, Simulator
    from fluidserve.scheduler.workloads import Job

    path = tiny_model("llama")
    prompts = [list(range(3 + 5 * i, 3 + 5 * i + 12 + 3 * i)) for i in range(6)]
    out_tokens = 20
    # The simulator's jobs have no tokens to key a prefix cache by.
    llm = make_llm(path, scheduling_policy="fcfs", enable_prefix_caching=False, **SMALL_POOL)
    engine = llm.engine
    engine_moves = _record_moves(engine.scheduler)
    params = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"j{i}", p, params, arrival_time=float(i) * 1e-6)
    while engine.has_unfinished_requests():
        engine.step()

    cost = LinearCostModel(LinearCoefficients(base=1e-3, per_prefill_token=0, per_decode_seq=0,
                                              per_context_token=0, per_attn_pair=0))
    jobs = [Job(f"j{i}#0", 0.0, len(p), out_tokens) for i, p in enumerate(prompts)]
    cfg = SimConfig.create(num_kv_blocks=10, block_size=8, max_num_batched_tokens=2048, num_host_blocks=64,
                    max_swap_blocks_per_step=engine.scheduler.config.max_swap_blocks_per_step)
    sim = Simulator(jobs, "fcfs", cost, cfg)
    sim_moves = _record_moves(sim.scheduler)
    sim.run()
    assert any(out for out, _ in engine_moves)  # the trace does swap
    assert engine_moves == sim_moves


@pytest.mark.parametrize("host_cache", [False, True])
def test_a_shared_block_swapped_out_twice_in_one_step_comes_back_intact(host_cache):
    """Two requests sharing a cached block leave in the same step. Without a
    host-tier cache the plan's pairs carry the block to two host blocks; with
    one, the second request shares the first one's host copy (no second copy)
    and both, coming back, share the device copy that stayed cached."""
    from fluidserve.kvcache.prefix_cache import block_keys

    torch.manual_seed(0)
    ce = CacheEngine(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"), num_blocks=8, num_host_blocks=8)
    kv = KVCacheManager(8, 4, num_host_blocks=8, enable_prefix_caching=True)
    if not host_cache:
        kv.host_prefix = None
    keys = block_keys(list(range(9)), 4)  # two full blocks
    assert kv.admit("a", keys, 9).cached_tokens == 0
    for k, v in ce.device_caches:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    kv.cache_blocks("a", keys, 9)
    assert kv.admit("b", keys, 9).cached_tokens == 8  # shares both full blocks
    expect = {r: [(k[kv.block_table(r)].clone(), v[kv.block_table(r)].clone()) for k, v in ce.device_caches]
              for r in ("a", "b")}
    pairs = kv.swap_out("a") + kv.swap_out("b")
    if host_cache:
        assert len(pairs) == 4  # a: 3 blocks; b: only its own last block
    else:
        assert len({d for d, _ in pairs}) < len(pairs)  # a device block leaves twice
    ce.swap(pairs, [], wait=False)
    kv.release_pending()
    reused = [b for b in range(8) if kv.prefix.key_of(b) is None]  # what the device may overwrite now
    for k, v in ce.device_caches:
        k[reused] = 0
        v[reused] = 0
    kv.check_integrity()
    back = kv.swap_in("a") + kv.swap_in("b")
    if host_cache:  # the shared blocks stayed cached on the device: only the last blocks come back
        assert len(back) == 2 and kv.block_table("a")[:2] == kv.block_table("b")[:2]
    ce.swap([], back, wait=True)
    for r in ("a", "b"):
        table = kv.block_table(r)
        for (k, v), (ek, ev) in zip(ce.device_caches, expect[r]):
            assert torch.equal(k[table], ek) and torch.equal(v[table], ev)
    kv.check_integrity()


def test_cpu_moves_gather_and_scatter_every_block_at_once():
    """Scattered pairs (no two consecutive on both sides), both directions
    in one step: each block lands where its pair says, the others stay."""
    torch.manual_seed(0)
    ce = CacheEngine(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"), num_blocks=8, num_host_blocks=8)
    for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches):
        for t in (k, v, hk, hv):
            t.copy_(torch.randn_like(t))
    before = [(k.clone(), v.clone(), hk.clone(), hv.clone())
              for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches)]
    out, back = [(6, 1), (0, 5), (3, 3)], [(7, 2), (2, 0)]
    ce.swap(out, back, wait=False)
    for ((k, v), (hk, hv)), (k0, v0, hk0, hv0) in zip(zip(ce.device_caches, ce.host_caches), before):
        for d, h in out:  # swap-outs read the device before the swap-ins write it
            assert torch.equal(hk[h], k0[d]) and torch.equal(hv[h], v0[d])
        for h, d in back:
            assert torch.equal(k[d], hk0[h]) and torch.equal(v[d], hv0[h])
        assert torch.equal(k[[1, 3, 4, 5, 6, 7]], k0[[1, 3, 4, 5, 6, 7]])
        assert torch.equal(hk[[4, 6]], hk0[[4, 6]])


@pytest.mark.parametrize("staging_blocks", [None, 2], ids=["one-chunk", "chunks-of-2"])
def test_scattered_copies_cross_the_bus_once_per_host_run(monkeypatch, staging_blocks):
    """The copy stream's moves (``CacheEngine._copy``, run here on CPU
    tensors): device blocks scattered by churn, host blocks in a run, go
    through a staging gather (out) or scatter (in), so each layer's K and V
    cross in one copy per host run rather than one per block; adjacent pairs
    still move in one copy per run, and every block lands where its pair
    says, a device block leaving twice included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fluidserve.engine import cache_engine

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layers = 3
    ce = CacheEngine(num_layers=layers, block_size=4, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                     device=torch.device("cpu"), num_blocks=16, num_host_blocks=16)
    if staging_blocks:
        monkeypatch.setattr(cache_engine, "STAGING_BYTES", staging_blocks * ce.device_caches[0][0][0].nbytes)
    for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches):
        for t in (k, v, hk, hv):
            t.copy_(torch.randn_like(t))
    before = [[t.clone() for t in (k, v, hk, hv)] for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches)]
    out = [(9, 4), (1, 5), (13, 6), (5, 7), (1, 8)]  # scattered device blocks (1 twice) -> host 4..8
    back = [(0, 3), (1, 11), (2, 7), (3, 14)]  # host 0..3 -> scattered device blocks
    runs = [(5, 12), (6, 13)]  # adjacent on both sides: one run
    chunks = -(-len(out) // staging_blocks) if staging_blocks else 1
    expect = (chunks * 2 * layers, (-(-len(back) // staging_blocks) if staging_blocks else 1) * 2 * layers,
              2 * layers)
    for pairs, host_is_src, copies in zip((out, back, runs), (False, True, False), expect):
        src, dst = (ce.host_caches, ce.device_caches) if host_is_src else (ce.device_caches, ce.host_caches)
        Copies.count = 0
        with Copies():
            ce._copy(pairs, src, dst, host_is_src=host_is_src)
        assert Copies.count == copies, (pairs, Copies.count)
    for ((k, v), (hk, hv)), (k0, v0, hk0, hv0) in zip(zip(ce.device_caches, ce.host_caches), before):
        for d, h in out + runs:
            assert torch.equal(hk[h], k0[d]) and torch.equal(hv[h], v0[d])
        for h, d in back:
            assert torch.equal(k[d], hk0[h]) and torch.equal(v[d], hv0[h])
        untouched_dev = [b for b in range(16) if b not in {d for _, d in back}]
        untouched_host = [b for b in range(16) if b not in {h for _, h in out + runs}]
        assert torch.equal(k[untouched_dev], k0[untouched_dev]) and torch.equal(hv[untouched_host], hv0[untouched_host])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_swaps_of_scattered_blocks_land_on_the_copy_stream():
    """On CUDA the moves run on the copy stream, scattered device blocks
    through staging: after the step's event every block is where its pair
    says, in both directions, in the order swap-outs then swap-ins."""
    torch.manual_seed(0)
    ce = CacheEngine(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                     device=torch.device("cuda", torch.cuda.current_device()), num_blocks=64, num_host_blocks=64)
    for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches):
        for t in (k, v, hk, hv):
            t.copy_(torch.randn_like(t, device=t.device))
    before = [[t.cpu().clone() for t in (k, v, hk, hv)] for (k, v), (hk, hv) in zip(ce.device_caches, ce.host_caches)]
    out = [(d, 10 + i) for i, d in enumerate(range(1, 40, 3))]  # every third device block -> host 10..22
    back = [(40 + i, d) for i, d in enumerate(range(2, 40, 5))]  # host 40.. -> every fifth device block
    ce.swap(out, back, wait=True)
    torch.cuda.synchronize()
    for ((k, v), (hk, hv)), (k0, v0, hk0, hv0) in zip(zip(ce.device_caches, ce.host_caches), before):
        for d, h in out:  # read before the swap-ins wrote the device
            assert torch.equal(hk[h], k0[d]) and torch.equal(hv[h], v0[d])
        for h, d in back:
            assert torch.equal(k[d].cpu(), hk0[h]) and torch.equal(v[d].cpu(), hv0[h])
