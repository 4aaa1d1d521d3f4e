"""GLM-4 against Hugging Face transformers on tiny random checkpoints: exact
greedy tokens with its interleaved rope on half of each head (q_proj and
k_proj rows reordered into our halves layout at load), four norms a layer
and its fused gate/up, in whole and chunked prefills; the reordering is
within heads, so each tensor-parallel rank holds its heads' rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.layers import interleaved_to_halves
from fluidserve.engine.parallel import TensorParallel
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0,
                                                                  "partial_rotary_factor": 1.0}}],
                         ids=["half-of-each-head", "whole-heads"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, overrides):
    path = tiny_model("glm4", **overrides)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm):
    path = tiny_model("glm4")
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_interleaved_pairs_become_halves_within_each_head():
    assert interleaved_to_halves(2, 6, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 8, 7, 9, 10, 11]
    x = torch.randn(3, 16)  # one head of 16, 8 rotated
    cos, sin = torch.randn(3, 4).cos(), torch.randn(3, 4).sin()
    pairs = x[:, :8].unflatten(-1, (4, 2))  # the reference's rotation of neighbouring pairs
    turned = torch.stack((pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin), -1)
    halves = x[:, interleaved_to_halves(1, 16, 8)]
    h1, h2 = halves[:, :4], halves[:, 4:8]  # rotate_half's layout: feature i with i + 4
    ours = torch.cat((h1 * cos - h2 * sin, h2 * cos + h1 * sin), -1)
    torch.testing.assert_close(ours, turned.transpose(1, 2).flatten(1), rtol=0, atol=1e-6)


def test_each_rank_holds_its_heads_reordered_rows(tiny_model):
    path = tiny_model("glm4")
    saved = load_file(f"{path}/model.safetensors")
    q = saved["model.layers.0.self_attn.q_proj.weight"][interleaved_to_halves(4, 16, 8)]
    k = saved["model.layers.0.self_attn.k_proj.bias"][interleaved_to_halves(2, 16, 8)]
    for rank in range(2):
        model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
        load_weights(model, path)
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert torch.equal(qkv.dense_weight()[:32], q[32 * rank:32 * rank + 32])
        assert torch.equal(qkv.bias[32:48], k[16 * rank:16 * rank + 16])
