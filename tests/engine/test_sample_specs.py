"""Sampler rows sent as what the sampling rank lacks (engine/sample_specs.py):
through pickle, as Ray sends them, the rank's rows equal the engine's at
every step while sequences decode, come, go and come back; a decode step
carries one token a row with a history and no parameters; the rank refuses
what it cannot rebuild."""

from __future__ import annotations

import pickle
import random

import pytest

from fluidserve.engine.batch import ModelInput, SampleSpec
from fluidserve.engine.sample_specs import HELD_PER_ROW, SampleSpecMirror, SampleSpecSender
from fluidserve.engine.sampling_params import SamplingParams

KINDS = [SamplingParams(repetition_penalty=1.3, temperature=0), SamplingParams(frequency_penalty=0.7),
         SamplingParams(min_tokens=4, seed=11), SamplingParams(bad_words_token_ids=[[3, 4]]),
         SamplingParams(temperature=0)]


class Seq:
    """A sequence as the engine keeps it: one SampleSpec, its outputs the live list."""

    def __init__(self, params: SamplingParams, prompt: list[int]) -> None:
        self.outputs: list[int] = []
        history = params != SamplingParams(temperature=0)
        self.spec = SampleSpec(params=params, seed=None,
                               prompt_token_ids=prompt if params.repetition_penalty != 1.0 else [],
                               output_token_ids=self.outputs if history else [])

    def row(self) -> SampleSpec:
        if self.spec.params.seed is not None:
            self.spec.seed = hash((self.spec.params.seed, len(self.outputs))) & 0xFFFF
        return self.spec


def step(live: dict[str, Seq], ids: list[str]) -> ModelInput:
    return ModelInput(input_ids=[1] * len(ids), sample_indices=list(range(len(ids))), sample_ids=list(ids),
                      samples=[live[sid].row() for sid in ids])


def across(inp: ModelInput, sender: SampleSpecSender, mirror: SampleSpecMirror) -> ModelInput:
    """As the Ray executor sends a step and the rank takes it in."""
    got = pickle.loads(pickle.dumps(sender.wire(inp), protocol=5))
    mirror.sync(got)
    return got


