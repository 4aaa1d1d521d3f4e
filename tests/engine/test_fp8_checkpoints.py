"""FP8 checkpoints: float8 weights beside their scales, as transformers and
DeepSeek write them (``weight_scale_inv`` per block), as vLLM's older FP8
serialization does (``weight_scale`` per tensor) and as compressed-tensors
does (per output channel, per block). The tokens must be those of
transformers on the same checkpoint (it dequantizes FP8 on a CPU) or, where
transformers cannot read the format here, on a plain checkpoint of the
weights each format stands for. Formats we do not serve fail at start,
by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.parallel import TensorParallel
from fluidserve.engine.quantization import checkpoint_quantization, quantize_fp8
from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config
from token_paths import PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)


def _model(arch: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.uniform_(0.8, 1.2)
    return model.eval()


def _dequantized(q: torch.Tensor, scale: torch.Tensor, grain) -> torch.Tensor:
    """What a float8 weight stands for, written out independently of the
    engine's loader: each element times the scale that covers it."""
    if grain in ("tensor", "channel"):
        return q.float() * scale.float()
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * grain[0]:(i + 1) * grain[0], j * grain[1]:(j + 1) * grain[1]] *= scale[i, j]
    return out


def _write(model: torch.nn.Module, path: Path, grain, scale_suffix: str, quantization_config: dict | None,
           reference: Path | None = None) -> None:
    """``model`` as an FP8 checkpoint in ``path`` (every decoder linear in
    float8, each expert's too; embeddings, norms, routers and the head as
    they are) and, in ``reference``, the plain checkpoint of the weights it
    stands for. The tensors are those ``save_pretrained`` writes."""
    plain_dir = reference or path.with_name(path.name + "-plain")
    model.save_pretrained(plain_dir)
    saved = load_file(str(plain_dir / "model.safetensors"))
    tensors, plain = {}, {}
    for name, value in saved.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, scale = quantize_fp8(value, grain)
            tensors[name], tensors[name + scale_suffix] = q, scale
            plain[name] = _dequantized(q, scale, grain)
            if (quantization_config or {}).get("activation_scheme") == "static":  # activation scales: unread
                tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
        else:
            tensors[name] = plain[name] = value
    for folder, weights, qc in ((path, tensors, quantization_config), (plain_dir, plain, None)):
        folder.mkdir(exist_ok=True)
        config = json.loads((plain_dir / "config.json").read_text())
        config.pop("quantization_config", None)
        if qc is not None:
            config["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(config))
        save_file(weights, str(folder / "model.safetensors"))
        save_byte_tokenizer(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_block_fp8_checkpoint_gives_transformers_tokens(make_llm, tmp_path, arch):
    """transformers' and DeepSeek's format: 32 x 32 blocks, ``weight_scale_inv``
    (each expert's linears too, as Qwen3-30B-A3B-FP8 keeps them)."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    _write(_model(arch), tmp_path / "fp8", (32, 32), "_scale_inv", qc)
    outs = make_llm(str(tmp_path / "fp8")).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(tmp_path / "fp8"), PROMPTS)


@pytest.mark.parametrize("arch, grain, suffix, qc", [
    # Blocks that overhang the weight's edge (k_proj's 32 rows in blocks of 24, 64 columns in 48): DeepSeek-V3's
    # grids round up where a dimension is not a multiple of 128.
    ("llama", (24, 48), "_scale_inv", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                       "weight_block_size": [24, 48]}),
    # vLLM's older FP8 serialization: one weight_scale per tensor, static activation scales beside it.
    ("llama", "tensor", "_scale", {"quant_method": "fp8", "activation_scheme": "static"}),
    # compressed-tensors (RedHatAI's FP8-dynamic checkpoints): one scale per output channel, the head left out.
    ("qwen3", "channel", "_scale", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}),
    ("llama", (16, 32), "_scale", {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 32]}}}}),
], ids=["fp8-ragged-blocks", "fp8-per-tensor", "compressed-tensors-channel", "compressed-tensors-block"])
def test_fp8_formats_give_the_tokens_of_the_weights_they_stand_for(make_llm, tmp_path, arch, grain, suffix, qc):
    checkpoint, reference = tmp_path / "fp8", tmp_path / "plain"
    _write(_model(arch), checkpoint, grain, suffix, qc, reference)
    outs = make_llm(str(checkpoint)).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(reference), PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_each_tensor_parallel_rank_holds_its_shard_of_the_dequantized_weights(tmp_path, arch):
    """Blocks of 24 x 48 straddle the ranks' halves (q_proj's 64 rows cut at
    32, down_proj's columns at 64): a weight is dequantized whole, then cut."""
    qc = {"quant_method": "fp8", "weight_block_size": [24, 48]}
    checkpoint, reference = tmp_path / "fp8", tmp_path / "plain"
    _write(_model(arch), checkpoint, (24, 48), "_scale_inv", qc, reference)
    config = load_hf_config(checkpoint)
    for rank in range(2):
        ours, plain = (build_model(config, torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
                       for _ in range(2))
        load_weights(ours, checkpoint, quantization=checkpoint_quantization(config))
        load_weights(plain, reference)
        for (name, a), (_, b) in zip(ours.named_parameters(), plain.named_parameters(), strict=True):
            assert torch.equal(a, b), f"rank {rank}: {name}"


def test_the_loader_refuses_what_it_cannot_dequantize(make_llm, tmp_path):
    model = _model()
    block = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    cases = {
        "gptq": ({"quant_method": "gptq", "bits": 4}, None, "gptq checkpoints are not supported"),
        "int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
            "weights": {"num_bits": 4, "type": "int"}}}}, None, "only 8-bit float"),
        "no-config": (None, None, "declares no quantization_config"),
        "asked-for": (None, "fp8", "declares no quantization_config"),
        "mismatch": (block, "compressed-tensors", "does not match the checkpoint's quant_method 'fp8'"),
        "wrong-grid": ({"quant_method": "fp8", "weight_block_size": [16, 16]}, None, "fits neither"),
    }
    for label, (qc, asked, message) in cases.items():
        path = tmp_path / label
        if label == "asked-for":  # a plain checkpoint, with --quantization fp8
            _write(model, tmp_path / "unread", (32, 32), "_scale_inv", None, reference=path)
        else:  # 32 x 32 blocks whatever the config says; without a config the float8 is unexplained
            _write(model, path, (32, 32), "_scale_inv", qc)
        kwargs = {"quantization": asked} if asked else {}
        with pytest.raises(ValueError, match=message):
            make_llm(str(path), **kwargs)
    # Named for its own method, the checkpoint serves.
    path = tmp_path / "named"
    _write(model, path, (32, 32), "_scale_inv", block)
    assert make_llm(str(path), quantization="fp8").generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
