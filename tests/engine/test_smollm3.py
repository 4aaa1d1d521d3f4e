"""SmolLM3 against Hugging Face transformers on tiny random checkpoints:
exact greedy tokens with NoPE layers (no rope, ``no_rope_layers``) between
rotated ones, with and without sliding-window layers, in whole and chunked
prefills; and the NoPE layers kept off the fused paths' shared rope launch."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
# SmolLM3-3B's layout in small: a NoPE layer every fourth, and (as its config
# allows) sliding windows on the NoPE layers.
LAYOUT = dict(num_hidden_layers=4, no_rope_layer_interval=4, use_sliding_window=True, sliding_window=16)


@pytest.mark.parametrize("overrides", [{}, LAYOUT], ids=["nope-every-second", "nope-every-fourth-sliding"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, overrides):
    path = tiny_model("smollm3", **overrides)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm):
    path = tiny_model("smollm3", **LAYOUT)
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_nope_layers_are_where_the_config_says_and_run_through_their_modules(tiny_model):
    config = load_hf_config(tiny_model("smollm3", **LAYOUT))
    assert config.no_rope_layers == [1, 1, 1, 0]
    model = build_model(config, torch.float32, torch.device("cpu"))
    layers = model.model.layers
    assert [layer.self_attn.use_rope for layer in layers] == [True, True, True, False]
    assert [layer.modules_only for layer in layers] == [False, False, False, True]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, None, None, 16]
