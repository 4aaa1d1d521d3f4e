"""OutputProcessor on its own: sampled tokens chosen by the test go straight
into ``process``, no scheduler or model in between. Requests are admitted by
a real engine (so their sequences' stop ids, length limits and text streams
are the engine's), then handed to a processor with maps, stats and callbacks
of its own. The tiny model's byte tokenizer makes token id = byte value."""

from __future__ import annotations

import pytest

from fluidserve.engine.batch import StepResult
from fluidserve.engine.engine import EngineStats
from fluidserve.engine.output_processor import OutputProcessor
from fluidserve.engine.outputs import Logprob
from fluidserve.engine.sampler import SampledToken
from fluidserve.engine.sampling_params import SamplingParams, StructuredOutputs
from fluidserve.scheduler.request_state import RequestClass

EOS = 257  # the tiny model's <|eos|>
X, Y, Z, A, B, C = (ord(c) for c in "xyzabc")


class Harness:
    """A processor with its own request and sequence maps, fed one step at a time."""

    def __init__(self, engine, block_size: int = 16):
        self.engine = engine
        self.stats = EngineStats()
        self.filled: list[tuple[str, int]] = []  # (sequence, its length in tokens) per block_filled call
        self.grammars_done: list[str] = []
        self.proc = OutputProcessor({}, {}, engine.eos_token_ids, self.stats, block_size,
                                    lambda s: self.filled.append((s.seq_id, len(s.request.prompt_token_ids)
                                                                  + len(s.output_token_ids))),
                                    self.grammars_done.append)

    def admit(self, rid: str, prompt, klass=RequestClass.ONLINE, final_only=False, **params):
        """Admit through the engine, then move the request over: only the
        processor holds it after."""
        engine = self.engine
        engine.add_request(rid, prompt, SamplingParams(**params), klass=klass, final_only=final_only)
        req = engine.requests.pop(rid)
        self.proc.requests[rid] = req
        for seq in req.seqs:
            self.proc.seqs[seq.seq_id] = engine.seqs.pop(seq.seq_id)
            engine.scheduler.finish(seq.seq_id)
        return req

    def step(self, tokens: dict, now: float = 1.0, logprobs: dict | None = None):
        sampled = {rid: SampledToken(t, (logprobs or {}).get(rid)) for rid, t in tokens.items()}
        return self.proc.process(StepResult(sampled=sampled), now)


@pytest.fixture
def harness(tiny_model, make_llm):
    return Harness(make_llm(tiny_model("llama"), max_model_len=64).engine)


def test_stop_string_across_two_tokens(harness):
    harness.admit("r", "hi", stop=["ab"], temperature=0)
    outs, finished = harness.step({"r#0": X})
    assert finished == [] and outs[0].outputs[0].text_delta == "x"
    outs, finished = harness.step({"r#0": A})  # "a" may begin "ab": held back
    assert finished == [] and outs[0].outputs[0].text_delta == "" and not outs[0].finished
    outs, finished = harness.step({"r#0": B})
    assert finished == ["r#0"]
    (out,) = outs
    co = out.outputs[0]
    assert out.finished and (co.finish_reason, co.stop_reason, co.text) == ("stop", "ab", "x")
    assert co.token_ids == [X, A, B] and co.new_token_ids == [B]
    assert "r" not in harness.proc.requests and "r#0" not in harness.proc.seqs


def test_stop_token_id_and_eos(harness):
    harness.admit("tok", "hi", stop_token_ids=[C])
    harness.admit("eos", "hi")
    outs, finished = harness.step({"tok#0": X, "eos#0": X})
    assert finished == [] and len(outs) == 2
    outs, finished = harness.step({"tok#0": C, "eos#0": EOS})
    assert finished == ["tok#0", "eos#0"]
    by_id = {o.request_id: o.outputs[0] for o in outs}
    # A stop token id is the stop_reason; the model's EOS is none. Neither is text.
    assert (by_id["tok"].finish_reason, by_id["tok"].stop_reason, by_id["tok"].text) == ("stop", C, "x")
    assert (by_id["eos"].finish_reason, by_id["eos"].stop_reason, by_id["eos"].text) == ("stop", None, "x")
    assert not harness.proc.requests and not harness.proc.seqs


