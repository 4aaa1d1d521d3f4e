"""benchmarks/profile_decode.py and benchmarks/swap_copy.py, which
gpu_check.sh runs last on a GPU, on the CPU lane: the profile of a tiny
model's decode, counted per token, with the Python functions cProfile saw;
and the swap benchmark's two block layouts. On a GPU the same code adds
kernel times, launches and the copy stream's overlap."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_decode.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fluidserve_bench_profile_decode", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_profile_of_a_cpu_decode(bench, tmp_path):
    rc = bench.main(["--preset", "tiny", "--device", "cpu", "--output-len", "6", "--top", "5", "--python-top", "8",
                     "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    (written,) = tmp_path.glob("profile_decode_*-eager.json")  # the CPU has no graphs: eager alone
    record = json.loads(written.read_text())
    eager = record["modes"]["eager"]
    assert eager["tokens"] == 6 and eager["wall_ms_per_token"] > 0
    assert eager["kernel_ms_per_token"] == 0 and eager["kernel_launches_per_token"] == 0  # no device here
    ops = {o["name"]: o for o in eager["top_host_ops"]}
    assert len(ops) == 5 and all(o["self_cpu_ms_per_token"] > 0 for o in ops.values())
    functions = eager["python_top"]
    assert len(functions) == 8
    assert all(0 <= f["own_share"] <= f["cumulative_share"] for f in functions)
    assert sum(f["own_share"] for f in functions) <= 1.0 + 1e-9
    text = written.with_suffix(".md").read_text()
    assert "| eager |" in text and "Python functions by their own time" in text


def test_swap_copy_runs_on_the_cpu(tmp_path):
    """benchmarks/swap_copy.py, gpu_check.sh's swap step, on the CPU lane:
    both block layouts run through CacheEngine.swap and report every figure."""
    spec = importlib.util.spec_from_file_location("fluidserve_bench_swap_copy", BENCH.with_name("swap_copy.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--device", "cpu", "--preset", "tiny", "--blocks", "6", "--runs", "3", "1", "--batch", "2",
                        "--repeats", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    (written,) = tmp_path.glob("swap_copy_*.json")
    runs = json.loads(written.read_text())["runs"]
    assert [r["run"] for r in runs] == [3, 1]
    for r in runs:
        assert r["bytes"] == 6 * r["block_mib"] * 2**20
        for key in ("swap_out_gb_s", "swap_in_gb_s", "pinned_d2h_gb_s", "pinned_h2d_gb_s", "step_slowdown"):
            assert r[key] > 0, key
