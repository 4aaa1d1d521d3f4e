"""Prefix caching: greedy tokens unchanged with the cache on (same and
different prefixes, partial-block tails, multi-turn prompts that repeat a
previous answer, aborts in the middle of a shared chain), and reference
counts conserved under random arrivals, aborts, preemptions and swaps."""

from __future__ import annotations

import random

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluidserve.engine import SamplingParams
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.kvcache.prefix_cache import block_keys
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import RequestClass, SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig

from token_paths import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = list(range(40, 40 + 37))  # a shared "system prompt": 4 full blocks of 8 and a partial one


def _prompts() -> list[list[int]]:
    return [SYSTEM + [200 + i] * (i + 1) for i in range(4)] + [SYSTEM[:16], SYSTEM[:17], SYSTEM[5:10]]


@pytest.mark.slow
def test_cached_prefixes_give_the_same_tokens(tiny_model, make_llm):
    path = tiny_model("llama")
    prompts = _prompts()
    llm = make_llm(path, block_size=8)
    first = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]  # one at a time: later ones hit
    stats = llm.engine.kv.prefix_stats
    assert stats.hit_tokens >= 32 * 3  # prompts 2..4 share 4 blocks of the system prompt
    assert first == hf_greedy(path, prompts, 12)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]  # all at once, all cached
    assert again == first
    off = make_llm(path, block_size=8, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY)] == first
    assert off.engine.kv.prefix_stats.hit_tokens == 0


def test_a_prompt_fully_cached_still_computes_its_last_token(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path, block_size=8)
    prompt = SYSTEM[:32]  # exactly 4 blocks
    a = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    hits = llm.engine.kv.prefix_stats.hit_tokens
    b = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert a == b == hf_greedy(path, [prompt], 12)[0]
    assert llm.engine.kv.prefix_stats.hit_tokens - hits == 24  # 3 of 4 blocks: the last is recomputed


def test_cache_salt_keeps_tenants_apart_and_keys_their_answers(tiny_model, make_llm):
    """A salt is the root of a request's key chain: the same prompt under
    another salt (or none) takes no hit, under its own it does, answers
    included (the blocks an answer fills are keyed under its salt), and the
    tokens are the same whatever the salt."""
    import dataclasses

    path = tiny_model("llama")
    llm = make_llm(path, block_size=8)
    salted = {s: dataclasses.replace(GREEDY, cache_salt=s) for s in ("a", "b")}
    stats = llm.engine.kv.prefix_stats

    def run(prompt, params) -> tuple[list[int], int]:
        before = stats.hit_tokens
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        return list(out), stats.hit_tokens - before

    plain, _ = run(SYSTEM, GREEDY)
    assert run(SYSTEM, salted["a"]) == (plain, 0)
    assert run(SYSTEM, salted["b"]) == (plain, 0)
    assert run(SYSTEM, salted["a"]) == (plain, 32)
    assert run(SYSTEM, GREEDY) == (plain, 32)
    turn2 = SYSTEM + plain + [30]  # the answer's blocks were keyed under "b"'s root
    assert run(turn2, salted["b"])[1] == 48
    assert run(turn2, dataclasses.replace(GREEDY, cache_salt="c"))[1] == 0


