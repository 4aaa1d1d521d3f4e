"""Greedy tokens as the judge: the reference continuations of transformers,
and two kernel paths compared (the same model and weights once through one
path, the Triton kernels, and once through another, the reference or the
CPU kernels)."""

from __future__ import annotations

import torch
import transformers

# Prompts of every shape the engine handles: short, long, one byte, non-ASCII.
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "Long prompt " * 9, "你好, wörld"]


def hf_greedy(model_dir: str, prompts, max_new_tokens: int = 16, auto_class=None,
              attn_implementation: str | None = None) -> list[list[int]]:
    """Reference continuations, one prompt at a time (no padding in play);
    ``auto_class``: the transformers class that loads the model (default
    ``AutoModelForCausalLM``); ``attn_implementation``: its attention (one
    registered with transformers' ``AttentionInterface``, say)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    hf = (auto_class or transformers.AutoModelForCausalLM).from_pretrained(model_dir, **kwargs).eval()
    out = []
    for p in prompts:
        ids = tok.encode(p) if isinstance(p, str) else p
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(gen[0, len(ids):].tolist())
    return out

# Largest logprob gap (nats) between the reference's token and the other
# path's at a position where they part. bf16 logits of magnitude 4-8 are
# quantised in steps of 2^-5 = 0.03, so a correct kernel that moves one
# attention output by an ulp can flip a tie of a few steps; a wrong page or
# split moves logits by whole nats.
NEAR_TIE = 0.15


def assert_agree_but_for_near_ties(outs, ref_outs, label: str) -> None:
    """Greedy tokens agree token for token; a request may part from the
    reference only at a near-tie of the reference's own logprobs (asked
    for with ``logprobs >= 2``), after which the continuations legitimately
    differ. At least half of all tokens come before any parting."""
    matched = total = 0
    for t, r in zip(outs, ref_outs, strict=True):
        t_ids, r_ids, r_lps = t.outputs[0].token_ids, r.outputs[0].token_ids, r.outputs[0].logprobs
        total += len(r_ids)
        for pos, (a, b) in enumerate(zip(t_ids, r_ids)):
            if a != b:
                alternatives = r_lps[pos]
                assert a in alternatives, f"{label}: token {pos} of {r.prompt!r}: {a} not in the reference's top k"
                gap = alternatives[b].logprob - alternatives[a].logprob
                assert gap < NEAR_TIE, f"{label}: token {pos} of {r.prompt!r} parts at a {gap:.3f}-nat gap"
                break
            matched += 1
    assert matched >= total // 2, f"{label}: only {matched} of {total} tokens before the paths part"
