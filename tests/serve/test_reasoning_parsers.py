"""The reasoning parsers beyond ``<think>`` models' two (``mistral``,
``granite``, ``ernie45``, ``glm45``, ``olmo3``): each reply split whole and
at every streamed chunking, thinking switches, prompts that closed the
thinking, token counts, the tokenizer checks at start, the requests a text
marker cannot serve (a 400 naming the field), and a special-token marker kept
through a real server's detokenizer.

No model hub: the tokenizers are the tiny byte-level one with each family's
markers added as the real models have them (Magistral's ``[THINK]`` and
GLM's ``<think>`` special, ERNIE's plain; Granite's phrases and OLMo 3's
``<think>`` are text).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from tokenizers import AddedToken

from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, build_tiny_model, save_byte_tokenizer
from fluidserve.serve.api import ServerSettings
from fluidserve.serve.errors import APIError
from fluidserve.serve.inputs import InputProcessor, ModelInfo
from fluidserve.serve.protocol import ChatCompletionRequest
from fluidserve.serve.reasoning import REASONING_PARSERS, Reasoning, ReasoningParser, ReasoningStream
from server_utils import start_server

MSGS = [{"role": "user", "content": "Think, then answer."}]
LETTERS = list(range(ord("a"), ord("z") + 1))
PAD = 258  # <|pad|>: a special token of the byte tokenizer that is no marker
GLM_TOOL_TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
# Each family's added tokens: (special ones, plain ones), as its real tokenizer has them.
ADDED = {
    "mistral": (["[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]"], []),
    "glm45": (["<think>", "</think>", "<|user|>", "<|assistant|>", *GLM_TOOL_TAGS], []),
    "ernie45": ([], ["<think>", "</think>", "<response>", "</response>"]),
    "granite": ([], []),
    "olmo3": ([], []),
}


def add_markers(path, special: list[str], plain: list[str]):
    """The byte tokenizer saved at ``path`` with ``special`` added as special
    tokens and ``plain`` as plain added ones (ids from BYTE_VOCAB_SIZE on,
    in that order)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if special:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    if plain:
        tok.add_tokens(plain)
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    out = {}
    for name, (special, plain) in ADDED.items():
        path = tmp_path_factory.mktemp(f"tok-{name}")
        save_byte_tokenizer(path)
        out[name] = add_markers(path, special, plain)
    return out


@pytest.fixture(scope="module")
def parsers(tokenizers) -> dict[str, ReasoningParser]:
    return {name: ReasoningParser.load(name, tok) for name, tok in tokenizers.items()}


def split_all_ways(parser: ReasoningParser, reply: str) -> tuple[str, str | None]:
    """The whole reply's split, after checking that the stream gives the same
    at every chunk size and at every single cut into two deltas."""
    whole = Reasoning(parser).split(reply)
    chunkings = [[reply[i:i + size] for i in range(0, len(reply), size)] for size in range(1, len(reply) + 1)]
    chunkings += [[reply[:cut], reply[cut:]] for cut in range(len(reply) + 1)]
    for deltas in chunkings:
        stream = ReasoningStream(parser)
        pieces = [stream.step(d, last=i == len(deltas) - 1) for i, d in enumerate(deltas)]
        reasoning, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        assert (reasoning, None if stream.in_reasoning and not content else content) == whole, deltas
    return whole


