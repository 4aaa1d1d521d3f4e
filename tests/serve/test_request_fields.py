"""Every request field OpenAI or vLLM defines for /v1/completions and
/v1/chat/completions, sent to a real server: each either changes the output
as specified or is refused with a 400 whose ``param`` names it. No silent 200.

The tiny model's byte tokenizer makes token ids readable: the id of a byte is
the byte, so ``allowed_token_ids`` of the lowercase letters gives text one
can cut stop strings and bad words from. A meta-test checks the table covers
every field the wire models know, so a new field cannot slip in untested.
"""

from __future__ import annotations

import json
from typing import Any, Callable, get_args

import httpx
import pytest

from fluidserve.engine import LLM, SamplingParams
from fluidserve.serve import protocol
from fluidserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from server_utils import start_server

EOS = 257  # "<|eos|>"
IM_END = 260  # "<|im_end|>"
LETTERS = list(range(ord("a"), ord("z") + 1))
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "abc"}]
BASE = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "allowed_token_ids": LETTERS}
CHAT_BASE = {"messages": MSGS, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "allowed_token_ids": LETTERS}


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), max_model_len=256)
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.fixture(scope="module")
def base(server) -> dict:
    """The greedy outputs every row is compared with."""
    out = {C: post(server, C, BASE).json(), CHAT: post(server, CHAT, CHAT_BASE).json()}
    text = out[C]["choices"][0]["text"]
    assert len(text) == 12 and set(text) <= set(map(chr, LETTERS)), text
    # Rows below cut pieces out of this text: it must not be one letter repeated.
    assert len(set(text[:6])) >= 3, text
    return out


