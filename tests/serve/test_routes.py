"""vLLM's and SageMaker's extra routes through a real server: /tokenize,
/detokenize, /ping, /load, /invocations; and /docs, /openapi.json describing
the request bodies while errors stay 400 in OpenAI's shape."""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import start_server

IM_START = 259


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), max_model_len=256)
    yield srv
    srv.stop()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_tokenize_prompt_and_detokenize(server):
    resp = post(server, "/tokenize", {"prompt": "héllo", "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = list("héllo".encode())  # the byte tokenizer: one token per UTF-8 byte
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] == 256
    assert len(body["token_strs"]) == len(ids) and body["token_strs"][0] == "h"
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "héllo"}
    assert post(server, "/tokenize", {"prompt": "a"}).json()["token_strs"] is None


def test_tokenize_chat_matches_what_chat_completions_bills(server):
    msgs = [{"role": "user", "content": "hi"}]
    tok = post(server, "/tokenize", {"messages": msgs}).json()
    assert tok["tokens"][0] == IM_START
    chat = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"]
    bare = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["count"] == tok["count"] - 1 - len("assistant\n")


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [99999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_errors_name_the_field(server, path, body, param):
    resp = post(server, path, body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


def test_ping_and_load(server):
    assert httpx.get(f"{server.base_url}/ping").status_code == 200
    assert httpx.post(f"{server.base_url}/ping").status_code == 200
    assert httpx.get(f"{server.base_url}/load").json() == {"server_load": 0}
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))
        assert httpx.get(f"{server.base_url}/load").json() == {"server_load": 1}
        for _ in lines:
            pass


def test_invocations_routes_by_body(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    comp = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    via_chat = post(server, "/invocations", chat).json()
    assert via_chat["object"] == "chat.completion"
    direct = post(server, "/v1/chat/completions", chat).json()
    assert via_chat["choices"][0]["message"] == direct["choices"][0]["message"]
    via_comp = post(server, "/invocations", comp).json()
    assert via_comp["object"] == "text_completion"
    assert via_comp["choices"][0]["text"] == post(server, "/v1/completions", comp).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{server.base_url}/invocations", json={**comp, "stream": True}, timeout=60) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == via_comp["choices"][0]["text"]
    bad = httpx.post(f"{server.base_url}/invocations", content=b"{nope", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_openapi_describes_request_bodies_and_errors_stay_400(server):
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    comps = schema["components"]["schemas"]
    op = schema["paths"]["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"messages", "logit_bias", "stop_token_ids", "priority"} <= set(comps["ChatCompletionRequest"]["properties"])
    assert "ChatMessage" in comps and "422" not in op["responses"] and "400" in op["responses"]
    tok = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(tok["oneOf"]) == 2
    # every $ref resolves
    refs = {m for m in json.dumps(schema).split('"$ref": "')[1:]}
    assert all(r.split('"')[0].removeprefix("#/components/schemas/") in comps for r in refs)
    docs = httpx.get(f"{server.base_url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    # described, yet still parsed by hand: a type error is a 400 naming the field, not a 422
    bad = post(server, "/v1/completions", {"prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_parameter_fastapi_validates_is_a_400_naming_it():
    """Routes parse their bodies and queries by hand; one that declares a
    typed parameter (FastAPI validates it) still answers a bad value with
    OpenAI's 400, not a 422 or a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from fluidserve.serve.errors import install_handlers

    app = FastAPI()
    install_handlers(app)

    @app.get("/items")
    async def items(limit: int = 20) -> dict:
        return {"limit": limit}

    client = TestClient(app)
    assert client.get("/items", params={"limit": 3}).json() == {"limit": 3}
    bad = client.get("/items", params={"limit": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    assert "integer" in bad.json()["error"]["message"]


def test_a_missing_route_is_a_404_that_says_why(server):
    """An unknown path is OpenAI's "Invalid URL"; a pooling model's route on
    a generative model's server says which kind of model serves it; a known
    path with the wrong method names the methods it takes."""
    r = post(server, "/v1/nope", {})
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "Invalid URL (POST /v1/nope)", "type": "not_found_error", "param": None, "code": None}
    for path, kind in (("/v1/embeddings", "an embedding model"), ("/classify", "a sequence classifier"),
                       ("/v1/rerank", "a pooling model"), ("/pooling", "a pooling model")):
        r = post(server, path, {"input": "hi"})
        message = r.json()["error"]["message"]
        assert r.status_code == 404 and message.startswith(f"{path} is served for {kind}"), (path, message)
        assert message.endswith("is generative"), message
    r = httpx.delete(f"{server.base_url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == (
        "DELETE is not allowed on /v1/chat/completions (only POST)")
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
