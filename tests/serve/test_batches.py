"""The Batch API end to end: the official ``openai`` client against a real
uvicorn server with a real SQLite store, a ``kill -9`` of a real server
process mid-batch, and the store's failure modes (full, corrupt)."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from fluidserve.engine.async_engine import AsyncEngine
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.serve.api import ServerSettings, build_app
from fluidserve.serve.batches import BatchConfig, parse_batch_input
from fluidserve.serve.cli import frontend_tokenizer, model_info
from fluidserve.serve.store import BatchLine, BatchRecord, LineResult, Store, StoreError
from tests.server_utils import (TEST_ENGINE_DEFAULTS, ThreadedServer, free_port, metric_sum, read_metrics,
                                start_server, start_subprocess_server, wait_healthy)

pytestmark = pytest.mark.timeout(180)


def start_batch_server(model_dir: str, data_dir: Path, settings: ServerSettings | None = None,
                       **batch_kwargs) -> ThreadedServer:
    return start_server(model_dir, settings, batch_config=BatchConfig(str(data_dir), **batch_kwargs))


@pytest.fixture(scope="module")
def batch_server(tiny_model, tmp_path_factory):
    srv = start_batch_server(tiny_model("llama"), tmp_path_factory.mktemp("batch-data"), max_in_flight=4)
    yield srv
    srv.stop()


@pytest.fixture
def client(batch_server):
    return openai.OpenAI(base_url=batch_server.base_url + "/v1", api_key="x", max_retries=0)


def jsonl(rows: list[dict]) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def completion_line(custom_id: str, prompt: str, max_tokens: int = 8, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}}


def wait_batch(client: openai.OpenAI, batch_id: str, statuses=("completed", "failed", "cancelled", "expired"),
               timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        time.sleep(0.05)
    raise TimeoutError(f"batch {batch_id} still {b.status}")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


# -- the client round trip ----------------------------------------------------


def test_files_and_batch_round_trip_with_openai_client(client):
    rows = [completion_line(f"req-{i}", f"Hello number {i}") for i in range(6)]
    rows.append(completion_line("bad-temp", "x", temperature=5))  # a 400 the online endpoint gives too
    up = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    assert up.object == "file" and up.purpose == "batch" and up.filename == "in.jsonl"
    assert up.bytes == len(jsonl(rows))
    assert client.files.retrieve(up.id).id == up.id
    assert client.files.content(up.id).content == jsonl(rows)
    assert up.id in [f.id for f in client.files.list(purpose="batch", order="asc")]

    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 7
    assert done.request_counts.completed == 6 and done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.expires_at
    assert done.usage.output_tokens == 6 * 8

    out = read_lines(client, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(6)]
    for o in out:
        assert o["id"].startswith("batch_req_") and o["error"] is None
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "text_completion"
        assert o["response"]["body"]["usage"]["completion_tokens"] == 8
    err = read_lines(client, done.error_file_id)
    assert [e["custom_id"] for e in err] == ["bad-temp"]
    assert err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"]["error"]["param"] == "temperature"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    outputs = [f.id for f in client.files.list(purpose="batch_output")]
    assert done.output_file_id in outputs and done.error_file_id in outputs and up.id not in outputs

    deleted = client.files.delete(up.id)
    assert deleted.deleted and deleted.id == up.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(up.id)


def test_batch_line_equals_online_greedy(client, batch_server):
    body = {"prompt": "The batch and the online path", "max_tokens": 12, "temperature": 0, "logprobs": 1}
    chat = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "temperature": 0}
    online = httpx.post(batch_server.base_url + "/v1/completions", json=body, timeout=30).json()
    online_chat = httpx.post(batch_server.base_url + "/v1/chat/completions", json=chat, timeout=30).json()

    rows = [{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body}]
    up = client.files.create(file=("a.jsonl", jsonl(rows)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=up.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    got = read_lines(client, b.output_file_id)[0]["response"]["body"]["choices"][0]
    assert got["logprobs"]["tokens"] == online["choices"][0]["logprobs"]["tokens"]
    assert got["text"] == online["choices"][0]["text"]

    rows = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat}]
    up = client.files.create(file=("b.jsonl", jsonl(rows)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    got = read_lines(client, b.output_file_id)[0]["response"]["body"]
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == online_chat["choices"][0]["message"]


def test_responses_lines_answer_as_the_online_route_and_are_kept(client, batch_server):
    """A batch on /v1/responses: each line's body is the Response object
    the online route gives, kept for previous_response_id as it keeps it."""
    body = {"input": "hi there", "instructions": "Be brief.", "max_output_tokens": 10, "temperature": 0}
    online = httpx.post(batch_server.base_url + "/v1/responses", json=body, timeout=30).json()
    rows = [{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body},
            {"custom_id": "bad", "method": "POST", "url": "/v1/responses",
             "body": {**body, "tools": [{"type": "web_search"}]}},
            {"custom_id": "background", "method": "POST", "url": "/v1/responses",
             "body": {**body, "background": True}}]
    up = client.files.create(file=("r.jsonl", jsonl(rows)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=up.id, endpoint="/v1/responses",
                                                 completion_window="24h").id)
    assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 1, 2)
    got = read_lines(client, b.output_file_id)[0]["response"]["body"]
    assert got["object"] == "response" and got["output"][0]["content"][0]["text"] == \
        online["output"][0]["content"][0]["text"]
    assert got["usage"]["input_tokens"] == online["usage"]["input_tokens"]
    assert client.responses.retrieve(got["id"]).id == got["id"]
    errors = read_lines(client, b.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"], e["response"]["body"]["error"]["param"])
            for e in errors] == [("bad", 400, "tools"), ("background", 400, "background")]


def test_validation_errors_per_line(client):
    rows = [
        json.dumps(completion_line("a", "x")),
        "{not json",
        json.dumps(completion_line("a", "dup")),
        json.dumps({**completion_line("u", "x"), "url": "/v1/chat/completions"}),
        json.dumps({**completion_line("m", "x"), "method": "GET"}),
        "",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
    ]
    up = client.files.create(file=("v.jsonl", "\n".join(rows).encode()), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=up.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.failed_at
    got = [(e.line, e.code, e.param) for e in b.errors.data]
    assert got == [(2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"),
                   (4, "invalid_url", "url"), (5, "invalid_method", "method"),
                   (7, "missing_required_parameter", "custom_id")]


def test_request_errors_in_openai_shape(client, batch_server):
    up = client.files.create(file=("x.jsonl", jsonl([completion_line("a", "x")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 3600})
    assert e.value.body["param"] == "output_expires_after"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    r = httpx.get(batch_server.base_url + "/v1/batches?limit=0")
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"


def test_oversize_file_refused(tiny_model, tmp_path):
    srv = start_batch_server(tiny_model("llama"), tmp_path, max_file_bytes=1000)
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        assert e.value.status_code == 413 and e.value.body["code"] == "file_too_large"
        assert c.files.create(file=("ok.jsonl", b"x" * 900), purpose="batch").bytes == 900
    finally:
        srv.stop()


def test_full_store_is_507_and_keeps_committed_files(tiny_model, tmp_path):
    srv = start_batch_server(tiny_model("llama"), tmp_path, store_max_pages=64)  # 256 KiB "disk"
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        first = c.files.create(file=("a.jsonl", b"a" * 100_000), purpose="batch")
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("b.jsonl", b"b" * 200_000), purpose="batch")
        assert e.value.status_code == 507 and e.value.body["code"] == "storage_full"
        assert "full" in e.value.body["message"]
        assert c.files.content(first.id).content == b"a" * 100_000
        assert [f.id for f in c.files.list()] == [first.id]
    finally:
        srv.stop()


def test_list_paging(client):
    up = client.files.create(file=("p.jsonl", jsonl([completion_line("a", "x", max_tokens=1)])), purpose="batch")
    made = [client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h").id
            for _ in range(5)]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    page2 = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in page2.data] == made[::-1][2:4]
    walked = [b.id for b in client.batches.list(limit=2)]  # the client follows `after` by itself
    assert walked[:5] == made[::-1]
    assert len(walked) == len(set(walked))
    for bid in made:
        wait_batch(client, bid)


def test_cancel_queued_batch_is_immediate(client):
    # The runner works through batches one at a time: cancelling one that
    # waits behind another must not wait for the other to finish.
    rows = [completion_line(f"q{i}", f"queued {i}", max_tokens=32, ignore_eos=True) for i in range(200)]
    up = client.files.create(file=("q.jsonl", jsonl(rows)), purpose="batch")
    first = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
    second = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, first.id, statuses=("in_progress",))
    cancelled = client.batches.cancel(second.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 0
    assert client.batches.retrieve(first.id).status == "in_progress"
    assert wait_batch(client, client.batches.cancel(first.id).id).status == "cancelled"


def test_cancel_mid_batch(client, batch_server):
    rows = [completion_line(f"r{i}", f"cancel me {i}", max_tokens=48, ignore_eos=True) for i in range(40)]
    up = client.files.create(file=("c.jsonl", jsonl(rows)), purpose="batch")
    b = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(b.id).request_counts.completed < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    cancelled = client.batches.cancel(b.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    final = wait_batch(client, b.id)
    assert final.status == "cancelled" and final.cancelled_at
    assert 2 <= final.request_counts.completed < 40
    out = read_lines(client, final.output_file_id)
    assert len(out) == final.request_counts.completed
    assert len({o["custom_id"] for o in out}) == len(out)
    with pytest.raises(openai.APIStatusError) as e:  # a finished batch cannot be cancelled
        client.batches.cancel(wait_batch(client, client.batches.list(limit=100).data[-1].id).id)
    assert e.value.status_code == 409
    # the engine let go of every aborted line
    deadline = time.monotonic() + 10
    while batch_server.engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert batch_server.engine.kv.num_used_blocks == 0


def test_metrics(client, batch_server):
    m = read_metrics(batch_server.base_url)
    assert m['fluidserve_batches{status="completed"}'] >= 1
    assert m["fluidserve_offline_generation_tokens_total"] > 0
    assert "fluidserve_offline_requests_in_flight" in m


def test_batch_never_crowds_out_online_requests(tiny_model, tmp_path):
    # One online place in the queue, eight batch lines in flight: every online
    # request must still be admitted, and the batch must stay within its bound.
    srv = start_batch_server(tiny_model("llama"), tmp_path, ServerSettings(max_queued_requests=1), max_in_flight=8)
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        rows = [completion_line(f"o{i}", f"offline {i}", max_tokens=32, ignore_eos=True) for i in range(400)]
        up = c.files.create(file=("o.jsonl", jsonl(rows)), purpose="batch")
        bid = c.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h").id
        peak = 0
        for i in range(5):
            deadline = time.monotonic() + 60
            while srv.async_engine.num_in_flight < 8:  # the batch holds all its places
                assert time.monotonic() < deadline
                time.sleep(0.002)
            if i == 0:  # batch lines are in the engine as offline requests, and only they are
                while True:  # /metrics shows the engine's last snapshot: wait for one with the lines in
                    m = read_metrics(srv.base_url)
                    if metric_sum({k: v for k, v in m.items() if 'klass="offline"' in k},
                                  "fluidserve_num_requests") >= 1:
                        break
                    assert time.monotonic() < deadline, "batch lines never showed as offline requests"
                    time.sleep(0.01)
                assert metric_sum({k: v for k, v in m.items() if 'klass="online"' in k},
                                  "fluidserve_num_requests") == 0
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "online", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            peak = max(peak, srv.async_engine.num_in_flight)
        assert c.batches.retrieve(bid).status == "in_progress"
        wait_batch(c, c.batches.cancel(bid).id)
        assert 1 <= peak <= 8 + 1  # the batch's bound, plus at most the one online request
    finally:
        srv.stop()


def test_expired_batch_reports_unfinished_lines(tiny_model, tmp_path):
    # A batch whose window passed while the server was down: on restart the
    # runner expires it, and each line without a result is in the error file.
    store = Store(tmp_path)
    f = store.create_file("in.jsonl", "batch", b"{}")
    store.create_batch(BatchRecord(id="batch_old", input_file_id=f.id, endpoint="/v1/completions",
                                   completion_window="24h", status="validating", created_at=1, expires_at=2))
    store.start_batch("batch_old", [BatchLine(i + 1, f"e{i}", {"prompt": "x", "max_tokens": 2}) for i in range(3)])
    store.record_result("batch_old", LineResult(1, True, {"custom_id": "e0"}))
    store.close()
    srv = start_batch_server(tiny_model("llama"), tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        b = wait_batch(c, "batch_old")
        assert b.status == "expired" and b.expired_at
        assert (b.request_counts.completed, b.request_counts.failed) == (1, 2)
        err = read_lines(c, b.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in err] == [("e1", "batch_expired"),
                                                                        ("e2", "batch_expired")]
    finally:
        srv.stop()


def test_run_batch_cli(tiny_model, tmp_path, capsys):
    from fluidserve.serve.cli import main

    rows = [completion_line(f"r{i}", f"offline {i}", max_tokens=4) for i in range(5)]
    rows.append({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}})
    rows.append(completion_line("bad", "x", max_tokens=100_000))
    (tmp_path / "in.jsonl").write_bytes(jsonl(rows))
    rc = main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
               "--model", tiny_model("llama"), "--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "256"])
    assert rc == 0
    out = {o["custom_id"]: o for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert sorted(out) == sorted(r["custom_id"] for r in rows)
    assert out["chat"]["response"]["body"]["object"] == "chat.completion"
    assert out["r3"]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert out["bad"]["response"]["status_code"] == 400
    assert "7/7 requests, 1 failed" in capsys.readouterr().err
    # The server's frontend flags hold offline too: names, template, structured output.
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}
    rows = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                      "temperature": 0, "response_format": fmt}}]
    (tmp_path / "flags.jsonl").write_bytes(jsonl(rows))
    rc = main(["run-batch", "-i", str(tmp_path / "flags.jsonl"), "-o", str(tmp_path / "flags-out.jsonl"),
               "--model", tiny_model("llama"), "--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "256",
               "--served-model-name", "alias", "--chat-template", "{{ messages[0].content }}!",
               "--structured-outputs-config.disable_any_whitespace", "true"])
    assert rc == 0
    body = json.loads((tmp_path / "flags-out.jsonl").read_text())["response"]["body"]
    assert body["model"] == "alias" and body["usage"]["prompt_tokens"] == len("hi!")
    content = body["choices"][0]["message"]["content"]
    assert content == json.dumps(json.loads(content), separators=(",", ":")), content
    (tmp_path / "bad.jsonl").write_text('{"custom_id": "a"}\n')
    assert main(["run-batch", "-i", str(tmp_path / "bad.jsonl"), "-o", str(tmp_path / "o2.jsonl"),
                 "--model", tiny_model("llama"), "--device", "cpu"]) == 2


# -- the store ----------------------------------------------------------------


def test_parse_batch_input_limits():
    lines, errors = parse_batch_input(jsonl([completion_line(str(i), "x") for i in range(3)]), "/v1/completions", 2)
    assert errors[0]["code"] == "too_many_requests"
    lines, errors = parse_batch_input(b"\n\n", "/v1/completions", 10)
    assert errors[0]["code"] == "empty_file"
    lines, errors = parse_batch_input(b"\xff\xfe", "/v1/completions", 10)
    assert errors[0]["code"] == "invalid_file_encoding"


def test_multipart_upload_keeps_bytes(client, batch_server):
    data = b"line1\r\n--notboundary\r\nline2\r\n"
    body = (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a b.jsonl\"\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--B--\r\n")
    r = httpx.post(batch_server.base_url + "/v1/files", content=body,
                   headers={"Content-Type": 'multipart/form-data; boundary="B"'}, timeout=30)
    assert r.status_code == 200, r.text
    assert (r.json()["filename"], r.json()["purpose"], r.json()["bytes"]) == ("a b.jsonl", "batch", len(data))
    assert client.files.content(r.json()["id"]).content == data


def _batch_with_lines(store: Store, n: int) -> str:
    f = store.create_file("in.jsonl", "batch", b"{}")
    rec = BatchRecord(id="batch_t", input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                      status="validating", created_at=1)
    store.create_batch(rec)
    assert store.start_batch(rec.id, [BatchLine(i, f"c{i}", {"prompt": "x"}) for i in range(n)])
    return rec.id


def test_store_disk_full_loses_nothing_committed(tmp_path):
    store = Store(tmp_path)
    bid = _batch_with_lines(store, 4)
    assert store.record_result(bid, LineResult(0, True, {"custom_id": "c0"}))
    store.close()
    pages = sqlite3.connect(tmp_path / "fluidserve.sqlite3").execute("PRAGMA page_count").fetchone()[0]
    full = Store(tmp_path, max_pages=pages + 2)
    with pytest.raises(StoreError, match="full"):
        full.create_file("big.jsonl", "batch", b"x" * 100_000)
    with pytest.raises(StoreError, match="full"):
        full.record_result(bid, LineResult(1, True, {"custom_id": "c1", "pad": "y" * 100_000}))
    assert [n for n, _, _ in full.results(bid)] == [0]  # the committed one is intact, the failed one absent
    assert full.get_batch(bid).completed == 1
    assert [ln.line_no for ln in full.pending_lines(bid, 10)] == [1, 2, 3]
    assert full.record_result(bid, LineResult(1, True, {"custom_id": "c1"}))  # small writes still fit
    full.close()


def test_store_exactly_once_and_corrupt(tmp_path):
    store = Store(tmp_path / "a")
    bid = _batch_with_lines(store, 2)
    assert store.record_result(bid, LineResult(0, True, {"custom_id": "c0"}, 3, 5))
    assert not store.record_result(bid, LineResult(0, True, {"custom_id": "c0"}, 3, 5))
    assert store.get_batch(bid).output_tokens == 5
    assert not store.finish_batch(bid, "completed", ("finalizing",))  # only out of the state named
    assert store.finish_batch(bid, "cancelled", ("in_progress",))
    assert not store.record_result(bid, LineResult(1, True, {"custom_id": "c1"}))  # too late: lands nowhere
    store.close()


def test_corrupt_store_stops_startup_untouched(tiny_model, tmp_path):
    (tmp_path / "fluidserve.sqlite3").write_bytes(b"this is not a database" * 100)
    engine = LLMEngine(EngineConfig.create(model=tiny_model("llama"), **TEST_ENGINE_DEFAULTS))
    with pytest.raises(StoreError, match="unreadable.*left untouched"):
        build_app(AsyncEngine(engine), frontend_tokenizer(engine), model_info(engine), ServerSettings(),
                  batch_config=BatchConfig(str(tmp_path)))
    assert (tmp_path / "fluidserve.sqlite3").read_bytes() == b"this is not a database" * 100


# -- kill -9 ------------------------------------------------------------------


@pytest.mark.slow
def test_kill9_mid_batch_resumes_exactly_once(tiny_model, tmp_path):
    data = tmp_path / "data"
    args = ["--model", tiny_model("llama"), "--device", "cpu", "--num-kv-blocks", "256", "--max-model-len", "256",
            "--data-dir", str(data), "--batch-max-in-flight", "4", "--log-level", "warning"]
    n = 40
    rows = [completion_line(f"k{i}", f"survive {i}", max_tokens=32, ignore_eos=True) for i in range(n)]
    port = free_port()
    proc = start_subprocess_server(args, port, tmp_path / "first.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        up = c.files.create(file=("k.jsonl", jsonl(rows)), purpose="batch")
        bid = c.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h").id
        deadline = time.monotonic() + 120
        while (done_before := c.batches.retrieve(bid).request_counts.completed) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done_before < n, "the batch finished before the kill: make it longer"

    proc = start_subprocess_server(args, port, tmp_path / "second.log")
    try:
        wait_healthy(base, timeout=120, proc=proc)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        assert c.batches.retrieve(bid).request_counts.completed >= done_before  # nothing committed was lost
        final = wait_batch(c, bid, timeout=120)
        assert final.status == "completed"
        assert final.request_counts.completed == n and final.request_counts.failed == 0
        out = read_lines(c, final.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(r["custom_id"] for r in rows)  # each exactly once
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == 32 for o in out)
    finally:
        proc.terminate()
        proc.wait(30)
