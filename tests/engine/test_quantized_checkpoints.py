"""Quantized checkpoints. FP8: float8 weights beside their scales, as
transformers and DeepSeek write them (``weight_scale_inv`` per block), as
vLLM's older FP8 serialization does (``weight_scale`` per tensor) and as
compressed-tensors does (per output channel, per block). GPTQ and AWQ:
4- and 8-bit integers packed in int32 words with a scale and zero point per
group of input features. The tokens must be those of transformers on the
same checkpoint (it dequantizes FP8 on a CPU) or, where transformers cannot
read the format here, on a plain checkpoint of the weights each format
stands for. The packing is checked against words AutoAWQ's and GPTQ's own
packers write. Formats we do not serve fail at start, by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.parallel import TensorParallel, loaded_weights
from fluidserve.engine.quantization import PackedIntCheckpoint, checkpoint_quantization
from quantized_utils import fp8, packed_int, random_model, write_quantized
from token_paths import PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_block_fp8_checkpoint_gives_transformers_tokens(make_llm, tmp_path, arch):
    """transformers' and DeepSeek's format: 32 x 32 blocks, ``weight_scale_inv``
    (each expert's linears too, as Qwen3-30B-A3B-FP8 keeps them)."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    write_quantized(random_model(arch), tmp_path / "fp8", fp8((32, 32), "_scale_inv"), qc)
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
    static = qc.get("activation_scheme") == "static"
    write_quantized(random_model(arch), checkpoint, fp8(grain, suffix, static), qc, reference)
    outs = make_llm(str(checkpoint)).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(reference), PROMPTS)


@pytest.mark.parametrize("arch, quantize, qc", [
    ("llama", fp8((24, 48), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [24, 48]}),
    ("qwen3_moe", fp8((24, 48), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [24, 48]}),
    ("llama", packed_int("gptq", 4, 24, act_order=True), {"quant_method": "gptq", "bits": 4, "group_size": 24}),
], ids=["fp8", "fp8-experts", "gptq-act-order"])
def test_each_tensor_parallel_rank_holds_its_shard_of_the_dequantized_weights(tmp_path, arch, quantize, qc):
    """Blocks of 24 x 48 and groups of 24 shuffled features straddle the
    ranks' halves (q_proj's 64 rows cut at 32, down_proj's columns at 64):
    a weight is dequantized whole, then cut."""
    checkpoint, reference = tmp_path / "quantized", tmp_path / "plain"
    write_quantized(random_model(arch), checkpoint, quantize, qc, reference)
    config = load_hf_config(checkpoint)
    for rank in range(2):
        ours, plain = (build_model(config, torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
                       for _ in range(2))
        load_weights(ours, checkpoint, quantization=checkpoint_quantization(config))
        load_weights(plain, reference)
        for (name, a), (_, b) in zip(loaded_weights(ours).items(), loaded_weights(plain).items(), strict=True):
            assert torch.equal(a, b), f"rank {rank}: {name}"


def test_packed_words_read_as_gptqs_and_autoawqs_packers_write_them():
    """Known answers: codes 0..7 (and 8..15), one a feature, in the words
    AutoAWQ's packer writes for eight output columns (0x75316420 and
    0xfdb9eca8: columns 0, 2, 4, 6, 1, 3, 5, 7 from the low nibble up) and
    GPTQ's for eight input rows (0x76543210, 0xfedcba98: in order)."""
    def signed(word: int) -> int:
        return word - 2**32 if word >= 2**31 else word

    awq = torch.tensor([[signed(0x75316420), signed(0xFDB9ECA8)]], dtype=torch.int32)  # 1 input x 16 outputs
    gptq = torch.tensor([[signed(0x76543210)], [signed(0xFEDCBA98)]], dtype=torch.int32)  # 16 inputs x 1 output
    codes = torch.arange(16, dtype=torch.float32)
    for fmt, qweight, zeros, scales in (
        (PackedIntCheckpoint("awq", 4, -1), awq, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 16)),
        (PackedIntCheckpoint("gptq", 4, -1), gptq, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)),
    ):
        name, weight = fmt.dequantize("x.qweight", qweight, {"x.qzeros": zeros, "x.scales": scales})
        assert name == "x.weight" and torch.equal(weight.flatten(), codes), fmt.method
    # A zero point and scale per group: GPTQ's original format stores each zero point less one.
    zeros = torch.tensor([[signed(0x00000002)]], dtype=torch.int32)  # output 0's zero point 2 (3 less one)
    _, weight = PackedIntCheckpoint("gptq", 4, -1, zeros_less_one=True).dequantize(
        "x.qweight", gptq, {"x.qzeros": zeros, "x.scales": torch.full((1, 1), 0.5)})
    assert torch.equal(weight.flatten(), (codes - 3) * 0.5)


