"""vLLM's full metric set through a real server: every series a vLLM V1
server exports (names, types, labels with ``engine``, buckets) is on
/metrics, the series vLLM's Grafana dashboard queries are there, and the
values agree with the traffic sent. Then the per-replica path: stats of two
engines give two ``engine`` label values, and the router and replica
figures."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fluidserve.engine.engine import EngineStats
from fluidserve.engine.outputs import CompletionOutput, RequestOutput
from fluidserve.serve.metrics import RequestTimer, ServerMetrics

from server_utils import start_server

MAX_MODEL_LEN = 256
# vLLM's buckets (vllm/v1/metrics/loggers.py), written out so that a wrong
# constant in serve/metrics.py fails here.
SIZES = (1, 2, 5, 10, 20, 50, 100, 200)  # build_1_2_5_buckets(256)
ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0)
HISTOGRAMS = {
    "vllm:iteration_tokens_total": ITERATION,
    "vllm:request_prompt_tokens": SIZES,
    "vllm:request_generation_tokens": SIZES,
    "vllm:request_params_max_tokens": SIZES,
    "vllm:request_max_num_generation_tokens": SIZES,
    "vllm:request_prefill_kv_computed_tokens": SIZES,
    "vllm:request_params_n": (1, 2, 5, 10, 20),
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:time_per_output_token_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    "vllm:e2e_request_latency_seconds": REQUEST,
    "vllm:request_queue_time_seconds": REQUEST,
    "vllm:request_prefill_time_seconds": REQUEST,
    "vllm:request_decode_time_seconds": REQUEST,
    "vllm:request_inference_time_seconds": REQUEST,
}
# family -> (type, labels beyond model_name and engine)
SCALARS = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:gpu_cache_usage_perc": ("gauge", ()),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:mm_cache_queries": ("counter", ()),
    "vllm:mm_cache_hits": ("counter", ()),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:prompt_tokens_recomputed": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:request_success": ("counter", ("finished_reason",)),
}
# Every sample vLLM's example Grafana dashboard (examples/online_serving/
# prometheus_grafana) queries, old and new panel names.
DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def families(text: str) -> dict:
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def scrape(server) -> dict:
    resp = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert resp.status_code == 200
    return families(resp.text)


def total(fams: dict, family: str, sample: str | None = None, **labels: str) -> float:
    """Sum of the family's samples named ``sample`` (the family's own name
    by default) whose labels include ``labels``."""
    name = sample or family
    return sum(s.value for s in fams[family].samples
               if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = start_server(tiny_model("llama"), max_model_len=MAX_MODEL_LEN, served_model_name="tiny")
    yield srv
    srv.stop()


def test_every_vllm_series_with_its_type_labels_and_buckets(server):
    fams = scrape(server)
    for name, (kind, extra) in SCALARS.items():
        assert name in fams, name
        assert fams[name].type == kind, name
        samples = fams[name].samples
        assert samples, name
        for s in samples:
            assert set(s.labels) == {"model_name", "engine", *extra}, (name, s.labels)
            assert (s.labels["model_name"], s.labels["engine"]) == ("tiny", "0"), (name, s.labels)
    for name, buckets in HISTOGRAMS.items():
        assert fams[name].type == "histogram", name
        les = [s.labels["le"] for s in fams[name].samples if s.name == f"{name}_bucket"]
        assert les == [str(float(b)) for b in buckets] + ["+Inf"], name
        for s in fams[name].samples:
            assert (s.labels["model_name"], s.labels["engine"]) == ("tiny", "0"), (name, s.labels)
    sources = {s.labels["source"] for s in fams["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons
    sleep = {s.labels["sleep_state"]: s.value for s in fams["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    # The cache config as an info-style gauge: engine, no model_name (as vLLM).
    (info,) = fams["vllm:cache_config_info"].samples
    assert fams["vllm:cache_config_info"].type == "gauge" and info.value == 1.0
    assert {"engine": "0", "block_size": "16", "num_gpu_blocks": "512", "enable_prefix_caching": "True"}.items() \
        <= info.labels.items()
    assert "model_name" not in info.labels and "num_cpu_blocks" in info.labels
    assert total(fams, "fluidserve_replicas_healthy") == total(fams, "fluidserve_replicas_total") == 1
    assert "fluidserve_router_requests" not in fams  # no router: no router series


def test_series_vllm_dashboards_query_are_there(server):
    names = {s.name for fam in scrape(server).values() for s in fam.samples}
    assert set(DASHBOARD) <= names, sorted(set(DASHBOARD) - names)


def _complete(server, **body) -> dict:
    resp = httpx.post(f"{server.base_url}/v1/completions", json={"ignore_eos": True, **body}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_values_agree_with_the_traffic(server):
    """One completion per engine request of n = 1 first: every figure is
    then an exact function of the usage the responses report."""
    eos = server.engine.eos_token_id
    long_prompt = "the same long system prompt " * 3  # some 80 tokens: full blocks to share
    before = scrape(server)
    seqs: list[tuple[int, int, int]] = []  # (prompt tokens, generated, max_tokens) per completion
    two = _complete(server, prompt=["Hello there", "The quick brown fox"], max_tokens=5)
    for choice in two["choices"]:
        assert choice["finish_reason"] == "length"
    # Usage sums both prompts; each is a request of its own.
    tokenize = [httpx.post(f"{server.base_url}/tokenize", json={"prompt": p}, timeout=10).json()["count"]
                for p in ("Hello there", "The quick brown fox")]
    assert sum(tokenize) == two["usage"]["prompt_tokens"]
    seqs += [(n, 5, 5) for n in tokenize]
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "ignore_eos": True}).json()
    seqs.append((chat["usage"]["prompt_tokens"], 4, 4))
    for _ in range(2):  # the second finds the first's blocks in the prefix cache
        u = _complete(server, prompt=long_prompt, max_tokens=2)["usage"]
        seqs.append((u["prompt_tokens"], 2, 2))
    # A chat without max_tokens: vLLM counts the room the prompt leaves; one token, EOS.
    u = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "yo"}], "allowed_token_ids": [eos]}).json()["usage"]
    assert u["completion_tokens"] == 1
    seqs.append((u["prompt_tokens"], 1, MAX_MODEL_LEN - u["prompt_tokens"]))
    after = scrape(server)

    def delta(family: str, sample: str | None = None, **labels: str) -> float:
        return total(after, family, sample, **labels) - total(before, family, sample, **labels)

    prompt, generated = sum(p for p, _, _ in seqs), sum(g for _, g, _ in seqs)
    hist = lambda fam, part: delta(fam, f"{fam}_{part}")  # noqa: E731
    assert hist("vllm:request_prompt_tokens", "sum") == prompt
    assert hist("vllm:request_prompt_tokens", "count") == len(seqs)
    assert hist("vllm:request_generation_tokens", "sum") == generated
    assert hist("vllm:request_params_max_tokens", "sum") == sum(m for _, _, m in seqs)
    assert hist("vllm:request_max_num_generation_tokens", "sum") == generated  # n = 1: the one completion
    assert hist("vllm:request_params_n", "sum") == hist("vllm:request_params_n", "count") == len(seqs)
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == len(seqs) - 1
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 1
    # Prompt tokens by source: all of them, the cached ones as the device cache counted them.
    by_source = lambda src: delta("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total",  # noqa: E731
                                  source=src)
    cached = delta("vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total")
    assert cached > 0
    assert by_source("local_cache_hit") == cached == delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert by_source("local_compute") + cached == prompt
    assert hist("vllm:request_prefill_kv_computed_tokens", "sum") == prompt - cached
    # Each step runs the prompt tokens not cached and, per completion, every
    # generated token but the last (sampled, never fed back).
    assert hist("vllm:iteration_tokens_total", "sum") == prompt - cached + generated - len(seqs)
    assert hist("vllm:iteration_tokens_total", "count") >= max(g for _, g, _ in seqs)
    for fam in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds"):
        assert hist(fam, "count") == len(seqs), fam
    gaps = sum(g - 1 for _, g, _ in seqs)
    assert hist("vllm:inter_token_latency_seconds", "count") == gaps
    assert hist("vllm:time_per_output_token_seconds", "count") == gaps
    # Idle again: nothing waits, for any reason.
    assert total(after, "vllm:num_requests_waiting") == total(after, "vllm:num_requests_waiting_by_reason") == 0


def test_parallel_sampling_counts_the_parent_once_and_each_completion(server):
    before = scrape(server)
    body = _complete(server, prompt="Hello there", n=2, max_tokens=3)
    after = scrape(server)
    assert len(body["choices"]) == 2
    prompt = body["usage"]["prompt_tokens"]  # the prompt once, as OpenAI counts it

    def delta(fam: str, sample: str, **labels: str) -> float:
        return total(after, fam, sample, **labels) - total(before, fam, sample, **labels)

    assert delta("vllm:request_params_n", "vllm:request_params_n_count") == 1
    assert delta("vllm:request_params_n", "vllm:request_params_n_bucket", le="1.0") == 0
    assert delta("vllm:request_params_n", "vllm:request_params_n_bucket", le="2.0") == 1
    assert delta("vllm:request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens_sum") == 3
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_count") == 2
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == 2 * prompt
    assert delta("vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 6
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 2 * prompt


# -- replicas: the dict-of-stats path, without a server -----------------------

def _stats(running: int, waiting: int, used: int, steps: list[int], swapped: int = 0,
           swapping_in: int = 0) -> EngineStats:
    requests = {("online", "running", "q0"): running, ("online", "waiting", "q0"): waiting,
                ("offline", "swapped", "q1"): swapped, ("offline", "swapping_in", "q1"): swapping_in}
    s = EngineStats(requests=requests,
                    kv_blocks_total=100, kv_blocks_used=used, prompt_tokens_total=10 * running,
                    prefix_cache_query_tokens=64, prefix_cache_hit_tokens=16 * running,
                    cache_config={"block_size": "16", "num_gpu_blocks": "100"})
    for n in steps:
        s.observe_iteration(n)
    return s


def _render(metrics: ServerMetrics) -> dict:
    return families(metrics.render().decode())


def test_two_replicas_export_one_engine_label_each():
    m = ServerMetrics("m", max_model_len=64)
    m.engine.update({"0": _stats(2, 1, 30, [1, 100]), "1": _stats(5, 0, 70, [3000], swapped=2, swapping_in=1)})
    fams = _render(m)

    def by_engine(family: str, sample: str | None = None, **labels: str) -> dict[str, float]:
        return {e: total(fams, family, sample, engine=e, **labels) for e in ("0", "1")}

    assert by_engine("vllm:num_requests_running") == {"0": 2, "1": 5}
    # Swapped requests wait for device room; a swap-in under way waits on its copy.
    assert by_engine("vllm:num_requests_waiting") == {"0": 1, "1": 3}
    assert by_engine("vllm:num_requests_waiting_by_reason", reason="capacity") == {"0": 1, "1": 2}
    assert by_engine("vllm:num_requests_waiting_by_reason", reason="deferred") == {"0": 0, "1": 1}
    assert by_engine("vllm:num_requests_swapped") == {"0": 0, "1": 3}
    assert by_engine("vllm:kv_cache_usage_perc") == {"0": 0.3, "1": 0.7}
    assert by_engine("vllm:prompt_tokens", "vllm:prompt_tokens_total") == {"0": 20, "1": 50}
    assert by_engine("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == {"0": 32, "1": 80}
    it = "vllm:iteration_tokens_total"
    assert by_engine(it, f"{it}_count") == {"0": 2, "1": 1}
    assert by_engine(it, f"{it}_sum") == {"0": 101, "1": 3000}
    assert by_engine(it, f"{it}_bucket", le="1.0") == {"0": 1, "1": 0}
    assert by_engine(it, f"{it}_bucket", le="2048.0") == {"0": 2, "1": 0}
    assert by_engine(it, f"{it}_bucket", le="4096.0") == {"0": 2, "1": 1}
    assert sorted(s.labels["engine"] for s in fams["vllm:cache_config_info"].samples) == ["0", "1"]
    # Our own names carry the replica too, beside their own labels.
    assert total(fams, "fluidserve_kv_blocks_used", engine="1", tier="device") == 70
    assert total(fams, "fluidserve_num_requests", engine="0", status="running") == 2
    assert {s.labels["engine"] for s in fams["fluidserve_preemptions_by_kind"].samples} == {"0", "1"}


def test_one_engine_keeps_its_label_sets_and_a_replica_that_leaves_goes():
    m = ServerMetrics("m", max_model_len=64)
    m.engine.update(_stats(1, 0, 10, [5]))
    fams = _render(m)
    assert all("engine" not in s.labels for s in fams["fluidserve_kv_blocks_used"].samples)
    assert {s.labels["engine"] for s in fams["vllm:num_requests_running"].samples} == {"0"}
    m.engine.update({"1": _stats(1, 0, 10, [5])})  # engine 0 is gone from the latest snapshot
    assert {s.labels["engine"] for s in _render(m)["vllm:num_requests_running"].samples} == {"1"}


def _output(prompt: list[int], tokens: list[list[int]], finished: bool, cached: int) -> RequestOutput:
    outs = [CompletionOutput(i, token_ids=t, new_token_ids=t[-1:], finish_reason="length" if finished else None)
            for i, t in enumerate(tokens)]
    return RequestOutput("r", None, prompt, outs, finished=finished, first_scheduled_time=0.0,
                         num_cached_tokens=cached)


def test_request_series_land_under_the_engine_that_served_them():
    m = ServerMetrics("m", max_model_len=64)
    m.set_replicas(healthy=1, total=2)
    fams = _render(m)
    assert total(fams, "fluidserve_replicas_healthy") == 1 and total(fams, "fluidserve_replicas_total") == 2
    # Both replicas' request series exist before any request: zeros, not gaps.
    ttft = "vllm:time_to_first_token_seconds"
    assert {s.labels["engine"] for s in fams[ttft].samples} == {"0", "1"}
    timer = RequestTimer(m, n=1, max_tokens=7)
    timer.routed_to("1")
    timer.on_output(_output(list(range(20)), [[5]], False, cached=16))
    timer.on_output(_output(list(range(20)), [[5, 6]], True, cached=16))
    fams = _render(m)
    assert total(fams, ttft, f"{ttft}_count", engine="1") == 1
    assert total(fams, ttft, f"{ttft}_count", engine="0") == 0
    src = "vllm:prompt_tokens_by_source"
    assert total(fams, src, f"{src}_total", engine="1", source="local_cache_hit") == 16
    assert total(fams, src, f"{src}_total", engine="1", source="local_compute") == 4
    assert total(fams, "vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum", engine="1") == 7
    assert total(fams, "vllm:request_success", "vllm:request_success_total", engine="1", finished_reason="length") == 1


def test_router_counters_from_their_source():
    from fluidserve.scheduler.router import make_router

    router = make_router("prefix-aware", 2, block_size=4)
    prompt = list(range(12))
    router.route("a", prompt)  # nothing cached anywhere: least-loaded
    router.finished("a")
    router.route("b", prompt + [99])  # where "a" went: 12 tokens expected cached
    m = ServerMetrics("m")
    m.set_router_source(router.counters)
    fams = _render(m)
    req = "fluidserve_router_requests"
    assert fams[req].type == "counter"
    first = router.counters()["replicas"][0]["routed"] and "0" or "1"
    assert {(s.labels["engine"], s.labels["reason"]): s.value for s in fams[req].samples
            if s.name == f"{req}_total"} == {(first, "least-loaded"): 1, (first, "prefix"): 1}
    hits = "fluidserve_router_prefix_hit_tokens"
    assert {s.labels["engine"]: s.value for s in fams[hits].samples if s.name == f"{hits}_total"} == \
        {first: 12, str(1 - int(first)): 0}
    router.route("c", prompt)  # read at each scrape
    assert total(_render(m), req, f"{req}_total", engine=first) == 3
