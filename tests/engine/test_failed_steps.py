"""A step that raises fails its own requests, and the engine serves on.

A fault in sampling (a feature's bug that one request's parameters reach,
as structured output's row mapping once did) fails that request alone:
the worker samples the step's rows again one by one, and every other row
gets the token it would have had. A fault in one request's prompt logprobs
fails that request alone the same way. A fault in the forward fails the
step's requests, keeping the tokens they had; the step counts as computing
nothing, so none of its blocks enters the prefix cache. Steps that keep
failing whatever they run stop the engine (``StepsKeepFailingError``), which
ends the server for its supervisor to restart.

The faults are injected: the worker's sampler (prompt scoring, forward)
raises for a marked request, which no shipped code path does. ``make_llm`` checks at
teardown that every KV block came back."""

from __future__ import annotations

import pytest

import fluidserve.engine.worker as worker_module
from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.engine import MAX_FAILED_STEPS_IN_A_ROW, StepsKeepFailingError
from fluidserve.engine.llm import GenerationFailedError
from fluidserve.engine.sampling_params import StructuredOutputs
from fluidserve.engine.worker import Worker

MARK = 37  # the top_k that marks the request whose sampling raises
MARK_TOP_N = 7  # the prompt_logprobs that mark the request whose scoring raises
POISON = 250  # a prompt token whose forward raises
KWARGS = dict(num_kv_blocks=64, block_size=8, max_model_len=256)
PROMPTS = ["Hello there", "The quick brown fox", "one two three", "abc " * 6]


def _marked(rows) -> bool:
    return any(row.params.top_k == MARK for row in rows)


@pytest.fixture
def faulty_sampling(monkeypatch):
    """The worker's sampler raises on the ``after``-th call (and every one
    after) that holds a marked row; returns the calls seen so far."""
    calls = {"marked": 0}

    def install(function: str, after: int = 1):
        real = getattr(worker_module, function)

        def faulty(logits, rows, *args, **kwargs):
            if _marked(rows):
                calls["marked"] += 1
                if calls["marked"] >= after:
                    raise RuntimeError("injected sampling fault")
            return real(logits, rows, *args, **kwargs)

        monkeypatch.setattr(worker_module, function, faulty)
        return calls

    return install


@pytest.fixture
def faulty_forward(monkeypatch):
    """The forward raises on any step that feeds the token ``POISON``
    (``always``: on every step)."""
    real = Worker._forward

    def install(always: bool = False):
        def faulty(self, inp, feed=None):
            if always or POISON in inp.input_ids:
                raise RuntimeError("injected forward fault")
            return real(self, inp, feed)

        monkeypatch.setattr(Worker, "_forward", faulty)

    return install


def _serve(engine, arrivals: dict[int, list[tuple[str, object, SamplingParams]]]) -> dict:
    """Step the engine, adding each request at its step; every finished output by id."""
    done, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 2000, "the engine stopped making progress"
    return done


def _reference(make_llm, path, requests, **kwargs) -> dict:
    outs = make_llm(path, **KWARGS, **kwargs).generate([p for _, p, _ in requests], [s for _, _, s in requests])
    return {rid: out.outputs[0].token_ids for (rid, _, _), out in zip(requests, outs)}


# Every draft verified (speculative decoding's tests fix them too).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}


