"""Structured output and tools, end to end on the tiny random model.

A random model writes noise, so whatever valid JSON comes out is the
grammar's doing: JSON mode must parse, a json_schema reply must validate, a
forced tool call must carry schema-valid arguments — through the official
``openai`` client against a real server, streamed and not. Below the HTTP
layer: the matcher bookkeeping on the worker (rebuilt after a recompute,
released on finish and abort) and EOS allowed exactly where the grammar ends.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.batch import SampleSpec
from fluidserve.engine.sampling_params import StructuredOutputs
from fluidserve.engine.structured import StructuredDecoder
from fluidserve.serve.api import ServerSettings
from server_utils import start_server

EOS = 257
# A schema whose every document is short, so a random model finishes it.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["answer", "score", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}},
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MSGS = [{"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), ServerSettings(tool_call_parser="hermes"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client, stream: bool, **kw):
    """One choice's (content, tool_calls as dicts, finish_reason), streamed or not."""
    kw.setdefault("messages", MSGS)
    kw.setdefault("model", client.models.list().data[0].id)
    kw.setdefault("max_tokens", 200)
    if not stream:
        resp = client.chat.completions.create(**kw)
        choice = resp.choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


# -- response_format -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_json_mode_reply_parses_as_a_json_object(client, stream):
    finished = 0
    for seed in range(4):
        content, calls, finish = chat(client, stream, response_format={"type": "json_object"},
                                      temperature=1.0, seed=seed, max_tokens=120)
        assert not calls
        if finish == "stop":  # a reply cut by max_tokens is a JSON prefix
            assert isinstance(json.loads(content), dict), content
            finished += 1
    assert finished, "no JSON-mode reply finished within max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_reply_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    for seed in range(3):
        content, _, finish = chat(client, stream, response_format=fmt, temperature=1.0, seed=seed)
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), ANSWER_SCHEMA)


def test_json_schema_on_completions_and_vllm_fields(server):
    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}},
         lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA)),
        ({"guided_json": ANSWER_SCHEMA}, lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA)),
        ({"structured_outputs": {"json": ANSWER_SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), ANSWER_SCHEMA)),
        ({"guided_regex": "[a-c]{3}-[0-9]{2}"}, lambda t: _match(r"[a-c]{3}-[0-9]{2}", t)),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: _in(t, ["alpha", "beta"])),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: _in(t, ["up", "down"])),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: _match(r"x[0-9]{2}", t)),
    ]
    for extra, check in cases:
        resp = httpx.post(f"{server.base_url}/v1/completions", json={**body, **extra}, timeout=60)
        assert resp.status_code == 200, (extra, resp.text)
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (extra, choice)
        check(choice["text"])


def _match(pattern: str, text: str) -> None:
    import re

    assert re.fullmatch(pattern, text), text


def _in(text: str, options: list[str]) -> None:
    assert text in options, text


