"""The benchmark client (``fluidserve bench`` / benchmarks/serve_bench.py)
against a real server on the tiny model: ``vllm bench serve``'s flags, its
datasets (random ids, ShareGPT real text, BurstGPT lengths, custom JSONL) and
its flat result keys, recomputed here from the per-request data the client
saved, plus the older interface benchmarks/vs_vllm.py and serve_bench.py use.
"""

from __future__ import annotations

import asyncio
import csv
import json

import numpy as np
import pytest
import transformers

from fluidserve.serve import bench_client as bc
from server_utils import start_server

VLLM_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
             "max_concurrent_requests", "date", "backend", "model_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency")


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=256)
    yield srv
    srv.stop()


def bench(server, tmp_path, *flags: str) -> dict:
    rc = bc.main(["--base-url", server.base_url, "--no-progress", "--save-result", "--result-dir", str(tmp_path),
                  "--result-filename", "run.json", *flags])
    assert rc == 0
    return json.loads((tmp_path / "run.json").read_text())


def test_random_dataset_writes_vllms_keys(server, tmp_path):
    res = bench(server, tmp_path, "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
                "--random-range-ratio", "0.5", "--num-prompts", "8", "--request-rate", "40", "--burstiness", "0.5",
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--goodput", "ttft:60000", "e2el:60000", "--save-detailed", "--seed", "3")
    for key in VLLM_KEYS:
        assert key in res, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in res, (stat, metric)
    assert res["completed"] == 8 and res["failed"] == 0 and res["num_prompts"] == 8
    assert res["request_rate"] == 40 and res["burstiness"] == 0.5
    # Lengths from [12, 36] and [3, 9]; random runs ignore EOS (vLLM forces it), so outputs are exact.
    assert all(12 <= n <= 36 for n in res["input_lens"]) and res["total_input_tokens"] == sum(res["input_lens"])
    assert len(set(res["input_lens"])) > 1
    assert res["total_output_tokens"] == sum(res["output_lens"]) and all(3 <= n <= 9 for n in res["output_lens"])
    # The figures are numpy's over the requests' own timings.
    assert res["mean_ttft_ms"] == pytest.approx(np.mean(res["ttfts"]) * 1000)
    assert res["p99_e2el_ms"] == pytest.approx(np.percentile(res["latencies"], 99) * 1000)
    assert res["median_itl_ms"] == pytest.approx(np.median([x for r in res["itls"] for x in r]) * 1000)
    tpots = [(e - t) / (n - 1) for e, t, n in zip(res["latencies"], res["ttfts"], res["output_lens"]) if n > 1]
    assert res["p90_tpot_ms"] == pytest.approx(np.percentile(tpots, 90) * 1000)
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    assert res["request_goodput"] == pytest.approx(8 / res["duration"])  # generous SLOs: all meet them
    assert 1 <= res["max_concurrent_requests"] <= 8
    # Our own figures beside them.
    assert res["normalized_latency_ms_per_token"]["mean"] > 0 and res["slo_attainment"] == 1.0


def test_embeddings_endpoint_loads_an_embedding_model(model_dir, tmp_path):
    """vLLM's openai-embeddings backend: each prompt one /v1/embeddings
    request of exactly its random ids, the latency its end-to-end time, the
    input tokens the server's count; an offline backlog goes at priority 1."""
    srv = start_server(model_dir, runner="pooling", max_model_len=256)
    try:
        res = bench(srv, tmp_path, "--endpoint", "/v1/embeddings", "--dataset-name", "random",
                    "--random-input-len", "24", "--random-range-ratio", "0.5", "--num-prompts", "8",
                    "--request-rate", "40", "--save-detailed", "--offline-prompts", "3")
    finally:
        srv.stop()
    assert res["completed"] == 11 and res["failed"] == 0 and res["backend"] == "openai-embeddings"
    assert res["total_output_tokens"] == 0 and res["total_input_tokens"] == sum(res["input_lens"])
    assert all(12 <= n <= 36 for n in res["input_lens"][:8])
    assert res["p99_e2el_ms"] == pytest.approx(np.percentile(res["latencies"], 99) * 1000)
    assert "mean_ttft_ms" not in res  # vLLM's embeddings default: e2el only
    assert res["coserving"]["offline"]["completed"] == 3


def test_goodput_counts_only_requests_meeting_the_slo(server, tmp_path):
    res = bench(server, tmp_path, "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
                "--num-prompts", "4", "--goodput", "ttft:0.001")
    assert res["completed"] == 4 and res["request_goodput"] == 0.0 and res["slo_attainment"] == 0.0
    assert "p99_ttft_ms" in res and "mean_e2el_ms" not in res  # vLLM's default metrics: ttft, tpot, itl


def test_sharegpt_sends_the_real_text(server, model_dir, tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "Tell me about the sea and its tides."},
                           {"from": "gpt", "value": "The sea rises and falls twice a day."}]},
        {"conversations": [{"from": "human", "value": "What is a prime number, in short?"},
                           {"from": "gpt", "value": "A number with exactly two divisors."}]},
        {"conversations": [{"from": "human", "value": "Name three colours of a rainbow."},
                           {"from": "gpt", "value": "Red, green and violet, among others."}]},
        {"conversations": [{"from": "human", "value": "Only one turn here."}]},  # skipped: no answer
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]},  # too short
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    res = bench(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--tokenizer", model_dir,
                "--num-prompts", "3", "--sharegpt-output-len", "5", "--ignore-eos", "--save-detailed")
    assert res["completed"] == 3 and res["total_output_tokens"] == 15
    # The server counted exactly the three usable prompts' tokens: the text itself was sent.
    expected = sorted(len(tok(c["conversations"][0]["value"]).input_ids) for c in convs[:3])
    assert sorted(res["input_lens"]) == expected and res["total_input_tokens"] == sum(expected)

    # Without --sharegpt-output-len each request asks for its reference answer's length.
    res = bench(server, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--tokenizer", model_dir,
                "--num-prompts", "3", "--ignore-eos")
    assert res["total_output_tokens"] == sum(len(tok(c["conversations"][1]["value"]).input_ids) for c in convs[:3])