@pytest.mark.parametrize("drafts", [False, True])
def test_a_request_whose_sampling_raises_fails_alone(tiny_model, make_llm, faulty_sampling, drafts):
    """The marked request fails on its fourth sampling, keeping the tokens
    before (three, without drafts); greedy, seeded and grammar-constrained
    rows in the same steps get exactly the tokens they get without it, and
    with drafts, each grammar row sampled alone takes the mask after the
    drafts before it."""
    pytest.importorskip("xgrammar")
    path = tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    others = [(f"g{i}", p, greedy) for i, p in enumerate(PROMPTS)] + [
        ("seeded", "Once upon", SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)),
        ("regex", "Spell:", SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                                           structured_outputs=StructuredOutputs(regex="[a-e]{5,12}x"))),
        ("repeats", "abcabcabc", SamplingParams(temperature=0, max_tokens=20,
                                                structured_outputs=StructuredOutputs(regex="(abc){6,}x"))),
    ]
    marked = ("marked", "Tell me", SamplingParams(temperature=1.0, seed=5, top_k=MARK, max_tokens=20,
                                                  ignore_eos=True))
    reference = _reference(make_llm, path, [*others, marked])
    calls = faulty_sampling("sample", after=4)
    llm = make_llm(path, **KWARGS, **(dict(speculative_config=NGRAM) if drafts else {}))
    done = _serve(llm.engine, {0: [*others, marked]})

    failed = done["marked"]
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error == "RuntimeError: injected sampling fault"
    if drafts:
        stats = llm.engine.stats()
        assert stats.spec_num_accepted_tokens > 0
        kept = failed.outputs[0].token_ids
        assert 3 <= len(kept) < 20 and kept == reference["marked"][:len(kept)]
    else:
        assert calls["marked"] == 5  # the fourth step's, and its row again alone
        assert failed.outputs[0].token_ids == reference["marked"][:3]
    for rid, _, _ in others:
        assert done[rid].error is None and done[rid].outputs[0].finish_reason in ("stop", "length"), rid
        assert done[rid].outputs[0].token_ids == reference[rid], rid
    stats = llm.engine.stats()
    assert (stats.num_failed_requests, stats.num_failed_steps) == (1, 0)


def test_a_request_whose_prompt_logprobs_raise_fails_alone(tiny_model, make_llm, monkeypatch):
    """Three prompts in one step, two scoring their prompt logprobs: when
    scoring raises for one of them (injected: for top_n ``MARK_TOP_N``), the
    worker scores each request again alone, and only that request fails,
    answered once with the error and no token; the other's prompt logprobs
    and every other request's tokens equal a run without the fault."""
    path = tiny_model("llama")
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    requests = [("scored", PROMPTS[1], SamplingParams(prompt_logprobs=2, **greedy)),
                ("marked", PROMPTS[3], SamplingParams(prompt_logprobs=MARK_TOP_N, **greedy)),
                ("plain", PROMPTS[0], SamplingParams(**greedy))]
    reference = _serve(make_llm(path, **KWARGS).engine, {0: requests})
    real, calls = worker_module.score_prompts, []

    def faulty(hidden, specs, compute_logits):
        calls.append(sorted(spec.request_id for spec in specs))
        if any(spec.top_n == MARK_TOP_N for spec in specs):
            raise RuntimeError("injected scoring fault")
        return real(hidden, specs, compute_logits)

    monkeypatch.setattr(worker_module, "score_prompts", faulty)
    llm = make_llm(path, **KWARGS)
    done = _serve(llm.engine, {0: requests})

    assert calls == [["marked", "scored"], ["scored"], ["marked"]]  # together, then each alone
    failed = done["marked"]
    assert failed.error == "RuntimeError: injected scoring fault"
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    for rid in ("scored", "plain"):
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == reference[rid].outputs[0].token_ids
    assert done["scored"].prompt_logprobs == reference["scored"].prompt_logprobs
    stats = llm.engine.stats()
    assert (stats.num_failed_requests, stats.num_failed_steps) == (1, 0)


def test_a_request_of_n_completions_fails_whole(tiny_model, make_llm, faulty_sampling):
    """One request, three completions: when its rows fail, every one of
    them ends with finish reason error, and the request is answered once."""
    faulty_sampling("sample", after=2)
    llm = make_llm(tiny_model("llama"), **KWARGS)
    done = _serve(llm.engine, {0: [("n3", "Hi", SamplingParams(n=3, temperature=1.0, top_k=MARK, max_tokens=9)),
                                   ("plain", "Hi", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))]})
    assert [c.finish_reason for c in done["n3"].outputs] == ["error"] * 3
    assert done["plain"].outputs[0].finish_reason == "length"
    assert llm.engine.stats().num_failed_requests == 1