@pytest.mark.parametrize("name, reply, reasoning, content", [
    # Content until [THINK]; its trailing whitespace dropped; later markers.
    ("mistral", "[THINK]plan[/THINK]answer", "plan", "answer"),
    ("mistral", "[THINK]a  plan \n[/THINK]answer", "a  plan", "answer"),
    ("mistral", "no thinking here", "", "no thinking here"),
    ("mistral", "[THINK]still thinking", "still thinking", None),
    ("mistral", "hi[THINK]plan", "plan", "hi"),  # cut short: what came before stays content
    ("mistral", "[THINK]a [THINK]b[/THINK]c[/THINK]d[THINK]e [/THINK]f", "a be", "cdf"),
    ("mistral", "[THINK]a[TOOL_CALLS]f[ARGS]{}", "a", "[TOOL_CALLS]f[ARGS]{}"),
    ("mistral", "[THINK]a<|pad|>b[/THINK]c<|im_end|>d<|pad", "ab", "cd<|pad"),  # other specials dropped
    # Granite: only a reply that opens with the phrase thinks.
    ("granite", "Here is my thought process:\nplan\nHere is my response:\nanswer", "\nplan\n", "\nanswer"),
    ("granite", "Here's my thought process: a Here's my response: b", " a ", " b"),
    ("granite", "Here is my thought process: a Here is my thought process: b Here is my response: c "
                "Here is my response: d", " a Here is my thought process: b ", " c Here is my response: d"),
    ("granite", "Here is my thought process: still going", " still going", None),
    ("granite", "Here is my thought", "", "Here is my thought"),
    ("granite", " Here is my thought process: a Here is my response: b", "",
     " Here is my thought process: a Here is my response: b"),
    ("granite", "Just the answer.", "", "Just the answer."),
    # ERNIE: R1's split, the answer unwrapped from <response>.
    ("ernie45", "abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("ernie45", "abc\n</think>\ndef", "abc\n", "\ndef"),
    ("ernie45", "<think>abc</think>def", "abc", "def"),
    ("ernie45", "abc", "abc", None),
    ("ernie45", "a</think><response>x</response>y</response>z", "a", "x</response>y"),
    ("ernie45", "a</think> <response>cut short", "a", "cut short"),
    ("ernie45", "a</think>pre<response>x</response>", "a", "pre<response>x</response>"),
    ("ernie45", "a</think>\n\n", "a", "\n\n"),
    ("ernie45", "a</think>b</think>c", "a", "b</think>c"),
    # GLM: R1's split, later markers as Magistral's, a tool call ends the thinking.
    ("glm45", "plan</think>answer", "plan", "answer"),
    ("glm45", "<think>plan\n</think>answer", "plan", "answer"),
    ("glm45", "plan", "plan", None),
    ("glm45", "a</think>b</think>c<think>d</think>e", "ad", "bce"),
    ("glm45", "a<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>", "a",
     "<tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>"),
    ("glm45", "a<|pad|>b</think>c<|user|>", "ab", "c"),
    # OLMo 3: R1's split on text markers.
    ("olmo3", "plan</think>answer", "plan", "answer"),
    ("olmo3", "<think>plan</think>answer", "plan", "answer"),
    ("olmo3", "a</thin", "a</thin", None),
    ("olmo3", "a</think>b</think>c<think>", "a", "b</think>c<think>"),
])
def test_whole_and_streamed_splits_agree(parsers, name, reply, reasoning, content):
    assert split_all_ways(parsers[name], reply) == (reasoning, content)


def test_markers_as_the_tokenizers_have_them(parsers, tokenizers):
    """Magistral's and GLM's markers are special tokens: kept in the reply,
    every other special token's text dropped (not the family's tool tags);
    ERNIE's are plain tokens; Granite's and OLMo 3's are text."""
    mistral, glm, ernie = parsers["mistral"], parsers["glm45"], parsers["ernie45"]
    assert (mistral.start_id, mistral.end_id, mistral.keeps_special_tokens) == (BYTE_VOCAB_SIZE,
                                                                                BYTE_VOCAB_SIZE + 1, True)
    assert {"<|pad|>", "<|eos|>"} <= set(mistral.drops) and not {"[THINK]", "[TOOL_CALLS]"} & set(mistral.drops)
    assert glm.keeps_special_tokens and "<|user|>" in glm.drops and not set(GLM_TOOL_TAGS) & set(glm.drops)
    assert glm.boundary_ids == {tokenizers["glm45"].convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>")}
    assert (ernie.start_id, ernie.end_id, ernie.keeps_special_tokens, ernie.drops) == (
        BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1, False, ())
    for name in ("granite", "olmo3"):
        assert (parsers[name].start_id, parsers[name].end_id, parsers[name].keeps_special_tokens) == (None, None, False)
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "mistral", "granite", "ernie45", "glm45", "olmo3"}


def test_the_tokenizer_checks_at_start(tokenizers, tmp_path):
    """A tokenizer without the family's marker tokens is refused; so is one
    that does not give a text marker back (a special ``<think>`` for olmo3)."""
    plain = tokenizers["olmo3"]  # the byte tokenizer: no added markers
    for name, marker in (("mistral", "[THINK]"), ("glm45", "<think>"), ("ernie45", "<think>")):
        with pytest.raises(ValueError, match=re.escape(f"no {marker!r} token")):
            ReasoningParser.load(name, plain)
    save_byte_tokenizer(tmp_path)
    special_think = add_markers(tmp_path, ["<think>", "</think>"], [])
    with pytest.raises(ValueError, match="does not give '<think>' back as text"):
        ReasoningParser.load("olmo3", special_think)
    assert ReasoningParser.load("deepseek_r1", special_think).keeps_special_tokens  # a special marker is kept


def test_thinking_switches(parsers):
    """glm45: off once ``thinking`` or ``enable_thinking`` is set and neither
    is true; granite: on only with ``thinking`` true; the others think
    whatever the template variables say."""
    glm, granite = parsers["glm45"], parsers["granite"]
    assert glm.thinking({}) and glm.thinking({"enable_thinking": None})
    assert not glm.thinking({"enable_thinking": False}) and not glm.thinking({"thinking": False})
    assert glm.thinking({"thinking": False, "enable_thinking": True})
    assert granite.thinking({"thinking": True}) and not granite.thinking({}) and not granite.thinking({"thinking": 0})
    for name in ("mistral", "ernie45", "olmo3"):
        assert parsers[name].thinking({"enable_thinking": False, "thinking": False})


def test_prompts_that_closed_the_thinking(parsers, tokenizers):
    """glm45 reads only the prompt's last turn; olmo3 reads the prompt's text;
    a reply that begins as content (mistral, granite) is never closed."""
    glm = parsers["glm45"]
    user, assistant = (tokenizers["glm45"].convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>"))
    think, end = glm.start_id, glm.end_id
    assert glm.ended_in([assistant, think, end, 7])
    assert not glm.ended_in([assistant, think, end, 7, user, 8, assistant])  # an earlier turn's
    assert not glm.ended_in([assistant, think, 7])
    olmo = parsers["olmo3"]
    assert olmo.ended_in([], "<|im_start|>assistant\n<think>x</think>") and not olmo.ended_in([], "a</think> <think>")
    assert not olmo.ended_in([], "no markers")
    mistral = parsers["mistral"]
    assert not mistral.ended_in([mistral.start_id, mistral.end_id])
    assert not parsers["granite"].ended_in([], "Here is my thought process: Here is my response:")


def test_reasoning_tokens(parsers, tokenizers):
    """Marker tokens: the tokens inside the thinking. Text markers: the tokens
    that end inside the reasoning's text (one a character here)."""
    m = parsers["mistral"]
    think, end, calls = m.start_id, m.end_id, m.implicit_end_id
    assert m.reasoning_tokens([1, 2, think, 3, 4, end, 5, think, 6, end, 7]) == 3  # content before, two spans
    assert m.reasoning_tokens([think, 3, calls, 4]) == 1 and m.reasoning_tokens([1, 2, 3]) == 0
    g = parsers["glm45"]
    assert g.reasoning_tokens([3, 4, g.end_id, 5, g.end_id, g.start_id, 6]) == 3
    e = parsers["ernie45"]
    assert e.reasoning_tokens([e.start_id, 3, 4, e.end_id, 5, e.start_id, 6]) == 2
    for name, text, count in (("granite", "Here is my thought process:plan Here is my response:ok", 5),
                              ("granite", "Just the answer.", 0),
                              ("granite", "Here's my thought process:abc", 3),
                              ("olmo3", "<think>plan</think>answer", 4),
                              ("olmo3", "plan</think>answer", 4),
                              ("olmo3", "never closed", 12)):
        ids = tokenizers[name].encode(text, add_special_tokens=False)
        assert parsers[name].reasoning_tokens(ids) == count, text
    # A character of several bytes counts by the tokens it ends on: "é" is two.
    ids = tokenizers["olmo3"].encode("é</think>x", add_special_tokens=False)
    assert len(ids) == 11 and parsers["olmo3"].reasoning_tokens(ids) == 2


def _processor(tokenizers, name: str, enable_in_reasoning: bool = False) -> InputProcessor:
    tok = tokenizers[name]
    parser = ReasoningParser.load(name, tok)
    return InputProcessor(tok, ModelInfo("m", 256, len(tok)), reasoning_parser=parser,
                          enable_in_reasoning=enable_in_reasoning)


def _chat(proc: InputProcessor, **body):
    return proc.chat(ChatCompletionRequest.model_validate({"messages": MSGS, "max_tokens": 4, **body}))


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"thinking_token_budget": 5}, "thinking_token_budget"),
])
@pytest.mark.parametrize("name, thinking", [("granite", {"chat_template_kwargs": {"thinking": True}}),
                                            ("olmo3", {})])
