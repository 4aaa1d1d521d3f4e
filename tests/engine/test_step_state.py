"""The engine's per-sequence step state: what it keeps between
steps so a step costs work for what changed only must never change what comes
out. Final-only requests (LLM.generate) against streamed ones, field by
field; the sampler row's live history; block tables the scheduler replaces
after a recompute or a swap."""

from __future__ import annotations

import dataclasses

import pytest

from fluidserve.engine import SamplingParams

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "你好, wörld", "Long prompt " * 5]


def fields(out) -> list[dict]:
    return [{**dataclasses.asdict(co), "token_ids": list(co.token_ids)} for co in out.outputs]


def streamed_and_final(engine, prompts, params):
    """(streamed outputs per request, final-only outputs per request), keyed by prompt index."""
    streamed: dict[int, list] = {}
    final: dict[int, list] = {}
    for final_only, into in ((False, streamed), (True, final)):
        tag = "f" if final_only else "s"
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}{i}", prompt, params, final_only=final_only)
        while engine.has_unfinished_requests():
            for out in engine.step():
                into.setdefault(int(out.request_id[1:]), []).append(
                    (out.finished, fields(out), out.prompt_logprobs is not None and list(out.prompt_logprobs)))
    return streamed, final


PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "one token": SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
    "logprobs": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    "n=2": SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8),
    "stop string": SamplingParams(temperature=0, max_tokens=16, stop=["e", "o "], ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5,
                                min_tokens=3),
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_final_only_output_equals_last_streamed_output(tiny_model, make_llm, name):
    """A final-only request yields one output, equal in every field (the
    deltas too) to the last output of the same request streamed."""
    engine = make_llm(tiny_model("llama")).engine
    streamed, final = streamed_and_final(engine, PROMPTS, PARAMS[name])
    for i in range(len(PROMPTS)):
        assert len(final[i]) == 1 and final[i][0][0], "final-only: exactly one output, the finished one"
        assert final[i][0] == streamed[i][-1]
        deltas = [co for _, outs, _ in streamed[i] for co in outs]
        for index, co in enumerate(final[i][0][1]):  # streamed deltas add up to the final text and tokens
            assert "".join(d["text_delta"] for d in deltas if d["index"] == index) == co["text"]
            assert [t for d in deltas if d["index"] == index for t in d["new_token_ids"]] == co["token_ids"]


def test_final_only_stop_token_is_not_in_the_text(tiny_model, make_llm):
    """A lazily detokenized sequence that ends on a stop token id: the text
    and stop reason are those of the streamed run."""
    llm = make_llm(tiny_model("llama"))
    base = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[base.token_ids[4]])
    streamed, final = streamed_and_final(llm.engine, [PROMPTS[1]], params)
    assert len(final[0]) == 1 and final[0][0] == streamed[0][-1]
    co = final[0][0][1][0]
    assert co["finish_reason"] == "stop" and co["stop_reason"] == base.token_ids[4]
    assert co["text"] == llm.tokenizer.decode(co["token_ids"][:-1], skip_special_tokens=True)


def test_sampler_row_history_is_the_output_so_far(tiny_model, make_llm):
    """The cached sampler row sends the live output list: at every step the
    worker reads exactly the tokens generated before it, and the seed of a
    seeded row moves with the position."""
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    seen: list[tuple[list[int], int | None]] = []
    execute = engine.executor.execute

    def spy(inp):
        for spec in inp.samples:
            seen.append((list(spec.output_token_ids), spec.seed))
        return execute(inp)

    engine.executor.execute = spy
    params = SamplingParams(temperature=1.0, seed=9, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert [h for h, _ in seen] == [out.token_ids[:k] for k in range(6)]
    assert len({s for _, s in seen}) == 6  # a fresh seed per position


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_replaced_block_tables_give_the_tokens_of_a_fresh_run(tiny_model, make_llm, mode):
    """Too few device blocks: requests are preempted (recompute) or swapped
    out and back, so the scheduler resends their tables whole; the engine's
    kept tables follow and every token equals an unconstrained run's."""
    path = tiny_model("llama")
    prompts = [p[:20] for p in PROMPTS] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = make_llm(path, block_size=8, max_model_len=64).generate(prompts, params)
    kw = {"num_host_blocks": 64} if mode == "swap" else {}
    tight = make_llm(path, num_kv_blocks=10, block_size=8, max_model_len=64, preemption_mode=mode, **kw)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in free]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in free]


