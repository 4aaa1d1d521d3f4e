"""A sequence classifier served on a real uvicorn server: ``/classify``
answers the label probabilities of Hugging Face's
``AutoModelForSequenceClassification`` for the same tiny random-weight
checkpoint (1e-5, fp32), for text, token ids and conversations; a one-label
classifier serves ``/score`` and ``/rerank`` as a cross-encoder; the routes
an embedding model has and a classifier has not are 404; mistakes are 4xx
naming the field, and the server serves on."""

from __future__ import annotations

import httpx
import pytest
import torch
import transformers

from fluidserve.engine.tiny_model import build_tiny_classifier
from server_utils import start_server

TOL = 1e-5
LABELS = ("neg", "neu", "pos")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = str(build_tiny_classifier(tmp_path_factory.mktemp("classifier"), "llama", labels=LABELS))
    srv = start_server(path, max_num_batched_tokens=16, max_model_len=64)
    yield srv, path
    srv.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = str(build_tiny_classifier(tmp_path_factory.mktemp("reranker"), "qwen3", labels=("relevant",)))
    srv = start_server(path, max_model_len=128)
    yield srv, path
    srv.stop()


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def post(srv, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}{route}", json=body, timeout=60)


def test_classify_gives_transformers_probabilities(classifier):
    srv, path = classifier
    tok = srv.engine.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog, then naps.", "Hello!"]
    r = post(srv, "/classify", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("classify-") and body["object"] == "list"
    assert body["usage"]["prompt_tokens"] == sum(len(tok.encode(t)) for t in texts)
    for d, text in zip(body["data"], texts):
        want = torch.softmax(hf_logits(path, list(tok.encode(text))), -1)
        assert (torch.tensor(d["probs"]) - want).abs().max() < TOL
        assert d["num_classes"] == 3 and d["label"] == LABELS[int(want.argmax())]
    ids = list(tok.encode(texts[1]))
    raw = post(srv, "/classify", {"input": ids, "use_activation": False}).json()["data"][0]["probs"]
    assert (torch.tensor(raw) - hf_logits(path, ids)).abs().max() < TOL
    talk = [{"role": "user", "content": "Is this good?"}]
    chat = post(srv, "/classify", {"messages": talk}).json()["data"][0]["probs"]
    rendered = list(tok.encode(tok.apply_chat_template(talk, tokenize=False), add_special_tokens=False))
    assert (torch.tensor(chat) - torch.softmax(hf_logits(path, rendered), -1)).abs().max() < TOL


def test_the_pooling_route_gives_the_label_probabilities(classifier):
    """vLLM's ``/pooling`` on a classifier: each input's probabilities as
    ``/classify`` gives them (the logits with ``use_activation: false``);
    ``task: "embed"`` and ``dimensions`` are 400s naming the field."""
    srv, _ = classifier
    texts = ["The quick brown fox jumps over the lazy dog, then naps.", "Hello!"]
    for extra in ({}, {"use_activation": False}):
        want = [d["probs"] for d in post(srv, "/classify", {"input": texts, **extra}).json()["data"]]
        for task in ({}, {"task": "classify"}):
            r = post(srv, "/pooling", {"input": texts, **extra, **task})
            assert r.status_code == 200, r.text
            assert [d["data"] for d in r.json()["data"]] == want
    for body, param in (({"input": "hi", "task": "embed"}, "task"), ({"input": "hi", "dimensions": 2}, "dimensions")):
        r = post(srv, "/pooling", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_classifier_serves_classify_not_embeddings(classifier):
    srv, _ = classifier
    for route in ("/v1/embeddings", "/v1/completions", "/v1/chat/completions"):
        r = post(srv, route, {"input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["message"].endswith("is a sequence classifier"), r.text
    r = post(srv, "/score", {"text_1": "a", "text_2": "b"})  # three labels: no single score
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert httpx.post(f"{srv.base_url}/invocations", json={"input": "hi"}).json()["data"][0]["num_classes"] == 3


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 2}, "dimensions"),
    ({"input": "hi", "encoding_format": "base64"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_classify_mistakes_name_the_field(classifier, body, param):
    srv, _ = classifier
    r = post(srv, "/classify", body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert post(srv, "/classify", {"input": "still serving"}).status_code == 200


def test_a_one_label_classifier_reranks_as_a_cross_encoder(reranker):
    srv, path = reranker
    tok = srv.engine.tokenizer
    query, docs = "Where do foxes live?", ["Foxes live in dens.", "Stocks fell.", "A fox naps."]

    def want(doc: str) -> float:
        return torch.sigmoid(hf_logits(path, list(tok(text=query, text_pair=doc)["input_ids"]))).item()

    scores = post(srv, "/score", {"queries": query, "documents": docs}).json()
    assert [abs(d["score"] - want(doc)) < TOL for d, doc in zip(scores["data"], docs)] == [True] * 3
    # One prompt per pair: the query counted with each document.
    assert scores["usage"]["prompt_tokens"] == sum(len(tok(text=query, text_pair=d)["input_ids"]) for d in docs)
    ranked = post(srv, "/rerank", {"query": query, "documents": docs, "top_n": 2}).json()["results"]
    order = sorted(range(3), key=lambda i: -want(docs[i]))
    assert [x["index"] for x in ranked] == order[:2]
    assert abs(ranked[0]["relevance_score"] - want(docs[order[0]])) < TOL


def test_a_causal_lm_reranker_with_a_score_template(tiny_model):
    """vLLM's Qwen3-Reranker recipe through the server: ``hf_overrides`` and
    ``--chat-template`` as the score template; /rerank orders by HF's
    ``softmax([no, yes])[yes]`` of each rendered pair."""
    import json

    path = tiny_model("qwen3")
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
                 "is_original_qwen3_reranker": True}
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<answer>"
    srv = start_server(path, chat_template=template, hf_overrides=json.dumps(overrides), max_model_len=128)
    try:
        tok = srv.engine.tokenizer
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        no, yes = tok.convert_tokens_to_ids("n"), tok.convert_tokens_to_ids("y")
        query, docs = "Where do foxes live?", ["Foxes live in dens.", "Stocks fell.", "A fox naps."]

        def want(doc: str) -> float:
            with torch.no_grad():
                logits = hf(torch.tensor([tok.encode(f"<query>{query}<document>{doc}<answer>")])).logits[0, -1]
            return torch.softmax(logits[[no, yes]].float(), -1)[1].item()

        ranked = post(srv, "/rerank", {"query": query, "documents": docs}).json()["results"]
        assert [x["index"] for x in ranked] == sorted(range(3), key=lambda i: -want(docs[i]))
        assert all(abs(x["relevance_score"] - want(docs[x["index"]])) < TOL for x in ranked)
    finally:
        srv.stop()
