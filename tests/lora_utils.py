"""LoRA adapters for the tests, made and run by PEFT itself: random weights
on a tiny checkpoint, saved in PEFT's format, and PEFT's greedy tokens as
the reference a served adapter must reproduce."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from fluidserve.engine.tiny_model import build_random_adapter


def make_adapter(model_dir: str, out: str | Path, seed: int, **kwargs) -> str:
    """``build_random_adapter``'s folder, as a string (a --lora-modules path)."""
    return str(build_random_adapter(model_dir, out, seed, **kwargs))


def peft_greedy(model_dir: str, adapter: str | None, prompts, max_new_tokens: int = 12) -> list[list[int]]:
    """PEFT's greedy continuations with ``adapter`` (None: the base model),
    one prompt at a time."""
    from peft import PeftModel

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    for p in prompts:
        ids = tok.encode(p) if isinstance(p, str) else list(p)
        new: list[int] = []
        # The argmax of every position, EOS included (``ignore_eos`` goes on
        # past it; ``generate``'s min_new_tokens would forbid it instead).
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1]
                new.append(int(logits.argmax()))
        out.append(new)
    return out
