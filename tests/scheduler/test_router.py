"""Router: prefix affinity, spill-over past the balance threshold, load
estimates between reports, health and exclusion, offline placement, the
bounded prefix index, counters."""

from __future__ import annotations

import pytest

from fluidserve.kvcache.prefix_cache import block_keys, salted_root
from fluidserve.scheduler.router import (
    ROUTING_POLICIES, AffinityIndex, BacklogCost, NoReplicaError, ReplicaLoad, make_router, prompt_keys,
)

BS = 16
# One second per 1000 queued prompt tokens, running decodes free: backlogs easy to reason about.
COST = BacklogCost(prefill_s_per_token=1e-3, decode_s_per_seq=0.0)


def prompt(tenant: int, own: int, prefix_tokens: int = 512, own_tokens: int = 64) -> list[int]:
    """A tenant's system prompt followed by a request's own tokens."""
    return [1000 * tenant + i for i in range(prefix_tokens)] + [10**6 + 1000 * own + i for i in range(own_tokens)]


def router(policy: str = "prefix-aware", n: int = 4, **kw):
    return make_router(policy, n, block_size=BS, **{"cost": COST, **kw})


def test_prompt_keys_are_the_engine_prefix_cache_keys():
    ids = list(range(1000, 1000 + 16 * 9 + 5))
    assert prompt_keys(ids, BS) == block_keys(ids, BS)
    assert prompt_keys(ids, 8) == block_keys(ids, 8)
    assert prompt_keys(ids[:15], BS) == []
    root = salted_root("tenant")
    assert prompt_keys(ids, BS, root) == block_keys(ids, BS, root=root)
    assert not set(prompt_keys(ids, BS, root)) & set(prompt_keys(ids, BS))


def test_a_salted_prompt_is_not_routed_by_the_unsalted_prefix():
    r = router()
    first = r.route("a0", prompt(1, 0))
    assert r.route("a1", prompt(1, 1)).replica == first.replica
    salted = r.route("s0", prompt(1, 2), root=salted_root("tenant"))
    assert salted.cached_tokens == 0 and salted.reason == "least-loaded"


def test_shared_prefix_sticks_to_one_replica_while_loads_are_even():
    r = router()
    first = r.route("a0", prompt(1, 0))
    assert first.reason == "least-loaded" and first.cached_tokens == 0
    for i in range(1, 6):
        route = r.route(f"a{i}", prompt(1, i))
        assert (route.replica, route.reason, route.cached_tokens) == (first.replica, "prefix", 512)
        r.started(f"a{i}")
        r.finished(f"a{i}")
    # Another tenant's prompt is a miss: it goes least-loaded, i.e. elsewhere
    # (the first replica carries a0's queued prompt).
    other = r.route("b0", prompt(2, 0))
    assert other.reason == "least-loaded" and other.replica != first.replica


def test_longest_prefix_wins():
    r = router()
    short = r.route("s", prompt(1, 0, prefix_tokens=128))
    r.finished("s")
    # Replica holding 512 tokens of tenant 1's prefix, forced elsewhere.
    long = r.route("l", prompt(1, 1, prefix_tokens=512), exclude={short.replica})
    r.finished("l")
    assert long.replica != short.replica
    again = r.route("x", prompt(1, 2, prefix_tokens=512))
    assert again.replica == long.replica and again.cached_tokens == 512


def test_skewed_load_spills_over_past_the_threshold():
    r = router(balance_threshold_s=0.25)
    home = r.route("a0", prompt(1, 0)).replica
    r.finished("a0")
    # 0.2 s more backlog than the others, below threshold + the 0.5 s the hit saves: stays.
    r.report(home, ReplicaLoad(queued_prefill_tokens=200, running=0, kv_usage=0.1))
    stay = r.route("a1", prompt(1, 1))
    assert (stay.replica, stay.reason) == (home, "prefix")
    r.finished("a1")
    # 10 s more: spills to a less loaded replica.
    r.report(home, ReplicaLoad(queued_prefill_tokens=10_000, running=0, kv_usage=0.1))
    spill = r.route("a2", prompt(1, 2))
    assert spill.replica != home and spill.reason == "load" and spill.cached_tokens == 0
    # The spill-over replica now holds the prefix too: the next request of the
    # tenant finds it there without spilling.
    r.finished("a2")
    follow = r.route("a3", prompt(1, 3))
    assert (follow.replica, follow.reason, follow.cached_tokens) == (spill.replica, "prefix", 512)


