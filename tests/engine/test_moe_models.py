"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5,
Granite MoE) against Hugging Face transformers on tiny random checkpoints:
exact greedy tokens, in whole and chunked prefills and mixed steps, dense
layers among the sparse ones, the checkpoint's per-expert (or stacked)
tensors loaded into the stacked weights, each rank's shard of them, and a
checkpoint that lacks an expert refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, checkpoint_targets, load_hf_config, load_weights
from fluidserve.engine.lora import AdapterError, read_adapter
from fluidserve.engine.models.moe import SparseMoeBlock
from fluidserve.engine.parallel import TensorParallel
from fluidserve.engine.tiny_model import build_random_adapter
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
MOE_CASES = [
    ("mixtral", {}),  # 4 experts, two a token, always renormalized, float32 weights
    ("qwen2_moe", {}),  # 8 experts and a gated shared expert; q/k/v biases; not renormalized
    ("qwen3_moe", {}),  # 8 experts, renormalized; per-head q/k norms
    ("qwen3_moe", {"mlp_only_layers": [0]}),  # a dense layer before a sparse one
    ("qwen3_moe", {"num_experts_per_tok": 1, "num_experts": 3}),  # top-1 of an odd count
    # A dense first layer, then sigmoid scores plus a correction bias choosing
    # within the 2 best of 4 groups, scaled; an ungated shared expert; rope on
    # half of each head, q/k/v biases.
    ("glm4_moe", {}),
    ("glm4_moe", {"use_qk_norm": True, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    # Granite's multipliers; a softmax over the chosen experts' logits; every
    # expert stacked in one checkpoint tensor (and a fused shared expert).
    ("granitemoe", {}),
    ("granitemoeshared", {}),
]
MOE_IDS = ["mixtral", "qwen2-moe-shared", "qwen3-moe", "qwen3-moe-dense-layer", "qwen3-moe-top1", "glm4-moe-groups",
           "glm4-moe-qk-norm-one-group", "granite-moe", "granite-moe-shared"]


@pytest.mark.parametrize("arch, overrides", MOE_CASES, ids=MOE_IDS)
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, arch, overrides):
    path = tiny_model(arch, **overrides)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "glm4_moe"])
def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm, arch):
    """Five tokens a step: prompts prefill in chunks beside other rows'
    decodes, so a step's rows go to different experts per request."""
    path = tiny_model(arch)
    llm = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_layers_route_where_the_config_says(tiny_model):
    config = load_hf_config(tiny_model("qwen3_moe", mlp_only_layers=[0]))
    model = build_model(config, torch.float32, torch.device("cpu"))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock"]
    block = model.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock)
    assert tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)  # [E, 2 * 32, hidden]
    assert tuple(block.experts.down_proj.shape) == (8, 64, 32)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_each_experts_checkpoint_tensors_land_in_its_rows(tiny_model, arch):
    path = tiny_model(arch)
    model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"))
    load_weights(model, path)
    saved = load_file(f"{path}/model.safetensors")
    block = model.model.layers[1].mlp
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    inter = block.experts.down_proj.shape[2]
    experts = block.experts.dense_values()  # read back from the packed layout where it holds them
    for e in range(block.experts.gate_up_proj.shape[0]):
        prefix = f"model.layers.1.{moe}.experts.{e}"
        assert torch.equal(experts["gate_up_proj"][e, :inter], saved[f"{prefix}.{gate}.weight"])
        assert torch.equal(experts["gate_up_proj"][e, inter:], saved[f"{prefix}.{up}.weight"])
        assert torch.equal(experts["down_proj"][e], saved[f"{prefix}.{down}.weight"])
    assert torch.equal(block.gate.weight, saved[f"model.layers.1.{moe}.gate.weight"])


def test_stacked_checkpoint_experts_are_cut_into_each_ranks_parts(tiny_model):
    """Granite MoE keeps every expert's gate|up in one [E, 2N, H] tensor and
    every down in one [E, H, N], its shared expert's gate|up fused: each
    rank of two takes its half of every expert's N features from them."""
    path = tiny_model("granitemoeshared")
    saved = load_file(f"{path}/model.safetensors")
    stacked_in = saved["model.layers.1.block_sparse_moe.input_linear.weight"]  # [8, 64, 64]
    stacked_out = saved["model.layers.1.block_sparse_moe.output_linear.weight"]  # [8, 64, 32]
    shared_in = saved["model.layers.1.shared_mlp.input_linear.weight"]  # [96, 64]
    for rank in range(2):
        tp = TensorParallel(rank=rank, size=2)
        model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"), tp)
        load_weights(model, path)
        block = model.model.layers[1].mlp
        mine = slice(16 * rank, 16 * rank + 16)
        experts = block.experts.dense_values()  # read back from the packed layout where it holds them
        assert torch.equal(experts["gate_up_proj"], torch.cat((stacked_in[:, :32][:, mine],
                                                              stacked_in[:, 32:][:, mine]), dim=1))
        assert torch.equal(experts["down_proj"], stacked_out[:, :, mine])
        assert torch.equal(block.gate.weight, saved["model.layers.1.block_sparse_moe.router.layer.weight"])
        shared = slice(24 * rank, 24 * rank + 24)
        assert torch.equal(block.shared_expert.gate_up_proj.dense_weight(),
                           torch.cat((shared_in[:48][shared], shared_in[48:][shared])))


def test_a_checkpoint_without_an_expert_is_refused_by_name(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe")
    tensors = load_file(f"{src}/model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = build_model(load_hf_config(src), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight"):
        load_weights(model, tmp_path)


def test_tensor_parallel_shards_split_every_experts_features(tiny_model):
    """Rank r of two holds features [16r, 16r + 16) of each expert's 32: rows
    of gate and up, columns of down; the router stays whole on each rank."""

    path = tiny_model("qwen2_moe")
    config = load_hf_config(path)
    saved = load_file(f"{path}/model.safetensors")
    for rank in range(2):
        model = build_model(config, torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
        load_weights(model, path)
        block = model.model.layers[0].mlp
        rows = slice(16 * rank, 16 * rank + 16)
        experts = block.experts.dense_values()
        for e in (0, 7):
            prefix = f"model.layers.0.mlp.experts.{e}"
            assert torch.equal(experts["gate_up_proj"][e, :16], saved[f"{prefix}.gate_proj.weight"][rows])
            assert torch.equal(experts["gate_up_proj"][e, 16:], saved[f"{prefix}.up_proj.weight"][rows])
            assert torch.equal(experts["down_proj"][e], saved[f"{prefix}.down_proj.weight"][:, rows])
        assert torch.equal(block.gate.weight, saved["model.layers.0.mlp.gate.weight"])
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in checkpoint_targets(model)


def test_an_adapter_on_the_experts_is_refused_naming_the_module(tiny_model, tmp_path):
    """Adapters reach linears only; the stacked experts are none. An
    adapter trained where each expert was a linear (PEFT over transformers
    4) names one of them, and is refused by that name."""
    path = tiny_model("qwen3_moe")
    adapter = build_random_adapter(path, tmp_path / "adapter", targets=["q_proj"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj"
    tensors[f"{expert}.lora_A.weight"] = torch.zeros(4, 64)
    tensors[f"{expert}.lora_B.weight"] = torch.zeros(32, 4)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    model = build_model(load_hf_config(path), torch.float32, torch.device("meta"))
    with pytest.raises(AdapterError, match=r"experts\.0\.gate_proj"):
        read_adapter(adapter, model, max_rank=16)
