"""Speculative decoding's pure parts: --speculative-config as vLLM spells
it, the n-gram drafter against a brute-force lookup, the draft limits, and
the scheduler's accounting of a step that verified drafts (KV kept for the
tokens that stood only, outputs counted, blocks allocated for the drafts)."""

from __future__ import annotations

import random
import re

import pytest

from fluidserve.engine.sampler import SampledToken
from fluidserve.engine.speculative import (NgramConfig, NgramDrafter, accepted, draft_limit,
                                           parse_speculative_config)
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig


def test_config_takes_vllms_ngram_keys_and_defaults():
    assert parse_speculative_config(None) is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}') == NgramConfig(4, 5, 5)
    assert parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}') == NgramConfig(3, 4, 4)
    assert parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 6}'
    ) == NgramConfig(3, 2, 6)


def test_drafts_by_batch_size_follow_vllms_ranges():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                      '"num_speculative_tokens_per_batch_size": [[5, 8, 1], [1, 2, 6], [16, 64, 0]]}')
    assert config.per_batch_size == ((1, 2, 6), (5, 8, 1), (16, 64, 0))
    # Capped at num_speculative_tokens; a gap or the tail takes the range before it.
    assert [config.drafts_at(b) for b in (1, 2, 3, 4, 5, 8, 9, 15, 16, 64, 500)] == [4, 4, 4, 4, 1, 1, 1, 1, 0, 0, 0]
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}').drafts_at(1000) == 3
    assert not config.adaptive  # the ranges fix the counts


def test_drafts_are_adaptive_unless_fixed():
    base = '{"method": "ngram", "num_speculative_tokens": 4'
    assert parse_speculative_config(base + "}").adaptive
    assert not parse_speculative_config(base + ', "adaptive": false}').adaptive
    assert parse_speculative_config(base + ', "adaptive": true}').adaptive


