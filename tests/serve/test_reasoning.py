"""Reasoning output (``--reasoning-parser``): a thinking model's reply split
into ``reasoning`` and ``content``, whole and streamed, on the chat route,
the Responses API and the Batch API's chat lines; structured output that
starts once the thinking ends.

The model is the tiny random one with ``<think>`` and ``</think>`` added to
its byte vocabulary and a Qwen3-style template (thinking unless
``enable_thinking`` is false, earlier turns' reasoning rendered back). A
random model writes noise, so the tests steer it: sampling is limited to
letters and the two markers (``allowed_token_ids``) and the markers are
favoured (``logit_bias``); every reply is then checked against the split
its own token ids give.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from fluidserve.engine import SamplingParams
from fluidserve.engine.batch import SampleSpec
from fluidserve.engine.outputs import CompletionOutput, RequestOutput
from fluidserve.engine.sampling_params import StructuredOutputs
from fluidserve.engine.structured import StructuredDecoder
from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, build_tiny_thinking_model
from fluidserve.serve.api import ServerSettings
from fluidserve.serve.reasoning import Reasoning, ReasoningParser, ReasoningStream
from fluidserve.serve.render import ChatStreamer, chat_choices
from fluidserve.serve.tool_parsers import ToolMode
from server_utils import start_server

THINK, END = BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1  # the two added tokens' ids
EOS = 257
LETTERS = list(range(ord("a"), ord("z") + 1))
STEER = {"allowed_token_ids": LETTERS + [ord(" "), THINK, END], "logit_bias": {str(THINK): 2, str(END): 2}}
MSGS = [{"role": "user", "content": "Think, then answer."}]
# A random model pads JSON with whitespace up to its length: no whitespace
# tokens, so a document closes.
COMPACT = {"allowed_token_ids": list(range(33, 127)) + [END, EOS]}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                  "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    return str(build_tiny_thinking_model(tmp_path_factory.mktemp("tiny-thinking")))


@pytest.fixture(scope="module")
def tokenizer(thinking_model):
    from fluidserve.engine.loader import load_tokenizer

    return load_tokenizer(thinking_model)


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def server(request, thinking_model):
    srv = start_server(thinking_model, ServerSettings(reasoning_parser=request.param, tool_call_parser="hermes"))
    srv.extra["parser"] = request.param
    yield srv
    srv.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def expected_split(token_ids: list[int], parser: str) -> tuple[str | None, str | None, int]:
    """(reasoning, content, reasoning tokens) as the reply's own tokens give
    them: before the first ``</think>`` is reasoning, ``<think>`` dropped;
    qwen3 drops a later ``</think>`` too."""
    def text(ids):
        return "".join(chr(t) if t < 256 else "<think>" if t == THINK else "</think>" for t in ids)

    cut = token_ids.index(END) if END in token_ids else len(token_ids)
    head = [t for t in token_ids[:cut] if t != THINK]
    tail = token_ids[cut + 1:]
    if parser == "qwen3":
        tail = [t for t in tail if t != END]
    content = text(tail) if cut < len(token_ids) else None
    return text(head) or None, content or None, len(head)


# -- the splitting itself ----------------------------------------------------------


def _parser(name: str) -> ReasoningParser:
    return ReasoningParser(name, THINK, END)


@pytest.mark.parametrize("name, reply, reasoning, content", [
    ("deepseek_r1", "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", "still thinking", "still thinking", None),  # never closed: all reasoning
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "x</thing> y</think>z", "x</thing> y", "z"),  # held as a maybe-marker, then released
    ("deepseek_r1", "plan</think>", "plan", ""),
    ("qwen3", "a</think>b</think>c", "a", "bc"),  # a repeated end is dropped
    ("qwen3", "plan<tool_call>{}</tool_call>", "plan", "<tool_call>{}</tool_call>"),  # a call ends the thinking
    ("qwen3", "<think>x<think>y</think>z", "xy", "z"),
])
def test_split_is_the_same_whole_and_at_every_chunking(name, reply, reasoning, content):
    whole = Reasoning(_parser(name)).split(reply)
    assert whole == (reasoning, content)
    for size in range(1, len(reply) + 1):
        stream = ReasoningStream(_parser(name))
        pieces = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)] + [stream.finish()]
        assert "".join(p[0] for p in pieces) == reasoning, size
        assert "".join(p[1] for p in pieces) == (content or ""), size
        assert stream.in_reasoning == (content is None)


def test_parser_reads_the_prompt_and_counts_tokens(tokenizer):
    parser = ReasoningParser.load("deepseek_r1", tokenizer)
    assert (parser.start_id, parser.end_id) == (THINK, END)
    assert parser.ended_in([1, THINK, 5, END, 9]) and not parser.ended_in([1, END, THINK, 5]) \
        and not parser.ended_in([1, 2])
    assert parser.reasoning_tokens([THINK, 5, 6, END, 7, 8]) == 2
    assert parser.reasoning_tokens([5, 6, 7]) == 3
    qwen = ReasoningParser.load("qwen3", tokenizer)
    assert qwen.thinking({}) and not qwen.thinking({"enable_thinking": False})
    assert parser.thinking({"enable_thinking": False})  # R1 has no switch


def test_a_model_without_think_tokens_is_refused_at_start(tiny_model):
    from fluidserve.engine.loader import load_tokenizer

    with pytest.raises(ValueError, match="no '<think>' token"):
        ReasoningParser.load("qwen3", load_tokenizer(tiny_model("llama")))
    with pytest.raises(ValueError, match="not a parser"):
        ReasoningParser.load("granite4", load_tokenizer(tiny_model("llama")))


def _output(text: str, finish: str | None = "stop", delta: str | None = None) -> CompletionOutput:
    return CompletionOutput(0, text, finish_reason=finish, text_delta=text if delta is None else delta)


def test_tool_calls_are_read_from_the_content_after_the_thinking():
    """hermes under tool_choice "auto": a call written in the thinking is
    reasoning, the one after it a call; streamed the same."""
    reply = 'maybe <tool_call>{"name": "f", "arguments": {}}</tool_call></think>ok <tool_call>' \
            '{"name": "g", "arguments": {"x": 1}}</tool_call>'
    mode, reasoning = ToolMode("auto", parser="hermes"), Reasoning(_parser("deepseek_r1"))
    final = RequestOutput("r", None, [1], [_output(reply)], finished=True)
    (choice,) = chat_choices(final, top_n=None, decode=chr, tool_mode=mode, reasoning=reasoning)
    assert choice.message.reasoning.startswith("maybe <tool_call>")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("g", {"x": 1})]
    assert choice.message.content.strip() == "ok" and choice.finish_reason == "tool_calls"

    streamer = ChatStreamer("r", "m", top_n=None, decode=chr, tool_mode=mode, reasoning=reasoning)
    thought, names = "", []
    for i in range(0, len(reply), 5):
        last = i + 5 >= len(reply)
        out = RequestOutput("r", None, [1], [_output(reply[:i + 5], "stop" if last else None, reply[i:i + 5])],
                            finished=last)
        for chunk in streamer.chunk(out):
            delta = chunk.choices[0].delta
            thought += delta.reasoning or ""
            names += [c.function.name for c in delta.tool_calls or [] if c.function.name]
    assert thought == choice.message.reasoning and names == ["g"]


def test_grammar_waits_for_the_end_of_thinking(tokenizer):
    """The worker's matcher: no mask while the output has no ``</think>``,
    then the grammar's mask over the tokens after it only."""
    dec = StructuredDecoder(lambda: tokenizer, BYTE_VOCAB_SIZE + 2, [EOS])
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="(ab|cd)x"),
                            structured_after_token_id=END)

    def allowed(history: list[int]) -> set[int] | None:
        mask = dec.fill(["s"], [SampleSpec(params, None, output_token_ids=history)])
        if mask is None:
            return None
        return {t for t in range(BYTE_VOCAB_SIZE + 2) if (int(mask.bitmask[0, t // 32]) >> (t % 32)) & 1}

    assert allowed([]) is None
    assert allowed([ord("q"), ord("a")]) is None  # thinking: free, "a" is not the grammar's
    assert allowed([ord("q"), ord("a"), END]) == {ord("a"), ord("c")}
    assert allowed([ord("q"), ord("a"), END, ord("a")]) == {ord("b")}
    assert allowed([ord("q"), ord("a"), END, ord("a"), ord("b"), ord("x"), END]) == {EOS}  # caught up; one END
    dec.release(["s"])
    assert dec.num_active == 0 and not dec._gates


def test_grammar_starts_inside_the_drafts_at_the_end_of_thinking(tokenizer):
    """A sequence verifying drafts while still thinking: its rows up to the
    draft ``</think>`` are free, the row after it takes the grammar's first
    mask, the next ones the grammar after the drafts past the end; with no
    ``</think>`` among the drafts, no row is masked; the next step's matcher
    starts from the engine's outputs alone."""
    dec = StructuredDecoder(lambda: tokenizer, BYTE_VOCAB_SIZE + 2, [EOS])
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="(ab|cd)x"),
                            structured_after_token_id=END)

    def rows(history: list[int], draft: list[int]) -> list[set[int] | None]:
        n = len(draft) + 1
        mask = dec.fill(["s"] * n, [SampleSpec(params, None, output_token_ids=history)] * n, {"s": draft})
        if mask is None:
            return [None] * n
        return [None if j not in mask.rows else
                {t for t in range(BYTE_VOCAB_SIZE + 2) if (int(mask.bitmask[mask.rows.index(j), t // 32])
                                                            >> (t % 32)) & 1} for j in range(n)]

    q, a, b, c = (ord(ch) for ch in "qabc")
    assert rows([q], [a, END, c, q]) == [None, None, {a, c}, {ord("d")}, {ord("d")}]  # "q" refused: a copy
    assert rows([q], [a, b, q]) == [None] * 4
    assert rows([q, a, END], [a]) == [{a, c}, {b}]  # the end in the outputs: the sequence's own matcher
    dec.release(["s"])
    assert dec.num_active == 0


# -- through the server --------------------------------------------------------------


def test_reply_splits_as_its_tokens_say_whole_and_streamed(server):
    parser = server.extra["parser"]
    body = {"messages": MSGS, "max_tokens": 30, "n": 4, "seed": 1, "return_token_ids": True, **STEER}
    whole = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    total, both = 0, 0
    for choice in whole["choices"]:
        reasoning, content, count = expected_split(choice["token_ids"], parser)
        assert (choice["message"]["reasoning"], choice["message"]["content"]) == (reasoning, content)
        total += count
        both += bool(reasoning and content)
    assert both >= 2, "the steering should give replies that think and then answer"
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": total}

    streamed: dict[int, dict[str, str]] = {}
    usage = None
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                got = streamed.setdefault(c["index"], {"reasoning": "", "content": ""})
                for key in got:
                    got[key] += c["delta"].get(key) or ""
    for choice in whole["choices"]:
        msg = choice["message"]
        assert streamed[choice["index"]] == {"reasoning": msg["reasoning"] or "", "content": msg["content"] or ""}
    assert usage["completion_tokens_details"] == {"reasoning_tokens": total}

    hidden = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "include_reasoning": False},
                        timeout=60).json()
    assert [c["message"]["reasoning"] for c in hidden["choices"]] == [None] * 4
    assert [c["message"]["content"] for c in hidden["choices"]] == [c["message"]["content"]
                                                                    for c in whole["choices"]]


def test_thinking_off_is_all_content(server):
    """enable_thinking false (or reasoning_effort "none"): the template
    closes the thinking in the prompt, so qwen3 (by the switch) and
    deepseek_r1 (by the prompt's end) read the reply as content."""
    client = _client(server)
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=MSGS, max_tokens=12,
                                               temperature=0, extra_body={**STEER, **extra})
        msg = reply.choices[0].message
        assert msg.model_extra.get("reasoning") is None and msg.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    on = client.chat.completions.create(model=client.models.list().data[0].id, messages=MSGS, max_tokens=12,
                                        temperature=0, reasoning_effort="high", extra_body=STEER)
    off = client.chat.completions.create(model=client.models.list().data[0].id, messages=MSGS, max_tokens=12,
                                         temperature=0, extra_body=STEER)
    assert on.choices[0].message.model_extra["reasoning"] == off.choices[0].message.model_extra["reasoning"]


def test_structured_output_starts_after_the_thinking(server):
    """A favoured ``</think>`` ends the thinking at once and the grammar
    takes over: the content is a valid document. Unfavoured, the reply
    thinks freely: token for token what it is without the grammar."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    body = {"messages": MSGS, "max_tokens": 60, "temperature": 0, "return_token_ids": True, "response_format": fmt}
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                       json={**body, **COMPACT, "logit_bias": {str(END): 100}}).json()["choices"][0]
    assert reply["token_ids"][0] == END and reply["finish_reason"] == "stop"
    jsonschema.validate(json.loads(reply["message"]["content"]), ANSWER_SCHEMA)

    free = {"messages": MSGS, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    constrained = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "max_tokens": 20},
                             timeout=60).json()["choices"][0]
    plain = httpx.post(f"{server.base_url}/v1/chat/completions", json=free, timeout=60).json()["choices"][0]
    assert END not in plain["token_ids"]
    assert constrained["token_ids"] == plain["token_ids"] and constrained["message"]["content"] is None


def test_a_forced_tool_call_comes_after_the_thinking(server):
    tool = {"type": "function", "function": {"name": "answer", "parameters": ANSWER_SCHEMA}}
    body = {"messages": MSGS, "max_tokens": 60, "temperature": 0, "tools": [tool], **COMPACT,
            "tool_choice": {"type": "function", "function": {"name": "answer"}}, "logit_bias": {str(END): 100}}
    msg = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    (call,) = msg["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), ANSWER_SCHEMA)


def test_grammar_in_the_reasoning_with_enable_in_reasoning(thinking_model):
    """--structured-outputs-config '{"enable_in_reasoning": true}': the
    grammar holds from the first token, so ``</think>`` never comes and the
    whole (valid) document is read as reasoning."""
    srv = start_server(thinking_model, ServerSettings(reasoning_parser="deepseek_r1", enable_in_reasoning=True))
    try:
        body = {"messages": MSGS, "max_tokens": 60, "temperature": 0, "logit_bias": {str(END): 100}, **COMPACT,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}
        msg = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert msg["content"] is None
        jsonschema.validate(json.loads(msg["reasoning"]), ANSWER_SCHEMA)
    finally:
        srv.stop()


def test_thinking_token_budget_forces_the_end_of_thinking(server):
    """With the end marker never chosen freely, a budget of N gives N tokens
    of thinking, then ``</think>``, then the answer; a grammar takes over
    after it; -1 is no limit; 0 ends the thinking at once."""
    free = {"messages": MSGS, "max_tokens": 20, "temperature": 0, "return_token_ids": True,
            "allowed_token_ids": LETTERS + [END], "logit_bias": {str(END): -50}}
    url = f"{server.base_url}/v1/chat/completions"
    for budget in (0, 5):
        r = httpx.post(url, json={**free, "thinking_token_budget": budget}, timeout=60).json()
        choice = r["choices"][0]
        assert choice["token_ids"].index(END) == budget and choice["token_ids"].count(END) == 1
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget
        assert (choice["message"]["reasoning"] or "") == "".join(map(chr, choice["token_ids"][:budget]))
        assert choice["message"]["content"] == "".join(map(chr, choice["token_ids"][budget + 1:]))
    # A <think> the reply writes is no thinking, as usage counts it.
    thinks = {**free, "max_tokens": 40, "allowed_token_ids": LETTERS + [THINK, END],
              "logit_bias": {str(END): -50, str(THINK): 1}}
    r = httpx.post(url, json={**thinks, "thinking_token_budget": 5}, timeout=60).json()
    ids = r["choices"][0]["token_ids"]
    head = ids[:ids.index(END)]
    assert THINK in head and len(head) - head.count(THINK) == 5
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    unlimited = httpx.post(url, json={**free, "thinking_token_budget": -1}, timeout=60).json()["choices"][0]
    assert END not in unlimited["token_ids"] and unlimited["message"]["content"] is None

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}
    r = httpx.post(url, timeout=60, json={**free, **COMPACT, "max_tokens": 60, "response_format": fmt,
                                          "logit_bias": {str(END): -50}, "thinking_token_budget": 3}).json()
    choice = r["choices"][0]
    assert choice["token_ids"][3] == END and choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER_SCHEMA)


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"thinking_token_budget": -2}, "greater than or equal to -1"),
    ("/v1/chat/completions", {"thinking_token_budget": 1.5}, "integer"),
    ("/v1/completions", {"thinking_token_budget": 4}, "thinking_token_budget"),
])
def test_thinking_token_budget_refusals(server, path, body, words):
    base = {"messages": MSGS} if path.endswith("chat/completions") else {"prompt": "x"}
    r = httpx.post(f"{server.base_url}{path}", json={**base, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert words in r.json()["error"]["message"]


def test_reasoning_in_history_reaches_the_template(server):
    """An assistant turn's ``reasoning`` (or ``reasoning_content``) goes to
    the template under both names; only an assistant turn may carry it."""
    for key in ("reasoning", "reasoning_content"):
        messages = [*MSGS, {"role": "assistant", "content": "yes", key: "because"}, {"role": "user", "content": "ok"}]
        r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages, "return_token_strs": True},
                       timeout=30).json()
        text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()["prompt"]
        assert "<|im_start|>assistant\n<think>because</think>yes<|im_end|>" in text
    bad = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30,
                     json={"messages": [{"role": "user", "content": "x", "reasoning": "no"}]})
    assert bad.status_code == 400 and "reasoning" in bad.json()["error"]["message"]


def test_reasoning_fields_on_a_server_without_a_parser(tiny_model):
    srv = start_server(tiny_model("llama"))
    try:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30,
                       json={"messages": MSGS, "max_tokens": 2, "reasoning_effort": "low"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30,
                       json={"messages": MSGS, "max_tokens": 2, "thinking_token_budget": 4})
        assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
        ok = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30,
                        json={"messages": MSGS, "max_tokens": 2, "include_reasoning": False})
        assert ok.status_code == 200
        assert "completion_tokens_details" not in ok.json()["usage"]  # no parser: nothing to report
    finally:
        srv.stop()


def test_responses_api_gives_a_reasoning_item_whole_and_streamed(server):
    parser = server.extra["parser"]
    client = _client(server)
    model = client.models.list().data[0].id
    for seed in range(20):  # a seed whose reply thinks, then answers
        extra = {**STEER, "seed": seed, "temperature": 1.0}
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"messages": MSGS, "max_tokens": 30, "return_token_ids": True, **extra}).json()
        reasoning, content, count = expected_split(chat["choices"][0]["token_ids"], parser)
        if reasoning and content:
            break
    resp = client.responses.create(model=model, input="Think, then answer.", max_output_tokens=30, extra_body=extra)
    kinds = [item.type for item in resp.output]
    assert kinds[0] == "reasoning" and resp.output[0].content[0].text == reasoning
    assert resp.output_text == (content or "")
    assert resp.usage.output_tokens_details.reasoning_tokens == count

    events = list(client.responses.create(model=model, input="Think, then answer.", max_output_tokens=30,
                                          stream=True, extra_body=extra))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == reasoning and done.output_index == 0
    final = events[-1].response
    assert [item.type for item in final.output] == kinds and final.output_text == resp.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    # The kept turn carries its reasoning to the template; a reasoning input item does too.
    follow = client.responses.create(model=model, previous_response_id=resp.id, input="And?", max_output_tokens=2)
    items = [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]},
             {"role": "assistant", "content": content or ""}, {"role": "user", "content": "And?"}]
    again = client.responses.create(model=model, input=[{"role": "user", "content": "Think, then answer."}, *items],
                                    max_output_tokens=2)
    assert follow.usage.input_tokens == again.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
                {"role": "user", "content": "x"}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"role": "assistant", "content": "x"}]}, "input"),
    ({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
])
def test_responses_reasoning_refusals(server, body, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"max_output_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and any(w in error["message"] for w in ("reasoning", "summary", "logprobs"))


def test_batch_chat_lines_split_too(server):
    body = {"messages": [MSGS, MSGS], "max_tokens": 30, "seed": 1, "return_token_ids": True, **STEER}
    r = httpx.post(f"{server.base_url}/v1/chat/completions/batch", json=body, timeout=60).json()
    total = 0
    for choice in r["choices"]:
        reasoning, content, count = expected_split(choice["token_ids"], server.extra["parser"])
        assert (choice["message"]["reasoning"], choice["message"]["content"]) == (reasoning, content)
        total += count
    assert r["usage"]["completion_tokens_details"] == {"reasoning_tokens": total}
