"""vLLM's ``/score`` and ``/rerank`` on an embedding model, on a real
uvicorn server: each pair's score is the cosine of the two texts' vectors
as Hugging Face ``transformers`` computes them for the same tiny
random-weight model (1e-5, fp32); the sides pair 1:1, 1:N and N:N under
every field name vLLM takes; rerank orders by that score; a query scored
against N documents is embedded once; mistakes are 4xx in OpenAI's shape
naming the field, and the server serves on; Batch API lines score as the
online routes do."""

from __future__ import annotations

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
QUERY = "Where do foxes live?"
DOCS = ["Foxes live in dens.", "The stock market fell.", "A fox jumps over the dog."]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_server(model_dir, runner="pooling", max_num_batched_tokens=16, max_model_len=64,
                       batch_config=BatchConfig(str(tmp_path_factory.mktemp("score-batches"))))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cosine_of(model_dir, server):
    """(text, text) -> the cosine of HF's last-token states."""
    hf = transformers.AutoModel.from_pretrained(model_dir).eval()
    tok = server.engine.tokenizer

    def vec(text: str) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([list(tok.encode(text))])).last_hidden_state[0, -1].double().numpy()

    def run(a: str, b: str) -> float:
        u, v = vec(a), vec(b)
        return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))

    return run


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def tokens(server, *texts: str) -> int:
    return sum(len(server.engine.tokenizer.encode(t)) for t in texts)


@pytest.mark.parametrize("one,two", [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                                     ("data_1", "data_2")])
def test_score_is_the_cosine_of_transformers_vectors(server, cosine_of, one, two):
    r = post(server, "/score", {one: QUERY, two: DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.engine.model_name
    assert body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    for d, doc in zip(body["data"], DOCS):
        assert abs(d["score"] - cosine_of(QUERY, doc)) < TOL
    # The query is embedded once for the three documents.
    assert body["usage"] == {"prompt_tokens": tokens(server, QUERY, *DOCS),
                             "total_tokens": tokens(server, QUERY, *DOCS), "completion_tokens": 0}


def test_pairs_one_to_one_and_n_to_n(server, cosine_of):
    one = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0]}).json()
    assert len(one["data"]) == 1 and abs(one["data"][0]["score"] - cosine_of(QUERY, DOCS[0])) < TOL
    firsts = [QUERY, DOCS[1], "Dens are warm."]
    many = post(server, "/score", {"text_1": firsts, "text_2": DOCS}).json()
    for d, a, b in zip(many["data"], firsts, DOCS):
        assert abs(d["score"] - cosine_of(a, b)) < TOL
    assert many["usage"]["prompt_tokens"] == tokens(server, *firsts, *DOCS)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(server, cosine_of, path):
    r = post(server, path, {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = sorted(((cosine_of(QUERY, d), i) for i, d in enumerate(DOCS)), reverse=True)
    assert [x["index"] for x in body["results"]] == [i for _, i in want]
    for x, (score, i) in zip(body["results"], want):
        assert abs(x["relevance_score"] - score) < TOL and x["document"] == {"text": DOCS[i]}
    n = tokens(server, QUERY, *DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    top = post(server, path, {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert [x["index"] for x in top["results"]] == [i for _, i in want[:2]]


def test_per_side_token_limits_cut_the_text(server, cosine_of):
    # The byte-level tokenizer spells one token per byte: 6 tokens are 6 characters.
    r = post(server, "/score", {"queries": QUERY, "documents": DOCS[0], "max_tokens_per_query": 6,
                                "max_tokens_per_doc": 4})
    assert r.status_code == 200, r.text
    assert abs(r.json()["data"][0]["score"] - cosine_of(QUERY[:6], DOCS[0][:4])) < TOL
    assert r.json()["usage"]["prompt_tokens"] == 10
    long = "abcdefgh" * 10  # 80 tokens, past max_model_len=64
    r = post(server, "/rerank", {"query": QUERY, "documents": [DOCS[0], long]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "documents"
    for body in ({"truncate_prompt_tokens": 20}, {"max_tokens_per_doc": 20}):
        r = post(server, "/rerank", {"query": QUERY, "documents": [long], **body})
        assert r.status_code == 200, r.text
        assert abs(r.json()["results"][0]["relevance_score"] - cosine_of(QUERY, long[:20])) < TOL


@pytest.mark.parametrize("path,body,status,param", [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, 400, "text_2"),
    ("/score", {"text_1": [], "text_2": DOCS}, 400, "text_1"),
    ("/score", {"text_1": QUERY}, 400, "text_2"),
    ("/score", {"queries": QUERY, "documents": DOCS, "items": DOCS}, 400, "items"),
    ("/score", {"text_1": {"content": [{"type": "text", "text": "hi"}]}, "text_2": "x"}, 400, "text_1"),
    ("/score", {"text_1": "hi", "text_2": "x", "instruction": "Judge relevance."}, 400, "instruction"),
    ("/score", {"text_1": "hi", "text_2": "x", "max_tokens_per_doc": 64}, 400, "max_tokens_per_doc"),
    ("/score", {"text_1": "hi", "text_2": "x", "model": "other"}, 404, "model"),
    ("/rerank", {"query": QUERY, "documents": []}, 400, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, 400, "top_n"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "return_documents": False}, 400, "return_documents"),
    ("/rerank", {"documents": DOCS}, 400, "query"),
])
def test_mistakes_are_4xx_naming_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert post(server, path, {"text_1": "a", "text_2": "b"} if path == "/score"
                else {"query": "a", "documents": ["b"]}).status_code == 200


def test_a_generation_server_has_no_scoring_routes(model_dir):
    srv = start_server(model_dir)
    try:
        for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            assert httpx.post(f"{srv.base_url}{path}", json={}).status_code == 404, path
    finally:
        srv.stop()


def test_batch_api_scores_as_online(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    lines = {"/v1/score": [{"text_1": QUERY, "text_2": DOCS}, {"text_1": [QUERY, QUERY], "text_2": DOCS}],
             "/v1/rerank": [{"query": QUERY, "documents": DOCS, "top_n": 2}]}
    for endpoint, bodies in lines.items():
        rows = [{"custom_id": f"s{i}", "method": "POST", "url": endpoint, "body": b} for i, b in enumerate(bodies)]
        up = client.files.create(file=("s.jsonl", io.BytesIO("\n".join(map(json.dumps, rows)).encode())),
                                 purpose="batch")
        batch = client.batches.create(input_file_id=up.id, endpoint=endpoint, completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert batch.request_counts.completed == 1 and batch.request_counts.failed == len(bodies) - 1
        got = json.loads(client.files.content(batch.output_file_id).text.splitlines()[0])["response"]["body"]
        online = post(server, endpoint.removeprefix("/v1"), bodies[0]).json()
        assert got["usage"] == online["usage"]
        key, score = ("data", "score") if endpoint == "/v1/score" else ("results", "relevance_score")
        assert [x.get("index") for x in got[key]] == [x.get("index") for x in online[key]]
        assert np.allclose([x[score] for x in got[key]], [x[score] for x in online[key]], atol=TOL)
        if len(bodies) > 1:
            err = json.loads(client.files.content(batch.error_file_id).text)
            assert err["response"]["body"]["error"]["param"] == "text_2"