def test_eos_ignored_with_ignore_eos_then_max_tokens(harness):
    harness.admit("r", "hi", ignore_eos=True, max_tokens=3)
    for tid in (EOS, X):
        outs, finished = harness.step({"r#0": tid})
        assert finished == [] and not outs[0].finished
    outs, finished = harness.step({"r#0": Y})
    co = outs[0].outputs[0]
    assert finished == ["r#0"] and (co.finish_reason, co.stop_reason) == ("length", None)
    assert co.token_ids == [EOS, X, Y] and co.text == "xy"  # the special token decodes to nothing


def test_max_model_len_limits_the_length(harness):
    harness.admit("r", [X] * 60, max_tokens=None)  # max_model_len 64 leaves 4 tokens
    for _ in range(3):
        assert harness.step({"r#0": Y})[1] == []
    outs, finished = harness.step({"r#0": Y})
    assert finished == ["r#0"] and outs[0].outputs[0].finish_reason == "length"
    assert len(outs[0].outputs[0].token_ids) == 4


def test_n_completions_finish_independently(harness):
    harness.admit("r", "hi", n=2, stop_token_ids=[C], max_tokens=3)
    outs, finished = harness.step({"r#0": C, "r#1": X})
    assert finished == ["r#0"]
    (out,) = outs
    assert not out.finished and [co.finish_reason for co in out.outputs] == ["stop", None]
    assert "r#0" not in harness.proc.seqs and "r" in harness.proc.requests
    # A token for a sequence that already stopped is dropped.
    outs, finished = harness.step({"r#0": X, "r#1": Y})
    assert finished == [] and outs[0].outputs[0].new_token_ids == [] and outs[0].outputs[1].new_token_ids == [Y]
    outs, finished = harness.step({"r#1": Z})
    (out,) = outs
    assert finished == ["r#1"] and out.finished
    assert [co.finish_reason for co in out.outputs] == ["stop", "length"] and out.outputs[1].text == "xyz"
    assert not harness.proc.requests and harness.stats.generation_tokens_total == 4


def test_final_only_has_one_output_equal_to_streamed_last(harness):
    harness.admit("lazy", "hi", final_only=True, max_tokens=3)
    harness.admit("streamed", "hi", max_tokens=3)
    for tid in (X, Y):
        outs, _ = harness.step({"lazy#0": tid, "streamed#0": tid})
        assert [o.request_id for o in outs] == ["streamed"]
    outs, finished = harness.step({"lazy#0": Z, "streamed#0": Z})
    assert finished == ["lazy#0", "streamed#0"]
    lazy, streamed = outs
    assert lazy.outputs[0] == streamed.outputs[0] and lazy.outputs[0].text == "xyz"


def test_logprobs_callbacks_stats_and_first_scheduled_time(harness):
    harness.admit("r", "abc", logprobs=1, klass=RequestClass.OFFLINE, max_tokens=2,
                  structured_outputs=StructuredOutputs(choice=["xy"]))
    harness.proc.block_size = 4  # the prompt's 3 tokens plus the first output fill one block
    lp = {"r#0": {X: Logprob(-0.1, 1), Y: Logprob(-2.5, 2)}}
    outs, _ = harness.step({"r#0": X}, now=7.0, logprobs=lp)
    co = outs[0].outputs[0]
    assert [(t, p.decoded) for t, p in co.new_logprobs[0].items()] == [(X, "x"), (Y, "y")]
    assert outs[0].first_scheduled_time == 7.0  # no step had run it: this step's start
    assert harness.filled == [("r#0", 4)] and harness.grammars_done == []
    outs, finished = harness.step({"r#0": Y}, now=8.0)
    assert finished == ["r#0"] and harness.grammars_done == ["r#0"]
    assert outs[0].outputs[0].logprobs == [lp["r#0"]] and outs[0].outputs[0].new_logprobs == []
    assert (harness.stats.generation_tokens_total, harness.stats.offline_generation_tokens_total) == (2, 2)
