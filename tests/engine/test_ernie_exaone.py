"""ERNIE 4.5 and EXAONE 4 against Hugging Face transformers on tiny random
checkpoints: exact greedy tokens. ERNIE 4.5 is the Llama family with GPT-J's
interleaved rope (its q and k rows reordered into our halves layout at load)
and biases on every linear where ``use_bias``; EXAONE 4 norms each branch's
output and q and k per head, and in its hybrid layout rotates only its
sliding-window layers."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
CASES = [("ernie4_5", {}), ("ernie4_5", {"use_bias": True}), ("exaone4", {}),
         ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2})]
IDS = ["ernie-4.5", "ernie-4.5-biases", "exaone-4-hybrid", "exaone-4-full"]


@pytest.mark.parametrize("arch, overrides", CASES, ids=IDS)
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, arch, overrides):
    path = tiny_model(arch, **overrides)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


@pytest.mark.parametrize("arch", ["ernie4_5", "exaone4"])
def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm, arch):
    path = tiny_model(arch)
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_exaone_hybrid_layers_rotate_where_they_slide():
    """The sliding layer keeps rope and its window; the full layer has neither."""
    from fluidserve.engine.tiny_model import tiny_config

    model = build_model(tiny_config("exaone4"), torch.float32, torch.device("meta"))
    attns = [layer.self_attn for layer in model.model.layers]
    assert [(a.use_rope, a.attn.sliding_window) for a in attns] == [(True, 16), (False, None)]
    assert all(a.per_head for a in attns)
    full = build_model(tiny_config("exaone4", sliding_window=None, layer_types=["full_attention"] * 2),
                       torch.float32, torch.device("meta"))
    assert [layer.self_attn.use_rope for layer in full.model.layers] == [True, True]