def test_text_markers_refuse_what_needs_the_end_token(tokenizers, name, thinking, body, param):
    """A grammar that waits for the end of the thinking, or a budget that
    forces it, needs that end as one token: a thinking request of a text
    marker parser asking for either is a 400 naming the field."""
    with pytest.raises(APIError) as err:
        _chat(_processor(tokenizers, name), **thinking, **body)
    assert (err.value.status, err.value.param) == (400, param)
    assert "in text" in err.value.message and err.value.message.startswith(param)


def test_text_markers_serve_what_does_not_wait_for_the_end(tokenizers):
    """Not thinking (granite without its switch, olmo3 after a prompt that
    closed the thinking), or a grammar over the whole reply
    (enable_in_reasoning): the constraint is served."""
    fmt = {"response_format": {"type": "json_object"}}
    off = _chat(_processor(tokenizers, "granite"), **fmt)
    assert off.reasoning is None and off.params.structured_outputs is not None
    assert _chat(_processor(tokenizers, "granite"), thinking_token_budget=5).params.thinking_token_budget is None
    closed = [*MSGS, {"role": "assistant", "content": "<think>x</think>"}]
    done = _processor(tokenizers, "olmo3").chat(ChatCompletionRequest.model_validate(
        {"messages": closed, "continue_final_message": True, "add_generation_prompt": False, **fmt}))
    assert done.reasoning is None and done.params.structured_outputs is not None
    whole = _chat(_processor(tokenizers, "olmo3", enable_in_reasoning=True), **fmt)
    assert whole.reasoning is not None and whole.params.structured_after_token_id is None


