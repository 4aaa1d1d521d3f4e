"""Speculative decoding (n-gram drafts) end to end on tiny random
checkpoints: greedy tokens equal transformers', seeded sampling draws the
tokens it draws without speculation, stops and lengths land inside a run of
accepted drafts exactly where they would without it, logprobs are the same,
and chunked prefills, prefix-cache hits, swaps and recomputes keep the KV
of the tokens that stood only. Each test checks that drafts were verified
and some stood, so a path that never speculates cannot pass it; they fix
the drafts (every draft verified), and the adaptive policy's choices are
tested last, on step times priced by the test."""

from __future__ import annotations

import json
import re

import pytest

from fluidserve.engine import SamplingParams
from fluidserve.engine.draft_policy import DraftPolicy
from fluidserve.engine.sampling_params import StructuredOutputs
from token_paths import PROMPTS, hf_greedy

# Fixed drafts: every step verifies every draft found, so each test exercises verification.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
EOS = 257  # the tiny checkpoints' end of sequence


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def drafts_stood(llm) -> int:
    """Drafts that stood; asserts drafts were verified at all."""
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    return stats.spec_num_accepted_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers(tiny_model, make_llm, arch):
    path = tiny_model(arch)
    expected = hf_greedy(path, PROMPTS, 40)
    plain = make_llm(path)
    assert tokens(plain.generate(PROMPTS, GREEDY)) == expected
    llm = make_llm(path, speculative_config=NGRAM)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert drafts_stood(llm) > 0
    assert llm.engine.stats().generation_tokens_total == plain.engine.stats().generation_tokens_total


def test_seeded_sampling_draws_the_same_tokens(tiny_model, make_llm):
    """Each row samples from the request's distribution with the seed of its
    output position: with or without drafts, a seeded request draws the
    same tokens (n = 2 completions, top-k and top-p in play)."""
    path = tiny_model("llama")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, n=n, max_tokens=40)
              for t, k, p, s, n in ((0.8, 0, 1.0, 1, 1), (1.0, 20, 0.9, 2, 2), (0.5, 5, 1.0, 3, 1),
                                    (1.2, 0, 0.95, 4, 1), (0.3, 0, 1.0, 5, 2))]
    plain = make_llm(path).generate(PROMPTS, params)
    llm = make_llm(path, speculative_config=NGRAM)
    spec = llm.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]
    assert drafts_stood(llm) > 0


def test_stops_and_lengths_inside_accepted_drafts_end_where_they_would(tiny_model, make_llm):
    """max_tokens, a stop token and a stop string met within a run of drafts
    that stood: the sequence ends on it, the tokens after it are dropped,
    and text, finish and stop reasons are those of a run without drafts."""
    path = tiny_model("llama")
    plain_llm = make_llm(path)
    ref = tokens(plain_llm.generate(PROMPTS, GREEDY))
    tok = plain_llm.tokenizer
    params = []
    for i, out in enumerate(ref):
        params += [SamplingParams(temperature=0.0, max_tokens=5 + 3 * i),
                   SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[out[11 + i]]),
                   SamplingParams(temperature=0.0, max_tokens=40, stop=[tok.decode(out[14 + i:16 + i])])]
    prompts = [p for p in PROMPTS for _ in range(3)]
    plain = plain_llm.generate(prompts, params)
    llm = make_llm(path, speculative_config=NGRAM)
    spec = llm.generate(prompts, params)
    assert drafts_stood(llm) > 0
    for a, b in zip(spec, plain):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == (
            cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
    assert {o.outputs[0].finish_reason for o in spec} == {"length", "stop"}


def test_streamed_outputs_carry_every_token_once(tiny_model, make_llm):
    """A step that keeps several tokens of a request sends one output with
    all of them: each output extends the one before, ending with the whole
    completion, in fewer steps than tokens."""
    path = tiny_model("llama")
    llm = make_llm(path, speculative_config=NGRAM)
    engine = llm.engine
    engine.add_request("r", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=40))
    seen: list[list[int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "r"
            seen.append(list(out.outputs[0].token_ids))
    full = make_llm(path).generate([PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert seen[-1] == full.token_ids
    assert all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(seen, seen[1:]))
    assert len(seen) == engine.stats().num_steps < 40


def test_logprobs_of_kept_drafts_are_their_rows(tiny_model, make_llm):
    path = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=3)
    plain = make_llm(path).generate(PROMPTS, params)
    llm = make_llm(path, speculative_config=NGRAM)
    spec = llm.generate(PROMPTS, params)
    assert drafts_stood(llm) > 0
    for a, b in zip(spec, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].rank == lb[t].rank and la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)


# Rows that read the outputs so far. Counted penalties break the tiny model's
# loops, which n-gram drafts copy, so those rows pick among a few letters,
# where the counts decide every token and drafts of the periodic text stand.
PENALISED = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.3, allowed_token_ids=[65, 66]),
             dict(presence_penalty=1.0, frequency_penalty=0.2, allowed_token_ids=[65, 66, 67]),
             dict(repetition_penalty=1.1, min_tokens=20), dict(bad_words_token_ids=[[4, 209], [36, 36, 36]]),
             dict(thinking_token_budget=12, thinking_start_token_id=ord("<"), thinking_end_token_id=ord("!"))]
