"""The roofline of a mixture-of-experts model: a token's compute counts the
experts it takes, a step's weight reads the experts its tokens reach, and
the device memory every expert."""

from __future__ import annotations

import pytest

from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel

# Qwen3-30B-A3B's config.json, the keys the roofline reads.
QWEN3_30B_A3B = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     num_hidden_layers=48, vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[])
MIXTRAL_8X7B = dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, intermediate_size=14336,
                    num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, vocab_size=32000)


def test_parameter_counts_match_the_published_totals():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Mixtral-8x7B: 46.7B, 12.9B."""
    for cfg, total, active in ((QWEN3_30B_A3B, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 46.7e9, 12.9e9)):
        shape = ModelShape.from_hf_config(cfg)
        embeddings = 2 * shape.hidden_size * shape.vocab_size  # the embedding and the LM head
        assert shape.num_layers * shape.layer_params + embeddings == pytest.approx(total, rel=0.02)
        assert shape.num_layers * shape.active_layer_params + embeddings == pytest.approx(active, rel=0.05)


def test_dense_layers_and_a_sparse_step_count_as_the_config_says():
    cfg = dict(QWEN3_30B_A3B, mlp_only_layers=[0, 1], decoder_sparse_step=2)
    assert ModelShape.from_hf_config(cfg).moe_layers == 23  # odd layers 3..47 routed; 1 is dense by name
    assert ModelShape.from_hf_config(dict(QWEN3_30B_A3B, num_experts=0)).moe_layers == 0


def test_glm45_counts_its_first_dense_layer_and_shared_expert():
    """GLM-4.5's keys: ``n_routed_experts``, its first layer dense
    (``first_k_dense_replace``) and one shared expert of an expert's size."""
    cfg = dict(num_attention_heads=96, num_key_value_heads=8, head_dim=128, hidden_size=4096, intermediate_size=10944,
               moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
               first_k_dense_replace=1, num_hidden_layers=46, vocab_size=151552)
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.num_experts, shape.moe_layers, shape.shared_expert_intermediate_size) == (128, 45, 1408)
    # A token's parameters: attention everywhere, the dense MLP once, then the
    # router, the shared expert and 8 routed experts a layer.
    routed = 3 * 4096 * 1408
    per_moe_layer = 4096 * 128 + routed + 8 * routed
    want = 46 * shape.attention_params + 3 * 4096 * 10944 + 45 * per_moe_layer
    assert shape.num_layers * shape.active_layer_params == pytest.approx(want, abs=46)  # per-layer floor division


def test_a_steps_weight_reads_grow_with_the_experts_its_tokens_reach():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    one, many = shape.step_weight_bytes(1), shape.step_weight_bytes(4096)
    assert shape.expected_experts(1) == pytest.approx(8)
    assert shape.expected_experts(4096) == pytest.approx(128)
    assert many == pytest.approx(shape.weight_bytes)
    expert_bytes = shape.expert_params * shape.dtype_bytes * shape.moe_layers
    assert many - one == pytest.approx(120 * expert_bytes)
    # Batch-1 decode on an H100 reads about 3.3B parameters' bytes, not 30.5B.
    cost = RooflineCostModel(shape, DeviceSpec.h100())
    dense = RooflineCostModel(ModelShape.from_hf_config(dict(QWEN3_30B_A3B, num_experts=0,
                                                             intermediate_size=8 * 768)), DeviceSpec.h100())
    assert cost.decode_time(1, 1024) == pytest.approx(dense.decode_time(1, 1024), rel=0.05)


def test_a_dense_model_is_unchanged():
    shape = ModelShape.llama3_8b()
    assert shape.active_layer_params == shape.layer_params
    assert shape.step_weight_bytes(1) == shape.weight_bytes