def test_a_plain_request_beside_a_streaming_constrained_one(server, client):
    """A plain completion sent while a constrained one streams shares its
    steps: both are answered, and the server stays healthy."""
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="x", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"regex": "[ab]{200}"}})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # decoding now
    plain = client.completions.create(model=model, prompt="hello there", max_tokens=8, temperature=0)
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    assert plain.choices[0].finish_reason in ("stop", "length") and plain.usage.completion_tokens >= 1
    assert len(text) == 200 and set(text) <= {"a", "b"}
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_unconstrained_reply_is_not_json(client):
    """The control: the same request without response_format is noise."""
    content, _, _ = chat(client, False, temperature=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(content)


# -- tools -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_is_schema_valid(client, stream):
    for seed in range(3):
        content, calls, finish = chat(client, stream, tools=[WEATHER, TIME], tool_choice="required",
                                      parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert finish == "tool_calls" and len(calls) == 1, (content, calls)
        call = calls[0]
        assert call["id"].startswith("call_") and call["name"] in TOOL_SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call_is_schema_valid(client, stream):
    choice = {"type": "function", "function": {"name": "get_time"}}
    content, calls, finish = chat(client, stream, tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
    # vLLM's: the whole reply is the call, its content "" (a stream sends no content delta).
    assert finish == "tool_calls" and content == ("" if not stream else None)
    assert [c["name"] for c in calls] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL_SCHEMAS["get_time"])


def test_a_named_call_cut_short_is_the_same_partial_call_streamed_or_not(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
    _, full, _ = chat(client, False, **kw)
    whole = chat(client, False, max_tokens=3, **kw)
    streamed = chat(client, True, max_tokens=3, **kw)
    assert whole[0] == "" and streamed[0] is None  # no content: the reply is the call's arguments
    for _, calls, finish in (whole, streamed):
        assert finish == "length" and [c["name"] for c in calls] == ["get_time"]
    partial = whole[1][0]["arguments"]
    assert partial == streamed[1][0]["arguments"] and partial and full[0]["arguments"].startswith(partial)
    assert partial != full[0]["arguments"]


def test_tool_history_round_trip(client):
    """A conversation carrying an assistant's tool call and the tool's answer
    is accepted and rendered; the next forced call is valid again."""
    _, calls, _ = chat(client, False, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                       temperature=1.0, seed=0)
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0]["id"], "type": "function",
             "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"},
    ]
    # All the room the 256-token context leaves: a random model's arguments,
    # drawn at temperature 1, may run long before the grammar closes them.
    _, again, finish = chat(client, False, messages=history, tools=[WEATHER], tool_choice="required",
                            parallel_tool_calls=False, temperature=1.0, seed=0, max_tokens=180)
    assert finish == "tool_calls"
    jsonschema.validate(json.loads(again[0]["arguments"]), TOOL_SCHEMAS["get_weather"])


def test_auto_tool_choice_without_a_call_is_content(client):
    content, calls, finish = chat(client, False, tools=[WEATHER], temperature=0, max_tokens=20)
    assert calls == [] and finish == "length" and content


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"structured_outputs": {"json": {}, "structural_tag": "x"}}, "structured_outputs"),  # names structural_tag
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_unsupported_combinations_are_400_naming_the_field(server, body, param):
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MSGS, **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_a_grammar_that_does_not_compile_is_a_400_saying_why(server):
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MSGS, "guided_regex": "[a-"},
                      timeout=30)
    assert resp.status_code == 400
    # xgrammar's own words ("... Regex parsing error at position 4: Unclosed '['"), without the
    # time and source file its native errors open with
    message = resp.json()["error"]["message"]
    assert "position 4" in message and ".cc:" not in message and "[00:" not in message, message


def test_auto_tool_choice_needs_the_server_flag(tiny_model):
    srv = start_server(tiny_model("llama"))  # no --enable-auto-tool-choice
    try:
        resp = httpx.post(f"{srv.base_url}/v1/chat/completions", json={"messages": MSGS, "tools": [WEATHER]},
                          timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
        forced = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "messages": MSGS, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "seed": 0, "max_tokens": 200})
        assert forced.status_code == 200 and forced.json()["choices"][0]["finish_reason"] == "tool_calls"
    finally:
        srv.stop()


# -- compact JSON (disable_any_whitespace) ----------------------------------------


def _compact(text: str) -> str:
    return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def test_compact_grammar_takes_no_whitespace_outside_strings(tiny_model):
    """The grammar itself: the default takes whitespace between tokens (up
    to its cap), the compact one only "," and ":" with nothing around them;
    whitespace inside a string is the string's and stays allowed."""
    import xgrammar as xgr

    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.engine.structured import GrammarCompiler

    compiler = GrammarCompiler(load_tokenizer(tiny_model("llama")), 261, [EOS])
    schema = json.dumps(ANSWER_SCHEMA)
    docs = ['{"answer":"yes","score":7,"ok":true}', '{"answer": "yes", "score": 7, "ok": true}',
            '{ "answer":"no","score":1,"ok":false }', '{"answer":"maybe",\n"score":0,"ok":true}']

    def takes(spec: StructuredOutputs, doc: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile(spec))
        return matcher.accept_string(doc) and matcher.accept_token(EOS) and matcher.is_terminated()

    assert [takes(StructuredOutputs(json=schema), d) for d in docs] == [True] * 4
    assert [takes(StructuredOutputs(json=schema, disable_any_whitespace=True), d) for d in docs] == \
        [True, False, False, False]
    anything = StructuredOutputs(json_object=True, disable_any_whitespace=True)
    assert takes(anything, '{"a b":[1,{"c":null}]}') and not takes(anything, '{"a b": [1]}')