READS_OUTPUTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "bad_words_token_ids",
                 "thinking_token_budget", "thinking_start_token_id", "thinking_end_token_id")


@pytest.mark.parametrize("penalty", PENALISED)
def test_penalised_rows_draft_and_sample_as_without_drafts(tiny_model, make_llm, penalty):
    """A row that reads the outputs so far (penalties, multi-token bad
    words, min_tokens, a thinking budget) reads the drafts before its
    position as outputs: the
    greedy and seeded tokens are those without drafts, and drafts of these
    rows stood (every request in the batch reads its outputs). Reading the
    outputs without the drafts gives other tokens where a count decides."""
    path = tiny_model("llama")

    def rows(**kw) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=30, **kw),
                SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, **kw)] * len(PROMPTS)

    prompts = [p for p in PROMPTS for _ in range(2)]
    plain = make_llm(path).generate(prompts, rows(**penalty))
    llm = make_llm(path, speculative_config=NGRAM)
    assert tokens(llm.generate(prompts, rows(**penalty))) == tokens(plain)
    assert drafts_stood(llm) > 0
    free = make_llm(path).generate(prompts, rows(**{k: v for k, v in penalty.items() if k not in READS_OUTPUTS}))
    assert tokens(plain)[::2] != tokens(free)[::2]  # the penalty changed the greedy replies


def test_repetition_penalty_with_drafts_equals_transformers(tiny_model, make_llm):
    import torch
    import transformers

    path = tiny_model("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    expected = []
    for p in PROMPTS:
        ids = tok.encode(p)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                          repetition_penalty=1.3, pad_token_id=tok.pad_token_id)
        expected.append(gen[0, len(ids):].tolist())
    llm = make_llm(path, speculative_config=NGRAM)
    got = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30,
                                                      repetition_penalty=1.3)))
    assert got == expected
    assert drafts_stood(llm) > 0


# Grammars whose masks change position by position, so a row masked as the
# sequence's first would sample other tokens; the prompts repeat text each
# grammar takes and text it refuses, which the drafter proposes too.
GRAMMARS = [StructuredOutputs(regex="(abc)+x"), StructuredOutputs(regex="([ab]{3},)+[ab]{3}z"),
            StructuredOutputs(json='{"type": "object", "properties": {"abab": {"type": "string"}}}')]
GRAMMAR_PROMPTS = ["abcabcabcab", "abdabdabd abd", "aab,aab,bba,", '{"abab": "abab abab'] * 2


