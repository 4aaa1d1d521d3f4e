"""The structure of an eager decode step, counted by benchmarks/op_counts.py:
what a GPU would launch per decoder layer and where the host would wait.

A Llama decoder layer is four GEMMs (fused q/k/v, o_proj, fused gate/up,
down_proj with the residual folded in), two norms (the second with the
residual add fused), rope fused with the KV write, the SiLU-mul, and
attention (one launch, plus a merge when a sequence is split): nine kernels
on the Triton lane, ten with the merge; vLLM's layer is ten. At batch 1,
where the GEMV runs (decode graphs), the norms go into the GEMVs' prologues,
the first residual add into the o_proj GEMV and the SiLU-mul into the
gate/up GEMV's epilogue: six. No host sync
may sit inside the forward: the only one of a greedy decode step is the
sampled tokens going to the host.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fluidserve.kernels import ops
from quantized_utils import fp8, packed_int, random_model, write_quantized

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "op_counts.py"
FORWARD = ("embedding", "rope tables", "final norm", "lm head")
GEMMS = 4  # qkv, o_proj, gate_up, down_proj
LAYER_LAUNCHES = GEMMS + 2 + 1 + 1 + 1  # norms, rope + KV write, SiLU-mul, attention


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("fluidserve_bench_op_counts", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def layers(counts: dict) -> list[dict]:
    return [v for k, v in counts.items() if k.startswith("layer ")]


def gemms(names: dict) -> int:
    # One row on the Triton lane runs the batch-1 kernel a decode graph
    # runs (kernels/gemv.py); more rows, and the CPU lane, run torch's.
    ops_ = ("_linear_pointwise", "mm", "addmm", "addmm_", "linear", "triton:gemv_kernel")
    return sum(n for op, n in names.items() if op in ops_)


@pytest.mark.parametrize("batch", [1, 3])
def test_triton_lane_decode_layer_launches_and_syncs(bench, tiny_model, monkeypatch, batch):
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    counts = bench.count_step(Path(tiny_model("llama")), "float32", batch)
    assert len(layers(counts)) == 2
    for layer in layers(counts):
        names = layer["names"]
        assert gemms(names) == GEMMS, names
        assert names.get("triton:paged_attention_kernel") == 1
        fused = batch == 1  # norms, the SiLU-mul and the adds inside the GEMVs
        assert names.get("triton:silu_and_mul_kernel", 0) == (0 if fused else 1), names
        assert names.get("triton:rms_norm_kernel", 0) == (0 if fused else 2), names
        launches = LAYER_LAUNCHES - 3 if fused else LAYER_LAUNCHES
        assert layer["kernels"] <= launches + names.get("triton:merge_kernel", 0), names
        assert layer["syncs"] == 0 and layer["waits"] == 0, layer["sync_sites"]
    for part in FORWARD:
        assert counts[part]["syncs"] == 0 and counts[part]["waits"] == 0, counts[part]["sync_sites"]
    assert counts["final norm"]["kernels"] == 1
    # The step's one sync: the sampled token ids, read by the sampler.
    assert sum(c["syncs"] + c["waits"] for c in counts.values()) == 1
    assert counts["sampling"]["syncs"] == 1


@pytest.mark.parametrize("quantize, qc", [
    (packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32}),
    (fp8((32, 32), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [32, 32]}),
], ids=["gptq", "fp8"])
def test_packed_weights_take_the_batch_1_layers_six_launches(bench, tmp_path, monkeypatch, quantize, qc):
    """Linears holding a quantized checkpoint's codes (``--quantized-weights
    packed``) run the batch-1 GEMV over them, its norms, SiLU-mul and
    residual adds fused as a dense layer's are: six launches a layer."""
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    write_quantized(random_model("llama"), tmp_path / "q", quantize, qc)
    counts = bench.count_step(tmp_path / "q", "float32", 1, load_format="auto", quantized_weights="packed")
    for layer in layers(counts):
        names = layer["names"]
        assert names.get("triton:packed_gemv_kernel") == GEMMS, names
        assert not any(op in names for op in ("triton:rms_norm_kernel", "triton:silu_and_mul_kernel", "add_"))
        assert layer["kernels"] <= LAYER_LAUNCHES - 3 + names.get("triton:merge_kernel", 0), names
        assert layer["syncs"] == 0 and layer["waits"] == 0, layer["sync_sites"]


def test_cpu_lane_layers_read_nothing_back(bench, tiny_model, monkeypatch):
    monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    counts = bench.count_step(Path(tiny_model("llama")), "float32", 2)
    for layer in layers(counts):
        assert gemms(layer["names"]) == GEMMS
        assert layer["names"].get("rms_norm") == 2  # one op each, the residual add beside one
        assert layer["syncs"] == 0 and layer["waits"] == 0, layer["sync_sites"]
    for part in FORWARD:
        assert counts[part]["syncs"] == 0


def test_the_counter_sees_syncs_views_and_launches(bench, monkeypatch):
    """The zero-sync checks above mean something only if the counter
    catches a read-back, tells a view from a kernel and sees a launch."""
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    counter = bench.OpCounter()
    device = torch.randn(4, 64)
    counter.mark_device(device)
    host, weight = torch.randn(4), torch.ones(64)
    with torch.inference_mode(), bench.counting(counter):
        doubled = device * 2  # a kernel; its output is device-resident
        doubled.view(2, 128).t()  # views: no kernel
        doubled[0, 0].item()  # sync
        doubled.tolist()  # sync
        bool(doubled.sum() > 0)  # a kernel, a kernel and a sync
        host.tolist()  # host data: no sync
        ops.rms_norm(doubled, weight, 1e-6, path="triton")  # one Triton launch
    tally = counter.tallies["other"]
    assert tally.syncs == 3, tally.sync_sites
    assert tally.triton == 1
    assert tally.kernels == 1 + 2 + 1, tally.names
