"""``POST /v1/embeddings`` on a real uvicorn server with the OpenAI client:
an embedding model's vectors (``--runner pooling``) equal the pooled
``last_hidden_state`` of Hugging Face ``transformers`` for the same tiny
random-weight model (1e-5, fp32), as JSON floats and as base64 in each
``embed_dtype`` and byte order; an embedding server has no generation
routes; mistakes are 4xx in OpenAI's shape and the server serves on."""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from fluidserve.serve.batches import BatchConfig
from server_utils import start_server

TOL = 1e-5
TEXTS = ["The quick brown fox jumps over the dogs.", "Hello!"]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # A 16-token step budget: the 40-token text runs in three chunks. With the Batch API.
    srv = start_server(model_dir, runner="pooling", max_num_batched_tokens=16, max_model_len=64,
                       batch_config=BatchConfig(str(tmp_path_factory.mktemp("embeddings-batches"))))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir, server):
    """token ids -> HF's last-token state, normalized (the served pooling)."""
    hf = transformers.AutoModel.from_pretrained(model_dir).eval()

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            last = hf(torch.tensor([ids])).last_hidden_state[0, -1].float()
        return torch.nn.functional.normalize(last, dim=0).numpy()

    return run


def ids_of(server, text: str) -> list[int]:
    return list(server.engine.tokenizer.encode(text))


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)


def test_openai_client_vectors_match_transformers(server, client, reference):
    want = [reference(ids_of(server, t)) for t in TEXTS]
    model = server.engine.model_name
    # Left unset, the SDK asks for base64 and decodes it as little-endian float32.
    for fmt in ({}, {"encoding_format": "float"}):
        got = client.embeddings.create(model=model, input=TEXTS, **fmt)
        assert got.model == model and got.object == "list"
        assert [d.index for d in got.data] == [0, 1]
        for d, w in zip(got.data, want):
            assert np.abs(np.array(d.embedding) - w).max() < TOL
        tokens = sum(len(ids_of(server, t)) for t in TEXTS)
        assert got.usage.prompt_tokens == got.usage.total_tokens == tokens
    ids = ids_of(server, TEXTS[0])
    for given in (ids, [ids, ids[:9]]):
        got = client.embeddings.create(model=model, input=given, encoding_format="float")
        rows = given if isinstance(given[0], list) else [given]
        for d, row in zip(got.data, rows):
            assert np.abs(np.array(d.embedding) - reference(row)).max() < TOL


