"""Phi-3 against Hugging Face transformers on tiny random checkpoints: its
fused q/k/v and gate/up tensors cut into our linears' parts (and shards),
exact greedy tokens with and without LongRoPE, LongRoPE's long factors from
the pretraining length on, and a partial rope refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.layers import RotaryEmbedding
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.parallel import TensorParallel
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
FACTORS = dict(long_factor=[1.0, 1.3, 1.7, 2.0, 2.6, 3.1, 3.9, 4.4], short_factor=[1.0, 1.05, 1.1, 1.2, 1.3, 1.35,
                                                                                    1.4, 1.5])


def longrope(original: int) -> dict:
    """Phi-3.5-mini's rope in small: the short factors within ``original``
    positions, the long ones past it, cos and sin scaled for 8x the length."""
    return dict(max_position_embeddings=8 * original, original_max_position_embeddings=original,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, **FACTORS})


@pytest.mark.parametrize("overrides", [{}, longrope(512)], ids=["rope", "longrope-short-factors"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, overrides):
    """Within the pretraining length (every prompt and its tokens here)."""
    path = tiny_model("phi3", **overrides)
    outs = make_llm(path, max_model_len=512).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_longrope_takes_the_long_factors_from_the_pretraining_length_on(tiny_model):
    """Positions before ``original_max_position_embeddings`` rotate as
    transformers does within it, the rest as it does past it (vLLM's
    reading: a token's rotation follows its own position, so the cache is
    never rotated again; transformers recomputes the whole sequence with
    the long factors once it grows past the length)."""
    path = tiny_model("phi3", **longrope(24))
    config = load_hf_config(path)
    ours = RotaryEmbedding(config, 16)
    cos, sin = ours(torch.arange(40), torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).model.rotary_emb
    short_cos, short_sin = hf(torch.zeros(1, 24, 64), torch.arange(24)[None])
    long_cos, long_sin = hf(torch.zeros(1, 40, 64), torch.arange(40)[None])
    assert not torch.allclose(short_cos[0], long_cos[0, :24])  # the two factor sets differ
    torch.testing.assert_close(cos[:24], short_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(cos[24:], long_cos[0, 24:], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[24:, 8:], long_sin[0, 24:, 8:], rtol=0, atol=1e-6)  # its second half, signed +


def test_fused_checkpoint_tensors_split_into_each_ranks_parts(tiny_model):
    """q/k/v and gate/up rows cut out of the fused tensors, each rank taking
    its share of every part, as from separate tensors."""
    path = tiny_model("phi3")
    config = load_hf_config(path)
    saved = load_file(f"{path}/model.safetensors")
    qkv, gate_up = saved["model.layers.1.self_attn.qkv_proj.weight"], saved["model.layers.1.mlp.gate_up_proj.weight"]
    q, k, v = qkv.split([64, 32, 32])  # 4 heads and 2 KV heads of 16
    gate, up = gate_up.chunk(2)
    for rank in range(2):
        model = build_model(config, torch.float32, torch.device("cpu"), TensorParallel(rank=rank, size=2))
        load_weights(model, path)
        layer = model.model.layers[1]
        heads, kv_heads, inter = slice(32 * rank, 32 * rank + 32), slice(16 * rank, 16 * rank + 16), slice(
            64 * rank, 64 * rank + 64)
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q[heads], k[kv_heads], v[kv_heads]]))
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[inter], up[inter]]))


def test_a_partial_rope_is_refused_by_name(tiny_model):
    config = load_hf_config(tiny_model("phi3"))
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        build_model(config, torch.float32, torch.device("cpu"))