def test_grammar_rows_draft_and_sample_as_without_drafts(tiny_model, make_llm):
    """A grammar's row after drafts is masked by the grammar after them: the
    greedy and seeded tokens are those without drafts, every reply follows
    its grammar, and drafts of these rows stood (every request in the batch
    has a grammar); the engine cut n-gram drafts the grammar refuses and
    drafted what it forces (engine/grammar_drafts.py)."""
    path = tiny_model("llama")
    params = [SamplingParams(temperature=0.0 if i < 4 else 0.8, seed=None if i < 4 else i, max_tokens=30,
                             structured_outputs=GRAMMARS[i % len(GRAMMARS)]) for i in range(len(GRAMMAR_PROMPTS))]
    plain = make_llm(path).generate(GRAMMAR_PROMPTS, params)
    llm = make_llm(path, speculative_config=NGRAM)
    spec = llm.generate(GRAMMAR_PROMPTS, params)
    assert tokens(spec) == tokens(plain)
    assert drafts_stood(llm) > 0
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some drafts refused
    shaped = llm.engine._grammar_drafts  # drafts the grammar cut, and drafts it forced
    assert shaped.cut > 0 and shaped.forced > 0
    for out, p in zip(spec, params):
        done, text, grammar = out.outputs[0], out.outputs[0].text, p.structured_outputs
        if done.finish_reason == "stop":  # else cut by max_tokens
            assert re.fullmatch(grammar.regex, text) if grammar.regex else isinstance(json.loads(text), dict), text


def test_grammar_after_thinking_drafts_and_samples_as_without_drafts(tmp_path, make_llm):
    """A reasoning model's grammar waits for ``</think>``: where the drafts
    hold it, the rows after it are masked by the grammar from its start.
    A thinking budget ends each reply's thinking where its prompt's
    thinking ended, which the drafts copy, marker and answer; the replies
    are those without drafts, and drafts stood."""
    from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, build_tiny_thinking_model

    path = str(build_tiny_thinking_model(tmp_path))
    end = BYTE_VOCAB_SIZE + 1
    prompts = ["aaaa</think>bxbxa aaaa</think>bxbxa aaaa", "aaa</think>bxa aaa</think>bxa aa",
               "aaaaa</think>bxbxbxa aaaaa</think>bxbxbxa a"] * 2
    params = [SamplingParams(temperature=0.0 if i < 3 else 0.9, seed=None if i < 3 else i, max_tokens=30,
                             structured_outputs=StructuredOutputs(regex="(bx)+a"), structured_after_token_id=end,
                             thinking_token_budget=budget, thinking_end_token_id=end,
                             allowed_token_ids=[ord("a"), ord("b"), ord("x"), end, EOS])
              for i, budget in enumerate((4, 3, 5) * 2)]
    plain = make_llm(path).generate(prompts, params)
    llm = make_llm(path, speculative_config=NGRAM)
    assert tokens(llm.generate(prompts, params)) == tokens(plain)
    assert drafts_stood(llm) > 0
    for reply, p in zip(tokens(plain)[:3], params):  # greedy: thinking to the budget, the end, then the grammar
        cut = reply.index(end)
        assert cut == p.thinking_token_budget and reply[-1] == EOS, reply
        assert re.fullmatch("(bx)+a", bytes(reply[cut + 1:-1]).decode()), reply


def test_chunks_prefix_hits_swaps_and_recomputes_keep_the_tokens_that_stood(tiny_model, make_llm):
    """Chunked prefills (16 tokens a step, drafts sharing it), prompts
    sharing a cached prefix, and a device pool too small for the running
    set, so requests swap out and back and recompute: rejected drafts' KV
    never reaches the prefix cache or another request, and the tokens stay
    transformers'."""
    path = tiny_model("llama")
    shared = "The quick brown fox jumps over the lazy dog. "
    prompts = [shared + p for p in PROMPTS[:3]] + [p[:20] for p in PROMPTS] + [shared * 2]
    expected = hf_greedy(path, prompts, 40)
    llm = make_llm(path, speculative_config=NGRAM, num_kv_blocks=20, block_size=8, max_model_len=160,
                   num_host_blocks=64, max_num_batched_tokens=16, scheduling_policy="fcfs", proactive_swap=False)
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.stats()
    assert stats.num_swaps > 0 and stats.prefix_cache_hit_tokens > 0
    assert drafts_stood(llm) > 0
    # A second round over the cached blocks: the blocks drafts wrote and rejected were not indexed.
    assert tokens(llm.generate(prompts, GREEDY)) == expected