def text_of(body: dict, i: int = 0) -> str:
    choice = body["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


# -- what each implemented field must do ------------------------------------
Check = Callable[[Any, dict, dict], None]  # (server, response body, baseline body)


def same_text(_s, body, b):
    assert text_of(body) == text_of(b)


UNMASKED = {"ignore_eos": False, "allowed_token_ids": None, "max_tokens": 150}
FLAG_SCHEMA = {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
               "additionalProperties": False}
FLAG_TOOL = {"type": "function", "function": {"name": "set_flag", "parameters": FLAG_SCHEMA}}


def check_one_of(*options: str) -> Check:
    def check(_s, body, _b):
        assert text_of(body) in options and body["choices"][0]["finish_reason"] == "stop", body
    return check


def check_regex(pattern: str) -> Check:
    def check(_s, body, _b):
        import re

        assert re.fullmatch(pattern, text_of(body)), body
    return check


def check_json_in(*options: str) -> Check:
    def check(_s, body, _b):
        assert json.loads(text_of(body)) in options, body
    return check


def check_flag_json(_s, body, _b):
    value = json.loads(text_of(body))
    assert list(value) == ["flag"] and isinstance(value["flag"], bool), body


def check_flag_tool_call(_s, body, _b):
    choice = body["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "set_flag"
    assert isinstance(json.loads(call["function"]["arguments"])["flag"], bool)


def differs(_s, body, b):
    assert text_of(body) != text_of(b)


def greedy_is_default_temperature(s, body, b):
    # temperature 0.7 with seed: a draw, reproducible with the same seed
    again = post(s, C, {**BASE, "temperature": 0.7, "seed": 5}).json()
    assert text_of(body) == text_of(again)


def stop_at(b_text: str, stop: str, include: bool) -> str:
    at = b_text.index(stop)
    return b_text[: at + len(stop)] if include else b_text[:at]


def check_stop(_s, body, b):
    stop = text_of(b)[3:5]
    assert text_of(body) == stop_at(text_of(b), stop, False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def check_include_stop(_s, body, b):
    stop = text_of(b)[3:5]
    assert text_of(body) == stop_at(text_of(b), stop, True)


def check_stop_token_ids(_s, body, b):
    first = text_of(b).index(text_of(b)[4])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ord(text_of(b)[4])
    assert text_of(body) == text_of(b)[:first]  # the stop token itself decodes to nothing shown
    assert body["usage"]["completion_tokens"] == first + 1


def check_n(_s, body, b):
    assert len(body["choices"]) == 2 and all(text_of(body, i) == text_of(b) for i in range(2))


def check_max_tokens(_s, body, b):
    assert text_of(body) == text_of(b)[:4] and body["choices"][0]["finish_reason"] == "length"


def check_min_tokens(_s, body, _b):
    # EOS is the only allowed token, but min_tokens holds it back: 3 other tokens first
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "stop"


def check_no_ignore_eos(_s, body, _b):
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"


def check_logit_bias(_s, body, _b):
    assert text_of(body) == "q" * 12


def check_allowed(_s, body, _b):
    assert set(text_of(body)) <= {"x", "y"} and len(text_of(body)) == 12


def check_bad_word_single(_s, body, b):
    banned = text_of(b)[0]
    assert banned not in text_of(body) and len(text_of(body)) == 12


def check_bad_word_pair(_s, body, b):
    pair = text_of(b)[1:3]
    assert pair not in text_of(body) and text_of(body)[:1] == text_of(b)[:1]


def check_specials_kept(_s, body, _b):
    assert text_of(body) == "<|eos|>" * 3


def check_specials_spaced(_s, body, _b):
    # The first one is spaced from the prompt text before it, as a whole decode would.
    assert text_of(body) == " <|eos|> <|eos|> <|eos|>"


def check_specials_skipped(_s, body, _b):
    assert text_of(body) == "" and body["usage"]["completion_tokens"] == 3


def check_truncate(s, body, _b):
    assert body["usage"]["prompt_tokens"] == 2
    direct = post(s, C, {**BASE, "prompt": "lo"}).json()
    assert text_of(body) == text_of(direct)


def check_truncate_right(s, body, _b):
    assert body["usage"]["prompt_tokens"] == 2
    assert text_of(body) == text_of(post(s, C, {**BASE, "prompt": "He"}).json())


def check_add_special_tokens(_s, body, b):
    # The byte tokenizer adds no BOS, so the prompt is the same either way.
    assert body["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert text_of(body) == text_of(b)


def check_request_id(_s, body, _b):
    assert body["id"] in ("cmpl-my-id.1", "chatcmpl-my-id.1")


def check_echo(_s, body, b):
    assert text_of(body) == "Hello" + text_of(b)


def check_logprobs(_s, body, _b):
    lp = body["choices"][0]["logprobs"]
    # The chosen token and the top 2 of the raw distribution (bytes that decode alike, as U+FFFD,
    # merge into one entry).
    assert len(lp["tokens"]) == 12 and all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
    assert len(lp["token_logprobs"]) == 12 and all(v <= 0 for v in lp["token_logprobs"])


def check_logprob_token_ids(_s, body, _b):
    # The asked-for ids replace the top N: each position lists the sampled token and them.
    lp = body["choices"][0]["logprobs"]
    assert all(set(top) == {tok, "q", "z"} for tok, top in zip(lp["tokens"], lp["top_logprobs"]))


def check_beam_width_one(s, body, _b):
    # One beam over the unmasked vocabulary is greedy decoding (tests/serve/test_beam_search.py has the rest).
    greedy = post(s, C, {**BASE, "allowed_token_ids": None}).json()
    assert text_of(body) == text_of(greedy) and len(body["choices"]) == 1


def check_two_beams(_s, body, _b):
    first, second = body["choices"]  # (bytes that are no whole character all read U+FFFD: compare ids)
    assert first["token_ids"] != second["token_ids"] and len(first["token_ids"]) == 12


def check_prompt_logprobs(_s, body, b):
    # vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}.
    entries = body["choices"][0]["prompt_logprobs"] if "text" in body["choices"][0] else body["prompt_logprobs"]
    assert len(entries) == b["usage"]["prompt_tokens"] and entries[0] is None
    assert all(1 <= len(e) <= 2 and all(v["logprob"] <= 0 and v["rank"] >= 1 for v in e.values())
               for e in entries[1:])
    assert text_of(body) == text_of(b)


def check_echo_logprobs(_s, body, b):
    lp = body["choices"][0]["logprobs"]
    assert text_of(body) == "Hello" + text_of(b)
    assert lp["tokens"][:5] == list("Hello") and len(lp["tokens"]) == 5 + 12
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])


def check_token_ids(_s, body, b):
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == list(b"Hello") and bytes(choice["token_ids"]).decode() == text_of(b)


def check_chat_token_ids(_s, body, b):
    assert len(body["prompt_token_ids"]) == b["usage"]["prompt_tokens"]
    assert bytes(body["choices"][0]["token_ids"]).decode() == text_of(b)


def check_tokens_as_ids(_s, body, b):
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{ord(c)}" for c in text_of(b)]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


def check_continued(_s, body, b):
    # The assistant turn "ab" is left open: no <|im_end|>, newline nor new header after it.
    assert body["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] + 2


def check_chat_echo(_s, body, _b):
    message = body["choices"][0]["message"]
    assert message["role"] == "user" and message["content"].startswith("abc") and len(message["content"]) == 15


def check_chat_logprobs(_s, body, _b):
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 12 and all(len(t["top_logprobs"]) == 2 for t in content)


def check_chat_logprobs_only(_s, body, _b):
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 12 and all(t["top_logprobs"] == [] for t in content)


def check_best_of_three(s, body, b):
    """One reply, the likeliest per token of the three the same seed makes
    (asked for whole, logprobs on), and all three billed."""
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 3 * 12
    three = post(s, C, {**BASE, "temperature": 1.0, "seed": 4, "n": 3, "logprobs": 0}).json()["choices"]
    assert len({c["text"] for c in three}) > 1  # the candidates differ: the pick is a choice

    def per_token(c: dict) -> float:
        return sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])

    assert choice["text"] == max(three, key=per_token)["text"]


def check_best_of_two_chat(_s, body, _b):
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["content"]
    assert body["usage"]["completion_tokens"] == 2 * 12


def check_max_completion_tokens(_s, body, b):
    assert text_of(body) == text_of(b)[:5] and body["usage"]["completion_tokens"] == 5


def check_no_generation_prompt(_s, body, b):
    # The template's "<|im_start|>assistant\n" is gone from the prompt.
    assert body["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] - 1 - len("assistant\n")


def check_model_name(s, body, _b):
    assert body["model"] == s.engine.model_name


def check_penalised(_s, body, b):
    assert text_of(body) != text_of(b)
    # With a strong penalty a letter that already occurred is less likely to recur.
    assert len(set(text_of(body))) >= len(set(text_of(b)))


# (name, endpoint, overrides of BASE / CHAT_BASE, check). ``fields`` lists the
# wire fields a row exercises, for the coverage meta-test.
ROWS: list[tuple[str, str, dict, Check, tuple[str, ...]]] = [
    ("model", C, {"model": "@MODEL"}, check_model_name, ("model",)),
    ("temperature", C, {"temperature": 0.7, "seed": 5}, greedy_is_default_temperature, ("temperature", "seed")),
    ("top_p_tiny", C, {"temperature": 1.0, "top_p": 1e-6, "seed": 1}, same_text, ("top_p",)),
    ("top_k_1", C, {"temperature": 1.0, "top_k": 1, "seed": 2}, same_text, ("top_k",)),
    ("min_p_1", C, {"temperature": 1.0, "min_p": 1.0, "seed": 3}, same_text, ("min_p",)),
    ("n", C, {"n": 2}, check_n, ("n",)),
    ("best_of_eq_n", C, {"n": 2, "best_of": 2}, check_n, ("best_of",)),
    ("best_of_ranked", C, {"best_of": 3, "temperature": 1.0, "seed": 4}, check_best_of_three, ("best_of",)),
    ("chat_best_of", CHAT, {"best_of": 2, "temperature": 1.0, "seed": 4}, check_best_of_two_chat, ("best_of",)),
    ("max_tokens", C, {"max_tokens": 4}, check_max_tokens, ("max_tokens",)),
    ("stop", C, {"stop": "@"}, same_text, ("stop",)),
    ("presence_penalty", C, {"presence_penalty": 2.0}, check_penalised, ("presence_penalty",)),
    ("frequency_penalty", C, {"frequency_penalty": 2.0}, check_penalised, ("frequency_penalty",)),
    ("repetition_penalty", C, {"repetition_penalty": 10.0}, check_penalised, ("repetition_penalty",)),
    ("min_tokens", C, {"ignore_eos": False, "allowed_token_ids": [EOS, ord("z")], "logit_bias": {str(EOS): 100},
                       "min_tokens": 3}, check_min_tokens, ("min_tokens", "ignore_eos")),
    ("no_ignore_eos", C, {"ignore_eos": False, "allowed_token_ids": [EOS]}, check_no_ignore_eos, ()),
    ("logit_bias", C, {"logit_bias": {str(ord("q")): 100}}, check_logit_bias, ("logit_bias",)),
    ("allowed_token_ids", C, {"allowed_token_ids": [ord("x"), ord("y")]}, check_allowed, ("allowed_token_ids",)),
    ("bad_words_one", C, {"bad_words": ["@FIRST"]}, check_bad_word_single, ("bad_words",)),
    ("bad_words_two", C, {"bad_words": ["@PAIR"]}, check_bad_word_pair, ()),
    ("stop_string", C, {"stop": ["@STOP"]}, check_stop, ()),
    ("include_stop_str", C, {"stop": ["@STOP"], "include_stop_str_in_output": True}, check_include_stop,
     ("include_stop_str_in_output",)),
    ("stop_token_ids", C, {"stop_token_ids": ["@TOK"]}, check_stop_token_ids, ("stop_token_ids",)),
    ("skip_special_false", C, {"allowed_token_ids": [EOS], "max_tokens": 3, "skip_special_tokens": False},
     check_specials_kept, ("skip_special_tokens",)),
    ("specials_skipped", C, {"allowed_token_ids": [EOS], "max_tokens": 3}, check_specials_skipped, ()),
    ("spaces_between", C, {"allowed_token_ids": [EOS], "max_tokens": 3, "skip_special_tokens": False,
                           "spaces_between_special_tokens": True}, check_specials_spaced,
     ("spaces_between_special_tokens",)),
    ("truncate_prompt_tokens", C, {"truncate_prompt_tokens": 2}, check_truncate, ("truncate_prompt_tokens",)),
    ("truncation_side_right", C, {"truncate_prompt_tokens": 2, "truncation_side": "right"}, check_truncate_right,
     ("truncation_side",)),
    ("add_special_tokens", C, {"add_special_tokens": True}, check_add_special_tokens, ("add_special_tokens",)),
    ("request_id", C, {"request_id": "my-id.1"}, check_request_id, ("request_id",)),
    ("priority_0", C, {"priority": 0}, same_text, ("priority",)),
    ("priority_later", C, {"priority": 10}, same_text, ()),
    ("class_offline", C, {"class": "offline"}, same_text, ("request_class",)),
    ("echo", C, {"echo": True}, check_echo, ("echo",)),
    ("logprobs", C, {"logprobs": 2}, check_logprobs, ("logprobs",)),
    ("echo_logprobs", C, {"echo": True, "logprobs": 1}, check_echo_logprobs, ()),
    ("prompt_logprobs", C, {"prompt_logprobs": 1}, check_prompt_logprobs, ("prompt_logprobs",)),
    ("logprob_token_ids", C, {"logprobs": 0, "logprob_token_ids": [ord("q"), ord("z")]}, check_logprob_token_ids,
     ("logprob_token_ids",)),
    ("use_beam_search", C, {"use_beam_search": True, "allowed_token_ids": None}, check_beam_width_one,
     ("use_beam_search",)),
    ("length_penalty", C, {"use_beam_search": True, "allowed_token_ids": None, "n": 2, "length_penalty": 0.5,
                        "return_token_ids": True},
     check_two_beams, ("length_penalty",)),
    ("prompt_ids", C, {"prompt": list(b"Hello")}, same_text, ("prompt",)),
    # Fields with no effect on generation by their own specification.
    ("user", C, {"user": "u-1"}, same_text, ("user",)),
    ("safety_identifier", C, {"safety_identifier": "s"}, same_text, ("safety_identifier",)),
    ("prompt_cache_key", C, {"prompt_cache_key": "k"}, same_text, ("prompt_cache_key",)),
    ("parallel_tool_calls", C, {"parallel_tool_calls": False}, same_text, ("parallel_tool_calls",)),
    ("stream_false", C, {"stream": False}, same_text, ("stream",)),
    # Chat.
    ("chat_messages", CHAT, {}, same_text, ("messages",)),
    ("chat_max_completion_tokens", CHAT, {"max_completion_tokens": 5}, check_max_completion_tokens,
     ("max_completion_tokens",)),
    ("chat_logprobs", CHAT, {"logprobs": True, "top_logprobs": 2}, check_chat_logprobs, ("top_logprobs",)),
    ("chat_logprobs_only", CHAT, {"logprobs": True}, check_chat_logprobs_only, ()),
    ("chat_no_generation_prompt", CHAT, {"add_generation_prompt": False}, check_no_generation_prompt,
     ("add_generation_prompt",)),
    ("chat_stop_token_ids", CHAT, {"stop_token_ids": ["@TOK"]}, check_stop_token_ids, ()),
    ("chat_request_id", CHAT, {"request_id": "my-id.1"}, check_request_id, ()),
    ("chat_logit_bias", CHAT, {"logit_bias": {str(ord("q")): 100}}, check_logit_bias, ()),
    ("chat_prompt_logprobs", CHAT, {"prompt_logprobs": 1}, check_prompt_logprobs, ()),
    ("return_token_ids", C, {"return_token_ids": True}, check_token_ids, ("return_token_ids",)),
    ("chat_return_token_ids", CHAT, {"return_token_ids": True}, check_chat_token_ids, ()),
    ("return_tokens_as_token_ids", C, {"logprobs": 1, "return_tokens_as_token_ids": True}, check_tokens_as_ids,
     ("return_tokens_as_token_ids",)),
    # A variable the template does not read changes nothing (test_vllm_parity.py has one it reads).
    ("chat_template_kwargs", CHAT, {"chat_template_kwargs": {"unused": 1}}, same_text, ("chat_template_kwargs",)),
    # No reasoning parser here: nothing to leave out (test_reasoning.py has the parsers).
    ("include_reasoning", CHAT, {"include_reasoning": False}, same_text, ("include_reasoning",)),
    # Which cached blocks a prompt may share, never its text (test_vllm_parity.py has the hits).
    ("cache_salt", C, {"cache_salt": "tenant"}, same_text, ("cache_salt",)),
    ("continue_final_message", CHAT, {"messages": [*MSGS, {"role": "assistant", "content": "ab"}],
                                      "add_generation_prompt": False, "continue_final_message": True},
     check_continued, ("continue_final_message",)),
    ("chat_echo", CHAT, {"echo": True, "add_generation_prompt": False}, check_chat_echo, ()),
    # Output constraints (tests/serve/test_structured_output.py has the rest). EOS
    # must be reachable, so these drop BASE's ignore_eos and letter mask.
    ("guided_choice", C, {**UNMASKED, "guided_choice": ["yes", "no"]}, check_one_of("yes", "no"), ("guided_choice",)),
    ("guided_regex", C, {**UNMASKED, "guided_regex": "[0-9]{4}"}, check_regex("[0-9]{4}"), ("guided_regex",)),
    ("guided_grammar", C, {**UNMASKED, "guided_grammar": 'root ::= "x" [0-9]'}, check_regex("x[0-9]"),
     ("guided_grammar",)),
    ("guided_json", C, {**UNMASKED, "guided_json": {"enum": ["on", "off"]}}, check_json_in("on", "off"),
     ("guided_json",)),
    ("structured_outputs", C, {**UNMASKED, "structured_outputs": {"choice": ["up", "down"]}},
     check_one_of("up", "down"), ("structured_outputs",)),
    ("response_format", C, {**UNMASKED, "response_format": {"type": "json_schema", "json_schema": {
        "name": "flag", "schema": FLAG_SCHEMA}}}, check_flag_json, ("response_format",)),
    ("chat_tools_named", CHAT, {**UNMASKED, "tools": [FLAG_TOOL],
                                "tool_choice": {"type": "function", "function": {"name": "set_flag"}}},
     check_flag_tool_call, ("tools", "tool_choice")),
]

# Known, not implemented: a value other than "off" is a 400 naming the field.
REFUSED: list[tuple[str, str, Any]] = [
    (C, "length_penalty", 0.5),  # without use_beam_search: nothing to act on
    (C, "logits_processors", ["x"]),
    (C, "kv_transfer_params", {"a": 1}),
    (C, "vllm_xargs", {"a": 1}),
    (C, "prompt_embeds", "AAAA"),
    (C, "mm_processor_kwargs", {"a": 1}),
    (C, "guided_decoding_backend", "outlines"),  # "xgrammar" and "auto" are what runs
    (C, "guided_whitespace_pattern", " "),
    (C, "structural_tag", "{}"),
    (C, "store", True),
    (C, "metadata", {"k": "v"}),
    (C, "service_tier", "flex"),
    (C, "suffix", "tail"),
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "prediction", {"type": "content", "content": "x"}),  # this server verifies no drafts
    (CHAT, "web_search_options", {"search_context_size": "low"}),
    (CHAT, "web_search_options", {}),  # a search with the defaults
    (CHAT, "reasoning_effort", "high"),  # the tiny model's template reads no effort
    (CHAT, "verbosity", "low"),
    (CHAT, "chat_template", "{{ messages }}"),  # without --trust-request-chat-template
    (CHAT, "documents", [{"title": "t", "text": "x"}]),  # the tiny model's template reads no documents
    (C, "session_id", "s-1"),
    (C, "stream_interval", 4),
    (C, "thinking_token_budget", 100),
    (C, "watermarking", True),
    (C, "logprob_token_ids", [1, 2]),
    (CHAT, "media_io_kwargs", {"image": {}}),
    (C, "routed_experts_prompt_start", 0),
    (C, "return_token_offsets", True),
    (CHAT, "return_prompt_text", True),
    (C, "mm_payload", {"a": 1}),
    (C, "return_mm_kwargs", True),
    (C, "ec_transfer_params", {"a": 1}),
    (C, "repetition_detection", {"max_pattern_size": 4}),
    (CHAT, "moderation", {"model": "omni-moderation-latest"}),
    (CHAT, "prompt_cache_options", {"ttl": "1h"}),
    (CHAT, "prompt_cache_retention", "24h"),
]
# ...and with its "off" value it is accepted.
OFF_VALUES: list[tuple[str, str, Any]] = [
    (C, "response_format", {"type": "text"}), (CHAT, "tools", []), (CHAT, "tool_choice", "none"),
    (C, "guided_decoding_backend", "xgrammar"),
    (C, "use_beam_search", False), (C, "length_penalty", 1.0), (C, "store", False),
    (C, "service_tier", "auto"), (CHAT, "modalities", ["text"]), (CHAT, "continue_final_message", False),
    (CHAT, "web_search_options", None),
]
# Fields of nested objects: messages[i] and stream_options.
REFUSED_NESTED: list[tuple[str, dict, str]] = [
    ("message_function_call",
 {"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f"}},
                                            {"role": "user", "content": "x"}]}, "function_call"),
    ("refusal", {"messages": [{"role": "assistant", "content": "x", "refusal": "no"},
                              {"role": "user", "content": "x"}]}, "refusal"),
    ("message_audio", {"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}},
                                    {"role": "user", "content": "x"}]}, "audio"),
    ("annotations", {"messages": [{"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]},
                                  {"role": "user", "content": "x"}]}, "annotations"),
    ("include_obfuscation", {"stream": True, "stream_options": {"include_obfuscation": True}}, "include_obfuscation"),
]


