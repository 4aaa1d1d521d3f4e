"""Triton cache kernels: write new K/V into their slots, and move whole blocks
between the paged cache and a contiguous staging buffer (swap, checkpoint).

Semantics are ``reference.reshape_and_cache``, ``reference.gather_blocks`` and
``reference.scatter_blocks``. Only the worker's cache engine calls the block
movers; the scheduler decides which blocks move (STYLE: policy returns a plan,
device code carries it out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fluidserve.kernels.cache_dtype import to_cache
from fluidserve.kernels.launch import Relaunch, cdiv, next_power_of_2

# Elements of one block row copied per program of the block movers.
COPY_BLOCK = 1024


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_ptr,  # [num_tokens] int, -1 = skip
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # tokens x row stride can pass 2^31
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # Padding slots (-1) mask the whole store rather than branching; the slot
    # is broadcast to a tensor first (a scalar mask term trips the interpreter).
    keep = (slot + tl.zeros([BLOCK_H, 1], tl.int64)) >= 0
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & keep
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(
        key_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
        to_cache(k, key_cache_ptr),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
        to_cache(v, value_cache_ptr),
        mask=mask,
    )


_RESHAPE_AND_CACHE = Relaunch(_reshape_and_cache_kernel)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,  # [n] int: source row of pair i (unused if SRC_DIRECT)
    dst_ids_ptr,  # [n] int: destination row of pair i (unused if DST_DIRECT)
    row_numel,  # elements of one block
    stride_src, stride_dst,  # elements between rows
    SRC_DIRECT: tl.constexpr,  # source row is i itself (staging buffer)
    DST_DIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    if SRC_DIRECT:
        src_row = i.to(tl.int64)
    else:
        src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    if DST_DIRECT:
        dst_row = i.to(tl.int64)
    else:
        dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_numel
    x = tl.load(src_ptr + src_row * stride_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * stride_dst + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


_COPY_BLOCKS = Relaunch(_copy_blocks_kernel)


def _check_token_layout(t: torch.Tensor, name: str) -> None:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim] with contiguous head_dim")


def _launch_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_token_layout(key, "key")
    _check_token_layout(value, "value")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.stride(-1) != 1:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous")
    if key.shape[1:] != key_cache.shape[2:] or value.shape != key.shape:
        raise ValueError("key/value heads and head_dim must match the cache")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must hold one slot per token ({key.shape[0]})")
    if key.dtype != value.dtype:
        raise ValueError(f"key ({key.dtype}) and value ({value.dtype}) differ in dtype")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _RESHAPE_AND_CACHE[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_heads),
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
    )  # fmt: skip


def _launch_copy_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    ids: torch.Tensor,  # [n] block ids in the cache side
    cache_is_src: bool,
) -> None:
    """Copy ``n`` block rows between a cache (indexed by ``ids``) and a
    contiguous staging buffer (row ``i`` = pair ``i``)."""
    for name, t in (("source", src), ("destination", dst)):
        # One block must be one contiguous row of memory.
        if t.shape[0] and not t[0].is_contiguous():
            raise ValueError(f"{name} blocks must be contiguous")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"cache and staging blocks differ in shape: {tuple(src.shape)} vs {tuple(dst.shape)}")
    n = ids.numel()
    if n == 0:
        return
    row_numel = src[0].numel()
    grid = (n, cdiv(row_numel, COPY_BLOCK))
    _COPY_BLOCKS[grid](
        src, dst, ids, ids, row_numel, src.stride(0), dst.stride(0),
        SRC_DIRECT=not cache_is_src,
        DST_DIRECT=cache_is_src,
        BLOCK=COPY_BLOCK,
    )  # fmt: skip


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    _launch_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> torch.Tensor:
    """Copy the listed blocks into a contiguous staging buffer [n, ...]."""
    staging = torch.empty((block_ids.numel(), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _launch_copy_blocks(cache, staging, block_ids, cache_is_src=True)
    return staging


def scatter_blocks(
    staging: torch.Tensor,  # [n, ...]
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> None:
    """Write staged blocks back into the listed cache blocks."""
    if staging.shape[0] != block_ids.numel():
        raise ValueError("one staged block per block id")
    _launch_copy_blocks(staging, cache, block_ids, cache_is_src=False)