def test_multi_turn_prompt_reuses_the_previous_answer(tiny_model, make_llm):
    """Turn 2 sends turn 1's prompt and answer back: the answer's full blocks
    were keyed as they were generated, so they are shared too."""
    path = tiny_model("llama")
    llm = make_llm(path, block_size=8)
    turn1 = SYSTEM[:20]
    answer = llm.generate([turn1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    turn2 = turn1 + list(answer.outputs[0].token_ids) + [30, 31, 32]
    before = llm.engine.kv.prefix_stats.hit_tokens
    out = llm.generate([turn2], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.kv.prefix_stats.hit_tokens - before == 32  # 39 of turn 1's 40 tokens were computed: 4 full blocks
    assert out == hf_greedy(path, [turn2], 12)[0]


def test_abort_in_the_middle_of_a_shared_chain(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path, block_size=8)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine.add_request("a", SYSTEM + [1, 2], params)
    for _ in range(3):
        engine.step()  # a's prompt is computed and cached
    engine.add_request("b", SYSTEM + [3, 4, 5], params)
    engine.add_request("c", SYSTEM[:24] + [6], params)
    engine.step()
    shared = set(engine.kv.block_table("a#0")[:3])
    assert shared <= set(engine.kv.block_table("b#0")) and shared <= set(engine.kv.block_table("c#0"))
    engine.abort("a")
    engine.kv.check_integrity()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.outputs[0].token_ids
    assert [outs["b"], outs["c"]] == hf_greedy(path, [SYSTEM + [3, 4, 5], SYSTEM[:24] + [6]], 16)


def test_a_prefix_evicted_from_the_device_comes_back_from_the_host(tiny_model, make_llm):
    """A small device pool reuses the system prompt's blocks for other work;
    their content was demoted to the host when they were freed, so the next
    request with that prompt finds it there, copies it back and gives the
    tokens a device hit (and no cache) gives."""
    path = tiny_model("llama")
    llm = make_llm(path, block_size=8, num_kv_blocks=10, max_model_len=80, num_host_blocks=64)
    stats = llm.engine.kv.prefix_stats
    llm.generate([SYSTEM + [1, 2]], GREEDY)
    # Demotions ride along with later steps, a few blocks a step (the swap budget).
    llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    churn = [[100 + 50 * i + j for j in range(60)] for i in range(2)]  # 8 blocks each: the pool turns over
    llm.generate(churn, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert stats.demoted_blocks >= 4 and stats.evicted_blocks >= 4
    before = (stats.hit_tokens, stats.host_hit_tokens)
    prompt = SYSTEM + [3, 4, 5]
    got = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert stats.host_hit_tokens - before[1] == 32 and stats.hit_tokens == before[0]  # 4 blocks, all from the host
    assert got == hf_greedy(path, [prompt], 12)[0]
    llm.engine.kv.check_integrity()


# -- accounting under churn ----------------------------------------------------

class _Contents:
    """What each block of both pools holds, moved by the plan's copies and
    written by its forward the way the worker does: a full keyed block holds
    its key, any other block ("own", request, index)."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}

    def label(self, seq: SeqState, i: int) -> object:
        return seq.block_keys[i] if i < len(seq.block_keys) else ("own", seq.request_id, i)

    def run(self, plan, seqs: dict[str, SeqState], kv: KVCacheManager) -> None:
        written = set()
        for item in plan.scheduled:
            seq, table = seqs[item.request_id], kv.block_table(item.request_id)
            c0 = seq.num_computed_tokens
            written |= {table[p // self.bs] for p in range(c0, c0 + item.num_tokens)}
        out_src = {d for d, _ in plan.swap_out}
        # Swap-ins land before the forward (it waits for them) and after the
        # swap-outs (one copy stream, in order); swap-outs may still be
        # reading while the forward runs.
        assert not written & out_src, "the forward writes a block a swap-out of its step reads"
        for d, h in plan.swap_out:
            self.host[h] = self.device.get(d)
        for h, d in plan.swap_in:
            self.device[d] = self.host.get(h)
        for item in plan.scheduled:  # what the forward reads: every computed block of its table
            seq, table = seqs[item.request_id], kv.block_table(item.request_id)
            for i in range(-(-seq.num_computed_tokens // self.bs)):
                assert self.device.get(table[i]) == self.label(seq, i), (
                    f"{item.request_id} block {i} (device {table[i]}) holds {self.device.get(table[i])}")
        for b in written:
            self.device[b] = None
        for item in plan.scheduled:
            seq, table = seqs[item.request_id], kv.block_table(item.request_id)
            c0 = seq.num_computed_tokens
            for i in range(c0 // self.bs, -(-(c0 + item.num_tokens) // self.bs)):
                self.device[table[i]] = self.label(seq, i)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), device=st.integers(6, 30), host=st.sampled_from([0, 8, 40]),
       mode=st.sampled_from(["swap", "recompute"]), policy=st.sampled_from(["fcfs", "skip-join-mlfq"]),
       checkpoint=st.sampled_from([None, 0.0, 0.5]))
def test_refcounts_conserved_with_shared_prefixes(seed, device, host, mode, policy, checkpoint):
    """Requests from a few prefix families arrive, run, are preempted or
    swapped and aborted at random: every step the two pools and the index
    agree, every block a forward reads holds what its request computed there
    (through host hits, demotions, checkpoints and shared swaps), and at the
    end nothing is held."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(device, bs, host, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(scheduling_policy=policy, max_num_batched_tokens=rng.choice([6, 16, 64]),
                                  max_num_seqs=rng.choice([2, 8]), preemption_mode=mode, kv_watermark=0.0,
                                  kv_checkpoint_threshold=checkpoint), kv)
    families = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    contents = _Contents(bs)
    now, made = 0.0, 0
    for step in range(300):
        if made < 25 and rng.random() < 0.3:
            prompt = rng.choice(families) + [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
            out = rng.randrange(1, 10)
            if len(prompt) + out <= device * bs:
                klass = rng.choice([RequestClass.ONLINE, RequestClass.OFFLINE])  # offline ones are checkpointed
                seq = SeqState(f"r{made}", len(prompt), out, now, klass, block_keys=block_keys(prompt, bs))
                s.add(seq, now)
                made += 1
        if s.seqs and rng.random() < 0.05:
            s.finish(rng.choice(sorted(s.seqs)))  # an abort
        plan = s.schedule(now)
        contents.run(plan, s.seqs, kv)
        now += 0.01
        finished = [i.request_id for i in plan.scheduled
                    if i.samples and s.seqs[i.request_id].num_output_tokens + 1 >= s.seqs[i.request_id].max_new_tokens]
        s.update_from_output(plan, StepOutcome(0.01, now, finished))
        kv.check_integrity()
        if made >= 25 and not s.seqs:
            break
    for rid in list(s.seqs):
        s.finish(rid)
    kv.release_pending()
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0
