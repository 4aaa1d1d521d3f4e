"""The routed experts of an MoE layer (``ops.fused_experts``): the torch
reference against transformers' eager experts written out here and a
per-token loop, the alignment of pairs into expert blocks, the Triton path
against the reference (the interpreter's small shapes; on a GPU bf16 at a
Qwen3-30B-A3B layer's shape), and a captured CUDA graph replayed with
new routing."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from fluidserve.kernels import moe, ops, reference

# fp32 in the interpreter: the GEMMs' summation order, observed under 1e-6
# on outputs of about 1; a wrong block, expert or slot is off by O(1).
FP32 = dict(atol=1e-5, rtol=1e-5)
# fp16 in the interpreter, which rounds as torch does: the kernels round at
# the reference's steps, so a product that rounds the other way after a
# reordered sum moves an output by an ulp or two (observed 1 ulp, 2^-9 at
# 2..4, in 0.3% of the outputs).
FP16 = dict(atol=2e-3, rtol=2e-3)


def operands(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype=torch.float32, device="cpu",
             seed: int = 0, unused: tuple[int, ...] = ()):  # fmt: skip
    """x, w13, w2 scaled to keep activations of order 1, and a routing as a
    router gives it (distinct experts per token, softmax weights of the
    chosen normalised, fp32) that never picks the ``unused`` experts."""
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: a GPU test's weights are gigabytes

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device)

    x = randn(tokens, hidden).to(dtype)
    w13 = randn(experts, 2 * inter, hidden).div_(hidden**0.5).to(dtype)
    w2 = randn(experts, hidden, inter).div_(inter**0.5).to(dtype)
    logits = randn(tokens, experts)
    logits[:, list(unused)] = -torch.inf
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return x, w13, w2, ids, weights / weights.sum(dim=-1, keepdim=True)


def hf_experts(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """transformers' Qwen3MoeExperts.forward (eager; Mixtral's and
    Qwen2-MoE's experts are the same code)."""
    num_experts = w13.shape[0]
    final = torch.zeros_like(x)
    expert_mask = F.one_hot(topk_ids, num_classes=num_experts + 1).permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        gate, up = F.linear(x[token_idx], w13[expert_idx]).chunk(2, dim=-1)
        current = F.linear(F.silu(gate) * up, w2[expert_idx])
        current = current * topk_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, current.to(final.dtype))
    return final


