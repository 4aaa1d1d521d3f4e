"""Prefix caching: greedy tokens unchanged with the cache on (same and
different prefixes, partial-block tails, multi-turn prompts that repeat a
previous answer, aborts in the middle of a shared chain), and reference
counts conserved under random arrivals, aborts, preemptions and swaps."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluidserve.engine import SamplingParams
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.kvcache.prefix_cache import block_keys
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig

from test_engine import hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = list(range(40, 40 + 37))  # a shared "system prompt": 4 full blocks of 8 and a partial one


def _prompts() -> list[list[int]]:
    return [SYSTEM + [200 + i] * (i + 1) for i in range(4)] + [SYSTEM[:16], SYSTEM[:17], SYSTEM[5:10]]


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


# -- accounting under churn ----------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), device=st.integers(6, 30), host=st.sampled_from([0, 40]),
       mode=st.sampled_from(["swap", "recompute"]), policy=st.sampled_from(["fcfs", "skip-join-mlfq"]))
def test_refcounts_conserved_with_shared_prefixes(seed, device, host, mode, policy):
    """Requests from a few prefix families arrive, run, are preempted or
    swapped and aborted at random: every step the two pools and the index
    agree, and at the end nothing is held."""
    rng = random.Random(seed)
    bs = 4
    kv = KVCacheManager(device, bs, host, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(policy=policy, max_num_batched_tokens=rng.choice([6, 16, 64]),
                                  max_num_seqs=rng.choice([2, 8]), preemption_mode=mode, kv_watermark=0.0), kv)
    families = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    now, made = 0.0, 0
    for step in range(300):
        if made < 25 and rng.random() < 0.3:
            prompt = rng.choice(families) + [rng.randrange(50) for _ in range(rng.randrange(0, 5))]
            out = rng.randrange(1, 10)
            if len(prompt) + out <= device * bs:
                seq = SeqState(f"r{made}", len(prompt), out, now, block_keys=block_keys(prompt, bs))
                s.add(seq, now)
                made += 1
        if s.seqs and rng.random() < 0.05:
            s.finish(rng.choice(sorted(s.seqs)))  # an abort
        plan = s.schedule(now)
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
