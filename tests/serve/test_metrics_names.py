"""/metrics through a real server, parsed with prometheus_client's own parser:
our ``fluidserve_*`` names stay, vLLM's names (with a ``model_name`` label)
and process metrics are there, and their values follow the traffic sent."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import start_server

VLLM_NAMES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success", "vllm:num_preemptions",
}
OURS = {"fluidserve_time_to_first_token_seconds", "fluidserve_e2e_request_latency_seconds",
        "fluidserve_num_requests", "fluidserve_kv_blocks_used", "fluidserve_engine_healthy"}
PROCESS = {"process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"}


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), max_model_len=256, served_model_name="tiny")
    yield srv
    srv.stop()


def scrape(server) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels): value}."""
    resp = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert resp.status_code == 200
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(resp.text):
        for sample in fam.samples:
            out.setdefault(fam.name, {})[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (name, lbl), v in metrics[family].items()
               if (sample is None or name == sample) and want <= set(lbl))


def test_names_parse_and_carry_model_name(server):
    m = scrape(server)
    assert VLLM_NAMES | OURS | PROCESS <= set(m), sorted(VLLM_NAMES | OURS | PROCESS - set(m))
    for fam in VLLM_NAMES:
        assert all(dict(lbl).get("model_name") == "tiny" for _, lbl in m[fam]), fam


def test_values_follow_the_traffic(server):
    before = scrape(server)
    lengths = [5, 9]
    prompt_tokens = 0
    for n in lengths:
        body = {"prompt": "Hello", "max_tokens": n, "ignore_eos": True}
        usage = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()["usage"]
        prompt_tokens += usage["prompt_tokens"]
    stop = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 8, "allowed_token_ids": [257]}).json()
    assert stop["choices"][0]["finish_reason"] == "stop"
    prompt_tokens += stop["usage"]["prompt_tokens"]
    after = scrape(server)

    def delta(family: str, sample: str | None = None, **labels: str) -> float:
        return value(after, family, sample, **labels) - value(before, family, sample, **labels)

    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 1
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == sum(lengths) + 1
    for fam in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds"):
        assert delta(fam, f"{fam}_count") == 3, fam
    # One gap between consecutive tokens of each request.
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == sum(
        n - 1 for n in lengths)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert value(after, "process_resident_memory_bytes") > 0


def test_running_request_and_kv_usage_while_streaming(server):
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        during = scrape(server)
        for _ in lines:
            pass
    assert value(during, "vllm:num_requests_running") == 1
    assert value(during, "vllm:num_requests_waiting") == 0
    assert 0.0 < value(during, "vllm:kv_cache_usage_perc") <= 1.0
    assert value(scrape(server), "vllm:num_requests_running") == 0
