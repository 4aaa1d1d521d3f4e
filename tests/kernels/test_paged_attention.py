"""Triton paged attention against ``reference.paged_attention``.

Without CUDA these run in the Triton interpreter in fp32; shapes are small and
parametrised sparingly because the interpreter executes every program in
Python. Tolerances (fp32): atol=1e-4, rtol=2e-4 (observed error ~1e-6; a kernel
that ignores the block table, the causal mask or a split is off by O(1)).
GPU tests (fp16/bf16, compiled) compare with the fp32 reference at
atol=rtol=1e-2 (fp16) and 2e-2 (bf16).
"""

from __future__ import annotations

import pytest
import torch

from fluidserve.kernels import packing, reference
from fluidserve.kernels import paged_attention as pa

ATOL, RTOL = 1e-4, 2e-4


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """(q_len, seq_len): decodes at lengths 1, block-1, block, block+1 and a
    few hundred; whole prompts; prefill chunks over a cached prefix."""
    b = block_size
    return [
        (1, 1),
        (1, b - 1),
        (1, b),
        (1, b + 1),
        (1, 300),
        (b + 1, b + 1),  # whole prompt
        (40, 200),  # chunk after a 160-token prefix
        (b - 1, 2 * b + 3),
        (260, 260),  # a prompt of a few hundred tokens
    ]


def specs_q(specs: list[tuple[int, int]]) -> list[int]:
    return [q for q, _ in specs]


def specs_s(specs: list[tuple[int, int]]) -> list[int]:
    return [s for _, s in specs]


def run(batch, plan=None, sliding_window=None) -> torch.Tensor:
    return pa.paged_attention(*batch.args, sliding_window=sliding_window, work=plan).float().cpu()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(device, make_batch, oracle, group, head_dim, block_size):
    # Two KV heads for MHA so the kv-head grid axis is exercised; one for the
    # wide groups (MQA-like) to keep the interpreter quick.
    num_kv_heads = 2 if group == 1 else 1
    batch = make_batch(
        mixed_specs(block_size), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        device=device, seed=group * 1000 + head_dim + block_size,
    )  # fmt: skip
    torch.testing.assert_close(run(batch), oracle(batch), atol=ATOL, rtol=RTOL)


def test_ignoring_the_block_table_would_fail(device, make_batch, oracle):
    """The test batches are sensitive to the page walk: the same cache read
    through an identity table gives a clearly different answer."""
    batch = make_batch([(1, 70), (20, 50)], num_kv_heads=1, group=4, head_dim=64, block_size=16, device=device)
    out = run(batch)
    torch.testing.assert_close(out, oracle(batch), atol=ATOL, rtol=RTOL)
    batch.block_tables = torch.arange(batch.block_tables.numel(), dtype=torch.int32, device=device).reshape(
        batch.block_tables.shape
    ) % batch.key_cache.shape[0]
    assert (out - oracle(batch)).abs().max() > 0.1


def test_packings_are_bit_identical(device, make_batch, oracle):
    """Same split boundaries, different unit counts and orders: the same bits.
    The default (auto-split) and unpacked plans agree with the reference."""
    specs = [(1, 300), (33, 120), (1, 17), (1, 64), (1, 200), (5, 5)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=16, device=device)
    expected = oracle(batch)
    outs = []
    for num_units in (1, 3, 8):
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=num_units,
                           tokens_per_tile=16, kv_chunk=64)  # fmt: skip
        assert plan.num_merge_rows > 0  # really split
        outs.append(run(batch, plan))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], expected, atol=ATOL, rtol=RTOL)
    for kw in (dict(pack=False), dict(num_units=2), dict(num_units=5, tokens_per_tile=3)):
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), **kw)
        torch.testing.assert_close(run(batch, plan), expected, atol=ATOL, rtol=RTOL)


def test_split_k_with_empty_pieces(device, make_batch, oracle):
    """Small KV chunks: long decodes split many ways, and prefill tiles whose
    last piece holds no allowed key for their early rows (lse = -inf)."""
    specs = [(1, 700), (40, 200), (1, 65)]
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=64, block_size=32, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=4,
                       tokens_per_tile=32, kv_chunk=64)  # fmt: skip
    assert plan.max_splits == 11  # 700 keys in 64-key pieces
    torch.testing.assert_close(run(batch, plan), oracle(batch), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window,block_size", [(16, 16), (37, 32)])
def test_sliding_window(device, make_batch, oracle, window, block_size):
    specs = [(1, 1), (1, 300), (40, 200), (block_size + 1, block_size + 1)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=block_size, device=device)
    expected = oracle(batch, sliding_window=window)
    torch.testing.assert_close(run(batch, sliding_window=window), expected, atol=ATOL, rtol=RTOL)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), window, num_units=3,
                       tokens_per_tile=8, kv_chunk=16)  # fmt: skip
    torch.testing.assert_close(run(batch, plan, sliding_window=window), expected, atol=ATOL, rtol=RTOL)


def test_plan_must_match_window_and_batch(device, make_batch):
    batch = make_batch([(3, 10)], num_kv_heads=1, group=1, head_dim=64, block_size=16, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, [3], [10], sliding_window=4)
    with pytest.raises(ValueError, match="window"):
        run(batch, plan)
    plan = pa.plan_for(batch.query, batch.key_cache, [2], [10])
    with pytest.raises(ValueError, match="tokens"):
        run(batch, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group,head_dim,block_size", [(1, 128, 16), (4, 64, 32), (8, 128, 16)])
def test_gpu_half_precision(cuda_only, make_batch, oracle, dtype, tol, group, head_dim, block_size):
    specs = mixed_specs(block_size) + [(1, 4096), (512, 2048), (1, 9000)]
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, device="cuda")  # fmt: skip
    expected = oracle(batch)
    torch.testing.assert_close(run(batch), expected, atol=tol, rtol=tol)
    unpacked = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), pack=False)
    torch.testing.assert_close(run(batch, unpacked), expected, atol=tol, rtol=tol)
    outs = [
        run(batch, pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=n,
                               kv_chunk=512))  # fmt: skip
        for n in (7, 64)
    ]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(run(batch, sliding_window=1000), oracle(batch, 1000), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_gpu_ops_dispatch(cuda_only, make_batch, oracle):
    from fluidserve.kernels import ops

    batch = make_batch([(1, 100), (30, 60)], num_kv_heads=2, group=4, head_dim=128, block_size=16,
                       dtype=torch.float16, device="cuda")  # fmt: skip
    out = ops.paged_attention(*batch.args)
    assert out.is_cuda and out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), oracle(batch), atol=1e-2, rtol=1e-2)


def test_ops_uses_reference_on_cpu(make_batch):
    from fluidserve.kernels import ops

    batch = make_batch([(1, 20), (4, 9)], num_kv_heads=1, group=2, head_dim=64, block_size=16)
    plan = packing.plan_attention([1, 4], [20, 9], num_units=1, tokens_per_tile=1)  # ignored on CPU
    assert torch.equal(ops.paged_attention(*batch.args, work=plan), reference.paged_attention(*batch.args))