@pytest.mark.parametrize("dtype,endianness", [("float32", "big"), ("float16", "little"), ("bfloat16", "big")])
def test_base64_in_each_dtype_and_byte_order(server, dtype, endianness):
    body = {"input": "Hello!"}
    floats = post(server, body).json()["data"][0]["embedding"]
    packed = post(server, {**body, "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness})
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    order = ">" if endianness == "big" else "<"
    if dtype == "bfloat16":  # bit for bit torch's rounding
        want = torch.tensor(floats).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
        assert np.array_equal(np.frombuffer(raw, dtype=f"{order}u2"), want)
    else:
        got = np.frombuffer(raw, dtype=f"{order}{'f4' if dtype == 'float32' else 'f2'}")
        assert np.array_equal(got, np.array(floats, dtype=dtype))


def test_truncation_fits_a_long_input(server, reference):
    long = ids_of(server, "abcdefgh" * 10)  # 80 tokens past max_model_len=64
    r = post(server, {"input": long})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["code"] == "context_length_exceeded"
    for side, kept in (("right", long[:20]), ("left", long[-20:])):
        r = post(server, {"input": long, "truncate_prompt_tokens": 20, "truncation_side": side,
                          "encoding_format": "float"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20
        assert np.abs(np.array(r.json()["data"][0]["embedding"]) - reference(kept)).max() < TOL


def test_chat_form_embeds_the_rendered_conversation(server, reference):
    """vLLM's chat form: each conversation rendered through the chat
    template (no generation prompt unless asked, no special tokens added)
    and embedded as one prompt; ``input`` may carry the conversations too."""
    tok = server.engine.tokenizer
    talks = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
             [{"role": "user", "content": "Where do foxes live?"}]]

    def rendered(talk: list[dict], **kw) -> list[int]:
        return list(tok.encode(tok.apply_chat_template(talk, tokenize=False, **kw), add_special_tokens=False))

    for body in ({"messages": talks[0]}, {"input": talks[0]}):
        r = post(server, {**body, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        ids = rendered(talks[0], add_generation_prompt=False)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert np.abs(np.array(r.json()["data"][0]["embedding"]) - reference(ids)).max() < TOL
    for body in ({"messages": talks}, {"input": talks}):
        r = post(server, {**body, "add_generation_prompt": True, "encoding_format": "float"})
        assert [d["index"] for d in r.json()["data"]] == [0, 1]
        for d, talk in zip(r.json()["data"], talks):
            assert np.abs(np.array(d["embedding"]) - reference(rendered(talk, add_generation_prompt=True))).max() < TOL


def test_a_trusted_server_embeds_a_conversation_through_the_requests_template(model_dir, reference):
    """With --trust-request-chat-template the chat form renders through the
    request's ``chat_template``, as the chat route does: the vector is that
    of the text the template writes."""
    from fluidserve.serve.api import ServerSettings

    srv = start_server(model_dir, ServerSettings(trust_request_chat_template=True), runner="pooling",
                       max_model_len=64)
    try:
        template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        talk = [{"role": "user", "content": "Where do foxes live?"}]
        r = post(srv, {"messages": talk, "chat_template": template, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        ids = list(srv.engine.tokenizer.encode("[user] Where do foxes live?\n", add_special_tokens=False))
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert np.abs(np.array(r.json()["data"][0]["embedding"]) - reference(ids)).max() < TOL
    finally:
        srv.stop()


def test_use_activation_false_leaves_the_vector_unnormalized(server, model_dir):
    r = post(server, {"input": "Hello!", "use_activation": False})
    vec = np.array(r.json()["data"][0]["embedding"])
    assert abs(np.linalg.norm(vec) - 1) > 0.1  # the raw state is no unit vector
    unit = np.array(post(server, {"input": "Hello!"}).json()["data"][0]["embedding"])
    assert np.abs(vec / np.linalg.norm(vec) - unit).max() < TOL


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ({"input": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    # A request's own template needs --trust-request-chat-template (this server lacks it), and the chat form.
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ({"input": "hi", "chat_template": "{{ 1 }}"}, 400, "chat_template"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True,
      "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "input"),
    ({"input": "hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ({"input": "hi", "embed_dtype": "fp8_e4m3"}, 400, "embed_dtype"),
    ({"input": "hi", "dimension": 8}, 400, "dimension"),
    ({"input": "hi", "model": "other"}, 404, "model"),
])
def test_mistakes_are_4xx_naming_the_field(server, body, status, param):
    r = post(server, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert post(server, {"input": "still serving"}).status_code == 200


def test_the_pooling_route_gives_the_embeddings(server, reference):
    """vLLM's ``/pooling`` on an embedding model: each input's vector as
    ``/v1/embeddings`` gives it (as floats, or base64 byte for byte), under
    ``task: "embed"`` or none; a task the model does not pool is a 400
    naming ``task``, and the server serves on."""
    def pool(body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/pooling", json=body, timeout=60)

    for body in ({"input": TEXTS}, {"input": TEXTS, "task": "embed"}):
        r = pool(body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["id"].startswith("pool-") and got["object"] == "list" and got["model"] == server.engine.model_name
        assert [(d["index"], d["object"]) for d in got["data"]] == [(0, "pooling"), (1, "pooling")]
        for d, text in zip(got["data"], TEXTS):
            assert np.abs(np.array(d["data"]) - reference(ids_of(server, text))).max() < TOL
        assert got["usage"]["prompt_tokens"] == sum(len(ids_of(server, t)) for t in TEXTS)
    packed = {"input": "Hello!", "encoding_format": "base64", "embed_dtype": "float16"}
    assert pool(packed).json()["data"][0]["data"] == post(server, packed).json()["data"][0]["embedding"]
    for task in ("classify", "token_embed", "bogus"):
        r = pool({"input": "hi", "task": task})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text
    assert pool({"input": "still serving"}).status_code == 200


def test_an_embedding_server_has_no_generation_routes(server):
    base = server.base_url
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                 "/v1/chat/completions/batch", "/classify"):
        r = httpx.post(f"{base}{path}", json={})
        why = r.json()["error"]["message"]  # what serves the route, and what this model is
        assert r.status_code == 404 and why.endswith("is an embedding model"), (path, why)
        kind = "a sequence classifier" if path == "/classify" else "a generative model (--runner generate)"
        assert why.startswith(f"{path} is served for {kind}"), why
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == server.engine.model_name
    assert httpx.post(f"{base}/tokenize", json={"prompt": "Hello!"}).json()["count"] == len(ids_of(server, "Hello!"))
    # SageMaker's one route takes an embeddings body here.
    r = httpx.post(f"{base}/invocations", json={"input": "Hello!"})
    assert r.status_code == 200 and r.json()["object"] == "list"


def test_a_generation_server_has_no_embeddings_route(model_dir):
    srv = start_server(model_dir)
    try:
        for route in ("/v1/embeddings", "/pooling"):
            assert httpx.post(f"{srv.base_url}{route}", json={"input": "hi"}).status_code == 404, route
    finally:
        srv.stop()


def test_batch_api_embeds_offline_as_online(server, client):
    """OpenAI's Batch API with /v1/embeddings lines: each line's reply is
    the online route's, run as offline work; a batch of another endpoint
    is refused at creation on an embedding model."""
    bodies = [{"input": TEXTS, "encoding_format": "float"}, {"input": "Hello!", "encoding_format": "float"},
              {"input": "Hello!", "dimensions": 4}]
    rows = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": b} for i, b in enumerate(bodies)]
    up = client.files.create(file=("e.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                             purpose="batch")
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert err.value.body["param"] == "endpoint"
    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 1
    out = {o["custom_id"]: o for o in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i in (0, 1):
        online = post(server, bodies[i]).json()
        got = out[f"e{i}"]["response"]["body"]
        assert got["usage"] == online["usage"]
        for a, b in zip(got["data"], online["data"]):
            assert np.abs(np.array(a["embedding"]) - np.array(b["embedding"])).max() < TOL
    err_line = json.loads(client.files.content(batch.error_file_id).text)
    assert err_line["custom_id"] == "e2" and err_line["response"]["body"]["error"]["param"] == "dimensions"


def test_run_batch_cli_embeds(model_dir, tmp_path, capsys):
    from fluidserve.serve.cli import main

    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
             "body": {"input": ["one", "two"], "encoding_format": "float"}},
            {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
            {"custom_id": "c", "method": "POST", "url": "/v1/rerank",
             "body": {"query": "one", "documents": ["two", "one"]}}]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    rc = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model",
               model_dir, "--runner", "pooling", "--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "64"])
    assert rc == 0
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert [d["index"] for d in out["a"]["response"]["body"]["data"]] == [0, 1]
    assert out["b"]["response"]["status_code"] == 400  # an embedding model generates nothing
    ranked = out["c"]["response"]["body"]["results"]
    assert [r["index"] for r in ranked] == [1, 0] and abs(ranked[0]["relevance_score"] - 1) < 1e-6
    assert "3/3 requests, 1 failed" in capsys.readouterr().err
