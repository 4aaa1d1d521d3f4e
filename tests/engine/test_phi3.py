"""Phi-3 against Hugging Face transformers on tiny random checkpoints: its
fused q/k/v and gate/up tensors cut into our linears' parts (and shards),
exact greedy tokens with and without LongRoPE and with a partial rope
(Phi-4-mini's), LongRoPE's factor set picked by the server's context, and a
rope width no kernel can rotate refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from fluidserve.engine import SamplingParams
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
    """A context within the pretraining length: LongRoPE's short factors,
    as transformers takes them for every sequence that short."""
    path = tiny_model("phi3", **overrides)
    outs = make_llm(path, max_model_len=512).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_a_longer_context_takes_the_long_factors_for_every_position(tiny_model, make_llm):
    """A context past the pretraining length (24): the long factors for the
    whole sequence, as vLLM takes them, so cached keys never need a second
    rotation. transformers takes them for a sequence past the length too,
    so prompts beyond it give its tokens."""
    path = tiny_model("phi3", **longrope(24))
    long_prompts = [p for p in PROMPTS if len(p.encode()) > 24]
    assert len(long_prompts) >= 2
    outs = make_llm(path, max_model_len=192).generate(long_prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, long_prompts)


@pytest.mark.parametrize("served, factors", [(24, "short"), (192, "long")])
def test_the_servers_context_picks_the_factor_set(tiny_model, served, factors):
    path = tiny_model("phi3", **longrope(24))
    model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"), max_model_len=served)
    cos, sin = model.model.rotary(torch.arange(40), torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).model.rotary_emb
    seen = 24 if factors == "short" else 40  # transformers picks by the longest position it is given
    hf_cos, hf_sin = hf(torch.zeros(1, seen, 64), torch.arange(seen)[None])
    torch.testing.assert_close(cos[:seen], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:seen, 8:], hf_sin[0, :, 8:], rtol=0, atol=1e-6)  # its second half, signed +
    short_cos, _ = hf(torch.zeros(1, 24, 64), torch.arange(24)[None])
    assert torch.allclose(cos[:24], short_cos[0]) == (factors == "short")


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
        assert torch.equal(layer.self_attn.qkv_proj.dense_weight(), torch.cat([q[heads], k[kv_heads], v[kv_heads]]))
        assert torch.equal(layer.mlp.gate_up_proj.dense_weight(), torch.cat([gate[inter], up[inter]]))


@pytest.mark.parametrize("rope", [{}, longrope(512)], ids=["rope", "longrope"])
def test_a_partial_rope_gives_transformers_greedy_tokens(tiny_model, make_llm, rope):
    """Phi-4-mini's rope: 3/4 of each head rotated, the rest passed through
    to the cache as projected (LongRoPE's factors sized by the rotated
    part)."""
    if rope:
        params = {**rope["rope_parameters"], "long_factor": FACTORS["long_factor"][:6],
                  "short_factor": FACTORS["short_factor"][:6]}
        rope = {**rope, "rope_parameters": params}
    path = tiny_model("phi3", partial_rotary_factor=0.75, **rope)
    config = load_hf_config(path)
    assert config.rope_parameters["partial_rotary_factor"] == 0.75
    llm = make_llm(path, max_model_len=512)
    assert llm.engine.executor.worker.runner.model.model.rotary.rotary_dim == 12
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


@pytest.mark.parametrize("factor", [0.1875, 1.5], ids=["odd-width", "wider-than-a-head"])
def test_a_rope_width_no_kernel_rotates_is_refused_by_name(tiny_model, factor):
    """3 of 16 features (rotate-half pairs need an even number), or 24."""
    config = load_hf_config(tiny_model("phi3"))
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": factor}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        build_model(config, torch.float32, torch.device("cpu"))
