"""benchmarks/gpu_check.sh, the one GPU command, on a machine without CUDA:
it must stop at once with a non-zero status and say why, before installing
or running anything; its command line; the summary it builds from the
steps' result files (benchmarks/gpu_check_report.py); and the imports of
what it runs, on a GPU machine that has no server packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "gpu_check.sh"
REPORT = BENCHMARKS / "gpu_check_report.py"
STEPS = ["install", "import", "engine GPU tests", "kernel GPU tests", "batch-1 decode", "kernel benchmark",
         "MoE experts", "throughput", "decode profile", "swap copy"]  # fmt: skip


def gpu_check(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the script's real job")
@pytest.mark.parametrize("extra", [[], ["--quick"], ["--throughput"]])  # --throughput: accepted, now a no-op
def test_gpu_check_fails_clearly_without_cuda(tmp_path, extra):
    done = gpu_check("--results", str(tmp_path), *extra, timeout=120)
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing installed, run or written


@pytest.mark.parametrize("args, message", [
    (["--no-such-flag"], "unknown argument --no-such-flag"),
    (["--results"], "--results needs a directory"),
    (["--budget", "soon"], "--budget needs a number of seconds"),
])  # fmt: skip
def test_gpu_check_refuses_bad_arguments(args, message):
    done = gpu_check(*args)
    assert done.returncode == 2 and message in done.stderr


def test_gpu_check_help_lists_the_steps_in_order_with_their_limits(tmp_path):
    done = gpu_check("--help", "--results", str(tmp_path))
    assert done.returncode == 0 and list(tmp_path.iterdir()) == []
    text = done.stdout
    positions = [text.index(step) for step in STEPS]
    assert positions == sorted(positions)
    assert "540 s" in text and "225 s" in text and "--budget SECONDS" in text


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_summary_reads_each_steps_fresh_result_and_ignores_stale_ones(tmp_path):
    summary = tmp_path / "gpu_check_fake.json"
    plan = ["engine_tests=engine GPU tests", "batch1_decode=batch-1 decode", "throughput=throughput",
            "kernel_bench=kernel benchmark", "profile=decode profile", "swap_copy=swap copy"]  # fmt: skip
    assert report("init", "--summary", summary, "--device", "Fake GPU", "--versions", "v", "--budget", 465,
                  "--plan", *plan).returncode == 0  # fmt: skip
    assert "| kernel benchmark | not run |" in summary.with_suffix(".md").read_text()
    started = time.time() - 1

    junit = tmp_path / "engine.xml"  # as pytest leaves it when interrupted: the stopped test has no name
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok" time="2.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="0.25"><failure message="assert 1 == 2">x</failure>'
        '</testcase><testcase classname="tests.test_b" name="test_skip" time="1.0"><skipped message="no"/></testcase>'
        '<testcase time="0.0"/></testsuite></testsuites>'
    )  # fmt: skip
    tests_json = tmp_path / "gpu_tests_engine_fake.json"
    report("step", "--summary", summary, "--key", "engine_tests", "--rc", 124, "--seconds", 150, "--limit", 150,
           "--since", started, "--result", tests_json, "--junit", junit)  # fmt: skip
    tests = json.loads(tests_json.read_text())
    assert tests["failures"][0]["test"] == "tests.test_a::test_bad"
    # where the step's time went: the slowest tests first, and per module
    assert tests["test_seconds"] == 3.8 and [t["test"] for t in tests["slowest"]] == [
        "tests.test_a::test_ok", "tests.test_b::test_skip", "tests.test_a::test_bad"]  # fmt: skip
    assert tests["modules"] == [dict(module="tests.test_a", seconds=2.8), dict(module="tests.test_b", seconds=1.0)]
    assert "by module: `tests.test_a` 3 s, `tests.test_b` 1 s; slowest: `tests.test_a::test_ok` 2.5 s" in (
        summary.with_suffix(".md").read_text())

    decode = tmp_path / "batch1_decode_fake.json"
    decode.write_text(json.dumps(dict(roofline_ms=5.0, eager_over_graphs=2.0, modes=dict(
        eager=dict(enforce_eager=True, ms_per_token=12.0, vs_roofline=2.4, graph_replays=None),
        graphs=dict(enforce_eager=False, ms_per_token=6.0, vs_roofline=1.2, graph_replays=127)))))
    report("step", "--summary", summary, "--key", "batch1_decode", "--rc", 0, "--seconds", 50, "--limit", 120,
           "--since", started, "--result", decode)  # fmt: skip

    stale = tmp_path / "throughput-fake-llama3-8b-graphs.json"  # an earlier run's, and this run wrote none
    stale.write_text(json.dumps(dict(results=dict(fluidserve=dict(tokens_per_s=1.0)))))
    os.utime(stale, (started - 3600, started - 3600))
    report("step", "--summary", summary, "--key", "throughput", "--rc", 1, "--seconds", 9, "--limit", 150,
           "--since", started, "--result", stale)  # fmt: skip
    report("step", "--summary", summary, "--key", "kernel_bench", "--limit", 90, "--skipped", "no time left")
    profile = tmp_path / "profile_decode_fake.json"
    profile.write_text(json.dumps(dict(modes=dict(
        eager=dict(wall_ms_per_token=20.0, kernel_ms_per_token=6.0, kernel_launches_per_token=365.0),
        graphs=dict(wall_ms_per_token=7.5, kernel_ms_per_token=6.0, kernel_launches_per_token=10.0)))))
    report("step", "--summary", summary, "--key", "profile", "--rc", 0, "--seconds", 40, "--limit", 60,
           "--since", started, "--result", profile)  # fmt: skip
    swap = tmp_path / "swap_copy_fake.json"
    swap.write_text(json.dumps(dict(runs=[dict(run=64, swap_out_vs_pinned=0.9, swap_in_vs_pinned=0.85,
                                               step_slowdown=1.05)])))
    report("step", "--summary", summary, "--key", "swap_copy", "--rc", 0, "--seconds", 20, "--limit", 45,
           "--since", started, "--result", swap)  # fmt: skip

    done = report("finish", "--summary", summary)
    assert done.returncode == 1
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert "TIMED OUT after 150 s" in rows["engine GPU tests"]
    assert "1 passed, 1 failed, 1 skipped, cut off mid-test" in rows["engine GPU tests"]
    assert "eager 12.00 ms/tok (2.40x roofline); graphs 6.00 ms/tok (1.20x roofline); eager/graphs 2.00x" in (
        rows["batch-1 decode"])
    assert "FAILED (exit 1)" in rows["throughput"] and "earlier run: not read" in rows["throughput"]
    assert "skipped: no time left" in rows["kernel benchmark"]
    assert "eager GPU idle 70% (365 launches/tok); graphs GPU idle 20% (10 launches/tok)" in rows["decode profile"]
    assert "runs of 64: out 90% / in 85% of pinned, step 1.05x beside a swap" in rows["swap copy"]
    record = json.loads(summary.read_text())
    assert record["status"] == "failed"
    assert record["steps"][1]["figures"]["graphs_ms_per_token"] == 6.0
    assert record["steps"][2]["results"] == []  # the stale file is not this run's
    md = summary.with_suffix(".md").read_text()
    assert "# GPU check on Fake GPU" in md and "`tests.test_a::test_bad` (failure): assert 1 == 2" in md


def test_summary_status_ok_only_when_every_step_ran_and_passed(tmp_path):
    summary = tmp_path / "gpu_check_fake.json"
    report("init", "--summary", summary, "--device", "Fake GPU", "--plan", "install=install", "import=import")
    report("step", "--summary", summary, "--key", "install", "--rc", 0, "--seconds", 5, "--limit", 60)
    assert report("finish", "--summary", summary).returncode == 1  # import never ran
    assert json.loads(summary.read_text())["status"] == "incomplete"
    report("step", "--summary", summary, "--key", "import", "--rc", 0, "--seconds", 3, "--limit", 45)
    assert report("finish", "--summary", summary).returncode == 0


def test_what_gpu_check_runs_imports_without_the_server_packages():
    """The GPU machine has torch, Triton, transformers and pytest, but no
    FastAPI, uvicorn, pydantic, Ray or xgrammar."""
    code = f"""
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {{"fastapi", "uvicorn", "pydantic", "ray", "xgrammar"}}:
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Missing())
sys.path.insert(0, {str(BENCHMARKS)!r})
import fluidserve.engine, fluidserve.kernels.paged_attention
from fluidserve.engine import LLM, SamplingParams
import kernel_bench, throughput, gpu_check_report, profile_decode, swap_copy, attention_tuning, linear_bandwidth
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_kernel_benchmark_headline_names_the_batch1_point_with_either_merge(tmp_path):
    """The kernel step's summary line carries the batch-1, 16k-context
    figure in a graph, and beside it the fused merge's where the run timed
    it; the prefill figure, with the alternative prefill tiles' beside it."""
    summary = tmp_path / "gpu_check_fake.json"
    report("init", "--summary", summary, "--device", "Fake GPU", "--plan", "kernel_bench=kernel benchmark")
    started = time.time() - 1
    result = tmp_path / "kernels_fake.json"
    result.write_text(json.dumps(dict(copy_gb_s=4000.0, mixed=dict(speedup=1.1, default="separate"), targets=dict(
        decode_pct_of_copy=84.2, prefill_vs_sdpa=0.83, decode_batch1_16k_graph_pct_of_copy=46.4,
        decode_batch1_16k_fused_graph_pct_of_copy=55.0, decode_batch1_16k_read_flush_graph_pct_of_copy=61.5,
        prefill_alternatives_vs_sdpa={"32 keys a step": 0.85, "two halves of rows": 0.97}))))
    report("step", "--summary", summary, "--key", "kernel_bench", "--rc", 0, "--seconds", 16, "--limit", 90,
           "--since", started, "--result", result)  # fmt: skip
    done = report("finish", "--summary", summary)
    assert ("decode 84.2% of copy; batch 1 at 16k 46.4% in a graph (55.0% merged in the launch, 61.5% after a "
            "read flush); prefill 0.83x "
            "SDPA (prefill tile, 32 keys a step: 0.85x, two halves of rows: 0.97x); mixed step 1.10x unpacked "
            "(separate plan)") in done.stdout
    assert json.loads(summary.read_text())["steps"][0]["figures"]["decode_batch1_16k_fused_graph_pct_of_copy"] == 55.0