def fill(value: Any, b_text: str) -> Any:
    """Placeholders that depend on the baseline text."""
    marks = {"@STOP": b_text[3:5], "@FIRST": b_text[0], "@PAIR": b_text[1:3]}
    if isinstance(value, list):
        return [ord(b_text[4]) if v == "@TOK" else fill(v, b_text) for v in value]
    return marks.get(value, value) if isinstance(value, str) else value


@pytest.mark.parametrize("name, path, overrides, check", [r[:4] for r in ROWS], ids=[r[0] for r in ROWS])
def test_implemented_field_changes_output(server, base, name, path, overrides, check):
    b = base[path]
    body = {**(BASE if path == C else CHAT_BASE), **{k: fill(v, text_of(b)) for k, v in overrides.items()}}
    if body.get("model") == "@MODEL":
        body["model"] = server.engine.model_name
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    check(server, resp.json(), b)


@pytest.mark.parametrize("path, field, value", REFUSED, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in REFUSED])
def test_unimplemented_field_is_refused_by_name(server, path, field, value):
    body = {**(BASE if path == C else CHAT_BASE), field: value}
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and field in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, field, value", OFF_VALUES, ids=[f"{p.split('/')[-1]}-{f}" for p, f, _ in OFF_VALUES])
def test_off_value_of_unimplemented_field_is_accepted(server, base, path, field, value):
    resp = post(server, path, {**(BASE if path == C else CHAT_BASE), field: value})
    assert resp.status_code == 200, resp.text
    assert text_of(resp.json()) == text_of(base[path])


