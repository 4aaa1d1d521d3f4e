"""``fluidserve serve`` takes a vLLM command line: the model as a positional
argument, vLLM's flag names and meanings, and one clear line (exit 2, no
traceback) for a vLLM flag we do not support."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from fluidserve.serve import cli
from fluidserve.serve.server import bind_socket
from server_utils import free_port, self_signed_cert, start_subprocess_server, wait_healthy


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fluidserve.serve.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("flags, named", [
    (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype fp8_inc"),
    (["--kv-cache-dtype=bfloat16"], "--kv-cache-dtype bfloat16"),
    (["--tool-parser-plugin", "my_parser.py"], "--tool-parser-plugin my_parser.py"),
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend outlines"),
    (["--quantization", "bitsandbytes"], "--quantization bitsandbytes"),
    (["-q", "marlin"], "-q marlin"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2"),
    (["--enable-lora", "--max-cpu-loras", "8"], "--max-cpu-loras 8"),
    (["--enable-lora", "--fully-sharded-loras"], "--fully-sharded-loras"),
])
def test_unsupported_vllm_flag_is_one_line(flags, named):
    proc = run_cli("serve", "some/model", *flags)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert named in lines[0] and "not supported" in lines[0]
    assert "Traceback" not in proc.stderr


def test_a_busy_port_is_one_line_before_any_engine_starts():
    """The server takes its port first: one that is taken ends the run with
    exit 2 and one line naming it, before an engine loads (so nothing an
    engine opens, such as Ray's ports for replicas, can take it later)."""
    busy = bind_socket("127.0.0.1", 0)
    try:
        port = busy.getsockname()[1]
        proc = run_cli("serve", "--host", "127.0.0.1", "--port", str(port))
    finally:
        busy.close()
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and f"cannot listen on 127.0.0.1:{port}" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "serving" not in proc.stderr


def test_harmless_values_of_unsupported_flags_pass_the_check():
    cli.check_unsupported(["serve", "m", "--kv-cache-dtype", "auto", "-pp", "1", "--kv-cache-dtype=fp8_e5m2"])
    with pytest.raises(cli.UnsupportedFlag, match="--kv-cache-dtype fp8_inc .*fp8_e4m3"):
        cli.check_unsupported(["serve", "m", "--kv-cache-dtype", "fp8_inc"])


def test_a_quantization_method_reaches_the_engine_config():
    assert cli.engine_config_from_args(parse("/m", "--quantization", "fp8")).quantization == "fp8"
    assert cli.engine_config_from_args(parse("/m", "-q", "compressed-tensors")).quantization == "compressed-tensors"
    assert cli.engine_config_from_args(parse("/m")).quantization is None
    assert cli.engine_config_from_args(parse("/m", "-q", "awq")).quantization == "awq"
    cli.check_unsupported(["serve", "m", "-q", "fp8", "--quantization=compressed-tensors", "-q", "gptq"])
    # vLLM's Marlin names: a vLLM command line for a GPTQ or AWQ checkpoint runs unchanged.
    cli.check_unsupported(["serve", "m", "-q", "gptq_marlin", "--quantization=awq_marlin"])
    assert cli.engine_config_from_args(parse("/m", "-q", "gptq_marlin")).quantization == "gptq_marlin"
    config = cli.engine_config_from_args(parse("/m", "--quantized-weights", "packed"))
    assert config.quantized_weights == "packed"
    assert cli.engine_config_from_args(parse("/m")).quantized_weights == "dequantized"


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_cache_flag_reaches_the_cache_config(value):
    config = cli.engine_config_from_args(parse("/m", "--kv-cache-dtype", value))
    assert config.cache.kv_cache_dtype == value
    assert cli.engine_config_from_args(parse("/m")).cache.kv_cache_dtype == "auto"


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


def test_lora_flags_in_either_of_vllms_forms():
    args = parse("/m", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules", "sql=/a/sql",
                 '{"name": "chat", "path": "/a/chat", "base_model_name": "/m"}')
    lora = cli.engine_config_from_args(args).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (True, 3, 32)
    assert lora.lora_modules == (("sql", "/a/sql"), ("chat", "/a/chat"))
    with pytest.raises(ValueError, match="lora_modules need --enable-lora"):
        cli.engine_config_from_args(parse("/m", "--lora-modules", "sql=/a/sql"))
    for bad in ("sql", "=/a", '{"name": "x"}', '{"name": "x", "path": "/p", "rank": 8}'):
        with pytest.raises(SystemExit):
            parse("/m", "--enable-lora", "--lora-modules", bad)
    proc = run_cli("serve", "--device", "cpu", "--enable-lora", "--lora-modules", "sql=/nonexistent/adapter")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "fluidserve serve: lora_path: '/nonexistent/adapter' is not a folder"


def test_structured_outputs_config_in_either_of_vllms_forms():
    def compact(*argv: str) -> bool:
        return cli.server_settings(parse(*cli._dotted_config_flags(list(argv)))).disable_any_whitespace

    assert not compact()
    assert compact("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')
    assert compact("--structured-outputs-config.disable_any_whitespace", "true")
    assert compact("--structured-outputs-config.disable_any_whitespace=true", "--structured-outputs-config.backend",
                   "auto")
    # Later flags win, as in vLLM.
    assert not compact("--structured-outputs-config", '{"disable_any_whitespace": true}',
                       "--structured-outputs-config.disable_any_whitespace", "false")


def test_reasoning_parser_flags():
    settings = cli.server_settings(parse("--reasoning-parser", "qwen3"))
    assert (settings.reasoning_parser, settings.enable_in_reasoning) == ("qwen3", False)
    settings = cli.server_settings(parse(*cli._dotted_config_flags([
        "--structured-outputs-config.reasoning_parser", "deepseek_r1",
        "--structured-outputs-config.enable_in_reasoning", "true"])))
    assert (settings.reasoning_parser, settings.enable_in_reasoning) == ("deepseek_r1", True)
    assert cli.server_settings(parse()).reasoning_parser is None
    for name in ("mistral", "granite", "ernie45", "glm45", "olmo3"):
        assert cli.server_settings(parse("--reasoning-parser", name)).reasoning_parser == name


def test_a_reasoning_parser_for_a_model_without_think_tokens_is_one_line():
    """The built-in tiny model has no <think>: exit 2 once its tokenizer is
    read, before the server listens."""
    proc = run_cli("serve", "--reasoning-parser", "deepseek_r1", "--port", str(free_port()))
    assert proc.returncode == 2, proc.stderr
    assert "--reasoning-parser deepseek_r1: the tokenizer has no '<think>' token" in proc.stderr
    assert "Traceback" not in proc.stderr and "/v1 (max_model_len" not in proc.stderr


@pytest.mark.parametrize("value, named", [
    ('{"reasoning_parser": "kimi_k2"}', "reasoning_parser: 'kimi_k2' is not supported"),
    ('{"backend": "outlines"}', "backend: 'outlines' is not supported"),
    ('{"disable_any_whitespace": "yes"}', "disable_any_whitespace: 'yes' is not supported"),
    ('{"disable_fallback": true}', "disable_fallback: True is not supported"),
    ('{"whitespace": true}', "whitespace: not a key this server knows"),
    ("[1]", "not a JSON object"),
])
def test_structured_outputs_config_we_do_not_run_is_a_usage_error(value, named):
    proc = run_cli("serve", "m", "--structured-outputs-config", value)
    assert proc.returncode == 2 and named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert cli.load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert cli.load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="chat_template"):
        cli.load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.slow
def test_vllm_command_line_starts_the_server(tiny_model, tmp_path):
    """The quick-start line of vLLM's OpenAI-server docs, plus the flags a
    vLLM deployment commonly carries; the key comes from the environment and
    the server speaks HTTPS."""
    model = tiny_model("llama")
    key, cert = self_signed_cert(tmp_path)
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")
    port = free_port()
    log_path = tmp_path / "server.log"
    args = [model, "--dtype", "auto", "--served-model-name", "served-a", "served-b",
            "--chat-template", str(template), "--generation-config", "vllm", "--scheduling-policy", "priority",
            "--enable-chunked-prefill", "--uvicorn-log-level", "warning", "--trust-remote-code",
            "--disable-log-stats", "--max-model-len", "256", "--num-kv-blocks", "64", "--device", "cpu",
            "--ssl-keyfile", key, "--ssl-certfile", cert, "--allowed-origins", '["https://ui.example"]',
            "--enable-log-requests", "--max-log-len", "3",
            "--swap-space", "0"]  # no host KV pool to size: a faster start
    os.environ["FLUIDSERVE_API_KEY"] = "env-key"
    try:
        proc = start_subprocess_server(args, port, log_path)
    finally:
        del os.environ["FLUIDSERVE_API_KEY"]
    base = f"https://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=120, proc=proc)
        client = httpx.Client(verify=False, timeout=60)
        auth = {"Authorization": "Bearer env-key"}
        assert client.get(f"{base}/v1/models").status_code == 401
        models = client.get(f"{base}/v1/models", headers={**auth, "Origin": "https://ui.example"})
        assert models.headers["access-control-allow-origin"] == "https://ui.example"
        assert [m["id"] for m in models.json()["data"]] == ["served-a", "served-b"]
        msgs = [{"role": "user", "content": "hi"}]
        resp = client.post(f"{base}/v1/chat/completions", headers=auth,
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
    assert "https://127.0.0.1" in log
    assert "prompt '[us'" in log  # --enable-log-requests, cut to --max-log-len
    assert "Traceback" not in log


def test_generation_config_modes(tmp_path):
    from types import SimpleNamespace

    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    (model / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]}')
    (other / "generation_config.json").write_text('{"do_sample": false, "top_k": 20}')
    engine = SimpleNamespace(model_dir=model)
    assert cli.sampling_defaults(engine, "auto") == {"temperature": 0.6, "top_p": 0.9}
    assert cli.sampling_defaults(engine, "vllm") == {}
    assert cli.sampling_defaults(engine, str(other)) == {"top_k": 20, "temperature": 0.0}
    with pytest.raises(ValueError, match="generation_config"):
        cli.sampling_defaults(engine, str(tmp_path))
