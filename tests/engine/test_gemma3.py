"""Gemma 3's text model against Hugging Face transformers on tiny random
checkpoints: exact greedy tokens with sliding and full layers (a window the
generation crosses, each layer type with its own rope), in whole and
chunked prefills, and what the model does not implement refused by name
(Gemma 2, on the same classes, is tests/engine/test_gemma2.py's)."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import build_model, load_hf_config
from fluidserve.engine.models.gemma3 import Gemma3ForCausalLM
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
# Gemma 3 4B's layout in small: full attention on a linearly scaled rope of
# base 1e6, sliding layers on base 1e4, two sliding layers a full one.
ROPES = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
LAYOUT = dict(num_hidden_layers=4, rope_parameters=ROPES,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])


@pytest.mark.parametrize("overrides", [{}, LAYOUT], ids=["one-of-each", "ropes-per-layer-type"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, overrides):
    path = tiny_model("gemma3", **overrides)
    assert max(len(p) for p in PROMPTS) > 16  # prompts cross the sliding window
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_chunked_prefill_and_mixed_steps_keep_the_tokens(tiny_model, make_llm):
    path = tiny_model("gemma3", **LAYOUT)
    outs = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_the_model_is_gemmas_own_and_ties_its_head(tiny_model):
    model = build_model(load_hf_config(tiny_model("gemma3")), torch.float32, torch.device("cpu"))
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [16, None]


@pytest.mark.parametrize("field, value", [("hidden_activation", "gelu")])
def test_what_is_not_implemented_is_refused_by_name(tiny_model, field, value):
    config = load_hf_config(tiny_model("gemma3"))
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        build_model(config, torch.float32, torch.device("cpu"))


def test_a_multimodal_checkpoint_serves_its_text_model(make_llm, tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text
    model's weights under ``language_model.``, a vision tower beside. The
    server runs the text model alone (the tower stays unread) with the
    tokens transformers' multimodal model gives for text prompts."""
    import transformers

    from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, save_byte_tokenizer, tiny_config

    text = tiny_config("gemma3", **LAYOUT)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    last = BYTE_VOCAB_SIZE - 1
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=last, boi_token_index=last - 1,
                                       eoi_token_index=last - 2)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.uniform_(-0.2, 0.2)
    model.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    assert load_hf_config(tmp_path).architectures == ["Gemma3ForCausalLM"]
    outs = make_llm(str(tmp_path)).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(tmp_path), PROMPTS)