def test_stream_taking_over_after_a_prompt_cut_mid_character(tmp_path, monkeypatch):
    """A prompt whose tail ends inside a UTF-8 character starts on the
    window; after its first delta a decode stream takes over. Chunk by
    chunk, the text is the window's alone. (A byte-level tokenizer decodes by
    its byte table instead; the stream path is the one every other fast
    tokenizer takes, so the table is switched off here.)"""
    import random

    import transformers

    from fluidserve.engine import detokenizer
    from fluidserve.engine.detokenizer import TextStream

    monkeypatch.setattr(detokenizer, "byte_table", lambda tokenizer, skip_special_tokens: None)
    from fluidserve.engine.tiny_model import save_byte_tokenizer

    save_byte_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rng = random.Random(1)
    took_over = 0
    for _ in range(60):
        prompt = list("Q: 你".encode())[:-rng.randint(1, 2)]  # ends inside 你
        text = "".join(rng.choice(["a", "é", "你", "🙂", " ", "z"]) for _ in range(rng.randint(1, 10)))
        outputs = list(text.encode()) + [rng.randint(0, 255) for _ in range(rng.randint(0, 2))]
        for stops in ([], ["z"]):
            params = SamplingParams(stop=stops)
            chunks = {}
            for window in (False, True):
                stream = TextStream(tok, prompt, params)
                assert stream._decode_stream is None
                if window:
                    stream._reseed = False
                got = []
                for t in outputs:
                    got.append((stream.append(t), stream.flush(False)))
                got.append((None, stream.flush(True)))
                chunks[window] = got
                took_over += not window and stream._decode_stream is not None
            assert chunks[False] == chunks[True]
    assert took_over > 0


def test_step_inputs_start_on_16_bytes_whatever_the_batch_size():
    """Every section of the one-copy input buffer starts 16-byte aligned, for
    any token and sequence count: Triton compiles a variant per pointer
    alignment, so a view whose alignment followed the batch would compile in
    the middle of serving (seen on an H100). The values read back intact."""
    import torch

    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.model_runner import ModelRunner

    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"), torch.float32)
    for tokens, seqs in [(1, 1), (3, 2), (5, 3), (7, 1), (8, 5), (13, 7)]:
        per_seq = [1] * (seqs - 1) + [tokens - seqs + 1]  # decodes and one prefill
        starts = [0]
        for n in per_seq:
            starts.append(starts[-1] + n)
        inp = ModelInput(input_ids=list(range(100, 100 + tokens)), positions=list(range(tokens)),
                         slot_mapping=list(range(200, 200 + tokens)), query_start_loc=starts,
                         seq_lens=[n + 4 for n in per_seq], block_tables=[[i + 1] * (i % 3 + 1) for i in range(seqs)],
                         sample_indices=[s - 1 for s in starts[1:]])  # fmt: skip
        input_ids, positions, meta, sample_idx = runner.prepare(inp, [])
        views = dict(input_ids=input_ids, positions=positions, slot_mapping=meta.slot_mapping,
                     sample_idx=sample_idx, seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc,
                     block_tables=meta.block_tables)  # fmt: skip
        for name, view in views.items():
            assert view.data_ptr() % 16 == 0, (name, tokens, seqs)
        assert input_ids.tolist() == inp.input_ids and positions.tolist() == inp.positions
        assert meta.slot_mapping.tolist() == inp.slot_mapping and sample_idx.tolist() == inp.sample_indices
        assert meta.seq_lens.tolist() == inp.seq_lens and meta.query_start_loc.tolist() == starts
        assert [row[:len(b)] for row, b in zip(meta.block_tables.tolist(), inp.block_tables)] == inp.block_tables
