"""Multimodal checkpoints served for their text model alone (Gemma 3 4B and
up, Mistral Small 3.1 and up): the text model's weights read from under
``language_model.``, the vision tower left unread, and the tokens
transformers' multimodal model gives for text prompts."""

from __future__ import annotations

import torch
import transformers

from fluidserve.engine import SamplingParams
from fluidserve.engine.loader import load_hf_config
from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, save_byte_tokenizer, tiny_config
from token_paths import PROMPTS, hf_greedy

# min_tokens as hf_greedy's min_new_tokens: the end-of-sequence token is held back for 16 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)


def _save(model: torch.nn.Module, path) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    save_byte_tokenizer(path)


def test_mistral_small_3_serves_its_text_model(make_llm, tmp_path):
    text = tiny_config("mistral", sliding_window=None)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=8, head_dim=16)
    config = transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                         image_token_index=BYTE_VOCAB_SIZE - 1)
    _save(transformers.Mistral3ForConditionalGeneration(config), tmp_path)
    assert load_hf_config(tmp_path).architectures == ["MistralForCausalLM"]
    outs = make_llm(str(tmp_path)).generate(PROMPTS, GREEDY)
    reference = hf_greedy(str(tmp_path), PROMPTS, auto_class=transformers.AutoModelForImageTextToText)
    assert [o.outputs[0].token_ids for o in outs] == reference
