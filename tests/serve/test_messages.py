"""Anthropic's Messages API (``/v1/messages``) on a real uvicorn server with
the tiny model, through Anthropic's official ``anthropic`` client: a reply
is the chat route's reply to the same conversation (system prompt, tool use
and results, thinking), as content blocks with Anthropic's stop reasons,
streamed as Anthropic's typed events that add up to the whole reply;
``count_tokens`` counts the prompt the reply reads; errors come in
Anthropic's shape, and the key may come as ``x-api-key``.

Greedy replies drawn from the letters (``allowed_token_ids``, passed to the
chat route as vLLM's extension) with ``ignore_eos``: every reply runs to its
token limit and reads as text.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from fluidserve.engine.tiny_model import build_tiny_thinking_model
from fluidserve.serve.api import ServerSettings
from server_utils import ok, start_server, wait_idle

LETTERS = list(range(ord("a"), ord("z") + 1))
GREEDY = {"allowed_token_ids": LETTERS, "ignore_eos": True, "top_k": 1}
KEY = "secret"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}
# A random model pads JSON with whitespace: none allowed, so a call closes.
COMPACT = {"allowed_token_ids": list(range(33, 127)) + [257], "top_k": 1}


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), ServerSettings(api_key=KEY, tool_call_parser="hermes"),
                       max_model_len=512)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", headers=server.headers()).json()["data"][0]["id"]


def chat(server, messages: list[dict], max_tokens: int = 8, **extra) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, **GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_reply_is_the_chat_routes_reply_to_the_same_conversation(server, client, model):
    r = client.messages.create(model=model, max_tokens=8, system="Be brief.", extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Hello there"}])
    body = chat(server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == body["choices"][0]["message"]["content"]
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (body["usage"]["prompt_tokens"], 8)
    # System blocks with cache_control marks: the same prompt (the prefix cache keeps every prompt anyway).
    blocks = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY,
                                    system=[{"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                                            {"type": "text", "text": "brief."}],
                                    messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}])
    assert blocks.content[0].text == r.content[0].text and blocks.usage.input_tokens == r.usage.input_tokens
    assert client.messages.count_tokens(model=model, system="Be brief.", messages=[
        {"role": "user", "content": "Hello there"}]).input_tokens == r.usage.input_tokens


def test_stop_sequences_end_the_reply_with_their_reason(client, model):
    full = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "abc"}]).content[0].text
    stop = full[4:6]
    r = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "abc"}])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    assert r.content[0].text == full[:full.index(stop)]


def test_a_streamed_reply_is_anthropics_event_sequence_adding_up_to_the_whole_reply(server, client, model):
    kw = dict(model=model, max_tokens=10, extra_body=GREEDY,
              messages=[{"role": "user", "content": "Stream me"}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text",)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text == final.content[0].text
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 10
    wait_idle(server)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_tool_use_is_schema_valid_whole_and_streamed(client, model, choice):
    kw = dict(model=model, max_tokens=120, tools=[WEATHER], tool_choice=choice, extra_body=COMPACT,
              messages=[{"role": "user", "content": "Weather in Oslo for two days?"}])
    r = client.messages.create(**kw)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and r.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"


def test_output_format_makes_the_text_follow_the_schema(client, model):
    schema = WEATHER["input_schema"]
    r = client.messages.create(model=model, max_tokens=80, extra_body={**COMPACT, "output_config": {
        "format": {"type": "json_schema", "schema": schema}}}, messages=[{"role": "user", "content": "JSON, please."}])
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_tool_use_and_results_in_the_history_reach_the_template_as_the_chat_route_sends_them(server, client,
                                                                                             model):
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    chat_history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = client.messages.create(model=model, max_tokens=6, extra_body=GREEDY, tools=[WEATHER],
                               tool_choice={"type": "none"}, messages=history)
    body = chat(server, chat_history, max_tokens=6, tools=[CHAT_WEATHER], tool_choice="none")
    assert r.content[0].text == body["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == body["usage"]["prompt_tokens"]
    assert client.messages.count_tokens(model=model, messages=history, tools=[WEATHER],
                                        tool_choice={"type": "none"}).input_tokens == r.usage.input_tokens


@pytest.mark.parametrize("body, words", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temprature": 1}, "temprature"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled",
                                                                                   "budget_tokens": 4}},
     "--reasoning-parser"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}},
     "budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "output_config": {"effort": "high"}},
     "the chat template reads neither"),
])
def test_errors_take_anthropics_shape(server, body, words):
    r = httpx.post(f"{server.base_url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert words in r.json()["error"]["message"]


def test_keys_models_and_the_other_routes(server, client):
    bad = httpx.post(f"{server.base_url}/v1/messages", json={}, headers={"x-api-key": "wrong"}, timeout=30)
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    # The OpenAI routes keep OpenAI's shape, and take the key as a bearer token.
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": []}, headers=server.headers(),
                   timeout=30)
    assert r.status_code == 400 and set(r.json()) == {"error"} and "param" in r.json()["error"]


def test_thinking_is_a_thinking_block_with_its_budget():
    """On a thinking model: the reply's reasoning is a thinking block (the
    chat route's reasoning), before the text; ``budget_tokens`` is the
    chat route's thinking_token_budget; ``disabled`` turns thinking off."""
    import tempfile
    from pathlib import Path

    path = str(build_tiny_thinking_model(Path(tempfile.mkdtemp()) / "thinking"))
    srv = start_server(path, ServerSettings(reasoning_parser="qwen3"))
    client = anthropic.Anthropic(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=60)
    try:
        msgs = [{"role": "user", "content": "Think, then answer."}]
        steer = {"allowed_token_ids": LETTERS + [261, 262], "top_k": 1}
        for thinking, budget in ((None, None), ({"type": "enabled", "budget_tokens": 5}, 5)):
            kw = dict(model=path, max_tokens=20, messages=msgs, extra_body=steer)
            r = client.messages.create(**kw, **({"thinking": thinking} if thinking else {}))
            body = ok(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "temperature": 0, **steer,
                                                    **({"thinking_token_budget": budget} if budget else {})})
            message = body["choices"][0]["message"]
            assert r.content[0].type == "thinking" and r.content[0].thinking == message["reasoning"]
            assert [b.text for b in r.content[1:]] == ([message["content"]] if message["content"] else [])
            with client.messages.stream(**kw, **({"thinking": thinking} if thinking else {})) as stream:
                events = list(stream)
            streamed = "".join(e.delta.thinking for e in events
                               if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
            assert streamed == message["reasoning"]
        assert len(r.content[0].thinking) == 5  # the budget: five letters of thinking
        off = client.messages.create(model=path, max_tokens=8, messages=msgs, extra_body=steer,
                                     thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"]
    finally:
        srv.stop()
