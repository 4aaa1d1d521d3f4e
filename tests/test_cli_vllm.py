"""``fluidserve serve`` takes a vLLM command line: the model as a positional
argument, vLLM's flag names and meanings, and one clear line (exit 2, no
traceback) for a vLLM flag we do not support."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from fluidserve.serve import cli
from server_utils import free_port, start_subprocess_server, wait_healthy


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fluidserve.serve.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, named", [
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8"),
    (["--kv-cache-dtype=fp8_e5m2"], "--kv-cache-dtype fp8_e5m2"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], "--enable-auto-tool-choice"),
    (["--tool-call-parser", "llama3_json"], "--tool-call-parser llama3_json"),
    (["--quantization", "awq"], "--quantization awq"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
])
def test_unsupported_vllm_flag_is_one_line(flags, named):
    proc = run_cli("serve", "some/model", *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert named in lines[0] and "not supported" in lines[0]
    assert "Traceback" not in proc.stderr


def test_harmless_values_of_unsupported_flags_pass_the_check():
    cli.check_unsupported(["serve", "m", "--kv-cache-dtype", "auto", "-pp", "1"])
    with pytest.raises(cli.UnsupportedFlag, match="--kv-cache-dtype fp8"):
        cli.check_unsupported(["serve", "m", "--kv-cache-dtype", "fp8"])


def parse(*argv: str):
    return cli.build_parser().parse_args(cli._map_policy_alias(["serve", *argv]))


def test_flags_map_onto_the_engine_config(monkeypatch):
    monkeypatch.setenv("FLUIDSERVE_API_KEY", "from-env")
    args = parse("/models/x", "--dtype", "half", "--no-enable-chunked-prefill", "--scheduling-policy", "priority",
                 "--served-model-name", "a", "b", "--tokenizer", "/tok", "-tp", "1",
                 "--allowed-origins", '["https://x.example"]')
    config = cli.engine_config_from_args(args)
    assert config.model == "/models/x" and config.dtype == "half" and config.tokenizer == "/tok"
    assert config.enable_chunked_prefill is False
    assert config.scheduling_policy == "fcfs"  # vLLM's "priority": see _map_policy_alias
    assert config.served_model_name == "a"
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["https://x.example"]
    assert parse().api_key == "from-env"
    assert cli.engine_config_from_args(parse("--model", "/m")).model == "/m"
    assert cli.engine_config_from_args(parse("--scheduling-policy=priority")).scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="model"):
        cli.engine_config_from_args(parse("/m1", "--model", "/m2"))


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert cli.load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert cli.load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="chat_template"):
        cli.load_chat_template(str(tmp_path / "missing.jinja"))


def test_vllm_command_line_starts_the_server(tiny_model, tmp_path):
    """The quick-start line of vLLM's OpenAI-server docs, plus the flags a
    vLLM deployment commonly carries; the key comes from the environment."""
    model = tiny_model("llama")
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    port = free_port()
    log_path = tmp_path / "server.log"
    args = [model, "--dtype", "auto", "--served-model-name", "served-a", "served-b",
            "--chat-template", str(template), "--generation-config", "vllm", "--scheduling-policy", "priority",
            "--enable-chunked-prefill", "--uvicorn-log-level", "warning", "--trust-remote-code",
            "--disable-log-stats", "--max-model-len", "256", "--num-kv-blocks", "64", "--device", "cpu"]
    os.environ["FLUIDSERVE_API_KEY"] = "env-key"
    try:
        proc = start_subprocess_server(args, port, log_path)
    finally:
        del os.environ["FLUIDSERVE_API_KEY"]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        auth = {"Authorization": "Bearer env-key"}
        assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{base}/v1/models", headers=auth, timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["served-a", "served-b"]
        msgs = [{"role": "user", "content": "hi"}]
        resp = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60,
                          json={"model": "served-b", "messages": msgs, "max_tokens": 2, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["model"] == "served-a"
        # The byte tokenizer: one token per byte of the rendered template.
        assert body["usage"]["prompt_tokens"] == len("[user]hi[assistant]")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    log = log_path.read_text()
    assert "--host 0.0.0.0" in log  # how to expose a loopback-only server
    assert "Traceback" not in log
