"""The tokens the penalties count, kept by the worker as they grow
(engine/token_history.py over engine/growing_lists.py): each penalised row's
history is its prompt + outputs at every step, only new tokens are
converted, and sampling with the kept histories picks what sampling with the
lists picks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fluidserve.engine.batch import SampleSpec
from fluidserve.engine.growing_lists import GrowingLists
from fluidserve.engine.sampler import SamplingRow, sample
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.engine.token_history import TokenHistories

PENALTIES = [SamplingParams(repetition_penalty=1.3, temperature=0), SamplingParams(frequency_penalty=0.7),
             SamplingParams(presence_penalty=0.4, temperature=0), SamplingParams(temperature=0)]


def spec(params: SamplingParams, prompt: list[int], outputs: list[int]) -> SampleSpec:
    # As the engine builds them: the prompt travels only for the repetition penalty.
    return SampleSpec(params=params, seed=None, prompt_token_ids=prompt if params.repetition_penalty != 1.0 else [],
                      output_token_ids=outputs)


@pytest.mark.parametrize("seed", [0, 1])
def test_histories_follow_growing_outputs_and_rows_that_come_and_go(seed):
    rng = random.Random(seed)
    histories = TokenHistories()
    live: dict[str, SampleSpec] = {}
    for step in range(120):
        if rng.random() < 0.3 or not live:
            sid = f"seq-{step}"
            live[sid] = spec(rng.choice(PENALTIES), [rng.randrange(500) for _ in range(rng.randint(0, 60))], [])
        for sid in list(live):
            if rng.random() < 0.04:
                del live[sid]  # finished
        ids = rng.sample(sorted(live), rng.randint(1, len(live)))  # the step's rows, any order
        rows = histories.rows(ids, [live[s] for s in ids])
        for sid, history in zip(ids, rows):
            s = live[sid]
            if s.params.repetition_penalty == 1.0 and not s.params.presence_penalty and not s.params.frequency_penalty:
                assert history is None
            else:
                assert history.tolist() == s.prompt_token_ids + s.output_token_ids, f"step {step}, {sid}"
        assert len(histories) <= len(ids)
        for sid in ids:
            live[sid].output_token_ids.append(rng.randrange(500))  # the step's sampled token


def test_a_decoding_row_converts_one_token_a_step():
    histories = TokenHistories()
    s = spec(SamplingParams(repetition_penalty=1.2), list(range(1000)), [7])
    histories.rows(["a"], [s])
    assert histories.converted_tokens == 1001
    for t in range(10):
        s.output_token_ids.append(t)
        (history,) = histories.rows(["a"], [s])
        assert len(history) == 1002 + t and history[-1] == t
    assert histories.converted_tokens == 1011


def test_growing_lists_refuse_a_list_that_shrank_or_skips_items():
    lists = GrowingLists("token history")
    lists.take("a", [1, 2, 3])
    with pytest.raises(ValueError, match="token history 'a' shrank from 3 to 2"):
        lists.take("a", [1, 2])
    with pytest.raises(ValueError, match="sent from item 5, but 3 of its items are held"):
        lists.take("a", [9], start=5)
    assert lists.take("a", [3, 4], start=2).tolist() == [1, 2, 3, 4]


def test_sampling_with_kept_histories_picks_what_the_lists_pick():
    """Every penalty, the repetition one with and without outputs yet, rows
    with seeds: the same tokens and logprobs from kept histories as from the
    lists, step after step."""
    torch.manual_seed(0)
    vocab, rng = 300, random.Random(3)
    params = [SamplingParams(repetition_penalty=1.5, temperature=0, logprobs=2),
              SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, temperature=0.8, seed=11),
              SamplingParams(presence_penalty=2.0, temperature=0), SamplingParams(temperature=0)]
    specs = [spec(p, [rng.randrange(vocab) for _ in range(40)], []) for p in params]
    ids = [f"s{i}" for i in range(len(specs))]
    histories = TokenHistories()
    for _ in range(12):
        logits = torch.randn(len(specs), vocab)
        kept = histories.rows(ids, specs)
        picks = []
        for with_histories in (True, False):
            rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids,
                                torch.Generator().manual_seed(s.params.seed) if s.params.seed else None,
                                history=h if with_histories else None) for s, h in zip(specs, kept)]
            picks.append(sample(logits, rows, eos_token_id=None))
        assert picks[0] == picks[1]
        for s, tok in zip(specs, picks[0]):
            s.output_token_ids.append(tok.token_id)
    assert all(isinstance(h, np.ndarray) for h in kept[:3]) and kept[3] is None
