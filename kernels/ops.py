"""The one dispatch point the models call: Triton kernels on CUDA tensors, the
torch reference everywhere else. Signatures and semantics are reference.py's.

The Triton modules are imported lazily so that CPU-only code paths (the
scheduler, the tests of the engine on CPU) never pay for importing Triton.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from fluidserve.kernels import reference

if TYPE_CHECKING:
    from fluidserve.kernels.packing import WorkPlan


_reference_only = False


@contextmanager
def reference_path() -> Iterator[None]:
    """Run the torch reference even on CUDA tensors, so that one device and
    dtype can compare the Triton path with the reference path (tests,
    benchmarks). Process-wide; not for serving."""
    global _reference_only
    before, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = before


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return not _reference_only and all(t.is_cuda for t in tensors)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
) -> None:
    if _on_cuda(key, value, key_cache, value_cache, slot_mapping):
        from fluidserve.kernels import cache_ops

        cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    sliding_window: int | None = None,
    work: WorkPlan | None = None,
) -> torch.Tensor:
    """``work`` (a per-step plan from ``paged_attention.plan_for``) is used only
    on CUDA; the reference needs none."""
    if _on_cuda(query, key_cache, value_cache, block_tables):
        from fluidserve.kernels import paged_attention as triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, work
        )
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window
    )


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> torch.Tensor:
    if _on_cuda(cache, block_ids):
        from fluidserve.kernels import cache_ops

        return cache_ops.gather_blocks(cache, block_ids)
    return reference.gather_blocks(cache, block_ids)


def scatter_blocks(
    staging: torch.Tensor,  # [n, ...]
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> None:
    # The staging buffer may sit in pinned host memory while the cache is on
    # the GPU; bring it over first so the kernel sees one device.
    if _on_cuda(cache, block_ids):
        from fluidserve.kernels import cache_ops

        cache_ops.scatter_blocks(staging.to(cache.device, non_blocking=True), cache, block_ids)
    else:
        reference.scatter_blocks(staging, cache, block_ids)