def test_recompute_preemption_keeps_the_tokens(tiny_model, make_llm):
    path = tiny_model("llama")
    prompts = [p[:24] for p in PROMPTS] * 2
    expected = hf_greedy(path, prompts, 40)
    llm = make_llm(path, speculative_config=NGRAM, num_kv_blocks=14, block_size=8, max_model_len=96,
                   num_host_blocks=0, max_num_batched_tokens=24)
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    assert llm.engine.stats().num_recomputes > 0
    assert drafts_stood(llm) > 0


def test_drafts_only_at_the_batch_sizes_that_allow_them(tiny_model, make_llm):
    """num_speculative_tokens_per_batch_size [[1, 1, 4], [2, 64, 0]]: steps
    of several sequences verify no drafts; once one sequence is left, it
    drafts (prompts of different lengths: the longest runs alone at the end)."""
    path = tiny_model("llama")
    llm = make_llm(path, speculative_config={**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 64, 0]]})
    verified: list[int] = []
    execute = llm.engine.executor.execute

    def counting(inp):
        if inp.drafts:
            verified.append(len(inp.seq_lens))
        return execute(inp)

    llm.engine.executor.execute = counting
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (8, 12, 4, 40, 16)]
    outs = llm.generate(PROMPTS, params)
    assert tokens(outs) == [t[:n] for t, n in zip(hf_greedy(path, PROMPTS, 40), (8, 12, 4, 40, 16))]
    assert verified and set(verified) == {1}
    assert drafts_stood(llm) > 0