def test_linears_step_reports_the_chain_with_and_without_dependent_launches(tmp_path):
    """``linear_bandwidth.py --parts chain`` (gpu_check's linears step)
    writes the chain to its own record: its markdown has each launch kind's
    row, and the summary line gives each kind against the roofline and
    against plain launches, and says so where a kind's bits differ."""
    sys.path.insert(0, str(BENCHMARKS))
    import linear_bandwidth

    def kind(ms: float, same: bool = True) -> dict:
        return dict(ms=ms, vs_roofline=ms / 3.55, speedup=3.95 / ms, same_bits=same)

    chain = dict(layers=32, launches=129, weight_gb=15.01, roofline_ms=3.55, rounds=10,
                 modes=dict(off=kind(3.95), on=kind(3.70), l2=kind(3.65, same=False)))  # fmt: skip
    record = dict(device="Fake GPU", preset="llama3-8b", copy_gb_s=4226.0, versions="torch x, triton y",
                  chain=chain)  # fmt: skip
    text = linear_bandwidth.chain_markdown(record)
    assert "| plain | 3.950 | 1.113 | 1.000 | yes |" in text
    assert "| programmatic dependents (`FLUIDSERVE_GEMV_PDL=1`) | 3.700 | 1.042 | 1.068 | yes |" in text
    assert "(`FLUIDSERVE_GEMV_PDL=l2`) | 3.650 | 1.028 | 1.082 | **no** |" in text
    summary = tmp_path / "gpu_check_fake.json"
    report("init", "--summary", summary, "--device", "Fake GPU", "--plan", "linears=batch-1 linears")
    result = tmp_path / "gemv_chain_fake.json"
    result.write_text(json.dumps(record))
    report("step", "--summary", summary, "--key", "linears", "--rc", 0, "--seconds", 30, "--limit", 60,
           "--since", time.time() - 1, "--result", result)  # fmt: skip
    done = report("finish", "--summary", summary)
    assert ("a token's GEMVs in a row: plain 1.113x roofline, on 1.042x (1.068x faster), l2 1.028x (1.082x "
            "faster, NOT the same bits)") in done.stdout
    assert json.loads(summary.read_text())["steps"][0]["figures"]["chain_on_speedup"] == 3.95 / 3.70


