"""benchmarks/profile_decode.py, which gpu_check.sh runs last on a GPU, on
the CPU lane: it profiles a tiny model's decode end to end, counts per
token what the profile holds, and reports the Python functions cProfile saw.
On a GPU the same code adds kernel times and launches."""

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