def test_threshold_is_measured_in_backlog_seconds():
    strict = router(balance_threshold_s=0.0)
    loose = router(balance_threshold_s=100.0)
    for r in (strict, loose):
        home = r.route("a0", prompt(1, 0)).replica
        r.finished("a0")
        r.report(home, ReplicaLoad(queued_prefill_tokens=5_000, running=0, kv_usage=0.0))
    assert strict.route("a1", prompt(1, 1)).reason == "load"
    assert loose.route("a1", prompt(1, 1)).reason == "prefix"


def test_a_burst_between_reports_spreads_by_the_routers_own_estimate():
    r = router("least-loaded")
    routes = [r.route(f"q{i}", prompt(i, i)) for i in range(8)]
    assert sorted(x.replica for x in routes) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(x.reason == "least-loaded" for x in routes)


def test_started_and_finished_move_the_estimate():
    r = router("round-robin", n=1)
    r.route("a", prompt(1, 0))  # 576 tokens
    assert (r.queued_tokens(0), r.running(0)) == (576, 0)
    r.started("a")
    r.started("a")  # twice: counted once
    assert (r.queued_tokens(0), r.running(0)) == (0, 1)
    r.finished("a")
    r.finished("a")  # idempotent
    r.finished("never-routed")  # unknown ids are ignored
    assert (r.queued_tokens(0), r.running(0), r.num_in_flight) == (0, 0, 0)
    # Finished before its first token: its prompt leaves the queue.
    r.route("b", prompt(2, 0))
    r.finished("b")
    assert r.queued_tokens(0) == 0


def test_report_corrects_the_estimate_and_events_move_it_after():
    r = router("least-loaded", n=2)
    r.report(0, ReplicaLoad(queued_prefill_tokens=500, running=3, kv_usage=0.5))
    assert (r.queued_tokens(0), r.running(0)) == (500, 3)
    assert r.backlog(0) == pytest.approx(0.5)
    route = r.route("a", prompt(1, 0))  # replica 1 is idle
    assert route.replica == 1
    r.report(1, ReplicaLoad(queued_prefill_tokens=400, running=0, kv_usage=0.1))  # it saw some of a's tokens
    assert r.queued_tokens(1) == 400
    r.started("a")
    assert (r.queued_tokens(1), r.running(1)) == (0, 1)  # never below zero


def test_reroute_forgets_the_earlier_route():
    r = router("round-robin", n=2)
    first = r.route("a", prompt(1, 0))
    second = r.route("a", prompt(1, 0), exclude={first.replica})
    assert second.replica != first.replica
    assert r.queued_tokens(first.replica) == 0 and r.num_in_flight == 1


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_unhealthy_never_chosen_and_no_replica_error(policy):
    r = router(policy)
    r.set_healthy(2, False)
    chosen = {r.route(f"q{i}", prompt(i % 3, i)).replica for i in range(40)}
    assert chosen == {0, 1, 3}
    for i in range(4):
        r.set_healthy(i, False)
    with pytest.raises(NoReplicaError):
        r.route("x", prompt(1, 1))
    assert r.num_healthy == 0


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_exclude_is_honoured(policy):
    r = router(policy)
    for i in range(20):
        assert r.route(f"q{i}", prompt(1, i), exclude={0, 1}).replica in {2, 3}
    r.set_healthy(3, False)
    assert r.route("y", prompt(1, 99), exclude=[0, 1]).replica == 2
    with pytest.raises(NoReplicaError):
        r.route("z", prompt(1, 100), exclude=range(3))


def test_a_replica_back_from_the_dead_has_an_empty_index():
    r = router()
    home = r.route("a0", prompt(1, 0)).replica
    r.finished("a0")
    r.set_healthy(home, False)
    r.set_healthy(home, True)
    route = r.route("a1", prompt(1, 1))
    assert route.cached_tokens == 0 and route.reason == "least-loaded"


def test_kv_pressure_counts_in_the_backlog():
    r = router("least-loaded", n=2, cost=BacklogCost(1e-3, 0.0, kv_high=0.9, kv_full_s=1.0))
    r.report(0, ReplicaLoad(queued_prefill_tokens=0, running=0, kv_usage=0.99))
    r.report(1, ReplicaLoad(queued_prefill_tokens=500, running=0, kv_usage=0.2))
    assert r.backlog(0) == pytest.approx(0.9)
    assert {r.route(f"q{i}", [i]).replica for i in range(2)} == {1}  # 1 token each: 0.5 s < 0.9 s