def test_moe_step_reports_each_shape_in_a_graph_against_the_reference(tmp_path):
    """``kernel_bench.py --moe`` (gpu_check's MoE step): the summary line
    gives each shape's graph time, the weights' GB/s and the reference
    against the Triton path, then each stored format against dense bf16."""
    row = dict(model="qwen3-30b-a3b", experts=128, top_k=8, hidden=2048, inter=768, tokens=1, experts_hit=8,
               block_m=16, triton_ms=0.05, graph_ms=0.02, reference_ms=0.5, weight_gb_s=1887.0, max_abs_diff=0.0)
    packed = dict(model="qwen3-30b-a3b", tokens=1, experts_hit=8, format="int4, groups of 128", dense_graph_ms=0.02,
                  packed_graph_ms=0.008, speedup=2.5, stored_gb_s=1500.0, max_abs_diff=0.01)
    record = dict(device="Fake GPU", time="t", torch="x", copy_gb_s=4000.0, moe=[row], packed=[packed])
    summary = tmp_path / "gpu_check_fake.json"
    report("init", "--summary", summary, "--device", "Fake GPU", "--plan", "moe=MoE experts")
    result = tmp_path / "moe_fake.json"
    result.write_text(json.dumps(record))
    report("step", "--summary", summary, "--key", "moe", "--rc", 0, "--seconds", 30, "--limit", 60,
           "--since", time.time() - 1, "--result", result)  # fmt: skip
    done = report("finish", "--summary", summary)
    assert "qwen3-30b-a3b x1: 0.020 ms in a graph, 1887 GB/s, reference 10.0x" in done.stdout
    assert "qwen3-30b-a3b x1 int4: 2.50x dense" in done.stdout
    figures = json.loads(summary.read_text())["steps"][0]["figures"]
    assert figures["graph_ms_qwen3-30b-a3b_1"] == 0.02 and figures["packed_speedup_qwen3-30b-a3b_1_int4"] == 2.5


