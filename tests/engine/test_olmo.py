"""OLMo 2 and OLMo 3 against Hugging Face transformers on tiny random
checkpoints: exact greedy tokens (norms after each branch, q and k normed
over the whole projection; OLMo 3's sliding and full layers, each type with
its own rope), in whole and chunked prefills, and the q/k norms' weights
sharded with the heads under tensor parallelism."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.models.olmo2 import Olmo2ForCausalLM
from fluidserve.engine.parallel import TensorParallel
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
# OLMo 3 7B's layout in small: three sliding layers to a full one, the full
# layers' rope scaled by YaRN.
ROPES = {"full_attention": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                            "rope_theta": 500_000.0, "attention_factor": 1.2, "beta_fast": 32.0, "beta_slow": 1.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}
LAYOUT = dict(num_hidden_layers=4, rope_parameters=ROPES,
              layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
CASES = [("olmo2", {}), ("olmo2", {"attention_bias": True, "num_key_value_heads": 4}), ("olmo3", {}),
         ("olmo3", LAYOUT)]
IDS = ["olmo2", "olmo2-bias-mha", "olmo3", "olmo3-yarn-3-to-1"]


@pytest.mark.parametrize("arch, overrides", CASES, ids=IDS)
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, arch, overrides):
    path = tiny_model(arch, **overrides)
    assert max(len(p) for p in PROMPTS) > 16  # prompts cross OLMo 3's sliding window
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm):
    path = tiny_model("olmo3", **LAYOUT)
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_the_layers_and_their_windows_are_olmos_own(tiny_model):
    model = build_model(load_hf_config(tiny_model("olmo3", **LAYOUT)), torch.float32, torch.device("cpu"))
    assert isinstance(model, Olmo2ForCausalLM)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [16, 16, 16, None]
    assert len(model.model.rotary) == 2
    plain = build_model(load_hf_config(tiny_model("olmo2")), torch.float32, torch.device("cpu"))
    assert [layer.self_attn.attn.sliding_window for layer in plain.model.layers] == [None, None]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-split", "kv-head-replicated"])
def test_tensor_parallel_ranks_hold_their_heads_share_of_the_qk_norms(tiny_model, kv_heads):
    """Each rank's q norm weight is its query heads' features; its k norm
    weight its KV head's (the one KV head every rank holds whole when there
    are fewer KV heads than ranks)."""
    path = tiny_model("olmo2", num_key_value_heads=kv_heads)
    saved = load_file(f"{path}/model.safetensors")
    q_full, k_full = saved["model.layers.1.self_attn.q_norm.weight"], saved["model.layers.1.self_attn.k_norm.weight"]
    for rank in range(2):
        model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"),
                            TensorParallel(rank=rank, size=2))
        load_weights(model, path)
        attn = model.model.layers[1].self_attn
        assert torch.equal(attn.q_norm.weight, q_full[32 * rank:32 * rank + 32])
        kv = k_full[16 * rank:16 * rank + 16] if kv_heads == 2 else k_full
        assert torch.equal(attn.k_norm.weight, kv)
