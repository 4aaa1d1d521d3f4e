"""Outputs sent as what the front lacks (engine/output_wire.py): through
pickle, as a replica's poll sends them, the front rebuilds every output
whole, field for field, while completions grow, with logprobs and prompt
logprobs and n > 1; a step's tail carries no prompt and one step's tokens;
a new request under a finished one's id, or a list that did not only grow,
crosses whole; and a tail with nothing before it is refused."""

from __future__ import annotations

import pickle
import random

import pytest

from fluidserve.engine.output_wire import OutputSender, OutputTail, rebuild
from fluidserve.engine.outputs import CompletionOutput, Logprob, RequestOutput


class Req:
    """A request as the engine's output processor keeps it: live token and
    logprob lists, text that grows by each step's delta."""

    def __init__(self, rid: str, rng: random.Random, n: int, logprobs: bool, prompt_logprobs: bool) -> None:
        self.rid, self.rng = rid, rng
        self.prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 300))]
        self.prompt_logprobs = ([None] + [{t: Logprob(-1.0, 1)} for t in self.prompt[1:]]) if prompt_logprobs else None
        self.texts = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs = [[] for _ in range(n)] if logprobs else None
        self.finished = [None] * n

    def step(self, finish: bool = False) -> RequestOutput:
        comps = []
        for i in range(len(self.tokens)):
            new_ids, delta, new_lp = [], "", None
            if self.finished[i] is None:
                t = self.rng.randrange(1000)
                new_ids, delta = [t], self.rng.choice(["", "a", "bc", " word", "ü"])
                self.tokens[i].append(t)
                self.texts[i] += delta
                if self.logprobs is not None:
                    new_lp = [{t: Logprob(-0.5, 1, "x"), 3: Logprob(-2.0, 2, "y")}]
                    self.logprobs[i] += new_lp
                if finish:
                    self.finished[i] = "length"
            comps.append(CompletionOutput(i, self.texts[i], self.tokens[i],
                                          None if self.logprobs is None else self.logprobs[i], self.finished[i],
                                          None, delta, new_ids, new_lp))
        return RequestOutput(self.rid, None, self.prompt, comps, finish, None, 12.5, self.prompt_logprobs,
                             num_cached_tokens=16)


def fields(out: RequestOutput) -> tuple:
    return (out.request_id, out.prompt, out.prompt_token_ids, out.finished, out.error, out.first_scheduled_time,
            out.prompt_logprobs, out.num_cached_tokens,
            [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text_delta,
              c.new_token_ids, c.new_logprobs) for c in out.outputs])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_front_rebuilds_every_output_whole(seed):
    rng = random.Random(seed)
    sender = OutputSender()
    held: dict[str, RequestOutput] = {}
    live: dict[str, Req] = {}
    for n in range(200):
        if rng.random() < 0.2 or not live:
            rid = f"cmpl-{n}"
            live[rid] = Req(rid, rng, rng.choice([1, 1, 2]), rng.random() < 0.5, rng.random() < 0.3)
        outs = []
        for rid in rng.sample(sorted(live), rng.randint(1, len(live))):  # a poll's outputs, any order
            outs.append(live[rid].step(finish=rng.random() < 0.05))
        got = pickle.loads(pickle.dumps(sender.wire(outs), protocol=5))
        for out, tail in zip(outs, got):
            whole = rebuild(held.get(out.request_id), tail)
            assert fields(whole) == fields(out), f"poll {n}, {out.request_id}"
            if out.finished:
                held.pop(out.request_id, None)
                del live[out.request_id]
            else:
                held[out.request_id] = whole
        assert len(sender) == len(held)  # the requests with an output so far, no finished one


def test_a_step_tail_carries_no_prompt_and_one_step_of_tokens():
    rng = random.Random(0)
    sender = OutputSender()
    reqs = [Req(f"r{i}", rng, 1, True, False) for i in range(64)]
    for r in reqs:
        r.prompt = list(range(2000))
        for _ in range(300):
            r.step()
    first = sender.wire([r.step() for r in reqs])
    assert all(t.whole for t in first)
    outs = [r.step() for r in reqs]
    tails = sender.wire(outs)
    assert not any(t.whole for t in tails)
    for out, tail in zip(outs, tails):
        c = tail.output.outputs[0]
        assert tail.output.prompt_token_ids == [] and tail.output.prompt_logprobs is None
        assert c.token_ids == out.outputs[0].new_token_ids and c.text == out.outputs[0].text_delta
        assert len(c.logprobs) == 1
    assert len(pickle.dumps(tails, protocol=5)) < len(pickle.dumps(outs, protocol=5)) / 50


def test_a_new_request_under_the_same_id_and_a_shrunk_list_cross_whole():
    rng = random.Random(3)
    sender = OutputSender()
    a = Req("same", rng, 1, False, False)
    sender.wire([a.step()])
    b = Req("same", rng, 1, False, False)  # the first was aborted on the front, its id reused
    assert sender.wire([b.step()])[0].whole
    sender.forget("same")
    assert len(sender) == 0
    c = Req("c", rng, 1, False, False)
    c.texts[0] = "a long reply so far"
    sender.wire([c.step()])
    c.texts[0] = ""  # text that did not only grow
    tail = sender.wire([c.step()])[0]
    assert tail.whole and tail.output.outputs[0].text == c.texts[0]


def test_a_tail_with_nothing_taken_before_is_refused():
    rng = random.Random(4)
    sender = OutputSender()
    r = Req("r", rng, 1, False, False)
    sender.wire([r.step()])
    tail = sender.wire([r.step()])[0]
    assert isinstance(tail, OutputTail) and not tail.whole
    with pytest.raises(ValueError, match="none was taken before"):
        rebuild(None, tail)


def test_tokens_the_engine_appends_before_the_poll_is_pickled_cross_once():
    """The engine's thread appends to the live lists while the replica's
    poll is pickled: each poll sends the lists as they were when it was cut,
    so no token crosses twice (the usage of a streamed reply counts them)."""
    rng = random.Random(5)
    sender = OutputSender()
    r = Req("r", rng, 2, True, False)
    held = None
    for n in range(12):
        out = r.step(finish=n == 11)
        tails = sender.wire([out])
        if n < 11:
            r.step()  # the next step's token lands before Ray pickles the poll's result
        held = rebuild(held, pickle.loads(pickle.dumps(tails, protocol=5))[0])
    assert [c.token_ids for c in held.outputs] == r.tokens
    assert [len(c.logprobs) for c in held.outputs] == [len(t) for t in r.tokens]