def test_bad_config_is_refused_at_start(tiny_model, make_llm):
    with pytest.raises(ValueError, match="method 'draft_model' is not implemented"):
        make_llm(tiny_model("llama"), speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


class PricedDrafts(DraftPolicy):
    """The adaptive policy on a device whose steps cost what ``price`` says
    (seconds for sequences and drafts), in place of the wall clock's noisy
    figures for a tiny model; everything else is the engine's own."""

    def __init__(self, price) -> None:
        super().__init__(refresh=16)
        self.price = price

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        super().observe_step(num_seqs, num_drafts, self.price(num_seqs, num_drafts))


@pytest.mark.parametrize("drafts_pay", [True, False])
def test_adaptive_drafts_follow_what_steps_cost(tiny_model, make_llm, drafts_pay):
    """By default (adaptive), a step verifies the drafts that buy tokens a
    second: on a device where they are nearly free, all of them; where each
    costs twice a sequence's decode, which no draft can repay, almost none
    (one verifying step every ``refresh`` decisions re-times them). Either way the tokens are
    transformers' greedy ones."""
    path = tiny_model("llama")
    adaptive = {k: v for k, v in NGRAM.items() if k != "adaptive"}
    llm = make_llm(path, speculative_config=adaptive)
    per_draft = 0.0001 if drafts_pay else 0.020
    policy = llm.engine._draft_policy = PricedDrafts(lambda seqs, drafts: 0.010 * seqs + per_draft * drafts)
    verifying = []
    execute = llm.engine.executor.execute

    def counting(inp):
        verifying.append(bool(inp.drafts))
        return execute(inp)

    llm.engine.executor.execute = counting
    assert tokens(llm.generate(PROMPTS, GREEDY)) == hf_greedy(path, PROMPTS, 40)
    stats = llm.engine.stats()
    assert stats.spec_num_withheld_tokens == policy.withheld
    if drafts_pay:
        assert drafts_stood(llm) > 0
        assert sum(verifying) > len(verifying) / 2
    else:
        assert policy.withheld > stats.spec_num_draft_tokens > 0
        assert sum(verifying) <= 2 + len(verifying) // policy.refresh


def test_a_step_returns_its_tokens_before_the_next_drafts_are_looked_up(tiny_model, make_llm):
    """A step's drafts are proposed as the next step begins, before it
    plans: the step that samples a prompt's first token returns it before
    the prompt's n-gram index is built (for a prompt of 8k tokens, about
    7 ms), and the next step verifies drafts from it all the same."""
    llm = make_llm(tiny_model("llama"), speculative_config=NGRAM)
    engine = llm.engine
    prompt = "one two three four one two three four " * 6
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    outs = engine.step()  # the whole prompt, and its first token
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    (seq,) = engine.requests["r"].seqs
    assert seq.drafter._indexed == 0 and not seq.draft  # nothing looked up yet
    engine.step()
    assert seq.drafter._indexed == len(seq.request.prompt_token_ids)  # looked up before that step planned
    while engine.has_unfinished_requests():
        engine.step()
    assert drafts_stood(llm) > 0
    assert engine.stats().generation_tokens_total == 24


def test_a_chunked_prompt_is_indexed_chunk_by_chunk(tiny_model, make_llm):
    """A prompt prefilled over several steps is indexed a chunk at a time,
    as each next step begins, so the lookup after its first token indexes
    only its last chunk; the drafts and tokens are those of indexing it
    whole (a run without drafts gives the same tokens)."""
    path = tiny_model("llama")
    prompt = "one two three four one two three four " * 3  # 117 byte tokens, 4 steps of 32
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = make_llm(path, max_num_batched_tokens=32).generate([prompt], params)[0].outputs[0].token_ids
    llm = make_llm(path, speculative_config=NGRAM, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    (seq,) = engine.requests["r"].seqs
    indexed = []
    while not seq.output_token_ids:
        engine.step()
        indexed.append(seq.drafter._indexed)
    assert indexed[:3] == [0, 32, 64] and indexed[-1] == 96  # the chunks before the last, each a step late
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == expected
    assert drafts_stood(llm) > 0


@pytest.mark.parametrize("policy", ["every-draft", "drafts-pay", "drafts-cost"])
def test_async_scheduling_queues_the_steps_that_carry_no_drafts(tiny_model, make_llm, policy):
    """--async-scheduling beside drafts: a step is queued before the last
    one's tokens are read only where it would carry no drafts (after a
    proposal that kept none, until an n-gram recurs, as of the tokens read,
    that would be verified); steps with drafts verify them synchronously.
    With n-grams of two tokens or more, which recur only now and then, runs
    of queued steps start and must end where one recurs: every draft
    verified, or drafts the adaptive policy takes (nearly free), stand
    nearly as often as with synchronous steps; drafts it withholds (each
    costs two decodes) leave most steps queued. Greedy tokens are those of a
    run without drafts, and every block comes back (make_llm)."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)  # min_tokens keeps rows on the host
    expected = tokens(make_llm(path).generate(PROMPTS, params))
    config = dict(NGRAM, prompt_lookup_min=2)
    if policy != "every-draft":
        del config["adaptive"]
    runs = {}
    for async_scheduling in (False, True):
        llm = make_llm(path, speculative_config=config, async_scheduling=async_scheduling)
        if policy != "every-draft":
            per_draft = 0.0001 if policy == "drafts-pay" else 0.020
            llm.engine._draft_policy = PricedDrafts(lambda seqs, drafts: 0.010 * seqs + per_draft * drafts)
        assert tokens(llm.generate(PROMPTS, params)) == expected
        runs[async_scheduling] = llm.engine.stats()
    sync, ahead = runs[False], runs[True]
    assert ahead.num_steps_launched_ahead > 0
    if policy == "drafts-cost":
        assert ahead.num_steps_launched_ahead > ahead.num_steps / 2
        assert ahead.spec_num_withheld_tokens > ahead.spec_num_draft_tokens
    else:
        assert ahead.spec_num_accepted_tokens >= 0.8 * sync.spec_num_accepted_tokens > 0
