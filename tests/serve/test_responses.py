"""OpenAI's Responses API (``/v1/responses``) on a real uvicorn server with
the tiny model, through the official ``openai`` client: a reply is the chat
route's reply to the same conversation (instructions, history carried by
``previous_response_id``, function calls and their outputs), streamed as
OpenAI's typed events whose deltas add up to the whole reply, with logprobs,
structured output and tool calls; kept responses are read back and
deleted; what cannot be honoured is a 400 naming the field, and nothing is
left in the engine.

Greedy replies drawn from the letters (``allowed_token_ids``, passed to the
chat route as vLLM's extension) with ``ignore_eos``: every reply runs to its
token limit and reads as text.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from fluidserve.serve.api import ServerSettings
from fluidserve.serve.responses import ResponseStore, Stored
from fluidserve.serve.store import Store
from server_utils import ok, start_server, wait_idle

LETTERS = list(range(ord("a"), ord("z") + 1))
GREEDY = {"allowed_token_ids": LETTERS, "ignore_eos": True}
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                       "required": ["city"]}}
NAMED = {"type": "function", "name": "get_weather"}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"], "parameters": TOOL["parameters"]}}


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), ServerSettings(max_stored_responses=4), max_model_len=512)
    yield srv
    srv.stop()


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture()
def model(client) -> str:
    return client.models.list().data[0].id


def chat(server, messages: list[dict], max_tokens: int = 6, **extra) -> dict:
    return ok(server, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                                **GREEDY, **extra})


def respond(client, max_output_tokens: int = 6, **fields):
    model = client.models.list().data[0].id
    return client.responses.create(model=model, max_output_tokens=max_output_tokens, temperature=0,
                                   extra_body=GREEDY, **fields)


def test_a_reply_is_the_chat_routes_reply_to_the_same_conversation(server, client):
    r = respond(client, input="Hello there", instructions="Be brief.")
    body = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # ran to its limit
    assert r.output_text == body["choices"][0]["message"]["content"] and len(r.output_text) == 6
    (message,) = r.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    assert r.usage.input_tokens == body["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    assert (r.instructions, r.max_output_tokens, r.temperature) == ("Be brief.", 6, 0.0)

    # Input as message items with text parts reads as the same conversation.
    items = [{"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                                             {"type": "input_text", "text": "there"}]}]
    assert respond(client, input=items).output_text == r.output_text
    wait_idle(server)


def test_previous_response_id_continues_the_conversation_and_kept_ones_read_back(server, client):
    first = respond(client, input="abc", instructions="Only the first turn's.", metadata={"topic": "letters"})
    second = respond(client, input="def", previous_response_id=first.id)
    # A previous response's instructions are not carried over; its turns are.
    body = chat(server, [{"role": "user", "content": "abc"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "def"}])
    assert second.output_text == body["choices"][0]["message"]["content"]
    assert second.usage.input_tokens == body["usage"]["prompt_tokens"]
    assert second.previous_response_id == first.id

    # Without keeping: the first reply's output items sent back as input (store false, the Agents SDK's way).
    sent_back = respond(client, store=False, input=[{"role": "user", "content": "abc"},
                                                    *[item.model_dump() for item in first.output],
                                                    {"role": "user", "content": "def"}])
    assert sent_back.output_text == second.output_text

    got = client.responses.retrieve(first.id)
    assert (got.output_text, got.metadata) == (first.output_text, {"topic": "letters"})

    # Deleting a turn breaks the chain of those that continue it, said as such.
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, input="ghi", previous_response_id=second.id)
    assert err.value.body["param"] == "previous_response_id" and "no longer kept" in err.value.body["message"]

    unkept = respond(client, input="abc", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.BadRequestError):
        respond(client, input="x", previous_response_id=unkept.id)


def test_a_response_the_store_cannot_take_is_still_answered_and_kept_in_memory(tmp_path, caplog):
    """A full disk: the reply is made, so it goes out; the response stays
    kept in memory (and says so in the log), nothing committed is lost."""
    store = Store(tmp_path)
    asyncio.run(ResponseStore(4, store).put("small", Stored({"id": "small"}, [], None)))
    pages = store._read("PRAGMA page_count")[0][0]
    store.close()
    full = ResponseStore(4, Store(tmp_path, max_pages=pages))  # no room to grow
    big = Stored({"id": "big", "text": "x" * 200_000}, [], "small")
    with caplog.at_level("WARNING", logger="fluidserve.serve.responses"):
        asyncio.run(full.put("big", big, continued=["small"]))
    assert "response big is kept in memory only" in caplog.text and "full" in caplog.text
    assert asyncio.run(full.get("big")) is big
    assert asyncio.run(ResponseStore(4, Store(tmp_path)).get("small")).body == {"id": "small"}


def test_with_a_data_dir_kept_responses_outlive_the_server(tiny_model, tmp_path):
    """--data-dir: a kept response is written before its reply goes out, so
    a new server on the same folder reads it back, lists its input items and
    continues its conversation as the first server would have; a deletion
    holds across a restart too."""
    from fluidserve.serve.batches import BatchConfig

    def serve():
        srv = start_server(tiny_model("llama"), max_model_len=512, batch_config=BatchConfig(str(tmp_path)))
        c = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        return srv, c

    srv, c = serve()
    try:
        first = respond(c, input="abc", instructions="Be brief.", metadata={"k": "v"})
        second = respond(c, input="def", previous_response_id=first.id)
        streamed = respond(c, input="xyz", stream=True)
        kept_stream = [e.response for e in streamed if e.type == "response.incomplete"][0]
        gone = respond(c, input="ghi")
        c.responses.delete(gone.id)
        continued_here = respond(c, input="jkl", previous_response_id=second.id, store=False)
    finally:
        srv.stop()

    srv, c = serve()
    try:
        assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
        assert c.responses.retrieve(kept_stream.id).output_text == kept_stream.output_text
        items = c.responses.input_items.list(second.id).data
        assert [(i.role, i.content[0].text) for i in items] == [("user", "def")]
        again = respond(c, input="jkl", previous_response_id=second.id, store=False)
        assert again.output_text == continued_here.output_text
        assert again.usage.input_tokens == continued_here.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone.id)
    finally:
        srv.stop()


def test_a_kept_responses_input_items_list_back_in_pages(server, client):
    items = [{"role": "user", "content": "abc"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "user", "content": [{"type": "input_text", "text": "and now?"}]}]
    r = respond(client, input=items)
    listed = client.responses.input_items.list(r.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output", "message"]
    assert listed.data[0].content[0].text == "abc" and listed.data[2].output == "sunny"
    assert len({i.id for i in listed.data}) == 4 and listed.has_more is False
    newest = client.responses.input_items.list(r.id, limit=2)  # newest first by default
    assert [i.id for i in newest.data] == [i.id for i in listed.data[::-1][:2]] and newest.has_more
    rest = client.responses.input_items.list(r.id, limit=2, after=newest.last_id)
    assert [i.id for i in rest.data] == [i.id for i in listed.data[::-1][2:]] and not rest.has_more
    for query, param in [({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"include": "x"}, "include")]:
        bad = httpx.get(f"{server.base_url}/v1/responses/{r.id}/input_items", params=query, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_a_streamed_reply_is_openais_event_sequence_adding_up_to_the_whole_reply(server, client, model):
    whole = respond(client, input="Stream me", max_output_tokens=8)
    events = list(client.responses.create(model=model, input="Stream me", max_output_tokens=8, temperature=0,
                                          stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # max_output_tokens reached
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == 8 and final.incomplete_details.reason == "max_output_tokens"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # The streamed response is kept like a whole one.
    assert client.responses.retrieve(final.id).output_text == text

    # A reply that ends by itself completes: the SDK's own stream helper reads it.
    stop = whole.output_text[3:5]
    with client.responses.stream(model=model, input="Stream me", max_output_tokens=8, temperature=0,
                                 extra_body={"allowed_token_ids": LETTERS, "stop": [stop]}) as s:
        for _ in s:
            pass
        done = s.get_final_response()
    assert done.status == "completed" and done.output_text == whole.output_text[:whole.output_text.index(stop)]
    wait_idle(server)


def test_logprobs_whole_and_streamed(server, client, model):
    asked = dict(input="Hello", max_output_tokens=4, top_logprobs=2, include=["message.output_text.logprobs"])
    r = respond(client, **asked)
    entries = r.output[0].content[0].logprobs
    assert [e.token for e in entries] == list(r.output_text)  # the byte tokenizer: a token a letter
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    events = list(client.responses.create(model=model, temperature=0, stream=True, extra_body=GREEDY, **asked))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
    # Without asking, none.
    assert respond(client, input="Hello").output[0].content[0].logprobs == []


def test_structured_output_follows_the_schema(server, client, model):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    r = client.responses.create(model=model, input="json please", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert r.status == "completed", r.output_text
    assert set(json.loads(r.output_text)) == {"a"} and isinstance(json.loads(r.output_text)["a"], int)
    assert r.text.format.type == "json_schema"


def test_function_calls_and_their_outputs_round_trip(server, client, model):
    r = client.responses.create(model=model, input="weather in Paris?", tools=[TOOL], tool_choice=NAMED,
                                max_output_tokens=200, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    assert call.call_id and call.id.startswith("fc_")

    # Streamed, the same call, its arguments as they are made.
    events = list(client.responses.create(model=model, input="weather in Paris?", tools=[TOOL], tool_choice=NAMED,
                                          max_output_tokens=200, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    (streamed,) = events[-1].response.output
    assert (streamed.name, streamed.call_id, streamed.id) == ("get_weather", events[2].item.call_id, events[2].item.id)
    # The kept turn holds the call under the id the stream gave.
    kept = respond(client, previous_response_id=events[-1].response.id, tools=[TOOL], tool_choice="none", input=[
        {"type": "function_call_output", "call_id": streamed.call_id, "output": "sunny"}])

    # The call and its output sent back read as the chat route's tool turn.
    follow = respond(client, previous_response_id=r.id, tools=[TOOL], tool_choice="none", input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    body = chat(server, [{"role": "user", "content": "weather in Paris?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": call.call_id, "type": "function",
                              "function": {"name": "get_weather", "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}],
                tools=[CHAT_TOOL], tool_choice="none")
    assert follow.output_text == body["choices"][0]["message"]["content"] == kept.output_text
    assert follow.usage.input_tokens == body["usage"]["prompt_tokens"]
    # The same turn sent whole, without the kept response.
    again = respond(client, tools=[TOOL], tool_choice="none", input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert again.output_text == follow.output_text
    wait_idle(server)


def test_a_call_cut_short_is_an_incomplete_item_whole_and_streamed(server, client, model):
    asked = dict(model=model, input="weather in Paris?", tools=[TOOL], tool_choice=NAMED, max_output_tokens=3,
                 temperature=0)
    r = client.responses.create(**asked)
    (call,) = r.output
    assert (r.status, call.type, call.status, len(call.arguments)) == ("incomplete", "function_call", "incomplete", 3)
    final = list(client.responses.create(**asked, stream=True))[-1]
    assert final.type == "response.incomplete"
    assert [(i.type, i.status, i.arguments) for i in final.response.output] == [
        ("function_call", "incomplete", call.arguments)]


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(server, client):
    """512-token context: three turns of 160 letters do not fit. Disabled
    (the default) that is OpenAI's 400 context_length_exceeded naming
    input; "auto" drops the oldest whole turn and answers as the chat route
    answers the turns left; the kept chain is untouched by it."""
    first = respond(client, input="a" * 160)
    second = respond(client, input="b" * 160, previous_response_id=first.id)
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, input="c" * 160, previous_response_id=second.id)
    body = err.value.body
    assert (body["code"], body["param"]) == ("context_length_exceeded", "input") and "truncation" in body["message"]

    third = respond(client, input="c" * 160, previous_response_id=second.id, truncation="auto", store=False)
    kept = chat(server, [{"role": "user", "content": "b" * 160}, {"role": "assistant", "content": second.output_text},
                         {"role": "user", "content": "c" * 160}])
    assert third.truncation == "auto" and third.output_text == kept["choices"][0]["message"]["content"]
    assert third.usage.input_tokens == kept["usage"]["prompt_tokens"]
    # Even the turn alone too long: the 400 stands, truncation or not.
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, input="d" * 600, previous_response_id=second.id, truncation="auto")
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "input")
    with pytest.raises(openai.BadRequestError) as err:
        respond(client, input="d", max_output_tokens=600, truncation="auto")
    assert err.value.body["param"] == "max_output_tokens"
    # The chat route says the same code.
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "e" * 600}]})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")


def test_truncation_auto_drops_the_fewest_turns(server, client):
    """Three kept turns of 100 letters and a 200-letter input: all of it
    does not fit 512 tokens, and "auto" drops only the oldest turn."""
    turns, previous = [], None
    for letter in "abc":
        r = respond(client, input=letter * 100, previous_response_id=previous)
        turns.append((letter * 100, r.output_text))
        previous = r.id
    r = respond(client, input="d" * 200, previous_response_id=previous, truncation="auto", store=False)

    def messages(last: int) -> list[dict]:
        said = [m for user, reply in turns[len(turns) - last:]
                for m in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})]
        return said + [{"role": "user", "content": "d" * 200}]

    whole = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=30, json={
        "messages": messages(3), "max_tokens": 6, "temperature": 0, **GREEDY})
    assert whole.status_code == 400  # the whole conversation does not fit
    two = chat(server, messages(2))
    assert (r.output_text, r.usage.input_tokens) == (two["choices"][0]["message"]["content"],
                                                     two["usage"]["prompt_tokens"])


@pytest.mark.parametrize("fields, param, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "input_image"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "reasoning item must come just before"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "reasoning.effort: the chat template reads"),
    ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "summary"),
    ({"input": "x", "truncation": "middle"}, "truncation", "'auto' or 'disabled'"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text", "needs a name and a schema"),
    ({"input": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
    ({"input": "x", "n": 2}, "n", "unrecognized"),
    ({"input": "x", "model": "nope"}, "model", "does not exist"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "x", "tools": [TOOL], "top_logprobs": 2}, "top_logprobs", "with tools"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(server, fields, param, words):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"max_output_tokens": 2, **fields}, timeout=30)
    assert r.status_code == (404 if "model" in fields else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    wait_idle(server)


def test_a_client_that_leaves_mid_stream_leaves_nothing_in_the_engine(server):
    body = {"input": "leave", "max_output_tokens": 200, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if "output_text.delta" in line:
                break
    wait_idle(server, timeout=10)


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "sqlite"])
def test_the_store_keeps_the_last_ones_used_and_walks_a_conversation_back(tmp_path, durable):
    """Made or continued counts as used; the least recently used goes first,
    in memory and in the SQLite store alike, and the store's survive a new
    process."""
    turn = lambda text: [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]  # noqa: E731

    async def run(store: ResponseStore) -> None:
        await store.put("a", Stored({"id": "a"}, turn("a"), None))
        await store.put("x", Stored({"id": "x"}, turn("x"), None))
        assert (await store.conversation("a"))[1] == ["a"]
        await store.put("b", Stored({"id": "b"}, turn("b"), "a"), continued=["a"])  # "a" used again: "x" goes
        assert await store.get("x") is None
        messages, ids = await store.conversation("b")
        assert [m["content"] for m in messages] == ["a", "A", "b", "B"] and ids == ["b", "a"]
        assert (await store.get("a")).body == {"id": "a"}  # a read is no use: "a" is still the oldest
        await store.put("c", Stored({"id": "c"}, turn("c"), None))
        assert await store.get("a") is None
        with pytest.raises(Exception, match="'a', which is no longer kept"):
            await store.conversation("b")
        assert await store.delete("c") and not await store.delete("c")
        assert await ResponseStore(capacity=0).get("x") is None

    asyncio.run(run(ResponseStore(2, Store(tmp_path) if durable else None)))
    if durable:
        again = ResponseStore(2, Store(tmp_path))
        kept = asyncio.run(again.get("b"))
        assert kept.previous == "a" and kept.turn == turn("b") and kept.body == {"id": "b"}
        assert [asyncio.run(again.get(rid)) for rid in "acx"] == [None, None, None]


def test_openapi_describes_the_body(server):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    op = schema["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"}
    comps = schema["components"]["schemas"]
    fields = set(comps["ResponsesRequest"]["properties"])
    assert {"input", "instructions", "previous_response_id", "text", "tools"} <= fields
    # the chat route's StreamOptions is still its own
    assert "include_usage" in comps["StreamOptions"]["properties"]
    assert {"get", "delete"} <= set(schema["paths"]["/v1/responses/{response_id}"])


# -- background responses -------------------------------------------------------------


def _until_final(client, response_id: str, timeout: float = 60.0):
    import time

    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"still {r.status}"
        time.sleep(0.05)


def _slowed(srv, seconds: float) -> None:
    """Every engine step of ``srv`` takes ``seconds`` longer: a reply of
    many tokens is still running when the test acts on it."""
    import time

    engine = srv.engine
    real = engine.step

    def slow_step():
        time.sleep(seconds)
        return real()

    engine.step = slow_step


def test_a_background_response_is_queued_at_once_and_read_back_when_done(server, client):
    """background: true answers at once with status queued; GET reads it
    in progress and then completed (here incomplete: it ran to its limit),
    the same reply a foreground request gets; it continues a conversation
    once finished, and not before."""
    fg = respond(client, input="Background work", max_output_tokens=8)
    bg = respond(client, input="Background work", max_output_tokens=8, background=True)
    assert bg.background is True and bg.status in ("queued", "in_progress") and bg.output == []
    done = _until_final(client, bg.id)
    assert done.status == "incomplete" and done.output_text == fg.output_text and done.background is True
    assert done.usage.output_tokens == 8 and done.created_at == bg.created_at
    follow = respond(client, input="and then?", previous_response_id=bg.id)
    assert follow.usage.input_tokens > fg.usage.input_tokens
    wait_idle(server)


def test_a_running_background_response_is_cancelled_and_frees_the_engine(tiny_model):
    srv = start_server(tiny_model("llama"), max_model_len=512)
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        _slowed(srv, 0.02)
        bg = respond(client, input="Long work", max_output_tokens=400, background=True)
        early = httpx.post(f"{srv.base_url}/v1/responses", timeout=30, json={
            "input": "x", "max_output_tokens": 2, "previous_response_id": bg.id})
        assert early.status_code == 400 and "still" in early.json()["error"]["message"]
        cancelled = client.responses.cancel(bg.id)
        assert cancelled.status == "cancelled" and client.responses.retrieve(bg.id).status == "cancelled"
        wait_idle(srv)  # its request left the engine, its KV blocks freed
        again = client.responses.cancel(bg.id)  # cancelling a finished one changes nothing
        assert again.status == "cancelled"
        fg = respond(client, input="not background")
        r = httpx.post(f"{srv.base_url}/v1/responses/{fg.id}/cancel", timeout=30)
        assert r.status_code == 400 and "background" in r.json()["error"]["message"]
        assert httpx.post(f"{srv.base_url}/v1/responses/resp_nope/cancel", timeout=30).status_code == 404
        running = respond(client, input="Long work", max_output_tokens=400, background=True)
        client.responses.delete(running.id)  # a running one stops, then goes
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(running.id)
        wait_idle(srv)
    finally:
        srv.stop()


@pytest.mark.parametrize("fields, param", [
    ({"background": True, "stream": True}, "stream"),
    ({"background": True, "store": False}, "store"),
])
def test_background_refusals(server, fields, param):
    r = httpx.post(f"{server.base_url}/v1/responses", json={"input": "x", "max_output_tokens": 2, **fields},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_background_response_left_running_is_run_again_by_the_next_server(tiny_model, tmp_path):
    """--data-dir: the request is kept with its queued response when it is
    accepted, so a server stopped mid-generation leaves it for the next one,
    which runs it under the same id to the reply a foreground request gets."""
    from fluidserve.serve.batches import BatchConfig

    def serve():
        srv = start_server(tiny_model("llama"), max_model_len=512, batch_config=BatchConfig(str(tmp_path)))
        return srv, openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    srv, c = serve()
    try:
        _slowed(srv, 0.05)  # 40 tokens: two seconds at least
        bg = respond(c, input="Survive a restart", max_output_tokens=40, background=True)
    finally:
        srv.stop()
    (pending,) = Store(str(tmp_path)).pending_responses()
    assert pending[0] == bg.id and pending[3]["input"] == "Survive a restart"

    srv, c = serve()
    try:
        done = _until_final(c, bg.id)
        fg = respond(c, input="Survive a restart", max_output_tokens=40)
        assert done.status == "incomplete" and done.output_text == fg.output_text
        assert done.created_at == bg.created_at and done.usage.output_tokens == 40
        assert Store(str(tmp_path)).pending_responses() == []
        wait_idle(srv)
    finally:
        srv.stop()
