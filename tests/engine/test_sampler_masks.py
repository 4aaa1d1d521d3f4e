"""The sampler's request-level masks: allowed_token_ids, logit_bias and
bad_words, each against a hand-computed expectation, and never leaking into
the other rows of the batch."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine.sampler import SamplingRow, sample
from fluidserve.engine.sampling_params import SamplingParams

V = 8
# Row logits: token 3 is the clear argmax, then 5, then 1.
LOGITS = torch.tensor([0.0, 2.0, 0.0, 5.0, 0.0, 3.0, 0.0, 0.0])


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def row(params: SamplingParams, output=()) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=[], output_token_ids=list(output), generator=None)


def pick(rows: list[SamplingRow]) -> list[int]:
    logits = LOGITS.expand(len(rows), V).contiguous()
    return [t.token_id for t in sample(logits, rows, eos_token_id=None)]


def test_allowed_token_ids_only_these_and_only_this_row():
    assert pick([row(greedy(allowed_token_ids=[1, 6])), row(greedy())]) == [1, 3]
    # ids past the vocabulary are ignored, not an error
    assert pick([row(greedy(allowed_token_ids=[6, 100]))]) == [6]


def test_logit_bias_adds_to_the_logit():
    assert pick([row(greedy(logit_bias={5: 2.5})), row(greedy(logit_bias={5: 1.5}))]) == [5, 3]
    assert pick([row(greedy(logit_bias={3: -100}))]) == [5]


def test_bad_words_single_token_and_sequence():
    one = greedy(bad_words_token_ids=[[3]])
    seq = greedy(bad_words_token_ids=[[2, 3]])
    assert pick([row(one), row(seq), row(seq, output=[4, 2]), row(greedy(), output=[2])]) == [5, 3, 5, 3]
    # the head must end the output: [2, 3] after [2, 4] does not apply
    assert pick([row(seq, output=[2, 4])]) == [3]


def test_thinking_budget_forces_the_end_marker_once():
    """Budget 2, end marker 6: a row with two tokens of thinking takes 6
    whatever its logits say; before the budget, or once 6 has come, it
    samples freely; other rows never feel it."""
    budget = greedy(thinking_token_budget=2, thinking_start_token_id=7, thinking_end_token_id=6)
    assert pick([row(budget, [1]), row(budget, [1, 2]), row(greedy(), [1, 2])]) == [3, 6, 3]
    assert pick([row(budget, [1, 2, 6]), row(budget, [1, 6, 3, 3]), row(budget, [6])]) == [3, 3, 3]
    assert pick([row(budget, [7, 1]), row(budget, [7, 1, 7, 2])]) == [3, 6]  # start markers are not thinking
    zero = greedy(thinking_token_budget=0, thinking_end_token_id=6)
    assert pick([row(zero), row(zero, [6]), row(zero, [6, 3])]) == [6, 3, 3]


def test_logprobs_still_describe_the_model():
    params = SamplingParams(temperature=0.0, allowed_token_ids=[1], logprobs=1)
    out = sample(LOGITS.unsqueeze(0).clone(), [row(params)], eos_token_id=None)[0]
    assert out.token_id == 1
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs[1].logprob == pytest.approx(raw[1].item())
    assert out.logprobs[3].rank == 1


@pytest.mark.parametrize("kw, param", [
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[1, -2]]}, "bad_words"),
])
def test_bad_values_name_the_parameter(kw, param):
    with pytest.raises(ValueError, match=f"^{param}"):
        SamplingParams(**kw)
