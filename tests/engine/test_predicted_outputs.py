"""Predicted outputs (OpenAI's ``prediction``): with speculative decoding
on, a request's drafts come from the text it is expected to repeat. The
drafter follows the prediction while the outputs do, finds its place again
after an edit, and falls back to the n-gram lookup where the prediction has
nothing; through the engine the tokens are those without a prediction, in
fewer steps where the prediction is right, and the prediction's kept and
thrown-away drafts are counted."""

from __future__ import annotations

import pytest

from fluidserve.engine import SamplingParams
from fluidserve.engine.speculative import NgramDrafter, PredictionDrafter, PredictionIndex

# Every draft verified, up to 4 a step: the counts below are the drafter's, not the policy's.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2,
         "adaptive": False}
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog"]


def drafter(prediction: list[int], prompt: list[int] | None = None) -> tuple[PredictionDrafter, list[int]]:
    outputs: list[int] = []
    ngram = NgramDrafter(prompt or [900, 901], outputs, 2, 3)
    return PredictionDrafter(prediction, outputs, ngram), outputs


def test_the_drafter_follows_the_prediction_and_finds_its_place_after_an_edit():
    pred = list(range(100, 120))
    d, out = drafter(pred)
    assert d.propose(4) == [100, 101, 102, 103] and d.from_prediction
    out += [100, 101, 102]
    assert d.propose(4) == [103, 104, 105, 106]
    out += [103, 7, 8]  # an insertion: off the prediction, and "7 8" is nowhere in it
    assert d.propose(4) == [] and not d.from_prediction
    out += [104, 105]  # back on it: "104 105" is found and drafting resumes after it
    assert d.propose(3) == [106, 107, 108] and d.from_prediction
    out += [106, 112, 113]  # a deletion: 107 .. 111 skipped
    assert d.propose(2) == [114, 115]
    out += [114, 115, 116, 117, 118, 119]
    assert d.propose(4) == [] and not d.from_prediction  # the prediction is used up


def test_after_an_edit_the_place_is_found_from_where_the_outputs_left():
    # "5 6" occurs twice: the match after the place the outputs left wins over the earlier one.
    pred = [5, 6, 1, 2, 3, 5, 6, 4]
    d, out = drafter(pred)
    out += [5, 6, 1, 2, 3, 9, 5, 6]
    assert d.propose(2) == [4]
    # Nothing after it matches: the first occurrence does.
    d, out = drafter([5, 6, 7, 8])
    out += [5, 6, 7, 8, 9, 5, 6]
    assert d.propose(2) == [7, 8]


def test_where_the_prediction_has_nothing_the_ngram_lookup_drafts():
    d, out = drafter([300, 301], prompt=[1, 2, 3, 4, 1, 2])
    out += [7]
    assert d.propose(2) == [] and not d.from_prediction
    out += [1, 2]  # "1 2" recurs in the prompt, followed by 3, 4
    assert d.propose(2) == [3, 4] and not d.from_prediction


def steps_of(llm, prompt: str, params: SamplingParams):
    before = llm.engine.stats().num_steps
    out = llm.generate([prompt], params)[0].outputs[0]
    return out, llm.engine.stats().num_steps - before


@pytest.mark.parametrize("edit", ["exact", "edited"])
def test_a_prediction_gives_the_same_tokens_in_fewer_steps(tiny_model, make_llm, edit):
    llm = make_llm(tiny_model("llama"), speculative_config=NGRAM)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        plain, plain_steps = steps_of(llm, prompt, greedy)
        assert plain.accepted_prediction_tokens is None and plain.rejected_prediction_tokens is None
        prediction = list(plain.token_ids)
        if edit == "edited":  # a stretch replaced, as an edit of the file would: the third step's drafts, 11-14,
            prediction[12:14] = [258, 258, 258]  # reach it after one that stands (258: the pad token)
        out, steps = steps_of(llm, prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                          prediction_token_ids=prediction))
        assert out.token_ids == plain.token_ids
        assert out.accepted_prediction_tokens > 20 and steps < plain_steps
        if edit == "exact":  # the prefill's token, then four drafts and a token a step: 40 tokens in 9 steps
            assert out.rejected_prediction_tokens == 0 and out.accepted_prediction_tokens == 31 and steps == 9
        else:
            assert out.rejected_prediction_tokens > 0


@pytest.mark.parametrize("vocab", [3, 200_000])  # many repeats; ids whose keys wrap past 2**64 from n = 4
def test_the_prediction_index_finds_every_end_of_each_n_gram_in_order(vocab):
    import random

    rng = random.Random(vocab)
    pred = [rng.randrange(vocab) for _ in range(300)]
    index = PredictionIndex(pred, 2, 5)
    for n in range(2, 6):
        for start in range(0, len(pred) - n + 1, 7):
            gram = pred[start:start + n]
            want = [e for e in range(n - 1, len(pred)) if pred[e - n + 1:e + 1] == gram]
            assert index.ends(gram).tolist() == want
    assert index.ends([vocab + 1, vocab + 2]).tolist() == []  # in no prediction
    assert index.ends([pred[0]]).tolist() == [] and index.ends(pred[:6]).tolist() == []  # n outside 2 .. 5
    assert PredictionIndex(pred[:1], 2, 5).ends(pred[:2]).tolist() == []  # shorter than any n


def test_a_requests_sequences_share_one_index_of_its_prediction(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), speculative_config=NGRAM)
    prediction = list(range(40, 60))
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, n=3, prediction_token_ids=prediction)
    llm.engine.add_request("shared", [1, 2, 3], params)
    drafters = [seq.drafter for seq in llm.engine.requests["shared"].seqs]
    assert len(drafters) == 3 and all(isinstance(d, PredictionDrafter) for d in drafters)
    assert len({id(d._index) for d in drafters}) == 1
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