@pytest.mark.parametrize("name, overrides, field", REFUSED_NESTED, ids=[r[0] for r in REFUSED_NESTED])
def test_unimplemented_nested_field_is_refused_by_name(server, name, overrides, field):
    resp = post(server, CHAT, {**CHAT_BASE, **overrides})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] in ("messages", "stream_options") and field in err["message"], err


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_non_text_content_part_is_refused_by_its_type(server, part):
    """A content part this text-only server cannot take is a 400 naming the
    part and its type (not pydantic's account of the whole union); text
    parts beside it are not the problem."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "abc"}, part]}]
    resp = post(server, CHAT, {**CHAT_BASE, "messages": messages})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    assert f"content part 1 is of type '{part['type']}'" in err["message"] and "text parts only" in err["message"]
    ok = post(server, CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"priority": "urgent"}, "priority"),
    ({"priority": 3, "class": "online"}, "priority"),
    ({"request_id": "has space"}, "request_id"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 3, "n": 2, "use_beam_search": True}, "best_of"),
])
def test_bad_values_of_implemented_fields(server, body, param):
    resp = post(server, C, {**BASE, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("path, body, param, named", [
    (C, {**BASE, "max_token": 3}, "max_token", "'max_token'"),  # a misspelt max_tokens must not run to 12
    (CHAT, {**CHAT_BASE, "temprature": 1.5, "frobnicate": 1}, "temprature", "'temprature', 'frobnicate'"),
    (CHAT, {**CHAT_BASE, "stream_options": {"include_usage": True, "usage_every": 2}, "stream": True},
     "stream_options", "'usage_every'"),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "abc", "timestamp": 1}]}, "messages",
     "'timestamp'"),
])
def test_unknown_field_is_refused_by_name(server, base, path, body, param, named):
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert f"unrecognized request argument(s) supplied: {named}" in err["message"], err
    again = post(server, path, BASE if path == C else CHAT_BASE)
    assert again.status_code == 200 and text_of(again.json()) == text_of(base[path])


def test_every_field_of_the_openai_sdk_is_known():
    # Unknown keys are refused, so a field OpenAI defines must be implemented
    # or in a _REFUSED table (where its "off" value passes), never unknown.
    from openai.types import completion_create_params as completion
    from openai.types.chat import ChatCompletionStreamOptionsParam
    from openai.types.chat import chat_completion_message_param as message
    from openai.types.chat import completion_create_params as chat

    def known(model: type, refused: dict) -> set[str]:
        return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias} | set(refused)

    pairs = [(completion.CompletionCreateParamsBase, CompletionRequest, protocol._REFUSED_COMMON),
             (chat.CompletionCreateParamsBase, ChatCompletionRequest, protocol._REFUSED_CHAT),
             (ChatCompletionStreamOptionsParam, protocol.StreamOptions, protocol._REFUSED_STREAM_OPTIONS)]
    pairs += [(kind, protocol.ChatMessage, protocol._REFUSED_MESSAGE)
              for kind in get_args(message.ChatCompletionMessageParam)]
    for sdk_type, model, refused in pairs:
        assert set(sdk_type.__annotations__) - known(model, refused) == set(), sdk_type.__name__


@pytest.mark.parametrize("path", [C, CHAT])
def test_continuous_usage_stats_on_every_chunk(server, base, path):
    body = {**(BASE if path == C else CHAT_BASE), "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(server, path, body)
    final = base[path]["usage"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == final
    with_choices = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] <= 1
    plain = sse(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" not in c for c in plain[:-1])


def test_priority_maps_onto_the_request_class():
    klass = {p: CompletionRequest.model_validate({"prompt": "a", "priority": p}).klass for p in (-5, 0, 1, 7)}
    assert klass == {-5: "online", 0: "online", 1: "offline", 7: "offline"}
    assert CompletionRequest.model_validate({"prompt": "a"}).klass == "online"


def test_stream_stop_reason(server, base):
    stop = text_of(base[C])[3:5]
    chunks = sse(server, C, {**BASE, "stream": True, "stop": [stop]})
    last = [c for c in chunks if c["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop


def test_table_covers_every_known_field():
    exercised = {f for row in ROWS for f in row[4]} | {"stream_options"}  # streaming tests above
    # Refused here (REFUSED, or no reasoning parser), honoured in test_reasoning.py; refused here (no drafts
    # verified, no --trust-request-chat-template, a template that reads no documents), honoured in
    # test_server_speculative.py and test_vllm_parity.py.
    exercised |= {"reasoning_effort", "thinking_token_budget", "prediction", "chat_template", "documents"}
    refused = {f for _, f, _ in REFUSED}
    for model, refused_table in ((CompletionRequest, protocol._REFUSED_COMMON),
                                 (ChatCompletionRequest, protocol._REFUSED_CHAT)):
        fields = set(model.model_fields)
        assert fields - exercised == set(), f"{model.__name__} fields with no row"
        assert set(refused_table) - refused == set(), f"{model.__name__} refused fields with no row"
    nested = {r[2] for r in REFUSED_NESTED}
    assert set(protocol._REFUSED_MESSAGE) | set(protocol._REFUSED_STREAM_OPTIONS) <= nested


def test_generation_config_defaults_and_second_eos(tiny_model, tmp_path):
    """generation_config.json: its sampling fields become defaults, and an
    EOS id only it lists ends a sequence (as Llama-3 instruct's <|eot_id|>)."""
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model)
    llm = LLM(model=str(model), device="cpu", num_kv_blocks=64, max_model_len=256)
    ids = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    second = ids[5]
    k = ids.index(second)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, second], "top_k": 1}))
    llm = LLM(model=str(model), device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop"
    # min_tokens holds against the second EOS too; ignore_eos ignores it.
    held = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0, min_tokens=k + 2))[0].outputs[0]
    assert len(held.token_ids) > k + 1 and second not in held.token_ids[: k + 2]
    free = llm.generate("abc", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert free.token_ids == ids

    srv = start_server(str(model), max_model_len=256)
    try:
        # top_k 1 from the generation config: sampling at temperature 1 is greedy
        draws = {text_of(post(srv, C, {"prompt": "abc", "max_tokens": 8, "ignore_eos": True, "seed": s}).json())
                 for s in range(3)}
        greedy = text_of(post(srv, C, {"prompt": "abc", "max_tokens": 8, "ignore_eos": True, "temperature": 0}).json())
        assert draws == {greedy}
        # an explicit top_k wins over the default
        wide = {text_of(post(srv, C, {"prompt": "abc", "max_tokens": 8, "ignore_eos": True, "seed": s,
                                      "top_k": -1}).json()) for s in range(3)}
        assert len(wide) > 1
        stopped = post(srv, C, {"prompt": "abc", "max_tokens": 12, "temperature": 0}).json()
        assert stopped["usage"]["completion_tokens"] == k + 1
        assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["stop_reason"] is None
    finally:
        srv.stop()