@pytest.mark.parametrize("arch, quantize, qc", [
    ("llama", packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}),
    # Qwen2's q/k/v biases beside 8-bit codes, GPTQModel's v2 format (zero points as they are), act-order groups.
    ("qwen2", packed_int("gptq", 8, 32, act_order=True, zeros_less_one=False), {
        "quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "checkpoint_format": "gptq_v2"}),
    # Every expert's linears, one group a row.
    ("qwen3_moe", packed_int("gptq", 4, -1), {"quant_method": "gptq", "bits": 4, "group_size": -1}),
    ("llama", packed_int("awq", 4, 32), {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                          "zero_point": True}),
    ("qwen3", packed_int("awq", 4, 16), {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "GEMM"}),
], ids=["gptq-4-bit", "gptq-8-bit-act-order-v2", "gptq-experts", "awq", "awq-qwen3"])
def test_gptq_and_awq_give_the_tokens_of_the_weights_they_stand_for(make_llm, tmp_path, arch, quantize, qc):
    checkpoint, reference = tmp_path / "int", tmp_path / "plain"
    write_quantized(random_model(arch), checkpoint, quantize, qc, reference)
    assert not any(k.endswith("_proj.weight") for k in load_file(str(checkpoint / "model.safetensors")))
    outs = make_llm(str(checkpoint)).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(reference), PROMPTS)


def test_the_loader_refuses_what_it_cannot_dequantize(make_llm, tmp_path):
    model, blocks = random_model(), fp8((32, 32), "_scale_inv")
    block = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    cases = {
        "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, None,
                         "bitsandbytes checkpoints are not supported"),
        "gptq-3-bit": ({"quant_method": "gptq", "bits": 3}, None, "GPTQ 3-bit"),
        "awq-gemv": ({"quant_method": "awq", "bits": 4, "version": "gemv"}, None, "version 'gemv'"),
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
            write_quantized(model, tmp_path / "unread", blocks, None, reference=path)
        else:  # 32 x 32 blocks whatever the config says; without a config the float8 is unexplained
            write_quantized(model, path, blocks, qc)
        kwargs = {"quantization": asked} if asked else {}
        with pytest.raises(ValueError, match=message):
            make_llm(str(path), **kwargs)
    # Named for its own method, the checkpoint serves.
    path = tmp_path / "named"
    write_quantized(model, path, blocks, block)
    assert make_llm(str(path), quantization="fp8").generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    # vLLM's Marlin names name GPTQ and AWQ checkpoints: the right one serves, the other is a mismatch.
    path = tmp_path / "gptq"
    write_quantized(model, path, packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32})
    assert make_llm(str(path), quantization="gptq_marlin").generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="'awq' does not match the checkpoint's quant_method 'gptq'"):
        make_llm(str(path), quantization="awq_marlin")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quantize, qc", [
    (fp8((24, 48), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [24, 48]}),
    (packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32}),
    (packed_int("gptq", 4, 24, act_order=True), {"quant_method": "gptq", "bits": 4, "group_size": 24}),
    (packed_int("awq", 4, 32), {"quant_method": "awq", "bits": 4, "group_size": 32}),
], ids=["fp8", "gptq", "gptq-act-order", "awq"])
def test_a_gpu_dequantizes_to_the_same_bits_as_the_cpu(tmp_path, quantize, qc):
    """On CUDA the weights dequantize on the device: fp32 products and
    differences, each exact, so the bits are the CPU's."""
    checkpoint, reference = tmp_path / "quantized", tmp_path / "plain"
    write_quantized(random_model("qwen3_moe"), checkpoint, quantize, qc, reference)
    config = load_hf_config(checkpoint)
    ours = build_model(config, torch.float32, torch.device("cuda"))
    load_weights(ours, checkpoint, quantization=checkpoint_quantization(config))
    plain = build_model(config, torch.float32, torch.device("cpu"))
    load_weights(plain, reference)
    for (name, a), (_, b) in zip(ours.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a.cpu(), b), name
