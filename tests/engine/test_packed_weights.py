"""Quantized checkpoints' weights held as the checkpoint's codes
(``--quantized-weights packed``): GPTQ's and AWQ's integers with their zero
points and scales (kernels/int_linear.py's format), float8 weights with a
scale a row a group (kernels/fp8_linear.py's), in place of a dense weight;
every product dequantizes them as the loader would have. So the tokens are
those of the dequantized model (transformers' on the plain checkpoint of
the weights the codes stand for, or on the FP8 checkpoint itself), on the
CPU's reference path and on the Triton lane; each tensor-parallel rank's
codes stand for its shard of the dense weight; the linears hold a quarter
of the bytes at 4 bits; a mixture-of-experts layer's stacked experts are
held so too, each expert with its own order of groups; and what cannot be
held so is refused at start, by name."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights, quantized_linears
from fluidserve.engine.models.moe import Experts
from fluidserve.engine.parallel import HeldWeights, QuantizedWeight, TensorParallel, loaded_weights, realize_linears
from fluidserve.engine.quantization import checkpoint_quantization
from fluidserve.kernels import ops, reference
from quantized_utils import fp8, packed_int, random_model, write_quantized
from token_paths import PROMPTS, assert_agree_but_for_near_ties, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
PACKED = dict(quantized_weights="packed")
GPTQ4 = (packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False})
FP8_BLOCKS = (fp8((32, 32), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [32, 32]})


def _quantized_weights(llm) -> list[QuantizedWeight]:
    """Every weight held as the checkpoint's codes: the linears' and the stacked experts'."""
    model = llm.engine.executor.worker.model
    return [w for m in model.modules() if isinstance(m, HeldWeights) for w in m.held_codes().values()]


def _held_as_dense_experts(model) -> list[tuple[str, torch.Tensor]]:
    """(name, each expert's weight) of every stacked expert weight held as
    codes, dequantized to fp32 as ``ops.fused_experts`` reads them."""
    out = []
    for name, module in model.named_modules():
        for leaf, codes in module.held_codes().items() if isinstance(module, Experts) else ():
            stack = codes.packed()
            out.append((f"{name}.{leaf}", torch.stack([stack.expert(e, torch.float32) for e in range(codes.experts)])))
    return out


@pytest.mark.parametrize("arch, quantize, qc", [
    ("llama", *GPTQ4),
    # Qwen2's q/k/v biases beside 8-bit codes, GPTQModel's v2 format, act-order groups shared by q/k/v.
    ("qwen2", packed_int("gptq", 8, 32, act_order=True, zeros_less_one=False), {
        "quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "checkpoint_format": "gptq_v2"}),
    # The stacked experts held packed beside the attention's linears, the router dense.
    ("qwen3_moe", packed_int("gptq", 4, -1), {"quant_method": "gptq", "bits": 4, "group_size": -1}),
    # Act-order groups in an order of each expert's own, shared by its gate and up.
    ("mixtral", packed_int("gptq", 4, 16, act_order=True), {
        "quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True}),
    ("qwen3", packed_int("awq", 4, 16), {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "GEMM"}),
    # Phi-3 keeps q/k/v and gate/up fused in the checkpoint: the codes are cut into their parts' rows.
    ("phi3", packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32}),
    # GLM-4 takes q's and k's rows in another order (interleaved rope pairs made halves): the codes' rows move.
    ("glm4", packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32}),
], ids=["gptq-4-bit", "gptq-8-bit-act-order", "gptq-experts", "gptq-experts-act-order", "awq-qwen3", "phi3-fused",
        "glm4-row-order"])
def test_packed_weights_give_the_tokens_of_the_weights_they_stand_for(make_llm, tmp_path, arch, quantize, qc):
    checkpoint, plain = tmp_path / "int", tmp_path / "plain"
    write_quantized(random_model(arch), checkpoint, quantize, qc, plain)
    llm = make_llm(str(checkpoint), **PACKED)
    held = _quantized_weights(llm)
    assert held and all(w.kind() == f"int{qc['bits']}" for w in held)
    assert any(w.experts for w in held) == (arch in ("qwen3_moe", "mixtral"))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(plain), PROMPTS)


@pytest.mark.parametrize("arch, quantize, qc", [
    ("llama", *FP8_BLOCKS),
    # Blocks that overhang k_proj's 32 rows and the 64 columns (DeepSeek-V3's ragged grids), experts held too.
    ("qwen3_moe", fp8((24, 48), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [24, 48]}),
    # compressed-tensors: a scale per output channel (RedHatAI's FP8-dynamic).
    ("qwen3", fp8("channel", "_scale"), {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}),
    ("phi3", fp8("tensor", "_scale"), {"quant_method": "fp8", "activation_scheme": "dynamic"}),  # one scale each
], ids=["fp8-blocks", "fp8-ragged-blocks-experts", "compressed-tensors-channel", "phi3-fused-per-tensor"])
def test_float8_weights_held_as_float8_give_the_tokens_of_the_weights_they_stand_for(make_llm, tmp_path, arch,
                                                                                    quantize, qc):  # fmt: skip
    checkpoint, plain = tmp_path / "fp8", tmp_path / "plain"
    write_quantized(random_model(arch), checkpoint, quantize, qc, plain)
    llm = make_llm(str(checkpoint), **PACKED)
    held = _quantized_weights(llm)
    assert held and all(w.kind() == "float8_e4m3fn" and w.codes.element_size() == 1 for w in held)
    assert any(w.experts for w in held) == (arch == "qwen3_moe")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(plain), PROMPTS)


