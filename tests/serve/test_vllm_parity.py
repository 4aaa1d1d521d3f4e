"""Behaviours that follow vLLM's OpenAI server point by point (issue #32):
chat template variables, continued and echoed chat messages, streamed
choices, usage, logprobs (``logprob_token_ids``, -1 for the whole vocabulary,
``--max-logprobs``), model cards, validation, token ids in responses, vLLM's
server options, forced tool calls with ``$defs``, ``/tokenizer_info`` and
``/v1/chat/completions/batch``. Beam search: tests/serve/test_beam_search.py.

The tiny model's byte tokenizer makes ids readable: the id of a byte is the
byte. Its chat template here also writes ``<think></think>`` when
``enable_thinking`` is false, so a template variable shows in the prompt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import httpx
import pytest

from fluidserve.engine.outputs import CompletionOutput, RequestOutput
from fluidserve.engine.tiny_model import CHAT_TEMPLATE
from fluidserve.serve.api import ServerSettings
from fluidserve.serve.inputs import Prompt
from fluidserve.serve.render import make_usage
import server_utils
from server_utils import ok, post, start_server

LETTERS = list(range(ord("a"), ord("z") + 1))
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "abc"}]
BASE = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "allowed_token_ids": LETTERS}
CHAT_BASE = {"messages": MSGS, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "allowed_token_ids": LETTERS}
THINKING_TEMPLATE = (CHAT_TEMPLATE
                     + "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
FLAGS = ServerSettings(return_tokens_as_token_ids=True, enable_force_include_usage=True,
                       enable_request_id_headers=True, enable_prompt_tokens_details=True,
                       enable_tokenizer_info_endpoint=True, ignore_unknown_fields=True,
                       trust_request_chat_template=True)
VOCAB = 261  # the tiny model's byte tokenizer: 256 bytes and 5 specials


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("parity") / "m"
    shutil.copytree(tiny_model("llama"), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def flagged(model_dir):
    srv = start_server(model_dir, FLAGS, max_model_len=256)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def whole_vocab(model_dir):
    """A server started as with ``--max-logprobs -1``: no cap below the vocabulary."""
    real = server_utils.model_info
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_utils, "model_info",
                   lambda engine, **kw: dataclasses.replace(real(engine, **kw), max_logprobs=-1))
        srv = start_server(model_dir, max_model_len=256)
    yield srv
    srv.stop()


def sse(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{srv.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def tokenize_chat(srv, **body) -> list[int]:
    return ok(srv, "/tokenize", {"messages": MSGS, **body})["tokens"]


def bad(srv, path: str, body: dict) -> dict:
    resp = post(srv, path, body)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


# -- 1. chat template variables, continue_final_message, echo ------------------


def test_chat_template_kwargs_reach_the_template(server):
    plain = ok(server, CHAT, CHAT_BASE)
    off = ok(server, CHAT, {**CHAT_BASE, "chat_template_kwargs": {"enable_thinking": False}})
    on = ok(server, CHAT, {**CHAT_BASE, "chat_template_kwargs": {"enable_thinking": True}})
    assert off["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("<think></think>")
    assert on["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    ids = tokenize_chat(server, chat_template_kwargs={"enable_thinking": False})
    assert bytes(ids[-len("<think></think>"):]) == b"<think></think>"


@pytest.mark.parametrize("kwargs", [{"tokenize": True}, {"add_generation_prompt": False}, {"chat_template": "x"}])
def test_chat_template_kwargs_cannot_set_the_renderers_arguments(server, kwargs):
    err = bad(server, CHAT, {**CHAT_BASE, "chat_template_kwargs": kwargs})
    assert err["param"] == "chat_template_kwargs" and next(iter(kwargs)) in err["message"]


# A RAG template of the kind Command-R's and Granite's are: the documents before the turns.
DOCUMENTS_TEMPLATE = ("{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
                      "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
DOCS = [{"title": "a", "text": "xyz"}, {"title": "b", "text": "uvw"}]


def test_a_requests_own_chat_template_and_documents_render_behind_the_flag(server, flagged):
    """vLLM's ``chat_template`` (a server started with
    --trust-request-chat-template) and ``documents``: the prompt is the
    request's template over its documents, to the byte."""
    expected = b"[doc a: xyz][doc b: uvw]<user>abc<assistant>"
    ids = tokenize_chat(flagged, chat_template=DOCUMENTS_TEMPLATE, documents=DOCS)
    assert bytes(ids) == expected
    body = ok(flagged, CHAT, {**CHAT_BASE, "chat_template": DOCUMENTS_TEMPLATE, "documents": DOCS})
    assert body["usage"]["prompt_tokens"] == len(expected)
    direct = ok(flagged, C, {**BASE, "prompt": list(expected)})  # greedy: a completion of that prompt
    assert body["choices"][0]["message"]["content"] == direct["choices"][0]["text"]
    # Without the flag the template is refused, by name; documents the template does not read change nothing.
    for srv, extra, param in ((server, {"chat_template": DOCUMENTS_TEMPLATE}, "chat_template"),
                              (server, {"documents": DOCS}, "documents"),
                              (flagged, {"documents": DOCS}, "documents")):
        for path, request in ((CHAT, CHAT_BASE), ("/tokenize", {"messages": MSGS})):
            err = bad(srv, path, {**request, **extra})
            assert err["param"] == param, err
    assert "--trust-request-chat-template" in bad(server, CHAT, {**CHAT_BASE, "chat_template": "x"})["message"]


