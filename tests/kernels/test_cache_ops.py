"""Triton cache kernels against ``reference`` (exact: they only move data;
fp32 in the interpreter, fp16/bf16 on the GPU)."""

from __future__ import annotations

import pytest
import torch

from fluidserve.kernels import cache_ops, reference


def caches(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize("block_size,heads,head_dim", [(16, 2, 64), (32, 3, 128), (16, 2, 80)])
def test_reshape_and_cache_skips_padding(device, block_size, heads, head_dim):
    num_blocks, num_tokens = 6, 40
    key_cache, value_cache = caches(num_blocks, block_size, heads, head_dim, torch.float32, device)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn((num_tokens, heads, head_dim), generator=gen).to(device)
    value = torch.randn((num_tokens, heads, head_dim), generator=gen).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens
    slots = slots.to(device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


def test_reshape_and_cache_strided_input(device):
    """K/V often arrive as views of a fused qkv projection (non-contiguous)."""
    key_cache, value_cache = caches(4, 16, 2, 64, torch.float32, device)
    qkv = torch.randn((10, 3, 2, 64)).to(device)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([5, 6, 7, -1, 20, 21, 40, 41, 63, 0], device=device)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)


def test_gather_then_scatter_round_trip(device):
    key_cache, _ = caches(12, 16, 2, 64, torch.float32, device)
    ids = torch.tensor([7, 2, 11, 0, 5], device=device)
    staged = cache_ops.gather_blocks(key_cache, ids)
    assert staged.shape == (5, 16, 2, 64)
    assert torch.equal(staged, reference.gather_blocks(key_cache, ids))
    target = torch.tensor([1, 9, 3, 10, 4], device=device)
    expected = key_cache.clone()
    reference.scatter_blocks(staged, expected, target)
    cache_ops.scatter_blocks(staged, key_cache, target)
    assert torch.equal(key_cache, expected)


def test_empty_block_list(device):
    key_cache, _ = caches(3, 16, 1, 64, torch.float32, device)
    ids = torch.tensor([], dtype=torch.int64, device=device)
    assert cache_ops.gather_blocks(key_cache, ids).shape == (0, 16, 1, 64)
    before = key_cache.clone()
    cache_ops.scatter_blocks(key_cache[:0], key_cache, ids)
    assert torch.equal(key_cache, before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_cache_ops(cuda_only, dtype):
    from fluidserve.kernels import ops

    key_cache, value_cache = caches(64, 16, 8, 128, dtype, "cuda")
    key = torch.randn((300, 8, 128), device="cuda", dtype=dtype)
    value = torch.randn((300, 8, 128), device="cuda", dtype=dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::5] = -1
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
    ids = torch.randperm(64, device="cuda")[:17]
    staged = ops.gather_blocks(key_cache, ids)
    assert torch.equal(staged, reference.gather_blocks(key_cache, ids))
    host = staged.cpu().pin_memory()  # the swap path stages on the host
    target = torch.randperm(64, device="cuda")[:17]
    expected = value_cache.clone()
    reference.scatter_blocks(staged, expected, target)
    ops.scatter_blocks(host, value_cache, target)
    assert torch.equal(value_cache, expected)


@pytest.mark.gpu
def test_gpu_token_offsets_past_2_31(cuda_only):
    """Keys as a view with a 2^20-element row stride over 2,100 tokens: the
    last tokens sit past 2^31 elements."""
    tokens, stride = 2100, 1 << 20
    key_cache, value_cache = caches(200, 16, 2, 64, torch.bfloat16, "cuda")
    big = torch.randn((tokens, stride), dtype=torch.bfloat16, device="cuda")
    key = big[:, :128].view(tokens, 2, 64)
    value = big[:, 128:256].view(tokens, 2, 64)
    assert key.stride(0) * (tokens - 1) >= 2**31
    slots = torch.randperm(200 * 16, device="cuda")[:tokens]
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, ref_k) and torch.equal(value_cache, ref_v)
