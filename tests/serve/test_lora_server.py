"""LoRA adapters through the server: a real uvicorn server on localhost and
the OpenAI client. An adapter is a model name (``/v1/models`` lists it under
its base model, replies carry it), generates PEFT's tokens, and, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, is loaded and unloaded while the
server runs (vLLM's routes); mistakes are 4xx in OpenAI's shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from fluidserve.serve.api import ServerSettings
from lora_utils import make_adapter, peft_greedy
from server_utils import start_server

PROMPT = "The quick brown fox jumps over"
TOKENS = 10
GREEDY = {"temperature": 0, "max_tokens": TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def lora_server(tiny_model, tmp_path_factory):
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora-server")
    made = {"a1": make_adapter(path, root / "a1", seed=1), "a2": make_adapter(path, root / "a2", seed=2, r=8),
            "wide": make_adapter(path, root / "wide", seed=3, r=32)}
    server = start_server(path, ServerSettings(runtime_lora_updating=True), enable_lora=True, max_loras=2,
                          max_lora_rank=8, lora_modules=(("a1", made["a1"]),))
    refs = {name: peft_greedy(path, made.get(name), [PROMPT], TOKENS)[0] for name in (None, "a1", "a2")}
    assert len({tuple(r) for r in refs.values()}) == 3  # the adapters change the tokens
    yield server, made, refs
    server.stop()


def test_adapters_are_models_that_generate_as_peft_does(lora_server):
    server, made, refs = lora_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    base = server.engine.model_name
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [base, "a1"]
    assert cards["a1"].root == made["a1"] and cards["a1"].parent == base and cards[base].parent is None
    for model, ref in [(base, refs[None]), ("a1", refs["a1"])]:
        done = client.completions.create(model=model, prompt=PROMPT, **GREEDY)
        assert done.model == model
        assert done.choices[0].token_ids == ref
        chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **GREEDY))
        assert {c.model for c in chunks} == {model}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a1"
    assert client.models.retrieve("a1").parent == base
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="a3", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'vllm:lora_requests_info{engine="0",max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' \
        in metrics


def test_adapters_load_and_unload_at_runtime(lora_server):
    server, made, refs = lora_server
    url = server.base_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

    def post(route, **body):
        return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)

    ok = post("load_lora_adapter", lora_name="a2", lora_path=made["a2"])
    assert ok.status_code == 200 and "a2" in ok.text
    assert [m.id for m in client.models.list().data][1:] == ["a1", "a2"]
    assert client.completions.create(model="a2", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a2"]
    for body, status, param, says in [
        (dict(lora_name="a2", lora_path=made["a2"]), 400, "lora_name", "already been loaded"),
        (dict(lora_name="a3", lora_path=made["a2"]), 400, "lora_name", "all 2 adapter slots are in use"),
        (dict(lora_name=server.engine.model_name, lora_path=made["a2"]), 400, "lora_name", "base model"),
        (dict(lora_name="a3"), 400, "lora_path", "lora_path"),
        (dict(lora_name="a3", lora_path=made["a2"], rank=4), 400, "rank", "rank"),
    ]:
        resp = post("load_lora_adapter", **body)
        assert resp.status_code == status, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and says in error["message"], error
    assert post("unload_lora_adapter", lora_name="a2").status_code == 200
    for body, param, says in [(dict(lora_name="a3", lora_path="/nonexistent"), "lora_path", "is not a folder"),
                              (dict(lora_name="a3", lora_path=made["wide"]), "lora_path", "exceeds max_lora_rank=8")]:
        resp = post("load_lora_adapter", **body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
        assert says in resp.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPT, max_tokens=2)
    gone = post("unload_lora_adapter", lora_name="a2")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    # Loaded again into the freed slot: PEFT's tokens again; the server served throughout.
    assert post("load_lora_adapter", lora_name="a2", lora_path=made["a2"]).status_code == 200
    assert client.completions.create(model="a2", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a2"]
    assert client.completions.create(model="a1", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a1"]
    # In place (vLLM's load_inplace): the new weights need a slot of their own while the old ones serve.
    resp = post("load_lora_adapter", lora_name="a2", lora_path=made["a1"], load_inplace=True)
    assert resp.status_code == 400 and "slots are in use" in resp.json()["error"]["message"]
    assert client.completions.create(model="a2", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a2"]
    assert post("unload_lora_adapter", lora_name="a2").status_code == 200
    assert server.engine.lora_names() == {"a1": made["a1"]}
    assert post("load_lora_adapter", lora_name="a1", lora_path=made["a2"], load_inplace=True).status_code == 200
    assert client.completions.create(model="a1", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a2"]
    assert post("load_lora_adapter", lora_name="a1", lora_path=made["a1"], load_inplace=True).status_code == 200
    assert client.completions.create(model="a1", prompt=PROMPT, **GREEDY).choices[0].token_ids == refs["a1"]
    assert server.engine.lora_names() == {"a1": made["a1"]}


def test_runtime_routes_exist_only_when_allowed(tiny_model):
    server = start_server(tiny_model("llama"), enable_lora=True)
    try:
        resp = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert resp.status_code == 404
    finally:
        server.stop()


def test_the_load_generator_spreads_requests_over_the_adapters(lora_server, tmp_path):
    """``fluidserve bench --lora-modules`` (vLLM's flag): each request names
    one of the given models, drawn at random, and the server serves them all."""
    import json
    import random

    from fluidserve.serve import bench_client as bc

    server, _, _ = lora_server
    base = server.engine.model_name
    args = bc.build_parser().parse_args(["--lora-modules", "a1", base])
    rng = random.Random(0)
    sent = [bc._payload(args, "unused", bc.RequestSpec(8, 4, 0.0), rng)[1]["model"] for _ in range(40)]
    assert set(sent) == {"a1", base}
    rc = bc.main(["--base-url", server.base_url, "--no-progress", "--save-result", "--result-dir", str(tmp_path),
                  "--result-filename", "run.json", "--num-prompts", "12", "--random-input-len", "16",
                  "--random-output-len", "4", "--lora-modules", "a1", base])
    assert rc == 0
    result = json.loads((tmp_path / "run.json").read_text())
    assert (result["completed"], result["failed"]) == (12, 0)