def test_custom_jsonl_on_the_chat_endpoint(server, model_dir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["Say a word.", "Count to three.", "Hello!"]))
    res = bench(server, tmp_path, "--dataset-name", "custom", "--dataset-path", str(path), "--tokenizer", model_dir,
                "--endpoint", "/v1/chat/completions", "--num-prompts", "5", "--custom-output-len", "3",
                "--ignore-eos", "--max-concurrency", "2")
    assert res["completed"] == 5 and res["total_output_tokens"] == 15  # 3 prompts, oversampled to 5
    assert res["backend"] == "openai-chat" and res["max_concurrency"] == 2
    assert res["max_concurrent_requests"] <= 2


def test_burstgpt_lengths_of_gpt4_rows(server, tmp_path):
    path = tmp_path / "burst.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        w.writerows([[i, "GPT-4", 10, 4, 14, "Conversation log"] for i in range(3)])
        w.writerow([3, "ChatGPT", 50, 50, 100, "Conversation log"])  # another model: not used
        w.writerow([4, "GPT-4", 50, 0, 50, "Conversation log"])  # failed request: not used
    res = bench(server, tmp_path, "--dataset-name", "burstgpt", "--dataset-path", str(path), "--num-prompts", "5")
    assert res["completed"] == 5 and res["total_input_tokens"] == 50 and res["total_output_tokens"] == 20


