"""The OpenAI-compatible server end to end: a real uvicorn on a free localhost
port, the tiny random-weight model, the official ``openai`` client.

Most tests share one server running in a thread; the queue-limit and
engine-death tests get their own, and the SIGTERM test runs
``fluidserve serve`` as a real process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from fluidserve.engine import LLM, SamplingParams
from fluidserve.serve.api import ServerSettings
from server_utils import (
    free_port,
    read_metrics,
    self_signed_cert,
    start_server,
    wait_idle,
    start_subprocess_server,
    wait_healthy,
)

API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
PROMPTS = ["Hello, my name is", "The capital of France"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from fluidserve.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-serve"), "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, ServerSettings(api_key=API_KEY, max_body_bytes=BODY_LIMIT),
                       max_model_len=MAX_MODEL_LEN)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir) -> LLM:
    return LLM(model=model_dir, device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


def greedy(llm: LLM, prompt, max_tokens: int):
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0]


def post(server, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> httpx.Response:
    hdrs = {**server.headers(), "Content-Type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=hdrs, timeout=60)


def assert_error_shape(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


def assert_still_serves(server) -> None:
    resp = post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 2


# -- round trips with the official client -------------------------------------


def test_completion_greedy_equals_offline_generate(client, server, offline):
    for prompt in PROMPTS:
        expected = greedy(offline, prompt, 12)
        resp = client.completions.create(model=server.engine.model_name, prompt=prompt, max_tokens=12,
                                         temperature=0)
        choice = resp.choices[0]
        assert choice.text == expected.text
        assert choice.finish_reason == expected.finish_reason
        prompt_len = len(offline.tokenizer.encode(prompt))
        assert resp.usage.prompt_tokens == prompt_len
        assert resp.usage.completion_tokens == len(expected.token_ids)
        assert resp.usage.total_tokens == prompt_len + len(expected.token_ids)


def test_completion_batch_of_prompts_and_token_ids(client, server, offline):
    ids = offline.tokenizer.encode(PROMPTS[1])
    resp = client.completions.create(model=server.engine.model_name, prompt=[PROMPTS[0], PROMPTS[1]],
                                     max_tokens=6, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [greedy(offline, p, 6).text for p in PROMPTS]
    by_ids = client.completions.create(model=server.engine.model_name, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == resp.choices[1].text
    assert by_ids.usage.prompt_tokens == len(ids)
    both = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    assert resp.usage.prompt_tokens == both and resp.usage.completion_tokens == 12


def test_completion_streaming_matches_non_streaming(client, server):
    kw = dict(model=server.engine.model_name, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_ends_with_done(server):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=server.headers()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def test_chat_greedy_equals_offline_generate(client, server, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = offline.tokenizer.encode(ids, add_special_tokens=False)
    expected = greedy(offline, ids, 10)
    resp = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=10,
                                          temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    # max_completion_tokens is the newer name of the same limit.
    again = client.chat.completions.create(model=server.engine.model_name, messages=messages,
                                           max_completion_tokens=10, temperature=0)
    assert again.choices[0].message.content == expected.text

    stream = client.chat.completions.create(model=server.engine.model_name, messages=messages, max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_completion_logprobs(client, server):
    resp = client.completions.create(model=server.engine.model_name, prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 3  # tokens decoding to the same text share a key
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat_logprobs(client, server):
    resp = client.chat.completions.create(model=server.engine.model_name,
                                          messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


def test_n_greater_than_one(client, server):
    resp = client.completions.create(model=server.engine.model_name, prompt=PROMPTS[0], max_tokens=7,
                                     temperature=1.0, n=3, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1
    assert resp.usage.completion_tokens == 21
    chat = client.chat.completions.create(model=server.engine.model_name, n=2, max_tokens=4, temperature=1.0,
                                          messages=[{"role": "user", "content": "x"}],
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_stop_string_truncates(client, server, offline):
    full = greedy(offline, PROMPTS[0], 16).text
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isprintable())
    expected = full[: full.index(stop)]
    resp = client.completions.create(model=server.engine.model_name, prompt=PROMPTS[0], max_tokens=16,
                                     temperature=0, stop=[stop])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 16


def test_seed_reproducible(client, server):
    kw = dict(model=server.engine.model_name, prompt=PROMPTS[1], max_tokens=12, temperature=1.0)
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    c = client.completions.create(**kw, seed=4321).choices[0].text
    assert a == b
    assert a != c


def test_extensions_and_priority(client, server):
    resp = client.completions.create(model=server.engine.model_name, prompt="x", max_tokens=9, temperature=0.7,
                                     extra_body={"top_k": 5, "min_p": 0.01, "repetition_penalty": 1.2,
                                                 "ignore_eos": True, "priority": "offline"})
    assert resp.usage.completion_tokens == 9


def test_models_health_version(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_metrics_exposed(client, server):
    before = read_metrics(server.base_url)
    client.completions.create(model=server.engine.model_name, prompt="m", max_tokens=5,
                              extra_body={"ignore_eos": True})
    after = read_metrics(server.base_url)
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        name = f"fluidserve_{hist}_count"
        assert after[name] == before.get(name, 0) + 1
    assert after["fluidserve_generation_tokens_total"] - before["fluidserve_generation_tokens_total"] == 5
    assert after["fluidserve_generation_tokens_per_second"] > 0
    assert after['fluidserve_kv_blocks_total{tier="device"}'] == 512
    assert 'fluidserve_num_requests{klass="online",queue="all",status="waiting"}' in after
    for name in ("fluidserve_preemptions_total", "fluidserve_swaps_total", 'fluidserve_kv_blocks_used{tier="host"}'):
        assert name in after


# -- errors ---------------------------------------------------------------------

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = list(range(65, 65 + 60)) * 4  # 240 token ids

ERROR_CASES = [
    ("max_tokens_zero", C, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens_string", C, {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt_plus_max_tokens_too_long", C, {"prompt": LONG, "max_tokens": 20}, 400, "max_tokens"),
    ("prompt_alone_too_long", C, {"prompt": LONG * 2, "max_tokens": 1}, 400, "prompt"),
    ("chat_max_completion_tokens_too_long", CHAT, {"messages": MSG, "max_completion_tokens": 1000}, 400,
     "max_tokens"),
    ("temperature_high", C, {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("temperature_negative", CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("top_p_zero", C, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p_above_one", C, {"prompt": "a", "top_p": 1.01}, 400, "top_p"),
    ("n_zero", C, {"prompt": "a", "n": 0}, 400, "n"),
    ("n_huge", CHAT, {"messages": MSG, "n": 1000}, 400, "n"),
    ("logprobs_21", C, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs_21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top_logprobs_without_logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("too_many_stops", C, {"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("empty_stop", C, {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("token_id_above_vocab", C, {"prompt": [1, 2, 261]}, 400, "prompt"),
    ("token_id_negative", C, {"prompt": [[5, -1]]}, 400, "prompt"),
    ("empty_prompt", C, {"prompt": ""}, 400, "prompt"),
    ("empty_prompt_list", C, {"prompt": []}, 400, "prompt"),
    ("prompt_wrong_type", C, {"prompt": {"text": "a"}}, 400, "prompt"),
    ("missing_prompt", C, {"max_tokens": 3}, 400, "prompt"),
    ("presence_penalty", C, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty"),
    ("priority_unknown", C, {"prompt": "a", "priority": "urgent"}, 400, "priority"),
    ("messages_missing", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("messages_empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages_not_list", CHAT, {"messages": "hi"}, 400, "messages"),
    # Any role string goes to the template (vLLM's custom roles); an empty one does not.
    ("message_empty_role", CHAT, {"messages": [{"role": "", "content": "x"}]}, 400, "messages"),
    ("message_no_role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages"),
    ("message_content_int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("message_no_content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("unknown_model", C, {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("unknown_model_chat", CHAT, {"messages": MSG, "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_invalid_requests(server, path, body, status, param):
    err = assert_error_shape(post(server, path, body), status)
    assert err["param"] == param, err
    assert_still_serves(server)


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2, 3]", b'"a string"', b"null", b"{", b"[" * 30000 + b"]" * 30000],
                         ids=["garbage", "array", "string", "null", "truncated", "deeply_nested"])
def test_non_object_bodies(server, raw):
    err = assert_error_shape(post(server, C, None, raw=raw), 400)
    assert err["type"] == "invalid_request_error"
    assert_still_serves(server)


def test_huge_invalid_body_is_not_echoed(server):
    body = {"prompt": [{"x": "y" * 30_000}], "stop": ["z" * 1000] * 30}  # under the 64 KiB limit
    resp = post(server, C, body)
    assert_error_shape(resp, 400)
    assert len(resp.content) < 4096


def test_body_over_limit_is_413(server):
    resp = post(server, C, {"prompt": "a" * (BODY_LIMIT + 10)})
    assert_error_shape(resp, 413)
    assert_still_serves(server)


def test_auth(server):
    url = f"{server.base_url}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = httpx.post(url, json={"prompt": "a", "max_tokens": 1}, headers=headers)
        err = assert_error_shape(resp, 401)
        assert err["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=server.engine.model_name, prompt="a", max_tokens=1)
    assert_still_serves(server)


def test_client_errors_are_not_retried(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=server.engine.model_name, prompt="a", max_tokens=0)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


# -- load, disconnects and KV accounting ---------------------------------------


async def _stream(client: httpx.AsyncClient, body: dict, drop_after: int | None) -> int:
    """Read a streamed completion; return its token chunks (drop early if asked)."""
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"]:
                chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return chunks  # leaving the block closes the connection mid-stream
    return chunks


def test_64_concurrent_streams_and_16_dropped_free_their_kv(server):
    before = wait_idle(server)

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as c:
            jobs = []
            for i in range(64):
                dropped = i % 4 == 0
                body = {"prompt": f"client {i}", "max_tokens": 200 if dropped else 16, "stream": True,
                        "ignore_eos": True, "temperature": 0.8, "seed": i}
                jobs.append(_stream(c, body, drop_after=3 if dropped else None))
            return await asyncio.gather(*jobs)

    chunks = asyncio.run(main())
    assert len(chunks) == 64 and all(chunks)
    kept = [n for i, n in enumerate(chunks) if i % 4]
    assert len(kept) == 48
    after = wait_idle(server)
    generated = after["fluidserve_generation_tokens_total"] - before["fluidserve_generation_tokens_total"]
    # The 48 kept streams make exactly 16 tokens each; the 16 dropped ones
    # would make 200 each if their abort had not reached the engine.
    assert 48 * 16 + 16 * 3 <= generated < 48 * 16 + 16 * 100
    assert after['fluidserve_kv_blocks_used{tier="device"}'] == 0
    assert server.engine.kv.num_used_blocks == 0
    server.engine.kv.check_integrity()


def test_non_streaming_disconnect_aborts(server):
    before = wait_idle(server)
    body = {"prompt": "leave early", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers(), timeout=0.05)
    after = wait_idle(server)
    generated = after["fluidserve_generation_tokens_total"] - before["fluidserve_generation_tokens_total"]
    assert generated < 240
    assert_still_serves(server)


# -- admission, watchdog, engine death ------------------------------------------


def test_queue_full_is_429_with_retry_after(model_dir):
    srv = start_server(model_dir, ServerSettings(max_queued_requests=2), max_num_seqs=1, num_kv_blocks=64)
    try:
        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
                body = {"prompt": "q", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert_error_shape(r, 429)
                assert int(r.headers["Retry-After"]) >= 1
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses if r.status_code == 200)
        assert_still_serves(srv)
    finally:
        srv.stop()


def test_watchdog_and_dead_engine_turn_health_503(model_dir):
    srv = start_server(model_dir, stall_timeout=0.5, num_kv_blocks=64)
    engine = srv.engine
    real_step = engine.step
    try:
        # A stalled step: /health is 503 while it hangs, 200 again after.
        def slow_step():
            engine.step = real_step
            time.sleep(1.5)
            return real_step()

        engine.step = slow_step
        resp_box: list = []

        async def one() -> None:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as c:
                resp_box.append(await c.post("/v1/completions", json={"prompt": "s", "max_tokens": 3}))

        import threading
        t = threading.Thread(target=lambda: asyncio.run(one()))
        t.start()
        time.sleep(1.0)
        assert_error_shape(httpx.get(f"{srv.base_url}/health"), 503)
        t.join(30)
        assert resp_box[0].status_code == 200
        assert httpx.get(f"{srv.base_url}/health").status_code == 200

        # A dying engine loop: in-flight and later requests fail with 503,
        # /health says so, and the HTTP side keeps answering.
        def broken_step():
            raise RuntimeError("simulated device failure")

        engine.step = broken_step
        resp = post(srv, C, {"prompt": "x", "max_tokens": 3})
        assert_error_shape(resp, 503)
        health = httpx.get(f"{srv.base_url}/health")
        assert "simulated device failure" in assert_error_shape(health, 503)["message"]
        err = assert_error_shape(post(srv, CHAT, {"messages": MSG}), 503)
        assert err["code"] == "engine_unavailable"
        assert "Retry-After" in post(srv, C, {"prompt": "y"}).headers
        assert read_metrics(srv.base_url)["fluidserve_engine_healthy"] == 0
    finally:
        engine.step = real_step
        srv.stop()


# -- the real process: built-in model and SIGTERM drain -------------------------


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    proc = start_subprocess_server(["--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "256",
                                    "--drain-timeout", "30"], port, log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "drain me", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text_chunks, usage, done = 0, None, False
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if event["choices"]:
                    text_chunks += 1
                    if text_chunks == 2:
                        proc.send_signal(signal.SIGTERM)
                else:
                    usage = event["usage"]
        assert done and usage["completion_tokens"] == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert "built-in tiny random-weight model" in log
    assert "SIGTERM received" in log


def test_sigterm_over_tls_finishes_the_stream_and_does_not_wait_on_idle_clients(tmp_path):
    """An idle keep-alive TLS client never answers the server's close_notify
    (nothing reads its socket): the drain drops that connection instead of
    waiting out its timeout, while a stream in flight over TLS still gets
    every token."""
    port = free_port()
    key, cert = self_signed_cert(tmp_path)
    proc = start_subprocess_server(["--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "256",
                                    "--drain-timeout", "60", "--ssl-keyfile", key, "--ssl-certfile", cert],
                                   port, tmp_path / "server.log")
    base = f"https://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        idle = httpx.Client(verify=False, timeout=60)  # its connection stays open in the pool, unread
        model = idle.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "drain me", "max_tokens": 100, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks, usage = 0, None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60, verify=False) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                chunks += bool(event["choices"])
                if chunks == 2 and event["choices"]:
                    proc.send_signal(signal.SIGTERM)
                usage = event.get("usage") or usage
        assert usage["completion_tokens"] == 100
        # Well inside the 60 s drain: waiting on the idle client would take all of it.
        assert proc.wait(timeout=30) == 0
        idle.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_whose_sampling_raises_fails_alone(server, client, offline, monkeypatch):
    """A fault in sampling that one request's parameters reach (injected
    here: the sampler raises on a row with top_k 37) fails that request with
    a 500 in OpenAI's shape, or an error event when streamed, while a
    greedy stream beside it gets every token it gets alone; the server
    stays healthy and counts the failures."""
    import fluidserve.engine.worker as worker_module

    real = worker_module.sample

    def faulty(logits, rows, *args, **kwargs):
        if any(row.params.top_k == 37 for row in rows):
            raise RuntimeError("injected sampling fault")
        return real(logits, rows, *args, **kwargs)

    monkeypatch.setattr(worker_module, "sample", faulty)
    before = read_metrics(server.base_url)
    model = server.engine.model_name
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text  # decoding now
    marked = {"prompt": "x", "max_tokens": 5, "temperature": 1.0, "top_k": 37}
    err = assert_error_shape(post(server, "/v1/completions", marked), 500)
    assert err["code"] == "generation_failed" and "injected sampling fault" in err["message"]
    streamed = post(server, "/v1/completions", {**marked, "stream": True})
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "injected sampling fault" in events[-1]["error"]["message"]
    text += "".join(c.choices[0].text for c in chunks if c.choices)
    alone = offline.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))[0]
    assert text == alone.outputs[0].text
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    after = read_metrics(server.base_url)
    assert after["fluidserve_requests_failed_total"] - before["fluidserve_requests_failed_total"] == 2
    assert after["fluidserve_steps_failed_total"] == before["fluidserve_steps_failed_total"]
    assert_still_serves(server)


# A step that raises once the trigger file exists (a device fault, a lost
# worker), put into a real `fluidserve serve` process before its main runs.
_DYING_SERVER = """
import os, sys
from fluidserve.engine.engine import LLMEngine
real_step = LLMEngine.step
def step(self):
    if os.path.exists({trigger!r}):
        raise RuntimeError("simulated device failure")
    return real_step(self)
