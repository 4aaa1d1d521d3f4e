"""The CPU's experts over oneDNN-packed weights (kernels/cpu_moe.py) against
the torch reference: the same sum of each token's experts, to the rounding
of a GEMM whose weight layout differs (fp32: 1e-5 relative; bf16: a unit in
the last place of the outputs, 2e-2)."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine.parallel import can_prepack
from fluidserve.kernels import cpu_moe, reference


def _case(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 64, 48
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 16, 4), (33, 4, 1)])
def test_packed_experts_equal_the_reference(dtype, tol, tokens, experts, top_k):
    x, w13, w2, ids, weights = _case(tokens, experts, top_k, dtype)
    if not can_prepack(w13):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    expected = reference.fused_experts(x, w13, w2, ids, weights)
    got = cpu_moe.fused_experts(x, cpu_moe.pack(w13), cpu_moe.pack(w2), ids, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_experts_no_token_reaches_add_nothing():
    """Top-1 of 8 over 3 tokens: five experts take no row and cost no product."""
    x, w13, w2, _, _ = _case(3, 8, 1, torch.float32)
    if not can_prepack(w13):
        pytest.skip("oneDNN packs no float32 weights on this CPU")
    ids = torch.tensor([[2], [2], [5]])
    weights = torch.ones(3, 1)
    got = cpu_moe.fused_experts(x, cpu_moe.pack(w13), cpu_moe.pack(w2), ids, weights)
    gate, up = torch.nn.functional.linear(x, w13[2]).chunk(2, dim=-1)
    torch.testing.assert_close(got[:2], torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[2])[:2],
                               rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[2]) > 0