def test_special_markers_keep_special_tokens_in_a_thinking_reply(tokenizers):
    """A thinking request of a parser whose markers are special is decoded
    with special tokens kept (what the request asked overridden), and a
    grammar waits for the end token; a glm45 request with thinking off keeps
    the request's own setting."""
    inputs = _chat(_processor(tokenizers, "mistral"), skip_special_tokens=True,
                   response_format={"type": "json_object"}, thinking_token_budget=3)
    end = tokenizers["mistral"].convert_tokens_to_ids("[/THINK]")
    assert inputs.params.skip_special_tokens is False and inputs.params.structured_after_token_id == end
    assert (inputs.params.thinking_start_token_id, inputs.params.thinking_end_token_id) == (end - 1, end)
    off = _chat(_processor(tokenizers, "glm45"), chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning is None and off.params.skip_special_tokens is True
    plain = _chat(_processor(tokenizers, "ernie45"))
    assert plain.reasoning is not None and plain.params.skip_special_tokens is True


# -- through the server ------------------------------------------------------------


@pytest.fixture(scope="module")
def magistral_like(tmp_path_factory) -> str:
    """The tiny model with Magistral's markers as special tokens (ids 261-264)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-magistral"), "llama", vocab_size=BYTE_VOCAB_SIZE + 4)
    add_markers(path, ADDED["mistral"][0], [])
    return str(path)


def expected_mistral(token_ids: list[int]) -> tuple[str | None, str | None, int]:
    """(reasoning, content, reasoning tokens) as the reply's ids give them:
    content until [THINK], reasoning until [/THINK] (its closing spaces
    dropped), <|pad|> dropped anywhere."""
    think, end = BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1
    spans, content, thinking, count = [], "", False, 0
    for tok in token_ids:
        if tok == think:
            if not thinking:
                spans.append("")
            thinking = True
        elif tok == end:
            if thinking:
                spans[-1] = spans[-1].rstrip()
            thinking = False
        else:
            count += thinking
            if tok != PAD:
                if thinking:
                    spans[-1] += chr(tok)
                else:
                    content += chr(tok)
    if thinking:
        spans[-1] = spans[-1].rstrip()
    reasoning = "".join(spans)
    return reasoning or None, content or None, count


def test_special_markers_split_through_the_server(magistral_like):
    """Magistral-like replies (special [THINK] / [/THINK], steered to write
    them and the special <|pad|>): the detokenizer keeps the markers for the
    split, whole and streamed alike, and drops <|pad|>."""
    think, end = BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1
    srv = start_server(magistral_like, ServerSettings(reasoning_parser="mistral"))
    try:
        url = f"{srv.base_url}/v1/chat/completions"
        body = {"messages": MSGS, "max_tokens": 30, "n": 4, "seed": 3, "return_token_ids": True,
                "allowed_token_ids": LETTERS + [ord(" "), think, end, PAD],
                "logit_bias": {str(think): 3, str(end): 2}}
        whole = httpx.post(url, json=body, timeout=60).json()
        total, split = 0, 0
        for choice in whole["choices"]:
            reasoning, content, count = expected_mistral(choice["token_ids"])
            assert (choice["message"]["reasoning"], choice["message"]["content"]) == (reasoning, content)
            total += count
            split += bool(reasoning and content)
        assert split >= 2, "the steering should give replies that think and then answer"
        assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": total}

        streamed: dict[int, dict[str, str]] = {}
        with httpx.stream("POST", url, timeout=60, json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got = streamed.setdefault(c["index"], {"reasoning": "", "content": ""})
                        for key in got:
                            got[key] += c["delta"].get(key) or ""
        for choice in whole["choices"]:
            msg = choice["message"]
            assert streamed[choice["index"]] == {"reasoning": msg["reasoning"] or "",
                                                 "content": msg["content"] or ""}
    finally:
        srv.stop()


def test_text_marker_refusal_and_count_through_the_server(tiny_model):
    """olmo3 on the plain tiny model: a reply with no ``</think>`` is all
    reasoning, every token of it counted; a grammar waiting for the end is a
    400 in OpenAI's shape naming the field."""
    srv = start_server(tiny_model("llama"), ServerSettings(reasoning_parser="olmo3"))
    try:
        url = f"{srv.base_url}/v1/chat/completions"
        r = httpx.post(url, timeout=60, json={"messages": MSGS, "max_tokens": 12, "allowed_token_ids": LETTERS,
                                              "ignore_eos": True}).json()
        msg = r["choices"][0]["message"]
        assert msg["content"] is None and len(msg["reasoning"]) == 12
        assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
        bad = httpx.post(url, timeout=30, json={"messages": MSGS, "max_tokens": 4,
                                                "response_format": {"type": "json_object"}})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert (error["param"], error["type"]) == ("response_format", "invalid_request_error")
        assert "'</think>'" in error["message"]
    finally:
        srv.stop()
