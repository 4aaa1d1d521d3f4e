"""Admission under a queue that memory holds back.

Each step tries every waiting request, so a burst of thousands costs the
scheduler thousands of admission checks a step. A floor under the blocks a
request needs (``KVCacheManager.admission_floor``: its prompt taken as shared
on the device up to where its last walk through the prefix index ended, while
that key is still in neither tier) refuses most of them before the index is
walked again; these tests hold it to giving the very plans the exact count
gives.
"""

from __future__ import annotations

import random

import pytest

from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.kvcache.prefix_cache import block_keys
from fluidserve.scheduler.cost_model import LinearCoefficients, LinearCostModel
from fluidserve.scheduler.request_state import RequestClass
from fluidserve.scheduler.scheduler import Scheduler
from fluidserve.scheduler.simulator import SimConfig, Simulator
from fluidserve.scheduler.workloads import Job

COST = LinearCostModel(LinearCoefficients(base=0.01, per_prefill_token=2e-5, per_decode_seq=1e-4,
                                          per_context_token=1e-7, per_attn_pair=0.0))


def burst(offline_every: int = 0) -> list[Job]:
    """240 requests in half a second: prompts of 40-400 tokens, most behind
    one of four shared system prompts, answers of 1-120 tokens (a third at
    most 32: borrowers under KV loans); with ``offline_every`` k, every k-th
    is a Batch API line."""
    rng = random.Random(7)
    jobs = []
    for i in range(240):
        klass = RequestClass.OFFLINE if offline_every and i % offline_every == 0 else RequestClass.ONLINE
        shared = (i % 4, 64 * (1 + i % 4)) if i % 5 else None
        prompt = rng.randint(40, 400)
        if shared is not None:
            prompt = max(prompt, shared[1] + 8)
        out = rng.randint(1, 32) if i % 3 == 0 else rng.randint(33, 120)
        jobs.append(Job(f"j{i}", i / 480, prompt, out, klass, shared_prefix=shared))
    return jobs


# (settings, every k-th job offline, policy, the floor spares most walks):
# without loans a request that may evict is always counted exactly.
CASES = {
    "server defaults": (dict(), 0, "skip-join-mlfq", True),
    "beside batch lines": (dict(), 3, "skip-join-mlfq", False),
    "loans off": (dict(swap_loan_tokens=-1), 0, "skip-join-mlfq", False),
    "fcfs, recompute, no host tier": (dict(preemption_mode="recompute", num_host_blocks=None), 0, "fcfs", True),
    "cache off": (dict(enable_prefix_caching=False), 0, "skip-join-mlfq", True),
}


def run(monkeypatch, settings: dict, offline_every: int, policy: str, floor: bool):
    """Every step's plan, as the scheduler handed it over, the run's
    summary, and how often admission walked a prompt's keys through the
    prefix index."""
    walks = []
    with monkeypatch.context() as patch:
        if not floor:  # a floor that never decides
            patch.setattr(KVCacheManager, "admission_floor", lambda self, keys, num_tokens, stop=-1: 0)
        exact = KVCacheManager.admission
        patch.setattr(KVCacheManager, "admission", lambda self, *a: walks.append(1) or exact(self, *a))
        plans = []
        schedule = Scheduler.schedule
        patch.setattr(Scheduler, "schedule", lambda self, now: plans.append(repr(p := schedule(self, now))) or p)
        config = SimConfig.create(**{"num_kv_blocks": 192, "block_size": 16, "num_host_blocks": 768,
                                     "block_transfer_time": 1e-4, "check_integrity": True, **settings})
        result = Simulator(burst(offline_every), policy, COST, config).run()
    return plans, result.summary(), len(walks)


@pytest.mark.parametrize("settings, offline_every, policy, spared", CASES.values(), ids=CASES.keys())
def test_the_floor_gives_the_exact_counts_plans(monkeypatch, settings, offline_every, policy, spared):
    """Server defaults, beside Batch API lines, without loans, FCFS with
    recompute and no host tier, without the prefix cache: every step's plan
    (what runs, swaps, evictions) is the one the exact count gives, and so
    is every figure of the run, with fewer walks of the index."""
    plans, summary, walks = run(monkeypatch, settings, offline_every, policy, floor=True)
    exact_plans, exact_summary, exact_walks = run(monkeypatch, settings, offline_every, policy, floor=False)
    assert summary["num_finished"] == 240
    assert plans == exact_plans
    assert summary == exact_summary
    assert walks <= exact_walks
    if spared:
        assert walks < exact_walks / 2, (walks, exact_walks)


def test_the_floor_is_never_above_the_exact_count():
    """Whatever the index holds (nothing; the prefix on the device in use,
    or free) and whatever hint it is given, the floor is at most
    the blocks admission takes, and equal once the whole shareable prefix is
    on the device in use and the hint marks where it ends."""
    bs = 4
    kv = KVCacheManager(64, bs, 64, enable_prefix_caching=True)
    system = list(range(16))  # 4 blocks shared
    a, b = system + [100 + i for i in range(24)], system + [200 + i for i in range(24)]
    keys_a, keys_b = block_keys(a, bs), block_keys(b, bs)

    def check(keys, n):
        need, stop = kv.admission(keys, n)
        for hint in (-1, 0, 2, 4, 5, len(keys) - 1, stop):
            assert kv.admission_floor(keys, n, hint) <= need, hint
        return need, stop

    assert check(keys_b, len(b)) == (10, 0)  # nothing cached
    assert kv.admit("a", keys_a, len(a)) is not None
    kv.cache_blocks("a", keys_a, len(a))
    need, stop = check(keys_b, len(b))  # the system prompt on the device, in use
    assert (need, stop) == (6, 4) and kv.admission_floor(keys_b, len(b), stop) == 6
    assert kv.admission_floor(keys_b, len(b)) == 1  # no hint: all 9 shareable blocks taken as shared
    assert check(keys_a, len(a)) == (1, 9)  # its own prompt again: all cached but the block it must compute
    kv.free("a")
    assert check(keys_b, len(b)) == (10, 4)  # on the device but free: sharing takes them from the free pool