def test_default_result_file_name_is_vllms(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bc.main(["--base-url", server.base_url, "--no-progress", "--save-result", "--dataset-name", "random",
                    "--random-input-len", "8", "--random-output-len", "2", "--num-prompts", "2",
                    "--max-concurrency", "1"]) == 0
    (path,) = tmp_path.glob("*.json")
    model = server.engine.model_name.split("/")[-1]
    assert path.name.startswith(f"openai-infqps-concurrency1-{model}-")


def test_offline_backlog_is_reported_apart(server, tmp_path):
    res = bench(server, tmp_path, "--input-len", "8", "--output-len", "3", "--num-prompts", "3",
                "--offline-prompts", "2", "--request-rate", "20")
    assert res["completed"] == 5
    assert res["coserving"]["online"]["completed"] == 3 and res["coserving"]["offline"]["completed"] == 2


@pytest.mark.parametrize("flags, message", [
    (["--goodput", "ttft"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--dataset-name", "random", "--random-range-ratio", "1.0"], "--random-range-ratio"),
    (["--percentile-metrics", "ttft,bogus"], "--percentile-metrics"),
    (["--metric-percentiles", "99,x"], "--metric-percentiles"),
    (["--endpoint", "/v1/responses"], "--endpoint"),
    (["--dataset-name", "random", "--use-trace-arrivals"], "--use-trace-arrivals"),
    (["--dataset", "chat", "--endpoint", "chat"], "--dataset chat"),
    (["--dataset", "chat", "--chat-context-len", "600", "--max-input-len", "100"], "--chat-context-len"),
])
def test_bad_flags_fail_with_a_message(server, flags, message, capsys):
    assert bc.main(["--base-url", server.base_url, "--no-progress", "--num-prompts", "1", "--output",
                    "/dev/null", *flags]) == 2
    assert message in capsys.readouterr().err


CHAT_FLAGS = ["--dataset", "chat", "--chat-context-len", "40", "--length-scale", "0.05", "--max-input-len", "150",
              "--max-output-len", "8", "--chat-think-s", "0.05", "--request-rate", "20", "--seed", "4"]


def chat_args(server, *flags: str):
    return bc.build_parser().parse_args(["--base-url", server.base_url, "--no-progress", *CHAT_FLAGS, *flags])


def test_chat_workload_is_conversations_that_extend_their_history(server):
    specs = bc.build_workload(chat_args(server, "--num-prompts", "40"))
    assert len(specs) == 40 and all(s.prompt_len <= 150 and 1 <= s.output_len <= 8 for s in specs)
    by_conv: dict[int, list] = {}
    for s in specs:
        by_conv.setdefault(s.conversation, []).append(s)
    assert 5 < len(by_conv) < 40  # several turns per conversation on average (LMSYS: 2)
    for turns in by_conv.values():
        first, rest = turns[0], turns[1:]
        assert first.think_s == 0 and len(first.prompt) == first.prompt_len > 40  # context and a message
        for before, turn in zip(turns, rest):
            assert turn.prompt_len == before.prompt_len + before.output_len + len(turn.prompt)
            assert turn.arrival_s == first.arrival_s and turn.think_s > 0
    starts = sorted(t[0].arrival_s for t in by_conv.values())
    assert starts[0] == 0 and 0 < starts[-1] < 40 / 20 * 3  # 40 turns offered at 20/s


def test_chat_turns_resend_history_and_wait_for_the_reply(server):
    """Closed loop: each follow-up goes after the reply before it (plus its
    think time), its prompt that turn's prompt, the reply's ids the server
    returned and the new message, so the server's prefix cache finds it."""
    args = chat_args(server, "--num-prompts", "16")
    specs = bc.build_workload(args)
    hits_before = _prefix_hits(server)
    results, elapsed = asyncio.run(bc.run_load(args, specs))
    assert all(r.ok for r in results), [r.error for r in results if r.error]
    reused = 0
    for i, (spec, r) in enumerate(zip(specs, results)):
        prev = [j for j in range(i) if specs[j].conversation == spec.conversation]
        if not prev:
            assert r.prompt_tokens == spec.prompt_len
            continue
        b, rb = specs[prev[-1]], results[prev[-1]]
        assert r.prompt_tokens == rb.prompt_tokens + rb.completion_tokens + len(spec.prompt) == spec.prompt_len
        assert len(rb.token_ids) == rb.completion_tokens == b.output_len
        assert r.start >= rb.start + rb.e2e + spec.think_s - 1e-3
        reused += (rb.prompt_tokens + rb.completion_tokens) // 16 * 16 - 16  # its history's full blocks, less one
    assert reused > 0 and _prefix_hits(server) - hits_before >= reused


def _prefix_hits(server) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "fluidserve_prefix_cache_hits_total" and s.labels.get("tier") == "device")


def test_a_failed_turn_ends_its_conversation(server):
    """A follow-up cannot be sent without the reply it resends: the rest of
    the conversation is reported failed, not silently dropped."""
    args = chat_args(server, "--num-prompts", "12", "--extra-body", '{"max_tokens": 100000}')
    results, _ = asyncio.run(bc.run_load(args, bc.build_workload(args)))
    assert not any(r.ok for r in results)
    assert any("not sent: an earlier turn" in r.error for r in results)
    assert all(r.error.startswith("HTTP 400") for r in results if "not sent" not in r.error)


def test_older_interface_keeps_working(server):
    """What benchmarks/vs_vllm.py and serve_bench.py call: parse, build, run, report."""
    args = bc.build_parser().parse_args([
        "--base-url", server.base_url, "--no-progress", "--endpoint", "chat", "--input-len", "8",
        "--output-len", "4", "--length-dist", "uniform", "--length-range", "0.5", "--num-requests", "4",
        "--request-rate", "50", "--seed", "1", "--slo-ttft-ms", "60000"])
    results, elapsed = asyncio.run(bc.run_load(args, bc.build_workload(args)))
    rep = bc.report(results, elapsed, args)
    assert rep["completed"] == 4 and rep["slo_attainment"] == 1.0 and rep["goodput_req_s"] > 0
    for key in ("duration_s", "output_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert key in rep
    assert rep["ttft_ms"]["p99"] >= rep["ttft_ms"]["p50"] > 0


@pytest.mark.parametrize("chunk,token", [
    ('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', False),
    ('{"choices": [{"index": 0, "delta": {"role": "assistant", "content": null}}]}', False),  # other spellings
    ('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}', False),
    ('{"choices":[{"index":0,"delta":{"content":"hi"}}]}', True),
    ('{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}', True),
    ('{"choices":[{"index":0,"text":"hi","finish_reason":null}]}', True),  # completions
])
def test_only_chunks_with_output_start_ttft_or_count_as_tokens(chunk, token):
    result = bc.RequestResult(prompt_len=1, output_len=1)
    bc._on_event(chunk, result)
    assert bool(result.token_times) is token


def test_per_request_figures_pool_into_the_same_ratios(server):
    """benchmarks/swap_serving.py pools seeds' requests before taking
    percentiles: the per-request figures a load returns reproduce its own
    report (same units), and pooled over one seed the ratios are that seed's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import swap_serving
        from serve_bench import load
    finally:
        sys.path.pop(0)
    flags = ["--input-len", "8", "--output-len", "4", "--length-dist", "uniform", "--length-range", "0.5",
             "--num-requests", "6", "--request-rate", "50", "--seed", "1"]
    rows = []
    for label in ("base", "other"):
        rep = load(server.base_url, flags, per_request=True)
        per = rep["per_request"]
        assert len(per["ttft_ms"]) == len(per["norm_ms"]) == rep["completed"] == 6
        sent = bc.build_workload(bc.build_parser().parse_args(["--base-url", server.base_url, *flags]))
        assert per["prompt_len"] == [spec.prompt_len for spec in sent]  # each figure stays with its request
        assert np.percentile(per["ttft_ms"], 99) == pytest.approx(rep["ttft_ms"]["p99"])
        assert np.percentile(per["tpot_ms"], 99) == pytest.approx(rep["tpot_ms"]["p99"])
        assert np.mean(per["norm_ms"]) == pytest.approx(rep["normalized_latency_ms_per_token"]["mean"])
        rows.append({"variant": label, "seed": 0, **rep})
    base, other = swap_serving.summary(rows)
    assert base["pooled_p99_ttft"] == pytest.approx(1.0) and base["pooled_requests"] == 6
    for k in ("mean_norm", "p99_ttft", "p99_tpot"):
        assert other[f"pooled_{k}"] == pytest.approx(other[k])


def test_baseline_run_twice_pools_both_runs_against_each_variant():
    """swap_serving.py --baseline-again: a variant's figures also stand
    against both baseline runs' requests together, each run counted once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import swap_serving
    finally:
        sys.path.pop(0)

    def row(label: str, ttft: list[float], norm: list[float]) -> dict:
        per = {"ttft_ms": ttft, "norm_ms": norm, "tpot_ms": norm}
        figs = {"ttft_ms": {"p99": float(np.percentile(ttft, 99))},
                "tpot_ms": {"p99": float(np.percentile(norm, 99))},
                "normalized_latency_ms_per_token": {"mean": float(np.mean(norm))}}
        return {"variant": label, "seed": 0, "per_request": per, **figs}

    rows = [row("fcfs", [10.0] * 4, [4.0] * 4), row("other", [10.0] * 4, [2.0] * 4),
            row("fcfs, again", [10.0] * 4, [2.0] * 4)]
    base, other, again = swap_serving.summary(rows)
    assert other["pooled_mean_norm"] == pytest.approx(2.0) and again["pooled_mean_norm"] == pytest.approx(2.0)
    assert other["pooled_both_mean_norm"] == pytest.approx(1.5)  # (4 + 2) / 2 over 2
    assert other["pooled_both_p99_ttft"] == pytest.approx(1.0) and other["pooled_both_requests"] == 4
    assert "pooled_both_mean_norm" not in base and "pooled_both_mean_norm" not in again