def test_a_step_whose_forward_raises_fails_its_requests_and_the_engine_serves_on(tiny_model, make_llm,
                                                                                  faulty_forward):
    """Two requests decode; a third arrives whose prompt makes the forward
    raise. That step's three requests fail with the tokens they had (a
    prefix of their answers). Requests after it get their exact answers,
    one of them the poisoned prompt less its last token: blocks the failed
    step would have filled are not in the prefix cache, so it computes them
    itself."""
    path = tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(path, **KWARGS)
    prefix = llm.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    assert len(prefix) >= 2 * KWARGS["block_size"]
    early = [("a", PROMPTS[0], greedy), ("b", PROMPTS[1], greedy)]
    late = [("c", prefix, greedy), ("d", PROMPTS[2], greedy)]
    reference = _reference(make_llm, path, [*early, *late])
    faulty_forward()
    done = _serve(llm.engine, {0: early, 3: [("poisoned", prefix + [POISON], greedy)], 4: late})

    for rid in ("a", "b", "poisoned"):
        out = done[rid]
        assert out.outputs[0].finish_reason == "error" and out.error == "RuntimeError: injected forward fault", rid
    for rid in ("a", "b"):
        got = done[rid].outputs[0].token_ids
        assert 0 < len(got) < len(reference[rid]) and got == reference[rid][:len(got)], rid
    assert done["poisoned"].outputs[0].token_ids == []
    for rid, _, _ in late:
        assert done[rid].error is None and done[rid].outputs[0].token_ids == reference[rid], rid
    stats = llm.engine.stats()
    assert (stats.num_failed_steps, stats.num_failed_requests) == (1, 3)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_launched_step_that_raises_fails_its_requests(tiny_model, make_llm, faulty_sampling, after):
    """Async scheduling: the marked request's ``after``-th queued decode
    raises at launch (the first launch from a plain step, the next ones
    queued behind a step not yet read, in turn). The requests of that step
    fail with a prefix of their answers; one arriving after gets its
    exact answer."""
    path = tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    early = [("a", PROMPTS[0], greedy), ("b", PROMPTS[1], greedy),
             ("marked", PROMPTS[3], SamplingParams(temperature=1.0, top_k=MARK, max_tokens=16, ignore_eos=True))]
    late = [("c", PROMPTS[2], greedy)]
    reference = _reference(make_llm, path, [*early[:2], *late])
    calls = faulty_sampling("sample_on_device", after=after)
    llm = make_llm(path, async_scheduling=True, **KWARGS)
    done = _serve(llm.engine, {0: early, 12: late})

    assert calls["marked"] == after
    assert done["marked"].outputs[0].finish_reason == "error"
    assert done["marked"].error == "RuntimeError: injected sampling fault"
    for rid in ("a", "b"):
        got = done[rid].outputs[0].token_ids
        assert done[rid].outputs[0].finish_reason == "error" and got == reference[rid][:len(got)], rid
    assert done["c"].error is None and done["c"].outputs[0].token_ids == reference["c"]
    assert llm.engine.stats().num_failed_steps == 1


def test_steps_that_keep_failing_stop_the_engine(tiny_model, faulty_forward):
    """Every step raises: the first ones fail their requests, and the
    ``MAX_FAILED_STEPS_IN_A_ROW``-th stops the engine."""
    engine = LLM(tiny_model("llama"), device="cpu", max_num_seqs=1, **KWARGS).engine
    faulty_forward(always=True)  # after the start: a warm-up that raises stops the start
    for i in range(MAX_FAILED_STEPS_IN_A_ROW + 2):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=4))
    for _ in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        (out,) = engine.step()
        assert out.finished and out.error == "RuntimeError: injected forward fault"
    with pytest.raises(StepsKeepFailingError, match=f"{MAX_FAILED_STEPS_IN_A_ROW} steps in a row failed"):
        engine.step()


def test_generate_raises_for_failed_requests_and_the_llm_serves_on(tiny_model, make_llm, faulty_sampling):
    """``LLM.generate`` does not hand back a failed request as if it were an
    answer: it raises once every request has ended, with every output (the
    failed one's tokens and text those it had), and the next call is
    answered."""
    llm = make_llm(tiny_model("llama"), **KWARGS)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    marked = dict(temperature=1.0, seed=5, top_k=MARK, ignore_eos=True)
    (two,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, **marked))  # its first two tokens
    faulty_sampling("sample", after=3)
    with pytest.raises(GenerationFailedError, match="1 of 2 requests failed, the first with RuntimeError") as err:
        llm.generate(PROMPTS[:2], [greedy, SamplingParams(max_tokens=6, **marked)])
    first, failed = err.value.outputs
    assert first.error is None and len(first.outputs[0].token_ids) == 6
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == two.outputs[0].token_ids
    assert failed.outputs[0].text == two.outputs[0].text
    (again,) = llm.generate(PROMPTS[:1], greedy)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
