"""Prompt logprobs (vLLM's ``prompt_logprobs``) and echo with logprobs
(OpenAI's shape) against a Hugging Face ``transformers`` forward of the same
tiny random-weight model: every prompt position's logprob equals
``log_softmax`` of HF's logits at the position before, within 1e-4 (both fp32
on CPU), the top-N are HF's top-N, and the ranks agree.

The server runs with a 16-token step budget, so a 40-token prompt is scored
over three prefill chunks. Engine-level tests cover recompute preemption and
prefix caching, which must neither repeat nor drop a position.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

from fluidserve.engine import SamplingParams
from fluidserve.engine.engine import LLMEngine
from server_utils import start_server

TOL = 1e-4
# 40 byte tokens (the tiny tokenizer's id of a byte is the byte).
PROMPT_IDS = list(b"The quick brown fox jumps over the dogs.")
assert len(PROMPT_IDS) == 40


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """token ids -> [len, vocab] fp32 log_softmax of HF's logits."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_num_batched_tokens=16, max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_against_hf(entries: list, ids: list[int], ref: torch.Tensor, top_n: int, tokenizer) -> None:
    """vLLM's wire shape: None, then per token {str(token id): {logprob, rank, decoded_token}}."""
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        entry = {int(k): v for k, v in entries[j].items()}
        row = ref[j - 1]
        target = ids[j]
        assert abs(entry[target]["logprob"] - row[target].item()) < TOL, j
        assert entry[target]["rank"] == int((row > row[target]).sum()) + 1
        top = row.topk(top_n).indices.tolist()
        assert sorted((v["rank"], t) for t, v in entry.items() if v["rank"] <= top_n) == list(enumerate(top, 1))
        for t, v in entry.items():
            assert abs(v["logprob"] - row[t].item()) < TOL
            assert v["decoded_token"] == tokenizer.decode([t])
        assert set(entry) <= set(top) | {target}


def test_completions_prompt_logprobs_match_hf_across_chunks(client, server, hf_logprobs):
    resp = client.completions.create(model=server.engine.model_name, prompt=PROMPT_IDS, max_tokens=2,
                                     temperature=0, extra_body={"prompt_logprobs": 3})
    choice = resp.choices[0]
    check_against_hf(choice.prompt_logprobs, PROMPT_IDS, hf_logprobs(PROMPT_IDS), 3, server.engine.tokenizer)
    assert choice.logprobs is None  # only the prompt was asked for


def test_prompt_logprobs_zero_gives_the_prompt_token_only(client, server, hf_logprobs):
    resp = client.completions.create(model=server.engine.model_name, prompt=PROMPT_IDS[:20], max_tokens=1,
                                     temperature=0, extra_body={"prompt_logprobs": 0})
    entries = resp.choices[0].prompt_logprobs
    ref = hf_logprobs(PROMPT_IDS[:20])
    assert entries[0] is None
    for j in range(1, 20):
        ((tok, lp),) = entries[j].items()
        assert int(tok) == PROMPT_IDS[j] and abs(lp["logprob"] - ref[j - 1, PROMPT_IDS[j]].item()) < TOL


def test_chat_prompt_logprobs_score_the_rendered_prompt(client, server, hf_logprobs):
    messages = [{"role": "user", "content": "Score every token of this prompt."}]
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert len(ids) > 32  # more than two 16-token chunks
    resp = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 2})
    check_against_hf(resp.prompt_logprobs, ids, hf_logprobs(ids), 2, server.engine.tokenizer)


def test_echo_with_logprobs_prepends_the_prompt(client, server, hf_logprobs):
    prompt = "Echo me back, scored."
    resp = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=4,
                                     temperature=0, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    ids = list(prompt.encode())
    ref = hf_logprobs(ids)
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 4
    assert lp.tokens[:len(ids)] == [chr(b) for b in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) < TOL
        top = ref[j - 1].topk(2)
        # As vLLM: the prompt token itself beside the top 2. Tokens that
        # decode alike (bytes of U+FFFD) keep the likeliest.
        expected: dict[str, float] = {}
        for t, v in sorted([(ids[j], ref[j - 1, ids[j]].item()), *zip(top.indices.tolist(), top.values.tolist())],
                           key=lambda tv: -tv[1]):
            expected.setdefault(server.engine.tokenizer.decode([t]), v)
        assert lp.top_logprobs[j] == pytest.approx(expected, abs=TOL)
    # The generated part: its own logprobs, offsets counting the echoed text.
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[len(ids):])
    assert lp.text_offset[:len(ids)] == list(range(len(ids)))
    assert lp.text_offset[len(ids)] == len(prompt)
    assert "".join(lp.tokens) == choice.text

    # Streamed: the first chunk carries the echoed prompt and its logprobs.
    stream = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=4,
                                       temperature=0, echo=True, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    tokens, values, offsets, text = [], [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert text == choice.text and tokens == lp.tokens
    # (Streamed offsets of generated tokens follow the text sent so far, which a
    # partial UTF-8 character holds back; the echoed part is exact.)
    assert offsets[:len(ids) + 1] == lp.text_offset[:len(ids) + 1]
    assert values[0] is None and values[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
])
def test_prompt_logprobs_out_of_range_or_streamed_is_400(server, path, body):
    resp = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt_logprobs" and err["type"] == "invalid_request_error", err


