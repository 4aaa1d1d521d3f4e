"""Every sampling feature in the same batches, under KV pressure, against the
same requests on an engine with KV to spare.

Sixty requests arrive over the first steps, each with one of: greedy,
seeded sampling (also with n > 1), logprobs, stop strings, penalties,
logit bias, allowed tokens, bad words, prompt logprobs, a regex or a
choice grammar; half share a system prompt (prefix-cache hits), a third are
offline, and some are aborted a few steps after they arrive. The pressured
engine swaps or recomputes dozens of times, so the same requests meet in
other batches, at other rows, split into other chunks. Each answer must be
the unpressured engine's (tokens, text and finish reason exactly, logprobs
to 2e-3: other batches and chunks sum in another order), and no KV block
may be left (the ``make_llm`` fixture checks).
A feature that reads its row from the wrong place, or state that does not
survive a preemption, shows up as a mismatch."""

from __future__ import annotations

import random

import pytest

from fluidserve.engine import SamplingParams
from fluidserve.engine.sampling_params import StructuredOutputs

SYSTEM = "You are a helpful assistant. " * 3
KINDS = ("greedy", "seeded", "seeded_n", "logprobs", "stop", "penalties", "bias", "allowed", "bad_words",
         "prompt_logprobs", "regex", "choice")


def _params(kind: str, rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 40)
    seed = rng.randint(0, 999)
    return {
        "greedy": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.5),
        "seeded": lambda: SamplingParams(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                         top_k=rng.choice([-1, 20]), seed=seed, max_tokens=max_tokens),
        "seeded_n": lambda: SamplingParams(n=rng.randint(2, 3), temperature=1.0, seed=seed, max_tokens=max_tokens),
        "logprobs": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=rng.randint(0, 3)),
        "stop": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, stop=[rng.choice(["a", "e", " t"])]),
        "penalties": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, presence_penalty=0.5,
                                            frequency_penalty=0.3, repetition_penalty=1.2),
        "bias": lambda: SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                       logit_bias={rng.randint(0, 255): rng.choice([-100, 5, 100]) for _ in range(3)}),
        "allowed": lambda: SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                          allowed_token_ids=rng.sample(range(256), 5)),
        "bad_words": lambda: SamplingParams(
            temperature=0, max_tokens=max_tokens,
            bad_words_token_ids=[[rng.randint(32, 120)] for _ in range(5)] + [[97, 98]]),
        "prompt_logprobs": lambda: SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=2),
        "regex": lambda: SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                                        structured_outputs=StructuredOutputs(regex="[a-e]{3,9}x")),
        "choice": lambda: SamplingParams(temperature=0, max_tokens=max_tokens,
                                         structured_outputs=StructuredOutputs(choice=("alpha", "beta"))),
    }[kind]()


def _requests(seed: int) -> list[tuple[str, str, SamplingParams, str, int, int | None]]:
    """(id, prompt, params, class, arrival step, abort step or None)."""
    rng = random.Random(seed)
    out = []
    for i in range(60):
        body = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 120)))
        prompt = SYSTEM + body if rng.random() < 0.5 else body
        arrival = rng.randint(0, 80)
        abort = arrival + rng.randint(1, 10) if rng.random() < 0.1 else None
        out.append((f"r{i}", prompt, _params(KINDS[i % len(KINDS)], rng),
                    "offline" if rng.random() < 0.3 else "online", arrival, abort))
    return out


def _serve(llm, requests) -> tuple[dict, set[str]]:
    """Each finished request's answer, and the ids aborted before finishing."""
    engine = llm.engine
    answers: dict = {}
    aborted: set[str] = set()
    step = 0
    while step <= 80 or engine.has_unfinished_requests():
        for rid, prompt, params, klass, arrival, abort in requests:
            if arrival == step:
                engine.add_request(rid, prompt, params, klass=klass)
            if abort == step and rid not in answers:
                engine.abort(rid)
                aborted.add(rid)
        for out in engine.step():
            if out.finished:
                answers[out.request_id] = ([(c.token_ids, c.text, c.finish_reason) for c in out.outputs],
                                           [_values(c.logprobs) for c in out.outputs], _values(out.prompt_logprobs))
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return answers, aborted


def _values(positions) -> list | None:
    """Logprobs per position as {token: logprob}."""
    if positions is None:
        return None
    return [None if pos is None else {t: lp.logprob for t, lp in pos.items()} for pos in positions]


def _close(a: list | None, b: list | None) -> bool:
    """The same tokens at every position, logprobs within 2e-3."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and x.keys() == y.keys()
                                      and all(abs(x[t] - y[t]) <= 2e-3 for t in x))
        for x, y in zip(a, b))


@pytest.mark.parametrize("seed, pressure, arch", [(0, "swap", "llama"), (1, "recompute", "llama"),
                                                  (2, "swap-async", "llama"), (3, "swap", "mistral")])
def test_every_feature_under_preemption_answers_as_without(tiny_model, make_llm, seed, pressure, arch):
    """``mistral``: a sliding window of 24 tokens, which most requests outgrow."""
    path = tiny_model(arch)
    requests = _requests(seed)
    reference, ref_aborted = _serve(make_llm(path, num_kv_blocks=512, max_model_len=384), requests)
    tight = dict(num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=(16, 256, 64, 256)[seed])
    if pressure.startswith("swap"):
        tight["num_host_blocks"] = 64
    else:
        tight["preemption_mode"] = "recompute"
    llm = make_llm(path, **tight, async_scheduling=pressure.endswith("async"))
    answers, aborted = _serve(llm, requests)
    stats = llm.engine.stats()
    assert stats.num_preemptions >= 10  # the pressure is real
    # A request aborted in one run may have finished before its abort step
    # in the other: only those aborted in neither are compared, all of them.
    compared = [rid for rid, *_ in requests if rid not in aborted | ref_aborted]
    assert len(compared) >= 45
    for rid in compared:
        outputs, logprobs, prompt_logprobs = answers[rid]
        ref_outputs, ref_logprobs, ref_prompt_logprobs = reference[rid]
        assert outputs == ref_outputs, rid
        assert all(_close(a, b) for a, b in zip(logprobs, ref_logprobs)), rid
        assert _close(prompt_logprobs, ref_prompt_logprobs), rid
