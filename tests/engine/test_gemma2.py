"""Gemma 2 against Hugging Face transformers on tiny random checkpoints:
exact greedy tokens with its attention scores and logits soft-capped (at
its own caps, and at caps small enough that every score and logit bends),
sliding and full layers on one rope, in whole and chunked prefills."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
TIGHT = dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0)


@pytest.mark.parametrize("overrides", [{}, TIGHT], ids=["gemma2-caps", "tight-caps"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, overrides):
    path = tiny_model("gemma2", **overrides)
    assert max(len(p) for p in PROMPTS) > 16  # prompts cross the sliding window
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm):
    path = tiny_model("gemma2", **TIGHT)
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_the_caps_reach_the_attention_and_the_logits(tiny_model):
    """Each layer's attention holds the score cap and its window; no q/k
    norms; the logits never pass the final cap."""
    path = tiny_model("gemma2", **TIGHT)
    model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"))
    load_weights(model, path)
    layers = model.model.layers
    assert [layer.self_attn.attn.softcap for layer in layers] == [1.0, 1.0]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [16, None]
    assert not any(hasattr(layer.self_attn, "q_norm") for layer in layers)
    assert len(model.model.rotary) == 1
    logits = model.compute_logits(torch.randn(3, model.config.hidden_size) * 100)
    assert logits.abs().max() <= 2.0
