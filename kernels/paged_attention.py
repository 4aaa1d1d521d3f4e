"""Triton paged attention over a flat ragged batch (prefill chunks + decodes).

This module owns the GPU attention kernel and its split-K merge. Semantics are
``reference.paged_attention``'s (cache layout, slots, causal-with-prefix,
sliding window); the work list comes from ``packing.plan_attention``.

One kernel serves every kind of query. Its grid is ``(num_units, num_kv_heads)``;
each program is persistent and walks the work items the planner packed onto its
unit. An item is a tile of up to ``tokens_per_tile`` queries of one sequence
against a KV range. The tile's rows are (token, query head of this KV head)
pairs, so GQA/MQA groups share every K/V load::

    row r  ->  token q_lo + r // GROUP,  query head kv_head * GROUP + r % GROUP

    keys (positions) ->  kv_lo ............................ kv_hi
    K/V of position k:   block_tables[seq, k // BLOCK_SIZE], offset k % BLOCK_SIZE

Softmax is online (running max ``m``, sum ``l``, accumulator) in fp32 and in
base 2 (the scale is pre-multiplied by log2(e)). An item that covers the whole
causal span normalises and writes the output; a split-K piece writes its
normalised partial and ``lse = m + log2(l)`` and ``_merge_kernel`` combines the
pieces of a row::

    out = sum_i 2^(lse_i - M) * o_i / sum_i 2^(lse_i - M),   M = max_i lse_i

A piece may hold no allowed key for some row (causal: the row's position is
before the piece); its lse is -inf and its weight 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import packing
from .packing import WORK_FIELDS, WorkPlan

LOG2E = 1.4426950408889634
# Rows of a prefill tile (tokens_per_tile * group); 128 keeps the tensor cores
# fed while the fp32 accumulator [128, head_dim] fits in registers.
PREFILL_ROWS = 128
# Keys per inner iteration.
BLOCK_N = 64
# Persistent programs per SM the default plan aims for.
PROGRAMS_PER_SM = 2


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_out_ptr,  # [num_merge_rows, max_splits, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_merge_rows, max_splits, num_q_heads] fp32
    block_tables_ptr,  # [S, max_blocks_per_seq] int32
    work_ptr,  # [num_items, WORK_FIELDS] int32
    unit_offsets_ptr,  # [num_units + 1] int32
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (used only if HAS_WINDOW)
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pm, stride_ps, stride_ph,
    stride_lm, stride_ls,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32)
):
    unit = tl.program_id(0)
    kv_head = tl.program_id(1)
    w_begin = tl.load(unit_offsets_ptr + unit)
    w_end = tl.load(unit_offsets_ptr + unit + 1)

    rows = tl.arange(0, BLOCK_M)
    tok_local = rows // GROUP  # [BLOCK_M] token of the tile
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)

    for w in range(w_begin, w_end):
        item = work_ptr + w * NUM_FIELDS
        seq = tl.load(item + 0)
        q_lo = tl.load(item + 1)
        q_hi = tl.load(item + 2)
        pos0 = tl.load(item + 3)
        kv_lo = tl.load(item + 4)
        kv_hi = tl.load(item + 5)
        merge_row = tl.load(item + 6)
        split = tl.load(item + 7)

        tok = q_lo + tok_local  # [BLOCK_M] flat token index
        row_ok = tok < q_hi
        pos = pos0 + tok_local  # [BLOCK_M] position in the sequence
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        bt_row = block_tables_ptr + seq * stride_bt
        for start in range(kv_lo, kv_hi, BLOCK_N):
            kpos = start + cols  # [BLOCK_N]
            k_ok = kpos < kv_hi
            # Page walk: logical block -> physical block, per key.
            blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            off = kpos % BLOCK_SIZE
            k = tl.load(
                k_cache_ptr + (blk * stride_kb + off * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            )  # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
            allowed = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no allowed key yet keeps m = -inf; shift by 0 instead
            # so that exp2(-inf - -inf) never produces NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(s - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + (blk * stride_vb + off * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                mask=k_ok[:, None],
                other=0.0,
            )  # [BLOCK_N, HEAD_DIM]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        if merge_row < 0:
            tl.store(
                out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
        else:
            lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
            mrow = merge_row + tok_local  # [BLOCK_M]
            tl.store(
                part_out_ptr + mrow[:, None] * stride_pm + split * stride_ps + head[:, None] * stride_ph + d[None, :],
                o,
                mask=row_ok[:, None],
            )
            tl.store(part_lse_ptr + mrow * stride_lm + split * stride_ls + head, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_out_ptr,  # [num_merge_rows, max_splits, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_merge_rows, max_splits, num_q_heads] fp32
    merge_tokens_ptr,  # [num_merge_rows] int32
    merge_num_splits_ptr,  # [num_merge_rows] int32
    stride_ot, stride_oh,
    stride_pm, stride_ps, stride_ph,
    stride_lm, stride_ls,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,  # max_splits rounded up to a power of two
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(merge_tokens_ptr + row)
    n = tl.load(merge_num_splits_ptr + row)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    sp_ok = sp < n
    lse = tl.load(part_lse_ptr + row * stride_lm + sp * stride_ls + head, mask=sp_ok, other=float("-inf"))
    # The piece holding the row's own position is never empty, so M is finite.
    big = tl.max(lse, 0)
    wgt = tl.exp2(lse - big)  # [SPLITS]
    o = tl.load(
        part_out_ptr + row * stride_pm + sp[:, None] * stride_ps + head * stride_ph + d[None, :],
        mask=sp_ok[:, None],
        other=0.0,
    )  # [SPLITS, HEAD_DIM]
    merged = tl.sum(wgt[:, None] * o, 0) / tl.sum(wgt, 0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty))


def _check_layouts(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("expected query [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]")
    head_dim = query.shape[2]
    if key_cache.shape[3] != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must match the cache and be a power of two >= 16")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError("num_q_heads must be a multiple of num_kv_heads")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError("query and caches must share a dtype")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head_dim")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    plan: WorkPlan,
) -> torch.Tensor:
    """Check the plan against the batch, allocate partials, run both kernels."""
    _check_layouts(query, key_cache, value_cache, block_tables)
    if plan.num_tokens != query.shape[0]:
        raise ValueError(f"plan covers {plan.num_tokens} tokens, query has {query.shape[0]}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(plan.tokens_per_tile * group))
    out = torch.empty_like(query)  # [T, Hq, D]
    if plan.num_items == 0:
        return out
    device = query.device
    # Partials only for split rows; dummies keep the kernel signature fixed.
    splits = max(plan.max_splits, 1)
    part_out = torch.empty(
        (max(plan.num_merge_rows, 1), splits, num_q_heads, head_dim), dtype=torch.float32, device=device
    )
    part_lse = torch.empty((max(plan.num_merge_rows, 1), splits, num_q_heads), dtype=torch.float32, device=device)
    window = plan.sliding_window
    _paged_attention_kernel[(plan.num_units, num_kv_heads)](
        query, key_cache, value_cache, out, part_out, part_lse,
        block_tables, plan.work, plan.unit_offsets,
        scale * LOG2E, window or 0,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        NUM_FIELDS=WORK_FIELDS,
        HAS_WINDOW=window is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if block_m <= 64 else 8,
    )  # fmt: skip
    if plan.num_merge_rows:
        _merge_kernel[(plan.num_merge_rows, num_q_heads)](
            out, part_out, part_lse, plan.merge_tokens, plan.merge_num_splits,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim,
            SPLITS=triton.next_power_of_2(splits),
            num_warps=4,
        )  # fmt: skip
    return out


def default_tokens_per_tile(max_q_len: int, group: int) -> int:
    """One token per tile for a decode-only batch (rows = the GQA group);
    ``PREFILL_ROWS // group`` tokens when any prefill chunk is present."""
    return 1 if max_q_len <= 1 else max(1, PREFILL_ROWS // group)


def default_num_units(device: torch.device, num_kv_heads: int) -> int:
    """Persistent programs per KV head: enough to fill every SM
    ``PROGRAMS_PER_SM`` times over all KV heads."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, math.ceil(sms * PROGRAMS_PER_SM / num_kv_heads))
    return 4


def plan_for(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,
    q_lens: list[int],
    seq_lens: list[int],
    sliding_window: int | None = None,
    *,
    pack: bool = True,
    num_units: int | None = None,
    tokens_per_tile: int | None = None,
    kv_chunk: int | None = None,
) -> WorkPlan:
    """The default plan for a batch, already on the query's device. The engine
    calls this once per step with host-side lengths and passes the plan to
    every layer."""
    group = query.shape[1] // key_cache.shape[2]
    plan = packing.plan_attention(
        q_lens,
        seq_lens,
        num_units=num_units or default_num_units(query.device, key_cache.shape[2]),
        tokens_per_tile=tokens_per_tile or default_tokens_per_tile(max(q_lens, default=0), group),
        sliding_window=sliding_window,
        kv_chunk=kv_chunk,
        pack=pack,
    )
    return plan.to(query.device)


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
    """Causal paged attention of a flat ragged batch (``reference.paged_attention``
    semantics). ``work`` is a plan from ``plan_for``/``packing.plan_attention``
    built from the same lengths and window, on the query's device; without it
    one is built here, which reads the lengths back to the host."""
    if work is None:
        starts = query_start_loc.tolist()
        q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        work = plan_for(query, key_cache, q_lens, seq_lens.tolist(), sliding_window)
    elif work.sliding_window != sliding_window:
        raise ValueError("the plan was built for another sliding window")
    return _launch(query, key_cache, value_cache, block_tables, scale, work)