def per_token(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """The definition, one (token, slot) at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w13[e] @ x[t]
            out[t] += topk_weights[t, j] * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


# -- the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights_dtype", ["fp32", "x"])
def test_the_reference_is_transformers_eager_experts_to_the_bit(dtype, weights_dtype):
    """Same rows in the same order through the same torch ops: equal bit for
    bit in every dtype, with routing weights in fp32 or (as transformers'
    routers cast them) in x's dtype."""
    x, w13, w2, ids, weights = operands(37, 8, 3, 64, 32, dtype, unused=(5,))
    if weights_dtype == "x":
        weights = weights.to(dtype)
    assert torch.equal(reference.fused_experts(x, w13, w2, ids, weights), hf_experts(x, w13, w2, ids, weights))


def test_the_reference_is_the_per_token_definition():
    x, w13, w2, ids, weights = operands(9, 6, 2, 48, 40, unused=(0, 3))
    # fp32: the order of a few dozen products' sums
    torch.testing.assert_close(reference.fused_experts(x, w13, w2, ids, weights),
                               per_token(x, w13, w2, ids, weights), atol=1e-5, rtol=1e-5)  # fmt: skip
    empty = reference.fused_experts(x[:0], w13, w2, ids[:0], weights[:0])
    assert empty.shape == (0, 48)


# -- alignment -------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,experts,top_k,bm", [(1, 8, 2, 16), (5, 4, 3, 16), (33, 8, 2, 16), (40, 4, 4, 32)])
def test_align_pads_each_experts_run_and_its_shapes_follow_the_sizes_alone(tokens, experts, top_k, bm):
    """Every pair once, in a block of its expert, in (token, slot) order
    within the expert; the padding is the sentinel; the total is each hit
    expert's count rounded up to ``bm``; and two routings of the same
    sizes (one leaving experts idle) give tensors of the same shapes."""
    shapes = set()
    idle = tuple(range(0, experts, 2))
    for unused in ((), idle if top_k <= experts - len(idle) else (0,)):
        ids = operands(tokens, experts, top_k, 16, 16, seed=tokens, unused=unused)[3]
        sorted_ids, expert_of_block, total = moe.align(ids, experts, bm)
        shapes.add((sorted_ids.shape, expert_of_block.shape, total.shape))
        pairs = tokens * top_k
        counts = torch.bincount(ids.flatten(), minlength=experts)
        assert int(total) == int(((counts + bm - 1) // bm * bm).sum())
        used = sorted_ids[:int(total)]
        assert torch.equal(used[used < pairs].sort().values, torch.arange(pairs, dtype=torch.int32))
        assert bool((sorted_ids[int(total):] == pairs).all())
        block_expert = expert_of_block.repeat_interleave(bm)[:int(total)]
        real = used < pairs
        assert torch.equal(ids.flatten()[used[real].long()], block_expert[real].long())
        for e in range(experts):
            mine = used[real & (block_expert == e)]
            assert torch.equal(mine, mine.sort().values)  # stable: token, then slot
    assert len(shapes) == 1
    assert shapes.pop()[0] == (moe.padded_size(tokens * top_k, experts, bm),)


# -- the Triton path, in the interpreter on CPU ---------------------------------------------


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,unused", [
    (1, 4, 2, 32, 16, ()),  # decode: each expert's block holds one pair
    (5, 8, 3, 64, 48, (1, 6)),  # 15 pairs, two experts idle
    (33, 6, 2, 48, 24, (2,)),  # blocks of 16 with 66 pairs, a ragged hidden
    (7, 4, 1, 32, 16, ()),  # k = 1: the down GEMM writes the output
    (40, 4, 4, 32, 40, ()),  # 40 pairs an expert: blocks of 32, ragged intermediate
    (50, 2, 2, 32, 24, ()),  # 50 pairs an expert: blocks of 64
])  # fmt: skip
def test_triton_path_equals_the_reference(device, tokens, experts, top_k, hidden, inter, unused):
    x, w13, w2, ids, weights = operands(tokens, experts, top_k, hidden, inter, device=device, seed=tokens,
                                        unused=unused)  # fmt: skip
    expected = reference.fused_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(moe.fused_experts(x, w13, w2, ids, weights), expected, **FP32)


def test_triton_path_takes_chunks_repeated_experts_int32_ids_and_16_bit_weights(device, monkeypatch):
    """A call of more tokens than a chunk (20 tokens in chunks of 8, each
    with its own blocks), a token routed twice to one expert (which the
    reference adds slot after slot), int32 expert ids and routing weights
    in fp16 (torch promotes each product to fp32)."""
    x, w13, w2, ids, weights = operands(20, 8, 2, 32, 16, device=device, seed=4)
    ids[3] = ids[3, :1]  # both slots of token 3 on one expert
    ids, weights = ids.int(), weights.half()
    expected = reference.fused_experts(x, w13, w2, ids, weights)
    monkeypatch.setattr(moe, "CHUNK_TOKENS", 8)
    torch.testing.assert_close(moe.fused_experts(x, w13, w2, ids, weights), expected, **FP32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests below cover half precision")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_path_in_half_precision_in_the_interpreter(dtype):
    """Rounded at the reference's steps: fp16 within an ulp or two. The
    interpreter converts fp32 to bf16 by truncation (the GPU rounds to
    nearest), which each of the four roundings can move by an ulp, so bf16
    only within a few ulps of its values (2^-7 relative, at up to 4)."""
    x, w13, w2, ids, weights = operands(9, 8, 2, 64, 32, dtype, seed=9, unused=(3,))
    got = moe.fused_experts(x, w13, w2, ids, weights)
    assert got.dtype == dtype
    tol = FP16 if dtype == torch.float16 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(got, reference.fused_experts(x, w13, w2, ids, weights), **tol)


def test_shapes_are_refused(device):
    x, w13, w2, ids, weights = operands(3, 4, 2, 32, 16, device=device)
    with pytest.raises(ValueError, match="expected x"):
        moe.fused_experts(x, w13, w2[:, :16], ids, weights)
    with pytest.raises(ValueError, match="share a dtype"):
        moe.fused_experts(x, w13, w2.double(), ids, weights)
    assert moe.fused_experts(x[:0], w13, w2, ids[:0], weights[:0]).shape == (0, 32)


# -- dispatch ------------------------------------------------------------------------------


def test_ops_dispatch_takes_the_reference_on_cpu_by_default(monkeypatch):
    monkeypatch.delenv(ops.KERNELS_ENV, raising=False)
    x, w13, w2, ids, weights = operands(5, 4, 2, 32, 16)

    def refuse(*args):
        raise AssertionError("the Triton path ran")

    monkeypatch.setattr(moe, "fused_experts", refuse)
    assert torch.equal(ops.fused_experts(x, w13, w2, ids, weights), reference.fused_experts(x, w13, w2, ids, weights))
    with pytest.raises(AssertionError, match="Triton path"):
        ops.fused_experts(x, w13, w2, ids, weights, path="triton")


# -- on a GPU ------------------------------------------------------------------------------

# Qwen3-30B-A3B's experts: hidden 2048, intermediate 768, 128 experts, 8 a token.
QWEN3_MOE = dict(experts=128, top_k=8, hidden=2048, inter=768)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_gpu_bf16_at_a_real_shape_is_the_reference_within_its_rounding(tokens):
    """bf16: both paths round at the same steps, so they differ where a
    reordered fp32 sum rounds the other way: an ulp of an intermediate
    (2^-8 relative) carried through the down projection, then an ulp of
    the output. Outputs are of order 1; 2e-2 is several such ulps and far
    below a wrong block or expert."""
    x, w13, w2, ids, weights = operands(tokens, **QWEN3_MOE, dtype=torch.bfloat16, device="cuda", seed=tokens)
    got = ops.fused_experts(x, w13, w2, ids, weights)
    assert torch.equal(got, moe.fused_experts(x, w13, w2, ids, weights))  # CUDA tensors: the Triton path
    with ops.reference_path():
        expected = ops.fused_experts(x, w13, w2, ids, weights)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert (got.float() - expected.float()).abs().mean() < 2e-3  # most outputs equal or an ulp apart


@needs_cuda
def test_gpu_a_captured_graph_replays_new_routing_as_an_eager_call():
    """No host sync (torch's sync debug mode raises on one); captured once
    with one routing, replayed with other x, ids and weights copied into
    the captured inputs (one routing leaving most experts idle, one
    spreading the tokens): each replay equals a fresh eager call bit for
    bit (the block sizes follow the shapes alone)."""
    shape = dict(tokens=4, **QWEN3_MOE, dtype=torch.bfloat16, device="cuda")
    x, w13, w2, ids, weights = operands(**shape, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compile) outside the capture
        ops.fused_experts(x, w13, w2, ids, weights)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.set_sync_debug_mode("error")  # a torch op that waits for the device raises
    try:
        ops.fused_experts(x, w13, w2, ids, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fused_experts(x, w13, w2, ids, weights)
    for seed, unused in ((2, tuple(range(16, 128))), (3, ())):
        new = operands(**shape, seed=seed, unused=unused)
        for captured, value in zip((x, ids, weights), (new[0], new[3], new[4]), strict=True):
            captured.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ops.fused_experts(x, w13, w2, ids, weights))