def test_packed_weight_steps_report_batch_1_against_bf16_and_dequantized(tmp_path):
    """gpu_check's int_linears step gives each packed variant's batch-1
    bandwidth against bf16 cuBLAS; its packed_decode step the decode time
    packed against dequantized per batch."""
    summary = tmp_path / "gpu_check_fake.json"
    report("init", "--summary", summary, "--device", "Fake GPU", "--plan", "int_linears=int", "packed_decode=packed")
    rows = [dict(linear="o", n=4096, k=4096, rows=1, bits=None, variant="bf16 cuBLAS", us=10.0, gb_s=3355.0,
                 rel_err=None, vs_cublas=1.0),
            dict(linear="o", n=4096, k=4096, rows=1, bits=4, variant="int4 int_linear", us=4.0, gb_s=2097.0,
                 rel_err=1e-3, vs_cublas=2.5),
            dict(linear="o", n=4096, k=4096, rows=1, bits=4, variant="int4 dequantize + matmul", us=40.0,
                 gb_s=210.0, rel_err=None, vs_cublas=0.25)]
    side = dict(decode_ms={"1": 7.0, "8": 9.0})
    records = {"int_linears": ("int_linear_bandwidth_fake.json", dict(device="Fake GPU", rows=rows)),
               "packed_decode": ("packed_weights-fake-llama3-8b.json", dict(formats={"GPTQ": dict(
                   dequantized=dict(decode_ms={"1": 14.0, "8": 18.0}), packed=side)}))}
    for key, (name, record) in records.items():
        result = tmp_path / name
        result.write_text(json.dumps(record))
        report("step", "--summary", summary, "--key", key, "--rc", 0, "--seconds", 30, "--limit", 60,
               "--since", time.time() - 1, "--result", result)  # fmt: skip
    done = report("finish", "--summary", summary)
    int_line = next(line for line in done.stdout.splitlines() if line.startswith("| int |"))
    assert "o int4 int_linear: 2097 GB/s, 2.50x bf16 cuBLAS" in int_line and "dequantize" not in int_line
    assert "batch 1: packed 7.00 ms vs dequantized 14.00 ms (2.00x)" in done.stdout
    steps = json.loads(summary.read_text())["steps"]
    assert steps[0]["figures"]["vs_cublas_o_int4_int_linear"] == 2.5
    assert steps[1]["figures"]["packed_speedup_b8"] == 2.0