@pytest.mark.parametrize("text, words", [
    ("[1]", "not a JSON object"),
    ("{", "not a JSON object"),
    ('{"method": "eagle", "model": "x", "num_speculative_tokens": 3}', "method 'eagle' is not implemented"),
    ('{"num_speculative_tokens": 3}', "method None is not implemented"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}',
     "disable_by_batch_size is not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 1]]}',
     "the first range must start at batch size 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, '
     '"num_speculative_tokens_per_batch_size": [[1, 8, 1], [8, 9, 0]]}', "ranges overlap"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8]]}',
     "[1, 8] is not a range"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}',
     "must be a non-empty list"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}', "adaptive must be true or false, got 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "adaptive": true, '
     '"num_speculative_tokens_per_batch_size": [[1, 8, 1]]}', "cannot be true with num_speculative_tokens_per"),
])
def test_config_errors_name_what_is_wrong(text, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_speculative_config(text)


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The longest suffix of lo..hi tokens that occurs earlier; the tokens
    after its earliest earlier occurrence (at most k, none past the end)."""
    last = len(tokens) - 1
    for n in range(min(hi, last), lo - 1, -1):
        suffix = tokens[last - n + 1:]
        for e in range(n - 1, last):
            if tokens[e - n + 1:e + 1] == suffix:
                return tokens[e + 1:min(e + 1 + k, last + 1)]
    return []


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 3), (2, 4), (5, 5)])
def test_drafter_grown_token_by_token_equals_a_brute_force_lookup(lo, hi):
    rng = random.Random(lo * 10 + hi)
    for _ in range(20):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        prompt = tokens[:rng.randrange(1, len(tokens) + 1)]
        outputs: list[int] = []  # the live list: grows by one or more tokens between lookups
        drafter = NgramDrafter(prompt, outputs, lo, hi)
        while True:
            k = rng.randrange(0, 6)
            assert drafter.propose(k) == brute_force(prompt + outputs, lo, hi, k)
            done = len(prompt) + len(outputs)
            if done == len(tokens):
                break
            outputs += tokens[done:done + rng.randrange(1, 4)]


def test_drafter_proposes_what_followed_the_repeated_text():
    outputs = [9, 1, 2, 3]
    drafter = NgramDrafter([7, 1, 2, 3, 4, 5], outputs, 1, 3)
    assert drafter.propose(4) == [4, 5, 9, 1]  # the 3-gram 1 2 3 first ended at index 3
    assert drafter.propose(10) == [4, 5, 9, 1, 2, 3]  # never past the newest token
    outputs.append(8)
    assert drafter.propose(4) == []  # 8 never occurred before


def test_accepted_counts_the_drafts_before_the_first_row_that_differs():
    rows = [SampledToken(t, None) for t in (5, 6, 7, 8)]
    assert accepted(rows, [5, 6, 7]) == 3
    assert accepted(rows, [5, 9, 7]) == 1
    assert accepted(rows, [4, 6, 7]) == 0


def test_draft_limits_keep_lengths_and_min_tokens():
    assert draft_limit(4, 10, 100, 0) == 4
    assert draft_limit(4, 10, 13, 0) == 2  # 2 drafts and the row after them end at 13 outputs
    assert draft_limit(4, 10, 11, 0) == 0
    assert draft_limit(4, 10, 100, 12) == 1  # rows at outputs 10 and 11: both still hold stop tokens back
    assert draft_limit(4, 12, 100, 12) == 4


def scheduler(budget: int = 64) -> Scheduler:
    config = SchedulerConfig(scheduling_policy="fcfs", kv_watermark=0.0, max_num_batched_tokens=budget)
    return Scheduler(config, KVCacheManager(64, 4))


def decoding(s: Scheduler, *rids: str) -> list[SeqState]:
    """Requests past their prompts (6 tokens each) with one output sampled."""
    seqs = [SeqState(rid, 6, 100, 0.0) for rid in rids]
    for seq in seqs:
        s.add(seq, 0.0)
    plan = s.schedule(0.0)
    assert [(i.request_id, i.num_tokens) for i in plan.scheduled] == [(rid, 6) for rid in rids]
    s.update_from_output(plan, StepOutcome(0.01, 0.0))
    return seqs


def test_a_verifying_step_keeps_the_kv_of_the_tokens_that_stood():
    s = scheduler()
    (seq,) = decoding(s, "a")
    assert (seq.num_computed_tokens, seq.num_output_tokens) == (6, 1)
    seq.num_draft_tokens = 4
    plan = s.schedule(0.1)
    (item,) = plan.scheduled
    assert (item.num_tokens, item.drafts, item.samples) == (5, 4, True)
    assert len(s.kv.block_table("a")) * 4 >= 11  # KV for the decode's token and every draft
    s.update_from_output(plan, StepOutcome(0.01, 0.1, rejected={"a": 3}))  # one draft stood
    # The decode's token and the draft are computed; the draft and the row after it are outputs.
    assert (seq.num_computed_tokens, seq.num_output_tokens) == (8, 3)
    seq.num_draft_tokens = 0
    (item,) = s.schedule(0.2).scheduled
    assert (item.num_tokens, item.drafts) == (1, 0)


def test_drafts_take_what_the_step_budget_leaves():
    s = scheduler(budget=12)
    a, b = decoding(s, "a", "b")
    a.num_draft_tokens = b.num_draft_tokens = 8
    plan = s.schedule(0.1)
    assert [(i.request_id, i.num_tokens, i.drafts) for i in plan.scheduled] == [("a", 9, 8), ("b", 3, 2)]
    # Nothing reported for b: none of its drafts stood.
    s.update_from_output(plan, StepOutcome(0.01, 0.1, rejected={"a": 0}))
    assert (a.num_computed_tokens, a.num_output_tokens) == (15, 10)
    assert (b.num_computed_tokens, b.num_output_tokens) == (7, 2)
