"""The adaptive draft policy (engine/draft_policy.py): which drafts a step
verifies, given measured step times and each sequence's acceptance record.
Pure Python: the step times are given, as a device would have measured them."""

import math

import pytest

from fluidserve.engine.draft_policy import Acceptance, DraftPolicy, StepTimes, bucket


def record(stood: int, rejected: int) -> Acceptance:
    return Acceptance(float(stood), float(rejected))


def timed(decode: dict[int, float], verify: dict[int, float]) -> DraftPolicy:
    """A policy that has seen these step times (seconds by token count)."""
    policy = DraftPolicy()
    for n, s in decode.items():
        policy.observe_step(n, 0, s)
    for n, s in verify.items():
        policy.observe_step(1, n - 1, s)
    return policy


def test_buckets_are_exact_then_geometric():
    assert [bucket(n) for n in range(1, 9)] == list(range(1, 9))
    assert bucket(16) == bucket(8) + 4 and bucket(32) == bucket(8) + 8
    assert bucket(9) == 9 and bucket(10) == 9  # 8 * 2**0.25 = 9.5
    assert all(bucket(n) <= bucket(n + 1) for n in range(1, 1000))


def test_step_times_interpolate_and_extrapolate():
    t = StepTimes()
    assert t.predict(4) is None
    t.observe(4, 0.040)
    assert t.predict(100) == 0.040  # one point: flat either side
    t.observe(8, 0.048)
    assert t.predict(6) == pytest.approx(0.044)  # linear between
    assert t.predict(16) == pytest.approx(0.064)  # the last two's slope beyond
    assert t.predict(2) == pytest.approx(0.036)  # and below, never above the nearest
    t.observe(8, 0.056)  # a moving average: a quarter of the new figure
    assert t.predict(8) == pytest.approx(0.050)
    flat = StepTimes()
    flat.observe(2, 0.040)
    flat.observe(3, 0.030)  # noise that falls with tokens: extrapolation stays at the nearest figure
    assert flat.predict(8) == pytest.approx(0.030)


def test_rate_starts_from_the_engine_wide_prior_and_follows_the_sequence():
    policy = DraftPolicy()
    fresh = Acceptance()
    assert policy.rate(fresh) == pytest.approx(0.5)  # nothing seen anywhere
    for _ in range(20):
        policy.observe_verify(Acceptance(), 4, 3)  # others stand 3 of 4
    assert policy.rate(fresh) == pytest.approx(61 / 82)  # the prior: 60 stood to 20 rejected (+1/+1)
    copier = Acceptance()
    for _ in range(10):
        policy.observe_verify(copier, 4, 4)
    writer = Acceptance()
    for _ in range(10):
        policy.observe_verify(writer, 4, 0)
    assert policy.rate(copier) > 0.9 > 0.2 > policy.rate(writer)
    # Decayed: a sequence that stops copying is believed within a few steps.
    for _ in range(6):
        policy.observe_verify(copier, 4, 0)
    assert policy.rate(copier) < 0.5


def test_drafts_all_go_where_they_are_nearly_free():
    # A batch-1 step of 5 tokens as fast as one of 1 (a device bound by reading weights).
    policy = timed({1: 0.040}, {5: 0.041})
    assert policy.choose(1, [(record(2, 1), 4)]) == [4]


def test_no_drafts_where_their_cost_outweighs_their_chance():
    # A decode of 8 takes 40 ms and each extra token 3 ms (a device bound by
    # compute): drafts standing one time in three cannot pay; drafts standing
    # nine in ten do, the first of each sequence before any second.
    policy = timed({8: 0.040}, {9: 0.043, 16: 0.064, 24: 0.088, 40: 0.136})
    low = [(record(1, 2), 4)] * 8
    assert policy.choose(8, low) == [0] * 8
    high = policy.choose(8, [(record(90, 10), 4)] * 8)
    assert 8 <= sum(high) < 32 and min(high) >= 1
    assert policy.withheld > 0


def test_the_likeliest_drafts_go_first():
    # Room for a few drafts: they go to the sequence whose drafts stand.
    policy = timed({4: 0.040}, {5: 0.041, 6: 0.041, 7: 0.041, 8: 0.060, 12: 0.100, 20: 0.180})
    copier, writer = record(20, 1), record(1, 20)
    counts = policy.choose(4, [(writer, 4), (copier, 4), (writer, 4), (writer, 4)])
    assert counts[1] == 3 and counts[0] == counts[2] == counts[3] == 0


def test_it_times_what_it_has_not_timed():
    policy = DraftPolicy()
    # Nothing timed: draft, as many as there are sequences (the likeliest:
    # each one's first), then time a plain step.
    assert policy.choose(2, [(Acceptance(), 3), (Acceptance(), 3)]) == [1, 1]
    assert DraftPolicy().choose(1, [(Acceptance(), 3)]) == [2]
    policy.observe_step(2, 2, 0.050)
    assert policy.choose(2, [(Acceptance(), 3), (Acceptance(), 3)]) == [0, 0]


@pytest.mark.parametrize("drafting_wins", [True, False])
def test_the_option_not_taken_is_timed_again(drafting_wins):
    verify = 0.041 if drafting_wins else 0.200
    policy = timed({1: 0.040}, {5: verify})
    offer = [(record(3, 1), 4)]
    choices = []
    for _ in range(2 * policy.refresh + 4):
        n = policy.choose(1, offer)[0]
        choices.append(n)
        policy.observe_step(1, n, verify if n else 0.040)
    other = [c for c in choices if (c == 0) == drafting_wins]
    # Mostly the better option; the other about once every `refresh` decisions.
    assert 1 <= len(other) <= math.ceil(len(choices) / policy.refresh)


@pytest.mark.parametrize("slower, drafts", [(1.10, 0), (1.02, 4)])
def test_one_copier_does_not_slow_fifteen_that_cannot_draft(slower, drafts):
    """Sixteen sequences, one whose drafts nearly always stand: its four
    drafts would raise the step's tokens a second even where they make the
    step 10% slower (16 tokens in 80 ms against 19.6 in 88), but the other
    fifteen would each wait 10% longer a token; the policy minimises the
    mean time per token, so it drafts only where the step slows by less."""
    policy = timed({16: 0.080}, {20: 0.080 * slower})
    assert policy.choose(16, [(record(40, 1), 4)]) == [drafts]