def test_continue_final_message_leaves_the_last_message_open(server):
    msgs = [*MSGS, {"role": "assistant", "content": "xy"}]
    ids = tokenize_chat(server, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert bytes(ids[-3:]) == b"\nxy"  # no <|im_end|> after it
    body = ok(server, CHAT, {**CHAT_BASE, "messages": msgs, "add_generation_prompt": False,
                             "continue_final_message": True})
    assert body["usage"]["prompt_tokens"] == len(ids)
    # Greedy: the same tokens as a completion of the rendered prompt.
    direct = ok(server, C, {**BASE, "prompt": ids})
    assert body["choices"][0]["message"]["content"] == direct["choices"][0]["text"]


def test_continue_final_message_with_generation_prompt_is_400(server):
    err = bad(server, CHAT, {**CHAT_BASE, "continue_final_message": True})
    assert err["param"] == "continue_final_message"


def test_chat_echo(server):
    plain = ok(server, CHAT, {**CHAT_BASE, "add_generation_prompt": False})
    text = plain["choices"][0]["message"]["content"]
    # Without a generation prompt the reply continues the user's turn: its role and content come first.
    echoed = ok(server, CHAT, {**CHAT_BASE, "add_generation_prompt": False, "echo": True})
    message = echoed["choices"][0]["message"]
    assert message == {**message, "role": "user", "content": "abc" + text}
    # With one, the reply is the assistant's: a last user message is not echoed.
    reply = ok(server, CHAT, {**CHAT_BASE, "echo": True})["choices"][0]["message"]
    assert reply["role"] == "assistant" and reply["content"] == ok(server, CHAT, CHAT_BASE)["choices"][0][
        "message"]["content"]
    chunks = sse(server, CHAT, {**CHAT_BASE, "add_generation_prompt": False, "echo": True, "stream": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "user", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "abc"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abc" + text


# -- 2, 3. streams ---------------------------------------------------------------


def test_streamed_completion_choices_come_one_per_chunk(server):
    body = {**BASE, "prompt": ["Hello", "World"], "n": 2, "temperature": 1.0, "seed": 3}
    whole = ok(server, C, body)
    chunks = sse(server, C, {**body, "stream": True})
    assert all(len(c["choices"]) == 1 for c in chunks)
    texts: dict[int, str] = {}
    for c in chunks:
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1, 2, 3]
    # Seeded: each choice draws the same tokens streamed or not.
    assert texts == {ch["index"]: ch["text"] for ch in whole["choices"]}


@pytest.mark.parametrize("path", [C, CHAT])
def test_continuous_usage_counts_each_chunks_tokens(server, path):
    body = {**(BASE if path == C else CHAT_BASE), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [c for c in sse(server, path, body) if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    if path == CHAT:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and counts[0] == 0
        counts = counts[1:]
    # One token a step: each chunk's count is the tokens sent so far.
    assert counts == list(range(1, 9))
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)


def test_continuous_usage_is_per_choice_with_n(server):
    body = {**BASE, "n": 2, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(server, C, body)
    for i in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert counts == list(range(1, 9))
    assert chunks[-1]["usage"]["completion_tokens"] == 16


# -- 4. completion logprobs ------------------------------------------------------------


def test_logprobs_zero_gives_the_sampled_token(server):
    lp = ok(server, C, {**BASE, "logprobs": 0})["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 8
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {token: value}


def test_echo_logprobs_include_each_prompt_token(server):
    lp = ok(server, C, {**BASE, "echo": True, "logprobs": 1})["choices"][0]["logprobs"]
    assert lp["tokens"][:5] == list("Hello") and lp["top_logprobs"][0] is None
    for token, value, top in zip(lp["tokens"][1:5], lp["token_logprobs"][1:5], lp["top_logprobs"][1:5]):
        assert top[token] == value and 1 <= len(top) <= 2


# -- 5. model cards --------------------------------------------------------------------


def test_model_card_by_id(server):
    listed = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    name = server.engine.model_name
    card = httpx.get(f"{server.base_url}/v1/models/{name}").json()
    assert [c["id"] for c in listed] == [name] and card["id"] == name and card["object"] == "model"
    for c in (card, listed[0]):
        assert c["root"] and c["parent"] is None and c["max_model_len"] == 256
        assert c["permission"][0]["object"] == "model_permission" and c["permission"][0]["allow_sampling"]
    missing = httpx.get(f"{server.base_url}/v1/models/no-such-model")
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error" and "no-such-model" in err["message"]


# -- 6. validation ----------------------------------------------------------------------


def test_custom_role_goes_to_the_template(server):
    msgs = [{"role": "narrator", "content": "abc"}]
    ids = tokenize_chat(server, messages=msgs)
    assert b"narrator\nabc" in bytes(i for i in ids if i < 256)
    body = ok(server, CHAT, {**CHAT_BASE, "messages": msgs})
    assert body["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seed_at_the_int64_bounds_is_accepted(server, seed):
    ok(server, C, {**BASE, "temperature": 1.0, "seed": seed})


@pytest.mark.parametrize("body, param", [
    ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_out_of_range_values_are_400(server, body, param):
    for path, base in ((C, BASE), (CHAT, CHAT_BASE)):
        assert bad(server, path, {**base, **body})["param"] == param


def test_stop_token_id_at_the_vocabulary_size_is_400(server):
    vocab = server.engine.vocab_size
    assert bad(server, C, {**BASE, "stop_token_ids": [vocab]})["param"] == "stop_token_ids"
    ok(server, C, {**BASE, "stop_token_ids": [vocab - 1]})


# -- 7. token ids in responses ----------------------------------------------------------


def test_return_token_ids_streamed(server):
    whole = ok(server, C, {**BASE, "return_token_ids": True})["choices"][0]
    chunks = sse(server, C, {**BASE, "return_token_ids": True, "stream": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(b"Hello")
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    chat = ok(server, CHAT, {**CHAT_BASE, "return_token_ids": True})
    chat_chunks = sse(server, CHAT, {**CHAT_BASE, "return_token_ids": True, "stream": True})
    assert chat_chunks[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    streamed = [t for c in chat_chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert streamed == chat["choices"][0]["token_ids"]
    plain = ok(server, C, BASE)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


@pytest.mark.parametrize("path", [C, CHAT])
def test_streamed_token_ids_are_whole_when_tokens_have_no_text(server, path):
    """UTF-8 lead bytes alone decode to no text: vLLM's completions still
    stream a chunk per token (clients time tokens by chunk), and with
    return_token_ids neither endpoint drops a token's id."""
    body = {**(BASE if path == C else CHAT_BASE), "allowed_token_ids": [0xC3], "return_token_ids": True}
    whole = ok(server, path, body)["choices"][0]["token_ids"]
    chunks = sse(server, path, {**body, "stream": True})
    streamed = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert whole == [0xC3] * 8 and streamed == whole
    if path == C:  # one chunk per generated token, each with no text but the last's replacement characters
        assert len([c for c in chunks if c["choices"]]) == 8


def test_tokens_as_token_ids_from_the_server_flag(server, flagged):
    body = {**CHAT_BASE, "logprobs": True, "top_logprobs": 1}
    named = ok(flagged, CHAT, body)["choices"][0]["logprobs"]["content"]
    text = ok(server, CHAT, body)["choices"][0]["message"]["content"]
    assert [t["token"] for t in named] == [f"token_id:{ord(c)}" for c in text]
    assert all(t["bytes"] == list(t["token"].encode()) for t in named)
    # The request's own false wins over the server's default.
    spelled = ok(flagged, CHAT, {**body, "return_tokens_as_token_ids": False})["choices"][0]["logprobs"]["content"]
    assert "".join(t["token"] for t in spelled) == text


# -- 8. server options ------------------------------------------------------------------------


def test_force_include_usage(server, flagged):
    for path, base in ((C, BASE), (CHAT, CHAT_BASE)):
        chunks = sse(flagged, path, {**base, "stream": True})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
        assert all("usage" not in c for c in chunks[:-1])
        assert "usage" not in sse(server, path, {**base, "stream": True})[-1]


def test_unknown_fields_dropped_behind_the_flag(server, flagged, caplog):
    # vLLM's way, for clients that send keys of their own; without the flag a 400 names the key.
    stamped = [{**MSGS[0], "timestamp": 1}]
    for path, base, extra in ((C, BASE, {}), (CHAT, CHAT_BASE, {"messages": stamped})):
        body = {**base, "frobnicate": 1, **extra}
        with caplog.at_level(logging.WARNING, logger="fluidserve.serve"):
            dropped = ok(flagged, path, body)
        logged = " ".join(r.getMessage() for r in caplog.records)
        assert "frobnicate" in logged and ("timestamp" in logged or not extra)
        plain = ok(flagged, path, base)
        assert dropped["choices"] == plain["choices"]
        assert dropped["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        refused = post(server, path, body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "frobnicate"
        caplog.clear()


def test_request_id_headers(server, flagged):
    resp = post(flagged, C, BASE, headers={"X-Request-Id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123" and resp.json()["id"] == "cmpl-abc-123"
    fresh = post(flagged, CHAT, CHAT_BASE)
    assert fresh.json()["id"] == f"chatcmpl-{fresh.headers['x-request-id']}"
    with httpx.stream("POST", f"{flagged.base_url}{C}", json={**BASE, "stream": True},
                      headers={"X-Request-Id": "s-1"}, timeout=60) as r:
        assert r.headers["x-request-id"] == "s-1" and '"id":"cmpl-s-1"' in r.read().decode()
    assert httpx.get(f"{flagged.base_url}/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"
    assert "x-request-id" not in post(server, C, BASE).headers
    # vLLM names the request after the header with or without the flag.
    assert post(server, C, BASE, headers={"X-Request-Id": "q-1"}).json()["id"] == "cmpl-q-1"
    err = post(flagged, C, BASE, headers={"X-Request-Id": "has space"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "X-Request-Id"


def test_prompt_tokens_details_from_the_engines_count():
    prompt = Prompt(list(b"Hello"), "Hello")
    assert make_usage([prompt], 3, 4).model_dump(mode="json")["prompt_tokens_details"] == {"cached_tokens": 4}
    # None (not asked) or 0 (none cached, as vLLM leaves it out): no details.
    assert "prompt_tokens_details" not in make_usage([prompt], 3, 0).model_dump(mode="json")
    assert "prompt_tokens_details" not in make_usage([prompt], 3).model_dump(mode="json")
    out = RequestOutput("r", "Hello", prompt.token_ids, [CompletionOutput(0)], True, num_cached_tokens=16)
    assert out.num_cached_tokens == 16


def test_prompt_tokens_details_on_a_prefix_cache_hit(flagged):
    body = {**BASE, "prompt": "abcdefghij" * 5, "max_tokens": 2}
    first = ok(flagged, C, body)
    again = ok(flagged, C, body)
    assert "prompt_tokens_details" not in first["usage"]  # nothing cached yet: left out, as vLLM does
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32  # three full blocks of 16


def test_cache_salt_shares_cached_prompts_only_within_a_salt(flagged):
    """vLLM's ``cache_salt``: a salted prompt takes no hit from the same
    prompt cached unsalted or under another salt, and hits under its own;
    the route (with the Responses route's) passes it, and an empty one is a
    400."""
    body = {**BASE, "prompt": "klmnopqrst" * 5, "max_tokens": 2}

    def cached(**salt) -> int:
        usage = ok(flagged, C, {**body, **salt})["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    assert cached() == 0
    assert cached() >= 32
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") >= 32
    chat = ok(flagged, CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "uvwxyz" * 8}],
                              "cache_salt": "tenant-c"})
    assert "prompt_tokens_details" not in chat["usage"]
    again = ok(flagged, CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "uvwxyz" * 8}],
                               "cache_salt": "tenant-c"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    r = post(flagged, C, {**body, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# -- 9. forced tool calls ------------------------------------------------------------------------

UNIT_TOOL = {"type": "function", "function": {"name": "temperature", "parameters": {
    "type": "object", "$defs": {"Unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"], "additionalProperties": False}}}
# Whitespace held off, or the random model pads the JSON past any budget.
FREE = {"ignore_eos": False, "allowed_token_ids": None, "max_tokens": 120,
        "logit_bias": {str(ord(c)): -100 for c in " \t\r\n"}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "temperature"}}],
                         ids=["required", "named"])
def test_forced_call_with_defs_and_ref(server, choice):
    # One call: left free, the random model repeats calls until the budget ends.
    body = {**CHAT_BASE, **FREE, "tools": [UNIT_TOOL], "tool_choice": choice, "parallel_tool_calls": False}
    out = ok(server, CHAT, body)["choices"][0]
    (call,) = out["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["unit"] in ("celsius", "kelvin")
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == ""


@pytest.mark.slow
def test_server_flags_on_the_command_line(tiny_model, tmp_path):
    from server_utils import free_port, start_subprocess_server, wait_healthy

    port = free_port()
    args = [tiny_model("llama"), "--max-model-len", "256", "--num-kv-blocks", "64", "--device", "cpu",
            "--swap-space", "0", "--return-tokens-as-token-ids", "--enable-force-include-usage",
            "--enable-request-id-headers", "--enable-prompt-tokens-details", "--max-logprobs", "5",
            "--enable-tokenizer-info-endpoint", "--ignore-unknown-fields"]
    proc = start_subprocess_server(args, port, tmp_path / "server.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        resp = httpx.post(f"{base}{C}", json={**BASE, "logprobs": 0}, headers={"X-Request-Id": "cli-1"}, timeout=60)
        assert resp.headers["x-request-id"] == "cli-1" and resp.json()["id"] == "cmpl-cli-1"
        assert all(t.startswith("token_id:") for t in resp.json()["choices"][0]["logprobs"]["tokens"])
        with httpx.stream("POST", f"{base}{C}", json={**BASE, "stream": True}, timeout=60) as r:
            last = [ln for ln in r.iter_lines() if ln.startswith("data: {")][-1]
        assert json.loads(last[6:])["usage"]["completion_tokens"] == 8
        assert httpx.post(f"{base}{C}", json={**BASE, "logprobs": 5}, timeout=60).status_code == 200
        capped = httpx.post(f"{base}{C}", json={**BASE, "logprobs": 6}, timeout=60).json()["error"]
        assert capped["message"].endswith("max allowed: 5") and capped["param"] == "logprobs"
        assert httpx.get(f"{base}/tokenizer_info", timeout=10).json()["tokenizer_class"]
        assert httpx.post(f"{base}{C}", json={**BASE, "frobnicate": 1}, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# -- 9. logprob_token_ids, -1 and --max-logprobs ------------------------------------------

ASKED = [ord("q"), ord("z")]


def test_logprob_token_ids_replace_the_top_n(server, whole_vocab):
    as_ids = {"return_tokens_as_token_ids": True}
    got = ok(server, C, {**BASE, **as_ids, "logprobs": 3, "logprob_token_ids": ASKED})["choices"][0]["logprobs"]
    full = ok(whole_vocab, C, {**BASE, **as_ids, "logprobs": -1})["choices"][0]["logprobs"]
    asked = {f"token_id:{t}" for t in ASKED}
    for tok, top, all_of_them in zip(got["tokens"], got["top_logprobs"], full["top_logprobs"]):
        assert set(top) == {tok} | asked  # the sampled token and the asked ids, not the top 3
        assert top == pytest.approx({k: all_of_them[k] for k in top}, abs=1e-5)
    chat = ok(server, CHAT, {**CHAT_BASE, "logprobs": True, "top_logprobs": 5, "logprob_token_ids": ASKED})
    for pos in chat["choices"][0]["logprobs"]["content"]:
        listed = [t["token"] for t in pos["top_logprobs"]]
        assert listed == list(dict.fromkeys([pos["token"], "q", "z"]))  # vLLM's order: sampled, then as asked
        assert pos["top_logprobs"][0]["logprob"] == pos["logprob"]


@pytest.mark.parametrize("path, body", [
    (C, {"logprob_token_ids": ASKED}),  # needs logprobs
    (C, {"logprobs": 0, "logprob_token_ids": []}),
    (C, {"logprobs": 0, "logprob_token_ids": [VOCAB]}),
    (C, {"logprobs": 0, "logprob_token_ids": list(range(129))}),
    (CHAT, {"logprob_token_ids": ASKED}),
    (CHAT, {"logprobs": True, "logprob_token_ids": ASKED, "use_beam_search": True, "n": 2}),
], ids=["no-logprobs", "empty", "past-vocab", "over-128", "chat-no-logprobs", "beam-search"])
def test_bad_logprob_token_ids_are_400(server, path, body):
    resp = post(server, path, {**(BASE if path == C else CHAT_BASE), **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "logprob_token_ids"


@pytest.mark.parametrize("path, body, param, message", [
    (C, {"logprobs": -1}, "logprobs", f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20"),
    (C, {"logprobs": 21}, "logprobs", "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
     f"Requested sample logprobs of {VOCAB}, which is greater than max allowed: 20"),
    (C, {"prompt_logprobs": -1}, "prompt_logprobs",
     f"Requested prompt logprobs of {VOCAB}, which is greater than max allowed: 20"),
    (C, {"echo": True, "logprobs": -1}, "logprobs", None),
    (C, {"logprobs": -2}, "logprobs", None),
    (CHAT, {"logprobs": True, "top_logprobs": -2}, "top_logprobs", None),
])
def test_logprobs_past_the_cap_are_400_as_vllm_says(server, path, body, param, message):
    resp = post(server, path, {**(BASE if path == C else CHAT_BASE), **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and (message is None or err["message"] == message), err


def test_minus_one_is_the_whole_vocabulary(whole_vocab):
    import math

    body = {**BASE, "max_tokens": 3, "return_tokens_as_token_ids": True}
    lp = ok(whole_vocab, C, {**body, "logprobs": -1})["choices"][0]["logprobs"]
    assert all(len(top) == VOCAB for top in lp["top_logprobs"])
    assert all(sum(map(math.exp, top.values())) == pytest.approx(1.0, abs=1e-3) for top in lp["top_logprobs"])
    chat = ok(whole_vocab, CHAT, {**CHAT_BASE, "max_tokens": 3, "logprobs": True, "top_logprobs": -1})
    assert all(len(pos["top_logprobs"]) == VOCAB for pos in chat["choices"][0]["logprobs"]["content"])
    prompt = ok(whole_vocab, C, {**body, "prompt_logprobs": -1})["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and all(len(entry) == VOCAB for entry in prompt[1:])


# -- 10. /tokenizer_info -------------------------------------------------------------------


def test_tokenizer_info_behind_its_flag(server, flagged, model_dir):
    from transformers import AutoTokenizer

    assert httpx.get(f"{server.base_url}/tokenizer_info").status_code == 404
    resp = httpx.get(f"{flagged.base_url}/tokenizer_info")
    assert resp.status_code == 200, resp.text
    info = resp.json()
    assert info["tokenizer_class"] == type(AutoTokenizer.from_pretrained(model_dir)).__name__
    assert info["chat_template"] == THINKING_TEMPLATE
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>"
    assert not [k for k in info if k.endswith("_file")]  # no paths of the server's disk


# -- 11. /v1/chat/completions/batch -------------------------------------------------------------

CONVERSATIONS = [MSGS, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "xyz"}]]


def test_chat_batch_answers_each_conversation(server):
    shared = {k: v for k, v in CHAT_BASE.items() if k != "messages"}
    shared.update(logprobs=True, top_logprobs=1, return_token_ids=True)
    singles = [ok(server, CHAT, {**shared, "messages": conv}) for conv in CONVERSATIONS]
    batch = ok(server, "/v1/chat/completions/batch", {**shared, "messages": CONVERSATIONS})
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for got, single in zip(batch["choices"], singles):
        want = single["choices"][0]
        assert got["message"] == want["message"] and got["token_ids"] == want["token_ids"]
        assert got["finish_reason"] == want["finish_reason"]
        # Batched together the logits differ in the last float bits.
        pairs = list(zip(got["logprobs"]["content"], want["logprobs"]["content"], strict=True))
        assert all(a["token"] == b["token"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
                   and [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
                   for a, b in pairs)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)


def test_chat_batch_takes_the_best_of_each_conversations_candidates(server):
    """best_of: one reply a conversation, the one its single request
    (the same seed) returns; every candidate billed."""
    shared = {k: v for k, v in CHAT_BASE.items() if k != "messages"}
    shared.update(temperature=1.0, seed=11, best_of=3)
    singles = [ok(server, CHAT, {**shared, "messages": conv}) for conv in CONVERSATIONS]
    batch = ok(server, "/v1/chat/completions/batch", {**shared, "messages": CONVERSATIONS})
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["message"] for c in batch["choices"]] == [s["choices"][0]["message"] for s in singles]
    assert batch["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    assert all(s["usage"]["completion_tokens"] == 3 * shared["max_tokens"] for s in singles)


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),
    ({"stream": True}, "stream"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"tools": [UNIT_TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [MSGS, []]}, "messages"),
    ({"messages": MSGS}, "messages"),  # one conversation, not a list of them
    ({"top_logprobs": 2}, "top_logprobs"),  # each conversation's own validation
])
def test_chat_batch_refuses_as_vllm_does(server, body, param):
    resp = post(server, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
