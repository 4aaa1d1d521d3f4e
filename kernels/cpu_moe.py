"""The mixture-of-experts experts on the CPU, over weights packed once for
oneDNN: ``fused_experts`` with reference.fused_experts's arithmetic.

An expert's product on the CPU reads its weights from memory every step
(a few hundred KB to tens of MB each; the cache holds few), so a step's
time is the bytes of the experts its tokens reach over the bandwidth the
product gets. oneDNN's linear over a weight reordered into its blocked
layout gets more of it than ``F.linear`` over the row-major weight at the
few rows an expert takes in a decode step: 1.6-1.9x the reference's speed
at 8 to 32 tokens of a 64-expert layer (benchmarks/cpu_moe.py). The pairs
are sorted by expert once and their rows gathered once; each expert then
takes a contiguous slice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluidserve.kernels.reference import pairs_by_expert


def pack(weights: torch.Tensor) -> list[torch.Tensor]:
    """[E, out, in] -> each expert's weight reordered for oneDNN's linear."""
    with torch.no_grad():
        return [torch.ops.mkldnn._reorder_linear_weight(w.detach()) for w in weights]


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: list[torch.Tensor],  # per expert, [2N, H] packed (pack)
    w2: list[torch.Tensor],  # per expert, [H, N] packed
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """[T, H] of x's dtype: reference.fused_experts over packed weights.
    Each expert's rows come in the order the reference gives them (slot,
    then token), its products in x's dtype, weighted by torch's promotion,
    then added into the zeroed output expert after expert (one
    ``index_add_`` over the pairs sorted by expert adds in that order)."""
    out = torch.zeros_like(x)
    if not topk_ids.numel():
        return out
    order, counts, tok = pairs_by_expert(topk_ids, len(w13))
    rows = x.index_select(0, tok)  # [T k, H], by expert
    ys = x.new_empty(rows.shape)
    linear = torch.ops.mkldnn._linear_pointwise
    start = 0
    for expert, n in enumerate(counts):
        if n:
            end = start + n
            gate, up = linear(rows[start:end], w13[expert], None, "none", [], "").chunk(2, dim=-1)
            ys[start:end] = linear(F.silu(gate) * up, w2[expert], None, "none", [], "")
            start = end
    weights = topk_weights.t().reshape(-1).index_select(0, order)
    return out.index_add_(0, tok, (ys * weights[:, None]).to(out.dtype))