def test_disable_any_whitespace_per_request_gives_compact_json(server):
    body = {"prompt": "Hello", "max_tokens": 200, "temperature": 1.0,
            "structured_outputs": {"json": ANSWER_SCHEMA, "disable_any_whitespace": True}}
    for seed in range(3):
        resp = httpx.post(f"{server.base_url}/v1/completions", json={**body, "seed": seed}, timeout=60)
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert choice["text"] == _compact(choice["text"])
        jsonschema.validate(json.loads(choice["text"]), ANSWER_SCHEMA)


@pytest.mark.parametrize("so", [{"regex": "a+", "disable_any_whitespace": True},
                                {"choice": ["a", "b"], "disable_any_whitespace": True}])
def test_disable_any_whitespace_on_a_pattern_is_a_400(server, so):
    resp = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "structured_outputs": so},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "structured_outputs" and "disable_any_whitespace" in error["message"], error


def test_a_compact_server_gives_compact_json_unless_a_request_opts_out(tiny_model):
    """--structured-outputs-config '{"disable_any_whitespace": true}': every
    JSON constraint is compact (response_format, guided_json, a forced tool
    call's arguments, whole and streamed: under "required" the calls read out
    of the reply's array are written compact too); a request's own
    structured_outputs flag wins, and patterns (regex, choice) are not JSON
    and pass untouched."""
    from fluidserve.serve.inputs import InputProcessor, ModelInfo
    from fluidserve.serve.protocol import ChatCompletionRequest, CompletionRequest

    srv = start_server(tiny_model("llama"), ServerSettings(disable_any_whitespace=True))
    try:
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
        for seed in range(3):
            content, _, finish = chat(c, seed % 2 == 1, response_format=fmt, temperature=1.0, seed=seed)
            assert finish == "stop" and content == _compact(content), content
        named = {"type": "function", "function": {"name": "get_weather"}}
        for stream, choice in ((False, named), (True, named), (False, "required"), (True, "required")):
            _, calls, finish = chat(c, stream, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
                                    temperature=1.0, seed=1)
            assert finish == "tool_calls" and calls[0]["arguments"] == _compact(calls[0]["arguments"]), calls
        resp = httpx.post(f"{srv.base_url}/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 8, "temperature": 0, "guided_regex": "[a-c] [a-c]"})
        assert resp.status_code == 200 and len(resp.json()["choices"][0]["text"]) == 3, resp.text
    finally:
        srv.stop()

    proc = InputProcessor(None, ModelInfo("m", 256, 261), disable_any_whitespace=True)  # no tokenizer needed

    def compact(body: dict, chat: bool = False) -> bool:
        req = (ChatCompletionRequest.model_validate({"messages": MSGS, **body}) if chat
               else CompletionRequest.model_validate({"prompt": "x", **body}))
        return proc._structured(req).disable_any_whitespace

    assert compact({"guided_json": ANSWER_SCHEMA})
    assert compact({"structured_outputs": {"json_object": True}})
    assert compact({"response_format": {"type": "json_object"}}, chat=True)
    assert not compact({"structured_outputs": {"json": ANSWER_SCHEMA, "disable_any_whitespace": False}})
    assert not compact({"structured_outputs": {"regex": "a+"}})


# -- the engine side --------------------------------------------------------------


def test_grammar_allows_eos_exactly_where_it_can_end(make_llm, tiny_model):
    """choice ["ab", "abc"]: after "ab" the grammar may end or go on, so both
    EOS and "c" are allowed there; after "abc" only EOS."""
    llm = make_llm(tiny_model("llama"))
    worker = llm.engine.executor.worker
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(choice=("ab", "abc")))
    allowed = []
    for prefix in ([], [ord("a")], [ord("a"), ord("b")], [ord("a"), ord("b"), ord("c")]):
        spec = SampleSpec(params, None, output_token_ids=prefix)
        mask = worker.structured.fill([f"s{len(prefix)}"], [spec])
        logits = torch.zeros(1, worker.structured.vocab_size)
        mask.apply(logits)
        allowed.append(set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist()))
    assert allowed == [{ord("a")}, {ord("b")}, {ord("c"), EOS}, {EOS}]


