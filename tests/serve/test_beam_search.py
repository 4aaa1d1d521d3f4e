"""Beam search through the server (``use_beam_search``, serve/beam_search.py),
judged by greedy decoding and by a reference beam search written here over
the transformers model.

The model is the tiny llama with its EOS row of ``lm_head`` set to twice the
row of ``e``: EOS is then likely wherever ``e`` is, so some beams end on EOS
and the length penalty has finished beams of different lengths to rank.
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
import torch

from server_utils import ok, post, start_server

EOS = 257  # "<|eos|>"
C, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["Hello there", "The quick brown fox", "a", "你好, wörld"]


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("beam") / "m"
    shutil.copytree(tiny_model("llama"), path)
    weights = load_file(str(path / "model.safetensors"))
    head = weights["lm_head.weight"]  # [vocab, hidden]
    head[EOS] = head[ord("e")] * 2.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()


def beams(srv, prompt: str, n: int, max_tokens: int, **extra) -> list[dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "use_beam_search": True, "n": n,
            "logprobs": 0, "return_token_ids": True, **extra}
    return ok(srv, C, body)["choices"]


def cumulative(choice: dict) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def reference_beam_search(hf, prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
                          ignore_eos: bool = False) -> list[tuple[list[int], float, bool]]:
    """The search vLLM serves, over the transformers model: each beam offers
    its 2 * width likeliest next tokens; a beam whose token is EOS is done
    (EOS not kept); the width likeliest others go on. The width best by
    cumulative logprob / (prompt + generated length) ** length_penalty are
    returned as (generated ids, their cumulative logprob, ended on EOS); the
    EOS's own logprob counts in the score, not in the returned sum."""
    live: list[tuple[list[int], float]] = [(list(prompt_ids), 0.0)]
    done: list[tuple[list[int], float, bool, float]] = []  # (tokens, score's logprob, EOS, tokens' logprob)
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            values, ids = torch.log_softmax(logits, dim=-1).topk(2 * width)
            for lp, token in zip(values.tolist(), ids.tolist()):
                if token == EOS and not ignore_eos:
                    done.append((tokens, cum + lp, True, cum))
                else:
                    candidates.append((cum + lp, token, tokens))
        candidates.sort(key=lambda c: -c[0])
        live = [(tokens + [token], cum) for cum, token, tokens in candidates[:width]]
    done += [(tokens, cum, False, cum) for tokens, cum in live]
    best = sorted(done, key=lambda b: b[1] / len(b[0]) ** length_penalty, reverse=True)[:width]
    return [(tokens[len(prompt_ids):], cum, eos) for tokens, _, eos, cum in best]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_width_one_is_greedy(server, prompt):
    greedy = ok(server, C, {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True})["choices"][0]
    (beam,) = beams(server, prompt, 1, 12, ignore_eos=True)
    assert beam["token_ids"] == greedy["token_ids"] and beam["text"] == greedy["text"]
    assert beam["finish_reason"] == "length"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_best_beam_is_at_least_as_likely_as_greedy(server, prompt):
    greedy = ok(server, C, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "logprobs": 0})["choices"][0]
    found = beams(server, prompt, 4, 16, ignore_eos=True)
    assert len(found) == 4 and len({tuple(c["token_ids"]) for c in found}) == 4
    scores = [cumulative(c) for c in found]
    assert scores == sorted(scores, reverse=True)  # equal lengths: ranked by cumulative logprob
    assert scores[0] >= cumulative(greedy) - 1e-4


@pytest.mark.parametrize("width, length_penalty", [(2, 1.0), (3, 1.0), (3, 0.3), (4, 2.0)])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_matches_the_reference_beam_search(server, hf, prompt, width, length_penalty):
    prompt_ids = list(prompt.encode())  # the byte tokenizer: one id per byte, no BOS
    ref = reference_beam_search(hf, prompt_ids, width, 10, length_penalty)
    got = beams(server, prompt, width, 10, length_penalty=length_penalty)
    assert [c["token_ids"] for c in got] == [ids for ids, _, _ in ref]
    assert [c["finish_reason"] for c in got] == ["stop" if eos else "length" for _, _, eos in ref]
    assert [cumulative(c) for c in got] == pytest.approx([cum for _, cum, _ in ref], abs=1e-3)


def test_eos_ends_some_beams(server):
    """The model really ends beams on EOS (else the reference test would not
    exercise finished beams), and include_stop_str_in_output keeps the EOS."""
    ended = [c for p in PROMPTS for c in beams(server, p, 4, 10) if c["finish_reason"] == "stop"]
    assert ended and all(c["stop_reason"] == EOS and EOS not in c["token_ids"] for c in ended)
    kept = [c for p in PROMPTS for c in beams(server, p, 4, 10, include_stop_str_in_output=True)
            if c["finish_reason"] == "stop"]
    assert kept and all(c["token_ids"][-1] == EOS for c in kept)


def test_chat_beam_search_streamed_as_whole_choices(server):
    body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 6, "temperature": 0,
            "use_beam_search": True, "n": 3}
    whole = ok(server, CHAT, body)["choices"]
    assert [c["index"] for c in whole] == [0, 1, 2]
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    text = {i: "" for i in range(3)}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    assert [text[i] for i in range(3)] == [c["message"]["content"] for c in whole]


@pytest.mark.parametrize("body, param", [
    ({"stream": True}, "stream"),
    ({"stop": ["x"]}, "stop"),
    ({"stop_token_ids": [5]}, "stop_token_ids"),
    ({"logit_bias": {"97": 5}}, "logit_bias"),
    ({"allowed_token_ids": [97]}, "allowed_token_ids"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"logprobs": 1, "logprob_token_ids": [97]}, "logprob_token_ids"),
])
def test_fields_beam_search_cannot_honour_are_400(server, body, param):
    resp = post(server, C, {"prompt": "Hello", "max_tokens": 4, "use_beam_search": True, "n": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_length_penalty_without_beam_search_is_400(server):
    resp = post(server, C, {"prompt": "Hello", "max_tokens": 4, "length_penalty": 0.5})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "length_penalty"


def test_beam_search_leaves_nothing_in_the_engine(server):
    """Every step's requests end, and a client that leaves mid-search aborts
    the rest: no request and no KV block stays behind."""
    beams(server, "Hello there", 4, 12)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}{C}", json={"prompt": "Hello", "max_tokens": 200, "temperature": 0,
                                                   "use_beam_search": True, "n": 8, "ignore_eos": True},
                   timeout=0.5)
    engine = server.engine
    deadline = time.monotonic() + 30
    while server.async_engine.num_in_flight or engine.has_unfinished_requests() or engine.kv.num_used_blocks:
        assert time.monotonic() < deadline, "a beam search left requests or KV blocks behind"
        time.sleep(0.05)
    engine.kv.check_integrity()