LLMEngine.step = step
from fluidserve.serve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_fails_in_flight_requests_and_the_process_exits_1(tmp_path):
    """A dead engine loop does not come back and plain `docker run --restart`
    does not restart an unhealthy container: the server answers what it
    holds with a 503, drains and exits with status 1, for its supervisor to
    start a fresh one."""
    import subprocess
    import sys

    port, trigger = free_port(), tmp_path / "die"
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", _DYING_SERVER.format(trigger=str(trigger)), "serve", "--host",
                             "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-model-len", "256"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "alive", "max_tokens": 3}).status_code == 200
        trigger.touch()
        err = assert_error_shape(httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                                            timeout=30), 503)
        assert "simulated device failure" in err["message"]
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "engine loop died" in (tmp_path / "server.log").read_text()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_leave_nagle_off(host):
    """The server's listener (``bind_socket``, what uvicorn serves on) gives
    asyncio sockets it turns TCP_NODELAY on for. Left on, Nagle's algorithm
    held a response's body behind its headers until the client's delayed
    ACK: ~40 ms on each request of a kept-alive connection, the OpenAI
    client's way (benchmarks/keepalive_latency.py)."""
    import socket

    from fluidserve.serve.server import bind_socket

    try:
        sock = bind_socket(host, 0)
    except OSError:
        pytest.skip(f"no {host} here")

    async def main() -> int:
        seen = asyncio.get_running_loop().create_future()

        async def on_connection(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(main()) != 0