@pytest.mark.parametrize("rows", [[1, 3], [1, 2], [0, 2, 3]], ids=["apart", "consecutive", "from-the-first"])
def test_mask_reaches_its_own_rows_among_unconstrained_ones(rows):
    """A step's constrained rows may sit anywhere among its sampling rows:
    each gets its own mask row, and every other row is left as it was."""
    from fluidserve.engine.structured import TokenMask

    vocab = 70
    bitmask = torch.zeros(len(rows), 3, dtype=torch.int32)  # nothing allowed...
    for j in range(len(rows)):
        bitmask[j, 0] = 1 << j  # ...but token j in the j-th constrained row
    logits = torch.randn(4, vocab)
    before = logits.clone()
    TokenMask(bitmask, rows, vocab_size=64).apply(logits)  # two ids past the tokenizer's
    for r in range(4):
        if r not in rows:
            assert torch.equal(logits[r], before[r])
            continue
        j = rows.index(r)
        assert torch.isfinite(logits[r]).nonzero().flatten().tolist() == [j]
        assert logits[r, j] == before[r, j]


def test_plain_request_joining_a_constrained_one(make_llm, tiny_model):
    """An unconstrained request that arrives while a constrained one decodes
    runs ahead of it in the batch (skip-join MLFQ ranks the newcomer first),
    so the constrained row is not the first: both finish, each as it would
    alone."""
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(regex="[ab]{40}"))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone_c = llm.generate(["x"], constrained)[0].outputs[0].token_ids
    alone_p = llm.generate(["hello there"], plain)[0].outputs[0].token_ids
    done = {}
    engine.add_request("c", "x", constrained)
    for step in range(200):
        if step == 3:
            engine.add_request("p", "hello there", plain)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {"c", "p"}
    assert done["c"] == alone_c and done["p"] == alone_p
    assert set(done["c"]) <= {ord("a"), ord("b")} and len(done["c"]) == 40


