"""Cost models: roofline sanity against hand arithmetic, the linear fit,
profile files, and the engine-facing constructor."""

from __future__ import annotations

import json

import pytest

from fluidserve.engine.profiler import fit_linear, main
from fluidserve.scheduler.cost_model import (
    CostModel, DeviceSpec, LinearCostModel, ModelShape, RooflineCostModel, attn_pairs, cost_model_for_engine,
    load_profile,
)


def llama8b_h100() -> RooflineCostModel:
    return RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())


def test_roofline_decode_is_memory_bound_at_batch_one():
    m = llama8b_h100()
    shape, dev = m.model, m.device
    assert 14.5e9 < shape.weight_bytes < 16.5e9  # ~8B params in bf16
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    expect = (shape.weight_bytes + 101 * shape.kv_bytes_per_token) / (dev.hbm_bandwidth * dev.memory_efficiency)
    assert m.decode_time(1, 100) == pytest.approx(expect + dev.step_overhead_s, rel=1e-6)
    assert m.min_iteration_time() <= m.decode_time(64, 64 * 2000)


def test_roofline_prefill_is_compute_bound_and_grows():
    m = llama8b_h100()
    t1, t2 = m.prefill_time(2048), m.prefill_time(4096)
    assert 0.03 < t1 < 0.08  # ~2*8e9*2048 FLOP at 60% of 989 TFLOP/s
    assert t2 > 2 * t1 - m.device.step_overhead_s  # attention makes it superlinear
    assert m.prefill_time(1024, context=1024) > m.prefill_time(1024)
    assert isinstance(m, CostModel)


def test_fit_recovers_linear_coefficients():
    truth = dict(base=0.005, per_prefill_token=2e-5, per_decode_seq=1e-4, per_context_token=1e-7,
                 per_attn_pair=1e-9)
    samples = []
    for p in (0, 64, 512, 2048):
        for d, c in ((0, 0), (1, 100), (8, 1000), (32, 300), (32, 3000)):
            if p + d == 0:
                continue
            ctx = d * c + p
            pairs = attn_pairs(p, 0)
            y = (truth["base"] + truth["per_prefill_token"] * p + truth["per_decode_seq"] * d
                 + truth["per_context_token"] * ctx + truth["per_attn_pair"] * pairs)
            samples.append({"prefill_tokens": p, "decode_seqs": d, "total_context": ctx,
                            "attn_pairs": pairs, "seconds": y})
    fitted = fit_linear(samples)
    for k, v in truth.items():
        assert getattr(fitted.c, k) == pytest.approx(v, rel=1e-3, abs=1e-12)


def test_fit_drops_negative_coefficients():
    samples = [{"prefill_tokens": p, "decode_seqs": 0, "total_context": p, "attn_pairs": 0,
                "seconds": 0.01 + 1e-5 * p - (1e-9 if p % 2 else 0)} for p in range(1, 40)]
    fitted = fit_linear(samples)
    assert min(vars(fitted.c).values()) >= 0.0


def test_profile_files_round_trip(tmp_path):
    m = fit_linear([{"prefill_tokens": p, "decode_seqs": d, "total_context": p + d, "attn_pairs": p,
                     "seconds": 0.002 + 1e-5 * p + 1e-4 * d} for p in (0, 10, 100) for d in (1, 4, 16)])
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(m.to_json()))
    loaded = load_profile(str(path))
    assert isinstance(loaded, LinearCostModel)
    assert loaded.step_time(100, 4, 104, 100) == pytest.approx(m.step_time(100, 4, 104, 100))
    roof = llama8b_h100()
    path.write_text(json.dumps(roof.describe()))
    assert load_profile(str(path)).prefill_time(512) == pytest.approx(roof.prefill_time(512))


def test_cost_model_for_engine_uses_profile_else_roofline(tmp_path):
    class Cfg:
        profile_path = None
        dtype = "float32"

    hf = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 300}
    m = cost_model_for_engine(Cfg(), hf, "cpu")
    assert isinstance(m, RooflineCostModel) and m.model.dtype_bytes == 4 and m.device.name == "cpu"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(llama8b_h100().describe()))
    Cfg.profile_path = str(path)
    assert isinstance(cost_model_for_engine(Cfg(), hf, "cpu"), RooflineCostModel)


def test_an_fp8_cache_halves_the_kv_bytes_the_roofline_reads():
    from fluidserve.engine.config import EngineConfig

    hf = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 300}
    auto, fp8 = (cost_model_for_engine(EngineConfig.create(dtype="bfloat16", kv_cache_dtype=kv), hf, "cuda")
                 for kv in ("auto", "fp8_e5m2"))
    assert auto.model.kv_bytes_per_token == 2 * fp8.model.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert fp8.decode_time(8, 8 * 4096) < auto.decode_time(8, 8 * 4096)


def test_profile_cli_roofline_mode(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256}))
    out = tmp_path / "profile.json"
    assert main(["--model", str(tmp_path), "-o", str(out), "--roofline", "h100"]) == 0
    assert load_profile(str(out)).prefill_time(2048) == pytest.approx(llama8b_h100().prefill_time(2048), rel=1e-6)


@pytest.mark.slow
def test_profile_measures_the_real_engine(tmp_path):
    pytest.importorskip("fluidserve.engine.engine")
    from fluidserve.engine.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "profile.json"
    assert main(["--model", str(model), "-o", str(out), "--device", "cpu", "--max-prefill", "64",
                 "--max-batch", "4", "--contexts", "16", "--repeats", "1"]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "linear" and len(data["samples"]) >= 5
    assert load_profile(str(out)).step_time(64, 0, 64) > 0