def test_echo_logprobs_above_the_cap_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.engine.model_name, prompt="hi", echo=True, logprobs=21)
    assert info.value.body["param"] == "logprobs"


# -- engine level: chunks, recompute, prefix cache ------------------------------


def _assert_engine_entries(entries, ids, ref, top_n):
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        e = entries[j]
        assert abs(e[ids[j]].logprob - ref[j - 1, ids[j]].item()) < TOL
        top = ref[j - 1].topk(top_n).indices.tolist()
        assert sorted((lp.rank, t) for t, lp in e.items() if lp.rank <= top_n) == list(enumerate(top, 1))


def test_recompute_preemption_neither_repeats_nor_drops_positions(model_dir, make_llm, hf_logprobs):
    llm = make_llm(model_dir, preemption_mode="recompute", num_kv_blocks=10, block_size=8, max_model_len=64,
                   max_num_batched_tokens=16)
    prompts = [PROMPT_IDS[i:i + 20] for i in range(0, 16, 2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2))
    assert llm.engine.scheduler.counters.num_recomputes > 0
    for ids, out in zip(prompts, outs):
        _assert_engine_entries(out.prompt_logprobs, ids, hf_logprobs(ids), 2)


def test_recompute_mid_prompt_resumes_where_scoring_stopped(model_dir, hf_logprobs):
    """A sequence preempted with 10 prompt tokens scored recomputes from
    position 0: the step scores only positions 10.., so nothing is repeated."""
    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.request import Request
    from fluidserve.scheduler.request_state import RequestClass

    req = Request("r", None, PROMPT_IDS, SamplingParams(prompt_logprobs=1), RequestClass.ONLINE, 0.0, 4)
    req.prompt_logprobs = [None] + [{}] * 10  # tokens 1..10 scored before the preemption
    inp = ModelInput()
    scored: dict[str, int] = {}
    LLMEngine._score_prompt(req, 0, 16, 5, scored, inp)  # recompute chunk [0, 16) at flat index 5
    (spec,) = inp.prompt_logprobs
    assert spec.first_index == 5 + 10 and spec.targets == PROMPT_IDS[11:17] and scored["r"] == 17
    LLMEngine._score_prompt(req, 16, 40, 0, scored, inp)  # the last chunk: up to the token before the end
    assert inp.prompt_logprobs[1].targets == PROMPT_IDS[17:40] and scored["r"] == 40
    LLMEngine._score_prompt(req, 40, 41, 0, scored, inp)  # decode: nothing left to score
    assert len(inp.prompt_logprobs) == 2


def test_prompt_logprobs_skip_prefix_cache_hits(model_dir, make_llm, hf_logprobs):
    llm = make_llm(model_dir, enable_prefix_caching=True, block_size=8, max_num_batched_tokens=16)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([PROMPT_IDS], greedy)  # caches the prompt's full blocks
    hits = llm.engine.kv.prefix_stats.hit_tokens
    out = llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    assert llm.engine.kv.prefix_stats.hit_tokens == hits  # no hit: every position was computed
    _assert_engine_entries(out.prompt_logprobs, PROMPT_IDS, hf_logprobs(PROMPT_IDS), 1)
    llm.generate([PROMPT_IDS], greedy)
    assert llm.engine.kv.prefix_stats.hit_tokens > hits  # the cache still serves the others


def test_a_scored_prompt_still_fills_the_prefix_cache(model_dir, make_llm, hf_logprobs):
    """Scoring reads nothing from the cache, but what it computes is offered
    to it: the next plain request with that prompt hits."""
    llm = make_llm(model_dir, enable_prefix_caching=True, block_size=8, max_num_batched_tokens=16)
    out = llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    _assert_engine_entries(out.prompt_logprobs, PROMPT_IDS, hf_logprobs(PROMPT_IDS), 1)
    assert llm.engine.kv.prefix_stats.hit_tokens == 0
    llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.kv.prefix_stats.hit_tokens == (len(PROMPT_IDS) - 1) // 8 * 8


def test_n_completions_share_one_scoring(model_dir, make_llm, hf_logprobs):
    llm = make_llm(model_dir, max_num_batched_tokens=16)
    out = llm.generate([PROMPT_IDS], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=1))[0]
    _assert_engine_entries(out.prompt_logprobs, PROMPT_IDS, hf_logprobs(PROMPT_IDS), 1)