def test_matcher_follows_the_engine_history():
    """Take last step's token, catch up, rebuild after the history changed
    under it (a recompute or a reused id), release."""
    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.engine.tiny_model import default_tiny_model_dir

    dec = StructuredDecoder(lambda: load_tokenizer(default_tiny_model_dir()), 261, [EOS])
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="(ab|cd)x"))

    def row(*text: str) -> list[int]:
        return [ord(c) for c in "".join(text)]

    def allowed(history: list[int]) -> set[int]:
        mask = dec.fill(["s"], [SampleSpec(params, None, output_token_ids=history)])
        bits = [(int(mask.bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(261)]
        return {t for t, b in enumerate(bits) if b}

    assert allowed([]) == set(row("ac"))
    assert allowed(row("a")) == set(row("b"))  # last step's token, taken in the batch call
    assert allowed(row("a")) == set(row("b"))  # a step that sampled nothing new (say, abandoned)
    assert allowed(row("abx")) == {EOS}  # two behind: caught up one by one
    assert allowed(row("c")) == set(row("d"))  # history changed: rebuilt, not "abx" + "c"
    assert dec.fill(["s"], [SampleSpec(SamplingParams(), None)]) is None  # no constrained row, no mask
    assert dec.num_active == 1
    dec.release(["s"])
    assert dec.num_active == 0


def test_rows_after_drafts_are_masked_after_them():
    """A sequence verifying drafts has a row at each position: row j is
    masked by the grammar after the first j drafts; past a draft the grammar
    refuses (or one that ends it) the rows copy the last reachable row's
    mask; and the matcher goes back to the engine's outputs, so the next
    step's rows read as they would without the drafts."""
    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.engine.tiny_model import default_tiny_model_dir

    dec = StructuredDecoder(lambda: load_tokenizer(default_tiny_model_dir()), 261, [EOS])
    params = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="(abc)+x"))
    other = SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="(ab|cd)x"))

    def row(text: str) -> list[int]:
        return [ord(c) for c in text]

    def allowed(mask, k: int) -> set[int]:
        return {t for t in range(261) if (int(mask.bitmask[k, t // 32]) >> (t % 32)) & 1}

    def step(history: str, draft: str, rows: int | None = None):
        """Rows of "s" (its drafts verified) around a row of "o" (no drafts)."""
        n = len(draft) + 1 if rows is None else rows
        spec, free = SampleSpec(params, None, output_token_ids=row(history)), SampleSpec(other, None)
        mask = dec.fill(["s"] * n + ["o"], [spec] * n + [free], {"s": row(draft)})
        assert mask.rows == list(range(n + 1))
        return [allowed(mask, k) for k in range(n)], allowed(mask, n)

    rows, free = step("ab", "cab")
    assert rows == [set(row("c")), set(row("ax")), set(row("b")), set(row("c"))] and free == set(row("ac"))
    # "d" is refused after "abca": the row after it (and any later) copies its mask.
    assert step("ab", "cadb")[0] == [set(row("c")), set(row("ax")), set(row("b")), set(row("b")), set(row("b"))]
    # "x" then EOS end the grammar: the row after the EOS copies the one that sampled it.
    assert step("abcab", "cx" + chr(EOS))[0] == [set(row("c")), set(row("ax")), {EOS}, {EOS}]
    # Nothing taken stayed: the outputs without drafts read as before, one step on.
    assert step("abca", "", rows=1)[0] == [set(row("b"))]
    assert step("abcab", "c")[0] == [set(row("c")), set(row("ax"))]


def test_constrained_output_stays_valid_across_recompute(make_llm, tiny_model):
    """A KV cache too small for the batch forces preemption by recompute;
    every sequence still ends in a document of its schema, and no matcher
    is left behind."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=100,
                            structured_outputs=StructuredOutputs(json=json.dumps(ANSWER_SCHEMA)))
    prompts = [f"request number {i}: " + "pad " * 6 for i in range(8)]
    tight_llm = make_llm(model, num_kv_blocks=12, block_size=16, max_model_len=160, preemption_mode="recompute",
                         max_num_seqs=8)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.stats().num_recomputes > 0
    for out in tight:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), ANSWER_SCHEMA)
    tight_llm.generate(["flush"], SamplingParams(max_tokens=1))  # a step carries the releases
    assert tight_llm.engine.executor.worker.structured.num_active == 0


def test_abort_releases_the_matcher(make_llm, tiny_model):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    params = SamplingParams(temperature=1.0, max_tokens=50, structured_outputs=StructuredOutputs(json_object=True))
    engine.add_request("r1", "hello", params)
    for _ in range(3):
        engine.step()
    assert engine.executor.worker.structured.num_active == 1
    engine.abort("r1")
    engine.add_request("r2", "hi", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.executor.worker.structured.num_active == 0


def test_cli_tool_flags():
    from fluidserve.serve import cli

    args = cli.build_parser().parse_args(["serve", "m", "--enable-auto-tool-choice", "--tool-call-parser",
                                          "llama3_json", "--guided-decoding-backend", "xgrammar"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    cli.check_unsupported(["serve", "m", "--guided-decoding-backend", "xgrammar", "--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):  # argparse: an unknown parser name is a usage error, exit 2
        cli.build_parser().parse_args(["serve", "m", "--tool-call-parser", "nope"])


# -- tool_choice "auto": the parsers ------------------------------------------------

HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
                '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
LLAMA_REPLY = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}; ' \
              '{"name": "get_time", "parameters": {"zone": "CET"}}'
PYTHONIC_REPLY = '[get_weather(city="Rome", days=3), get_time(zone="EST", extra={"dst": True, "offsets": [1, 2]})]'
MISTRAL_REPLY = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Kyiv", "days": 4}}, ' \
                '{"name": "get_time", "arguments": {"zone": "EET"}}]'
MISTRAL_V11_REPLY = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Kyiv", "days": 4}[TOOL_CALLS]get_time[ARGS]' \
                    '{"zone": "EET"}'
QWEN3_CODER_REPLY = ('I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n'
                     '<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
                     '<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>')
GRANITE_REPLY = 'I will check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Turin", "days": 6}}, ' \
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'
GRANITE_31_REPLY = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Turin", "days": 6}}, ' \
                   '{"name": "get_time", "arguments": {"zone": "CET"}}]\n'
PHI4_REPLY = 'Checking.functools[{"name": "get_weather", "arguments": {"city": "Quito", "days": 7}}, ' \
             '{"name": "get_time", "arguments": {"zone": "ECT"}}]'
OLMO3_REPLY = ('One moment.\n<function_calls>\nget_weather(city="Bern", days=8)\nget_time(zone="CET")\n'
               '</function_calls>')
GLM45_REPLY = ('Looking it up.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Nanjing</arg_value>\n'
               '<arg_key>days</arg_key>\n<arg_value>9</arg_value>\n</tool_call><tool_call>get_time'
               '<arg_key>zone</arg_key><arg_value>CST</arg_value></tool_call>')
EXPECTED_CALLS = {
    "hermes": [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})],
    "llama3_json": [("get_weather", {"city": "Lima", "days": 1}), ("get_time", {"zone": "CET"})],
    "pythonic": [("get_weather", {"city": "Rome", "days": 3}),
                 ("get_time", {"zone": "EST", "extra": {"dst": True, "offsets": [1, 2]}})],
    "mistral": [("get_weather", {"city": "Kyiv", "days": 4}), ("get_time", {"zone": "EET"})],
    "qwen3_coder": [("get_weather", {"city": "San Jose", "days": 5}), ("get_time", {"zone": "UTC"})],
    "granite": [("get_weather", {"city": "Turin", "days": 6}), ("get_time", {"zone": "CET"})],
    "phi4_mini_json": [("get_weather", {"city": "Quito", "days": 7}), ("get_time", {"zone": "ECT"})],
    "olmo3": [("get_weather", {"city": "Bern", "days": 8}), ("get_time", {"zone": "CET"})],
    "glm45": [("get_weather", {"city": "Nanjing", "days": 9}), ("get_time", {"zone": "CST"})],
}
EXPECTED_CONTENT = {"hermes": "Let me check.\n\n", "mistral": "Sure.", "qwen3_coder": "I will look.\n\n",
                    "granite": "I will check.", "phi4_mini_json": "Checking.", "olmo3": "One moment.\n",
                    "glm45": "Looking it up."}


def _streamed(mode, text: str, step: int):
    from fluidserve.serve.tool_parsers import CallStream

    stream = CallStream(mode)
    pieces = [stream.feed(text[i:i + step]) for i in range(0, len(text), step)] + [stream.finish()]
    content = "".join(p.content for p in pieces)
    calls: dict[int, list] = {}
    for p in pieces:
        for d in p.calls:
            if d.index not in calls:
                assert d.id and d.name, "a call's first delta carries its id and name"
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("parser, reply", [("hermes", HERMES_REPLY), ("llama3_json", LLAMA_REPLY),
                                           ("pythonic", PYTHONIC_REPLY), ("mistral", MISTRAL_REPLY),
                                           ("mistral", MISTRAL_V11_REPLY), ("qwen3_coder", QWEN3_CODER_REPLY),
                                           ("granite", GRANITE_REPLY), ("granite", GRANITE_31_REPLY),
                                           ("phi4_mini_json", PHI4_REPLY), ("olmo3", OLMO3_REPLY),
                                           ("glm45", GLM45_REPLY)],
                         ids=["hermes", "llama3_json", "pythonic", "mistral", "mistral-v11", "qwen3_coder", "granite",
                              "granite-3.1", "phi4_mini_json", "olmo3", "glm45"])
def test_parser_finds_the_calls_whole_and_streamed(parser, reply):
    from fluidserve.serve.tool_parsers import ToolMode, parameter_types, parse_reply

    types = parameter_types([t["function"] for t in (WEATHER, TIME)])  # days: an integer, as qwen3_coder reads it
    mode = ToolMode("auto", parser=parser, types=types)
    content, calls = parse_reply(mode, reply)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS[parser]
    assert len({c.id for c in calls}) == 2
    expected_content = EXPECTED_CONTENT.get(parser) if reply != GRANITE_31_REPLY else None
    assert content == expected_content
    if parser == "mistral":  # the ids its templates accept when the history comes back
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    for step in (1, 3, 7, len(reply)):  # tags and JSON split at every place
        streamed_content, streamed_calls = _streamed(mode, reply, step)
        assert streamed_calls == EXPECTED_CALLS[parser]
        assert streamed_content == (expected_content or "")


@pytest.mark.parametrize("parser, reply", [
    ("hermes", "plain answer, a < b and <tool no call"),
    ("hermes", "<tool_call>not json</tool_call> after"),
    ("llama3_json", "The weather is fine."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": '),  # cut short
    ("llama3_json", '{"not": "a call"}'),
    ("pythonic", "[1, 2, 3] are numbers"),
    ("pythonic", '[get_weather(city=input("x"))]'),  # not a literal: never run, not a call
    ("pythonic", '[get_weather(**{"city": "Oslo"})]'),
    ("pythonic", "The weather is fine."),
    ("mistral", "No tools needed, [TOOL_CALL] is not the marker."),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '),  # cut short
    ("qwen3_coder", "<tool_call>no function here</tool_call>"),
    ("qwen3_coder", "a <tool_ call> lookalike"),
    ("granite", "<tool_call>[1, 2]"),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Turin"}}] and more text'),
    ("phi4_mini_json", "Python's functools module caches results."),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": '),  # cut short
    ("olmo3", "<function_calls>\nget_weather(city=open('x'))\n</function_calls>"),  # not a literal
    ("olmo3", '<function_calls>\nget_weather(city="Bern")\n</function_calls> then prose'),
    ("glm45", "<tool_call></tool_call> is empty"),
    ("glm45", "<tool_call>get_weather<arg_key>city</arg_key>Nanjing</tool_call>"),  # a key with no value
])
def test_parser_leaves_text_that_is_no_call_as_content(parser, reply):
    from fluidserve.serve.tool_parsers import ToolMode, parse_reply

    mode = ToolMode("auto", parser=parser)
    assert parse_reply(mode, reply) == (reply, [])
    for step in (1, 4):
        assert _streamed(mode, reply, step) == (reply, [])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_turns_a_hermes_reply_into_tool_calls(client, stream):
    """The server runs --tool-call-parser hermes; a regex makes the random
    model write a Hermes tool call, which must come back as tool_calls."""
    regex = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
             r'"days": [1-7]\}\}</tool_call>')
    content, calls, finish = chat(client, stream, tools=[WEATHER], tool_choice="auto", temperature=0,
                                  extra_body={"guided_regex": regex})
    assert finish == "tool_calls" and content == "Checking."
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TOOL_SCHEMAS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_turns_a_pythonic_reply_into_tool_calls(tiny_model, stream):
    """--tool-call-parser pythonic on a server of its own: a regex makes the
    random model write a Python list of calls, which come back as tool_calls."""
    srv = start_server(tiny_model("llama"), ServerSettings(tool_call_parser="pythonic"))
    try:
        own = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0)
        regex = r'\[get_weather\(city="(Paris|Oslo)", days=[1-7]\), get_time\(zone="(UTC|CET)"\)\]'
        content, calls, finish = chat(own, stream, tools=[WEATHER, TIME], tool_choice="auto", temperature=0,
                                      extra_body={"guided_regex": regex})
    finally:
        srv.stop()
    assert finish == "tool_calls" and content is None
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), TOOL_SCHEMAS[c["name"]])


def test_qwen3_coder_values_are_read_as_their_schema_types():
    """Bare-text values: strings stay text even where they look like
    numbers, numbers, booleans, null, objects and arrays from their text,
    and an untyped parameter is JSON where it parses."""
    from fluidserve.serve.tool_parsers import ToolMode, parse_reply

    types = {"f": {"code": "string", "n": "integer", "x": "number", "ok": "boolean", "opts": "object",
                   "ids": "array", "maybe": ["string", "null"]}}
    reply = ("<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n<parameter=n>\n12\n</parameter>\n"
             "<parameter=x>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=opts>\n"
             '{"a": [1]}\n</parameter>\n<parameter=ids>\n[3, 4]\n</parameter>\n<parameter=maybe>\nnull\n'
             "</parameter>\n<parameter=extra>\n{\"k\": 1}\n</parameter>\n<parameter=text>\ntwo\nlines\n</parameter>\n"
             "</function>\n</tool_call>")
    content, (call,) = parse_reply(ToolMode("auto", parser="qwen3_coder", types=types), reply)
    assert content is None and call.name == "f"
    assert json.loads(call.arguments) == {"code": "007", "n": 12, "x": 2.5, "ok": True, "opts": {"a": [1]},
                                          "ids": [3, 4], "maybe": None, "extra": {"k": 1}, "text": "two\nlines"}


def test_the_mistral_and_granite_parsers_keep_the_special_tokens_they_read(tiny_model):
    """Mistral's [TOOL_CALLS] and Granite 3.0's <|tool_call|> are special
    tokens: a reply they read is detokenized with special tokens kept,
    whatever the request asked."""
    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.serve.inputs import InputProcessor, ModelInfo
    from fluidserve.serve.protocol import ChatCompletionRequest

    tok = load_tokenizer(tiny_model("llama"))
    body = {"messages": MSGS, "tools": [WEATHER], "tool_choice": "auto"}
    for parser, kept in (("mistral", True), ("granite", True), ("glm45", True), ("hermes", False), ("olmo3", False)):
        proc = InputProcessor(tok, ModelInfo("m", 256, 261), parser)
        params = proc.chat(ChatCompletionRequest.model_validate(body)).params
        assert params.skip_special_tokens is not kept
    none = InputProcessor(tok, ModelInfo("m", 256, 261), "mistral")
    params = none.chat(ChatCompletionRequest.model_validate({**body, "tool_choice": "none"})).params
    assert params.skip_special_tokens  # no tools read: the request's own setting


def test_tools_and_tool_history_reach_the_chat_template(tiny_model):
    """A template that writes tools and tool turns (as Qwen's and Llama's do)
    sees the request's tools, the assistant's calls (arguments as objects)
    and the tool's answer with its call id."""
    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.serve.inputs import InputProcessor, ModelInfo
    from fluidserve.serve.protocol import ChatCompletionRequest

    tok = load_tokenizer(tiny_model("llama"))
    tok.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}{% endfor %}")
    proc = InputProcessor(tok, ModelInfo("m", 256, 261))
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], "tools": [WEATHER, TIME], "tool_choice": "none"})
    text = proc.chat(req).prompts[0].text
    assert text == ("[tool get_weather][tool get_time]<user>weather?<assistant>[call call_1 get_weather Oslo]"
                    "<tool>sunny[answers call_1]")