@pytest.mark.parametrize("kernel, quantize, qc", [("int_linear", *GPTQ4), ("fp8_linear", *FP8_BLOCKS)],
                         ids=["gptq", "fp8"])
def test_the_triton_lane_runs_the_packed_kernels_to_the_same_tokens(make_llm, tmp_path, monkeypatch, kernel,
                                                                    quantize, qc):  # fmt: skip
    """FLUIDSERVE_KERNELS=triton: decode steps of two rows through the
    fused kernel, of one through the batch-1 GEMV over the codes, a long
    prompt through the dequantize kernel and the GEMM, in the interpreter."""
    import importlib

    from fluidserve.kernels import gemv

    checkpoint, plain = tmp_path / "q", tmp_path / "plain"
    write_quantized(random_model("llama"), checkpoint, quantize, qc, plain)
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    module = importlib.import_module(f"fluidserve.kernels.{kernel}")
    calls = {"fused": 0, "dequantize": 0, "gemv": 0}
    for name, key in ((kernel, "fused"), ("dequantize", "dequantize")):
        real = getattr(module, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    # The batch-1 GEMV over codes, however launched (the row path keeps its launchers): its kernel's runs.
    run = gemv._packed_gemv_kernel.run
    monkeypatch.setitem(vars(gemv._packed_gemv_kernel), "run",
                        lambda *a, **k: calls.__setitem__("gemv", calls["gemv"] + 1) or run(*a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    prompts = [PROMPTS[1], "Hello there. " * 12]  # the second's 156 tokens: past the fused kernel's rows
    llm = make_llm(str(checkpoint), num_kv_blocks=64, max_model_len=256, **PACKED)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [t[:6] for t in hf_greedy(str(plain), prompts)]
    assert calls["fused"] and calls["dequantize"], calls
    before = calls["gemv"]
    alone = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids  # decode steps of one row
    assert alone == hf_greedy(str(plain), PROMPTS[:1])[0][:6] and calls["gemv"] > before, calls


def test_a_packed_linear_holds_its_integers_not_a_dense_weight(make_llm, tmp_path):
    write_quantized(random_model("llama"), tmp_path / "int", *GPTQ4)
    llm = make_llm(str(tmp_path / "int"), **PACKED)
    model = llm.engine.executor.worker.model
    names = {n for n, _ in model.named_parameters()}
    for name, module in model.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            w = module.quantized_weight
            assert w is not None and f"{name}.weight" not in names, name
            assert module.weight.untyped_storage().nbytes() == module.weight.element_size()  # a stand-in
            groups = w.features // 32
            # 4 bits a weight; a uint8 zero point and an fp32 scale a group of 32; an int32 group a feature
            assert w.nbytes() == w.rows * w.features // 2 + w.rows * groups * (1 + 4) + w.features * 4, name
    assert "lm_head.weight" in names or "model.embed_tokens.weight" in names  # not quantized: dense
    dense = sum(w.rows * w.features * 4 for w in _quantized_weights(llm))  # as fp32 weights
    assert sum(w.nbytes() for w in _quantized_weights(llm)) < dense / 5


def _tensor_parallel_ranks(tmp_path, arch: str, quantize, qc):
    """(rank, config, our model holding the codes, the plain model's
    parameters by name) of each rank of two, from a checkpoint of ``arch``
    quantized by ``quantize`` and the plain checkpoint it stands for."""
    checkpoint, plain_dir = tmp_path / "q", tmp_path / "plain"
    write_quantized(random_model(arch), checkpoint, quantize, qc, plain_dir)
    config = load_hf_config(checkpoint)
    fmt = checkpoint_quantization(config)
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        ours = build_model(config, torch.float32, torch.device("cpu"), tp, defer_linears=True)
        realize_linears(ours, quantized_linears(ours, checkpoint, fmt), torch.device("cpu"))
        load_weights(ours, checkpoint, quantization=fmt)
        plain = build_model(config, torch.float32, torch.device("cpu"), tp)
        load_weights(plain, plain_dir)
        yield rank, config, ours, loaded_weights(plain)


@pytest.mark.parametrize("quantize, qc, group_size", [
    (packed_int("gptq", 4, 24, act_order=True), {"quant_method": "gptq", "bits": 4, "group_size": 24}, None),
    (packed_int("gptq", 4, 32), {"quant_method": "gptq", "bits": 4, "group_size": 32}, 32),
    # 24 x 48 blocks: a block's rows straddle q's and k's halves, its columns down_proj's.
    (fp8((24, 48), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [24, 48]}, None),
], ids=["act-order", "plain", "fp8-blocks"])
def test_each_tensor_parallel_rank_holds_its_shard(tmp_path, quantize, qc, group_size):
    """Groups of 24 shuffled features straddle the ranks' halves: a
    row-parallel shard keeps every group's scale and its features' groups.
    Plain groups of 32 split between groups: a shard keeps its own groups,
    renumbered, so its kernels read scales per word. Float8 blocks of 24 x
    48 straddle both. Each rank's codes stand for the plain model's shard,
    bit for bit."""
    for rank, config, ours, dense in _tensor_parallel_ranks(tmp_path, "llama", quantize, qc):
        held = 0
        for name, module in ours.named_modules():
            w = getattr(module, "quantized_weight", None)
            if w is None:
                continue
            if w.float8:
                weight = reference.fp8_dequantize(w.codes, w.scales, w.g_idx, torch.float32)
            else:
                weight = reference.int_dequantize(w.codes, w.scales, w.zeros, w.g_idx, w.bits, torch.float32)
            assert torch.equal(weight, dense[f"{name}.weight"]), f"rank {rank}: {name}"
            if group_size is not None:  # this shard's groups alone, read per word
                assert w.group_size == group_size, f"rank {rank}: {name}"
                assert w.scales.shape[1] == w.features // group_size, f"rank {rank}: {name}"
            held += 1
        assert held == 4 * config.num_hidden_layers


@pytest.mark.parametrize("quantize, qc, group_size", [
    (packed_int("gptq", 4, 16, act_order=True), {"quant_method": "gptq", "bits": 4, "group_size": 16}, None),
    (packed_int("gptq", 8, 16), {"quant_method": "gptq", "bits": 8, "group_size": 16}, 16),
    (fp8((16, 16), "_scale_inv"), {"quant_method": "fp8", "weight_block_size": [16, 16]}, 16),
], ids=["act-order", "plain", "fp8-blocks"])
def test_each_tensor_parallel_rank_holds_its_share_of_every_expert(tmp_path, quantize, qc, group_size):
    """Each rank holds every expert's share of the intermediate features:
    rows of gate and up, columns of down, whose plain groups are its own,
    renumbered. Each expert's codes stand for the plain model's shard of
    that expert, bit for bit, and no dense stack is allocated."""
    for rank, config, ours, dense in _tensor_parallel_ranks(tmp_path, "qwen3_moe", quantize, qc):
        stacks = _held_as_dense_experts(ours)
        assert len(stacks) == 2 * config.num_hidden_layers
        for name, weight in stacks:
            assert torch.equal(weight, dense[name]), f"rank {rank}: {name}"
        for module in ours.modules():
            if isinstance(module, Experts):
                assert not any(p.device.type == "meta" or p.numel() > 1 for p in module.parameters())
                for codes in module.held_codes().values():
                    assert codes.group_size == group_size, f"rank {rank}"
                    if group_size is not None:
                        assert codes.scales.shape[-1] == -(-codes.features // group_size)


def test_packed_experts_hold_their_codes_not_dense_stacks(make_llm, tmp_path):
    write_quantized(random_model("qwen3_moe"), tmp_path / "int", *GPTQ4)
    model = make_llm(str(tmp_path / "int"), **PACKED).engine.executor.worker.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and not any(".experts." in name for name, _ in model.named_parameters())
    for module in experts:
        for leaf, w in module.held_codes().items():
            assert getattr(module, leaf).untyped_storage().nbytes() == 4  # a stand-in of one fp32 element
            e, groups = w.experts, w.features // 32
            assert w.codes.shape == (e, w.rows, w.features // 8) and w.g_idx.shape == (e, w.features)
            # 4 bits a weight; a uint8 zero point and an fp32 scale a group of 32; an int32 group a feature
            assert w.nbytes() == e * (w.rows * w.features // 2 + w.rows * groups * (1 + 4) + w.features * 4)


@pytest.mark.parametrize("quantize, qc", [GPTQ4, FP8_BLOCKS], ids=["gptq", "fp8"])
def test_the_triton_lane_runs_packed_experts_to_the_same_tokens(make_llm, tmp_path, monkeypatch, quantize, qc):
    """FLUIDSERVE_KERNELS=triton: every MoE layer's grouped kernel reads the
    experts' codes, in the interpreter, prompt and decode steps alike."""
    from fluidserve.kernels import moe

    checkpoint, plain = tmp_path / "q", tmp_path / "plain"
    write_quantized(random_model("qwen3_moe"), checkpoint, quantize, qc, plain)
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    seen = []
    real = moe.fused_experts

    def counted(x, w13, w2, *args, **kwargs):
        seen.append((type(w13), type(w2)))
        return real(x, w13, w2, *args, **kwargs)

    monkeypatch.setattr(moe, "fused_experts", counted)
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    outs = make_llm(str(checkpoint), num_kv_blocks=64, max_model_len=256, **PACKED).generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in outs] == [t[:4] for t in hf_greedy(str(plain), PROMPTS[:2])]
    assert seen and set(seen) == {(reference.PackedExperts, reference.PackedExperts)}


def test_a_checkpoint_that_keeps_some_linears_in_floats_packs_the_rest(make_llm, tmp_path):
    checkpoint, plain = tmp_path / "int", tmp_path / "plain"
    quantize = packed_int("gptq", 4, 32)

    def some(name: str, weight: torch.Tensor):  # o_proj left in floats, as modules_to_not_convert leaves it
        return ({name: weight}, weight) if "o_proj" in name else quantize(name, weight)

    write_quantized(random_model("llama"), checkpoint, some, GPTQ4[1], plain)
    llm = make_llm(str(checkpoint), **PACKED)
    model = llm.engine.executor.worker.model
    o_proj = [m for n, m in model.named_modules() if n.endswith("o_proj")]
    assert o_proj and all(m.quantized_weight is None and isinstance(m.weight, torch.nn.Parameter) for m in o_proj)
    assert len(_quantized_weights(llm)) == 3 * len(o_proj)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(plain), PROMPTS)


def test_packed_weights_are_refused_where_they_cannot_hold(make_llm, tmp_path, tiny_model):
    write_quantized(random_model("llama"), tmp_path / "int", *GPTQ4)
    cases = [
        (tiny_model("llama"), {}, "this checkpoint is not quantized"),
        (str(tmp_path / "int"), {"enable_lora": True}, "with --enable-lora is not supported"),
    ]
    for model, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(model, **PACKED, **extra)


def test_fused_parts_whose_groups_are_ordered_apart_load_dequantized(make_llm, tmp_path):
    """Act-order GPTQ run on each of q, k and v alone orders each one's
    features apart: one ``g_idx`` cannot hold them, so q/k/v load dense
    and the rest packed."""
    checkpoint, plain = tmp_path / "int", tmp_path / "plain"
    quantize = packed_int("gptq", 4, 32, act_order=True, shared_order=False)
    write_quantized(random_model("llama"), checkpoint, quantize, GPTQ4[1], plain)
    llm = make_llm(str(checkpoint), **PACKED)
    model = llm.engine.executor.worker.model
    held = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if getattr(m, "quantized_weight", None) is not None}
    # The writer seeds each order by the weight's shape: q's and k's differ, gate's and up's agree.
    assert held == {"o_proj", "gate_up_proj", "down_proj"}
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(plain), PROMPTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch, quantize, qc", [
    ("llama", *GPTQ4),
    ("llama", packed_int("gptq", 8, 32, act_order=True), {"quant_method": "gptq", "bits": 8, "group_size": 32}),
    ("llama", *FP8_BLOCKS),
    ("qwen3_moe", packed_int("gptq", 4, 16, act_order=True), {"quant_method": "gptq", "bits": 4, "group_size": 16}),
    ("qwen3_moe", *FP8_BLOCKS),
], ids=["gptq-4-bit", "gptq-8-bit-act-order", "fp8-blocks", "experts-gptq-act-order", "experts-fp8-blocks"])
def test_on_a_gpu_packed_weights_give_the_dequantized_models_tokens(make_llm, tmp_path, arch, quantize, qc, dtype):
    """On CUDA, decode graphs on (the default): decode steps through the
    fused kernel inside the graphs, a 156-token prompt through dequantize
    and cuBLAS, and an MoE layer's experts through the grouped kernel over
    their codes; the tokens of the same checkpoint dequantized on the GPU,
    but for near-ties (the products' sums run in another order)."""
    write_quantized(random_model(arch), tmp_path / "int", quantize, qc)
    prompts = [*PROMPTS, "Hello there. " * 12]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    kwargs = dict(device="cuda", dtype=dtype, num_kv_blocks=256, enforce_eager=False)
    ref = make_llm(str(tmp_path / "int"), **kwargs).generate(prompts, params)
    got = make_llm(str(tmp_path / "int"), **kwargs, **PACKED).generate(prompts, params)
    assert_agree_but_for_near_ties(got, ref, f"packed {qc['quant_method']} {dtype}")