def test_offline_goes_to_the_most_idle_replica_and_records_its_prefix():
    r = router()
    # Replica 0 carries online work, replica 1 a lot of offline work, 2 and 3 a little online.
    r.report(0, ReplicaLoad(queued_prefill_tokens=3_000, running=0, kv_usage=0.1))
    r.report(1, ReplicaLoad(queued_prefill_tokens=50_000, running=0, kv_usage=0.1,
                            queued_offline_prefill_tokens=50_000))
    r.report(2, ReplicaLoad(queued_prefill_tokens=1_000, running=0, kv_usage=0.1))
    r.report(3, ReplicaLoad(queued_prefill_tokens=800, running=0, kv_usage=0.1))
    off = r.route("batch-1", prompt(7, 0), offline=True)
    assert (off.replica, off.reason) == (3, "offline")
    # Offline work does not count against online arrivals: replica 1 is the least loaded for them.
    assert r.route("chat", prompt(8, 0)).replica == 1
    # The batch line's prefix was recorded on replica 3.
    again = r.route("chat-2", prompt(7, 1))
    assert again.cached_tokens == 512 and again.replica == 3


def test_round_robin_cycles_over_healthy_replicas():
    r = router("round-robin", n=3)
    r.set_healthy(1, False)
    assert [r.route(f"q{i}", prompt(1, i)).replica for i in range(6)] == [0, 2, 0, 2, 0, 2]


def test_counters():
    r = router()
    r.route("a0", prompt(1, 0))
    r.route("a1", prompt(1, 1))
    r.route("b0", prompt(2, 0), offline=True)
    c = r.counters()
    assert c["policy"] == "prefix-aware"
    assert c["routed"] == {"least-loaded": 1, "prefix": 1, "offline": 1}
    assert c["prefix_hit_tokens"] == 512 and c["prompt_tokens"] == 3 * 576
    assert sum(x["routed"] for x in c["replicas"]) == 3
    assert sum(x["prefix_hit_tokens"] for x in c["replicas"]) == 512
    assert all(x["healthy"] for x in c["replicas"])


def test_affinity_index_is_bounded_and_drops_tails_first():
    idx = AffinityIndex(2, capacity_blocks=6)
    a = prompt_keys(prompt(1, 0, prefix_tokens=64, own_tokens=0), BS)  # 4 blocks
    b = prompt_keys(prompt(2, 0, prefix_tokens=64, own_tokens=0), BS)
    idx.insert(0, a)
    idx.insert(0, b)
    assert idx.num_blocks(0) == 6
    # a is older: its last two blocks went first, its first two still match.
    assert idx.match(a, 0b11) == {0: 2}
    assert idx.match(b, 0b11) == {0: 4}
    idx.insert(1, a)
    assert idx.match(a, 0b11) == {0: 2, 1: 4}
    assert idx.match(a, 0b10) == {1: 4}
    idx.clear(0)
    assert idx.match(b, 0b11) == {} and idx.num_blocks(0) == 0
    assert len(idx) == 4  # only replica 1's keys are left


def test_backlog_cost_from_the_roofline():
    from fluidserve.scheduler.cost_model import default_cost_model

    cost = BacklogCost.from_cost_model(default_cost_model())
    # Llama-3-8B on an H100: tens of microseconds per prefill token, a running
    # request worth a few hundred of them.
    assert 1e-5 < cost.prefill_s_per_token < 1e-4
    assert 50 < cost.decode_s_per_seq / cost.prefill_s_per_token < 1000


def test_make_router_rejects_unknown_policies():
    assert ROUTING_POLICIES[0] == "prefix-aware"
    with pytest.raises(ValueError, match="routing policy"):
        make_router("random", 2, block_size=BS)
    with pytest.raises(ValueError):
        make_router("prefix-aware", 0, block_size=BS)


def test_kv_usage_alone_steers_the_choice():
    """The engine's front end tallies requests itself and reports only KV usage."""
    r = make_router("least-loaded", 2, block_size=4)
    assert r.route("a", list(range(8))).replica == 0  # a tie goes to the first
    r.finished("a")
    r.report_kv_usage(0, 0.99)  # nearly full: an arrival there would wait for room
    assert r.route("b", list(range(8))).replica == 1