def same(a: SampleSpec, b: SampleSpec) -> bool:
    return (a.params == b.params and a.seed == b.seed and a.prompt_token_ids == b.prompt_token_ids
            and a.output_token_ids == b.output_token_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_rank_rows_equal_the_engine_rows_as_sequences_come_and_go(seed):
    rng = random.Random(seed)
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    live: dict[str, Seq] = {}
    for n in range(150):
        if rng.random() < 0.3 or not live:
            live[f"seq-{n}"] = Seq(rng.choice(KINDS), [rng.randrange(500) for _ in range(rng.randint(0, 40))])
        for sid in list(live):
            if rng.random() < 0.04:
                del live[sid]  # finished
        ids = rng.sample(sorted(live), rng.randint(1, len(live)))  # the step's rows, any order
        inp = step(live, ids)
        got = across(inp, sender, mirror)
        assert len(got.samples) == len(ids)
        for sid, mine, theirs in zip(ids, inp.samples, got.samples):
            assert same(mine, theirs), f"step {n}, {sid}"
        assert got.sample_wire is None and inp.sample_wire is None and inp.samples  # the engine's input unchanged
        assert len(mirror) == len(sender) <= HELD_PER_ROW * len(ids)
        for sid in ids:
            live[sid].outputs.append(rng.randrange(500))  # the step's sampled token


def test_a_decode_step_sends_one_token_a_row_and_no_parameters():
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    live = {f"s{i}": Seq(SamplingParams(repetition_penalty=1.2), list(range(2000))) for i in range(64)}
    ids = sorted(live)
    for sid in ids:
        live[sid].outputs += [5, 6]  # two tokens before the rank first saw them
    first = sender.wire(step(live, ids))
    assert sorted(first.sample_wire.new) == list(range(64))
    assert all(t == (0, [5, 6]) for t in first.sample_wire.tails.values())
    across(step(live, ids), SampleSpecSender(), mirror)  # a rank of its own for the first step
    whole = len(pickle.dumps(step(live, ids), protocol=5))
    for sid in ids:
        live[sid].outputs.append(9)
    wire = sender.wire(step(live, ids))
    assert not wire.sample_wire.new and not wire.samples
    assert wire.sample_wire.tails == {i: (2, [9]) for i in range(64)}
    assert len(pickle.dumps(wire, protocol=5)) < whole / 100


def test_the_same_input_sent_again_sends_nothing_new():
    """A paused step resumed: the engine sends the same input again."""
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    live = {"a": Seq(SamplingParams(frequency_penalty=0.5), [1, 2]), "b": Seq(SamplingParams(temperature=0), [])}
    live["a"].outputs += [7, 8]
    inp = step(live, ["a", "b"])
    across(inp, sender, mirror)
    again = sender.wire(inp)
    assert not again.sample_wire.new and not again.sample_wire.tails
    mirror.sync(again)
    assert all(same(x, y) for x, y in zip(inp.samples, again.samples))


def test_missing_sequences_are_forgotten_and_sent_whole_when_they_return():
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    live = {f"s{i}": Seq(SamplingParams(frequency_penalty=0.5), []) for i in range(5)}
    for sid in live:
        live[sid].outputs.append(3)
    across(step(live, sorted(live)), sender, mirror)
    got = across(step(live, ["s0", "s1"]), sender, mirror)  # 5 held > 2 x 2 rows: the three missing go
    assert len(sender) == len(mirror) == 2
    back = sender.wire(step(live, ["s4"]))
    assert back.sample_wire.new == {0: (live["s4"].spec.params, [])} and back.sample_wire.tails == {0: (0, [3])}
    assert got.samples[0].output_token_ids == [3]


def test_new_parameters_under_a_sequence_id_send_it_whole():
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    live = {"a": Seq(SamplingParams(repetition_penalty=1.5), [4, 4])}
    live["a"].outputs.append(2)
    across(step(live, ["a"]), sender, mirror)
    live["a"] = Seq(SamplingParams(repetition_penalty=1.1), [6])
    got = across(step(live, ["a"]), sender, mirror)
    assert got.samples[0].params.repetition_penalty == 1.1 and got.samples[0].prompt_token_ids == [6]
    assert got.samples[0].output_token_ids == []


def test_an_input_with_its_rows_or_without_rows_passes_as_it_is():
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    empty = ModelInput(input_ids=[1, 2])
    assert sender.wire(empty) is empty
    live = {"a": Seq(SamplingParams(temperature=0), [])}
    inp = step(live, ["a"])
    mirror.sync(inp)  # in-process: no wire, the rows stand
    assert inp.samples[0] is live["a"].spec and len(mirror) == 0


def test_the_rank_refuses_rows_it_cannot_rebuild():
    live = {"a": Seq(SamplingParams(frequency_penalty=0.5), [])}
    live["a"].outputs += [1, 2]
    wire = SampleSpecSender().wire(step(live, ["a"]))
    stale = SampleSpecMirror()
    wire.sample_wire.new.clear()
    with pytest.raises(ValueError, match="without its parameters"):
        stale.sync(wire)
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    across(step(live, ["a"]), sender, mirror)
    live["a"].outputs.append(3)
    skipped = sender.wire(step(live, ["a"]))
    live["a"].outputs.append(4)
    with pytest.raises(ValueError, match="from token 3, but 2 of them are held"):
        mirror.sync(sender.wire(step(live, ["a"])))  # the step before never reached the rank
    mirror.sync(skipped)  # the rank still takes the step it missed
    assert skipped.samples[0].output_token_ids == [1, 2, 3]


def test_a_sequence_verifying_drafts_gets_a_row_each_position_with_its_own_seed():
    """Speculative decoding: a sequence's rows at each verified position
    share its id; the rank gives each the seed sent for it, and the held
    spec stays the sequence's one list of outputs."""
    sender, mirror = SampleSpecSender(), SampleSpecMirror()
    seeded = Seq(SamplingParams(min_tokens=4, seed=11), [5, 6])
    plain = Seq(SamplingParams(temperature=0), [7])
    for n in range(4):
        base = seeded.row()
        rows = [SampleSpec(base.params, base.seed + j, base.prompt_token_ids, base.output_token_ids)
                for j in range(3)]
        inp = ModelInput(input_ids=[1] * 4, sample_indices=[0, 1, 2, 3], sample_ids=["a", "a", "a", "b"],
                         samples=[*rows, plain.row()], drafts={"a": [9, 9]})
        got = across(inp, sender, mirror)
        assert [s.seed for s in got.samples] == [s.seed for s in inp.samples]
        for mine, theirs in zip(inp.samples, got.samples):
            assert same(mine, theirs), f"step {n}"
        seeded.outputs += [3, 4]  # two tokens stood
        plain.outputs.append(1)
