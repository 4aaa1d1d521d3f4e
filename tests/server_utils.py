"""Helpers for the server tests: a real uvicorn server on a free localhost
port (in a thread, or as a ``fluidserve serve`` subprocess), and a parser for
the Prometheus text /metrics returns."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from fluidserve.engine.async_engine import AsyncEngine
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.serve.api import ServerSettings, build_app
from fluidserve.serve.cli import frontend_tokenizer, model_info
from fluidserve.serve.server import bind_socket, make_server

TEST_ENGINE_DEFAULTS = dict(device="cpu", num_kv_blocks=512, max_model_len=256, max_num_seqs=128,
                            max_num_batched_tokens=1024, seed=0)


@dataclass
class ThreadedServer:
    """uvicorn serving the real app in a background thread."""

    engine: LLMEngine
    async_engine: AsyncEngine
    base_url: str
    server: Any
    thread: threading.Thread
    api_key: str | None = None
    extra: dict = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(model_dir: str, settings: ServerSettings | None = None, stall_timeout: float = 60.0,
                 batch_config: Any = None, chat_template: str | None = None, **engine_kwargs: Any) -> ThreadedServer:
    """The real app on a free localhost port in a background thread; with
    ``batch_config`` (serve.batches.BatchConfig), the Batch API too."""
    config = EngineConfig.create(model=model_dir, **{**TEST_ENGINE_DEFAULTS, **engine_kwargs})
    engine = LLMEngine(config)
    async_engine = AsyncEngine(engine, stall_timeout=stall_timeout)
    settings = settings or ServerSettings()
    app = build_app(async_engine, frontend_tokenizer(engine, chat_template),
                    model_info(engine, chat_template=chat_template), settings,
                    batch_config=batch_config)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, drain_timeout=5, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url)
    return ThreadedServer(engine, async_engine, base_url, server, thread, settings.api_key)


def wait_healthy(base_url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until ``/health`` answers 200 (an https URL: any certificate)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before becoming healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0, verify=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} did not become healthy in {timeout} s")


def self_signed_cert(directory: Path) -> tuple[str, str]:
    """A key and certificate for 127.0.0.1 (openssl's command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return str(key), str(cert)


def free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def start_subprocess_server(args: list[str], port: int, log_path: Path) -> subprocess.Popen:
    """``fluidserve serve <args> --port <port>`` as a real process."""
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(log_path, "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line of Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def read_metrics(base_url: str) -> dict[str, float]:
    resp = httpx.get(f"{base_url}/metrics", timeout=10.0)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum of every labelled sample of ``name``."""
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


def wait_idle(server, timeout: float = 5.0) -> dict[str, float]:
    """Metrics once the server holds no KV block and no request."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(server.base_url)
        if m['fluidserve_kv_blocks_used{tier="device"}'] == 0 and metric_sum(m, "fluidserve_num_requests") == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


def post(srv, path: str, body: dict, **kw) -> "httpx.Response":
    """POST ``body`` as JSON to ``path`` of a started server."""
    import httpx

    return httpx.post(f"{srv.base_url}{path}", json=body, timeout=120, **kw)


def ok(srv, path: str, body: dict) -> dict:
    """POST and expect 200: the JSON answer."""
    resp = post(srv, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def streams_some_dropped(server, bodies: list[dict], drop_after: int = 3) -> list[int | None]:
    """Each body streamed to /v1/completions at once, with its usage chunk:
    the completion tokens each reports; None for a body marked ``"drop":
    True``, whose stream is closed after ``drop_after`` chunks."""

    async def one(c: httpx.AsyncClient, body: dict) -> int | None:
        dropped = body.pop("drop", False)
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks, usage = 0, None
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    usage = json.loads(line[6:]).get("usage") or usage
                    if dropped and chunks >= drop_after:
                        return None  # leaving the block closes the connection mid-stream
        return usage["completion_tokens"]

    async def main() -> list[int | None]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            return await asyncio.gather(*(one(c, dict(b)) for b in bodies))

    return asyncio.run(main())
