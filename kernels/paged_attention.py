"""Triton paged attention over a flat ragged batch (prefill chunks + decodes).

This module owns the GPU attention kernel, its split-K merge, and the small
fixed set of compiled variants they run as. Semantics are
``reference.paged_attention``'s (cache layout, slots, causal-with-prefix,
sliding window); the work list comes from ``packing.plan_attention``.

One kernel serves every kind of query. Its grid is ``(num_units, num_kv_heads)``;
each program is persistent and walks the work items the planner packed onto its
unit. An item is a tile of queries of one sequence against a KV range. The
tile's rows are (token, query head of this KV head) pairs, so GQA/MQA groups
share every K/V load::

    row r  ->  token q_lo + r // GROUP,  query head kv_head * GROUP + r % GROUP

    keys (positions) ->  kv_lo ............................ kv_hi
    K/V of position k:   block_tables[seq, k // BLOCK_SIZE], offset k % BLOCK_SIZE

Two tile heights: a **decode tile** of ``DECODE_ROWS`` (16) rows for items of
at most ``decode_tokens_per_tile`` tokens, and a **prefill tile** of
``TILES.prefill_rows`` (128) rows for the rest. A decode-only step launches a
variant that holds only the decode tile (few registers, several programs per
SM); a mixed step launches one holding both, and each item picks its tile by
its length. The prefill tile may run as two halves of its rows that share
each K/V load (``Tiles.prefill_halves``), one half's scores live at a time.
The grid is sized from the occupancy of the variant launched, read off the
compiled kernel (registers, shared memory, warps). A mixed step whose
decodes are long runs its decode tiles in a launch of their own, of the
decode-only variant, where the fitted cost of the two plans says it pays
(``plan_for``, ``packing.predicted_us``).

head_dim need not be a power of two: tiles are ``HEAD_PAD`` (next power of two)
wide and the extra columns are masked (zeros in Q and K add nothing to a dot,
and padded output columns are never stored).

Softmax is online (running max ``m``, sum ``l``, accumulator) in fp32 and in
base 2 (the scale is pre-multiplied by log2(e)). An item that covers the whole
causal span normalises and writes the output; a split-K piece writes its
normalised partial and ``lse = m + log2(l)`` and ``_merge_kernel`` combines the
pieces of a row::

    out = sum_i 2^(lse_i - M) * o_i / sum_i 2^(lse_i - M),   M = max_i lse_i

A piece may hold no allowed key for some row (causal: the row's position is
before the piece); its lse is -inf and its weight 0.

**No recompiles while serving.** Triton compiles one variant per distinct
(constexprs, argument types, integer arguments equal to 1 or divisible by 16,
pointer alignment). Every argument whose value follows the batch (the
block-table row stride, the split-buffer strides, the window) is listed in
``do_not_specialize``; the number of splits is a run-time loop bound of the
merge, not a constexpr. What is left depends on the model alone, so a model
compiles at most two attention variants per sliding window (decode-only and
mixed) and one merge variant. Inside ``recording_variants()``,
``variant_keys`` collects the keys the launchers produce, computed by
Triton's rules from the very arguments launched; on a GPU
``triton_compiled_count`` counts Triton's own compiles.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from fluidserve.kernels import packing
from fluidserve.kernels.cache_dtype import FP8
from fluidserve.kernels.launch import Relaunch, Site, aligned, arg_class, cache_layout, next_power_of_2
from fluidserve.kernels.packing import WORK_FIELDS, WorkPlan

LOG2E = 1.4426950408889634
# Rows of a decode tile: the smallest tile tl.dot takes. A decode item of a
# GQA group of 4 fills 4 of them; a 128-row tile would waste 124.
DECODE_ROWS = 16
# Partials the merge kernel combines per iteration (and whose lse its first
# pass reads per iteration, MERGE_LSE_SPLITS): an iteration waits for its own
# loads, so a row of many pieces (one warp a program puts 132 on a batch-1
# sequence) takes one round trip per chunk.
SPLIT_CHUNK = 32
# Partial values (fp32) the merge inside the attention launch
# (``_merge_pieces``) reads at a time: up to MAX_MERGE_SPLITS pieces of a
# (token, head) row, then as many rows as fit, 32 registers a thread at
# four warps (32 pieces of one row with a 128-wide head). Compiled for sm_90
# (Triton 3.6), all of a chunk's loads are issued before the first is used;
# at 8192 values the capped variant (``Tiles.max_registers`` 168) spills
# inside its key loop, at 4096 it does not. A tile of 8 pieces by 4 rows
# took Triton 3.9 to 229 registers, two programs per SM, where a row at a
# time keeps three under either Triton. Its first pass, which reads only
# the lse, takes MERGE_LSE_SPLITS pieces at a time.
MERGE_TILE = 4096
MAX_MERGE_SPLITS = 32
MERGE_LSE_SPLITS = 64
# Warps of a merge kernel program (one (row, head) pair).
MERGE_WARPS = 4
# Widest head the tiles hold in registers.
MAX_HEAD_DIM = 256
# Persistent programs per SM assumed where the compiled kernel cannot be read
# (the interpreter): decode-only and mixed variants.
FALLBACK_PROGRAMS_PER_SM = {False: 4, True: 1}
# Units per KV head off CUDA: enough for packing and split-K to have work to
# spread, few enough for the interpreter.
INTERPRETER_UNITS = 4


@dataclass(frozen=True)
class Tiles:
    """The launch shape a tuning sweep varies (``benchmarks/attention_tuning.py``);
    every field changes the compiled variant, none the result beyond
    summation order."""

    # Rows of a prefill tile (tokens_per_tile * group); 128 keeps the tensor
    # cores fed while the fp32 accumulator [128, head_dim] fits in registers.
    prefill_rows: int = 128
    # Keys per inner iteration.
    block_n: int = 64
    # Keys per inner iteration of the 128-row prefill tile; None: block_n.
    # Compiled for sm_90 (Triton 3.6, four warps, bf16, 128-wide head) the
    # prefill tile's key loops at 64 keys spill 63 registers and load them
    # back every iteration (131 local-memory instructions a thread beside 24
    # tensor-core ones); at 32 keys they spill none
    # (kernels_compile_sm90-triton3.6.md, "spill instructions per key-loop
    # iteration"). 32 keys also rescale the accumulator twice as often, so
    # kernel_bench.py times both on a GPU before either becomes the default.
    prefill_block_n: int | None = None
    # Warps of a variant whose widest tile has more than 64 rows, and of one
    # with none wider. Four for the 128-row prefill tile too: on an H100 it
    # runs prefill twice as fast as eight (attention_tuning_<device>.md),
    # though four spill part of the tile (784 stack bytes for sm_90 with a
    # 128-wide head, kernels_compile_sm90.md) where eight hold it in 252
    # registers, at one program per SM instead of two.
    wide_warps: int = 4
    narrow_warps: int = 4
    # Software-pipeline depth of the key loop; None: Triton's default.
    num_stages: int | None = None
    # Pipeline depth of the decode-only variant; None: ``num_stages``. Its
    # key loop reads K and V through the block table (an index load, then
    # the gather it addresses), and Triton's pipeliner spends two stages on
    # that chain: compiled for sm_90 (Triton 3.6) at its default depth of 3,
    # or 4, the loop holds one K/V buffer and waits for every copy at the top
    # of each iteration, so no load overlaps the arithmetic and one
    # program's reads are one tile at a time; at 5 it holds two and keeps
    # the next tile in flight (kernels_compile_sm90-triton3.6.md, "tile
    # buffers"), for 72 KiB of shared memory against 39. The batch-1 long
    # decode, whose 16k keys take 8 iterations a program, is where the
    # latency it hides should show; attention_tuning.py times it.
    decode_num_stages: int | None = None
    # Register cap per thread of the decode-only variant (ptxas maxnreg);
    # None: the compiler's choice. Triton 3.6, on the GPU machines, builds
    # it (bf16, 128-wide head, group 4) in 160 registers, three programs per
    # SM, but at five stages with the fused merge in 214, two; capped at 168
    # that one holds three without spilling in its key loop
    # (kernels_compile_sm90-triton3.6.md). attention_tuning.py times both.
    max_registers: int | None = None
    # The same for the mixed variant (the one with prefill tiles). Eight
    # warps hold the 128-row prefill tile at one program per SM (0.44x
    # flash SDPA at 8k on the H200 with the tile whole,
    # attention_tuning_nvidia_h200.md); capped at 128 registers two fit, at
    # the cost of spills in the prefill key loops (their counts per
    # iteration, tile whole and in halves: kernels_compile_sm90-triton3.6.md).
    # attention_tuning.py times them.
    mixed_max_registers: int | None = None
    # Launches of the decode-only variant (a decode-only step's, and a
    # two-launch mixed step's decode launch) merge their split-K pieces
    # inside the attention kernel: each piece counts itself done on an
    # atomic per tile, and the tile's last piece combines them
    # (``_merge_pieces``) while they are still in L2; a row of one piece (a
    # graph plan makes every row a merge row) writes its output directly.
    # It drops the merge launch: one launch a layer fewer for an eager step
    # with splits, and one launch plus its cold reads off the ~14 us a layer
    # that a batch-1 decode spends in a graph beyond moving its KV
    # (kernels_nvidia_h200.md: 0.014 ms at 512 keys). Not the mixed variant:
    # already at 255 registers for sm_90, the merge code spills more inside
    # its prefill key loop (kernels_compile_sm90.md). kernel_bench.py times it
    # against the merge kernel on a GPU before it becomes the default.
    fused_merge: bool = False
    # 2: the prefill tile runs as two halves of its rows that share each K
    # and V load, one half's scores and probabilities live at a time
    # (``_attend_item``'s ``HALVES``). With four warps the 128-row tile's
    # accumulator takes 128 registers a thread and its 128 x 64 scores 64
    # more. Compiled for sm_90 by Triton 3.6 (bf16, 128-wide head), one
    # tile's prefill key loops spill 135 and 101 local-memory instructions
    # an iteration, halves' 3 and 21, at the same 24 tensor-core
    # instructions and two programs per SM (Triton 3.9: 66 and 68, 17 and
    # 45; kernels_compile_sm90*.md). Halves keep the tile's K/V reuse, and
    # so its L2 traffic. On an H200 (bf16, Llama-3-8B heads) halves ran
    # prefill 1.27-1.34x faster than one tile from 1k to 8k tokens (1.16x
    # flash SDPA at 8k, against one tile's 0.86x) and a packed mixed step
    # 1.27x faster (kernels_nvidia_h200.md); kernel_bench.py still times
    # one tile beside them.
    prefill_halves: int = 2
    # sm_90: each program of the attention and merge launches lets the next
    # launch start as it begins (``griddepcontrol.launch_dependents``). It
    # acts only where that launch is a programmatic dependent: the batch-1
    # o projection's GEMV with kernels/gemv.py's dependent launches on,
    # whose programs then take the SMs a short attention leaves idle (eight
    # programs at batch 1 with short contexts) to load their weights while
    # it runs. The dependent waits for the attention to finish before it
    # reads its output. Off until a GPU times it (kernel_bench.py
    # --batch1-decode, mode graphs-async-pdl-l2-attention).
    launch_dependents: bool = False

    @property
    def prefill_step(self) -> int:
        """Keys per inner iteration of the prefill tile, as launched."""
        return self.prefill_block_n or self.block_n


TILES = Tiles()


@contextmanager
def tiles(**changes: int | None) -> Iterator[Tiles]:
    """Launch with ``changes`` to the tiles inside the block (a sweep)."""
    global TILES
    before = TILES
    TILES = dataclasses.replace(before, **changes)
    try:
        yield TILES
    finally:
        TILES = before

# Arguments whose value follows the batch. Triton would compile a new variant
# whenever one of them happens to be 1 or a multiple of 16 (a one-block table,
# a split count that changes the partial buffer's stride).
_ATTENTION_DYNAMIC = ("window", "stride_bt", "stride_pmu", "stride_lmu")
_MERGE_DYNAMIC = ("stride_pmu", "stride_lmu")
# Elements the split buffers' rows are padded to (see _split_row_strides).
SPLIT_ROW_ALIGN = tl.constexpr(16)


@triton.jit
def _split_row_strides(stride_pmu, stride_lmu):
    """The split buffers' row strides from their values in units of
    ``SPLIT_ROW_ALIGN`` elements (``split_buffers`` pads the rows to it).
    They follow the batch, so Triton does not specialise them; passed as
    multiples of a constant, they are known multiples of 16: with the other
    strides specialised, a row of partials starts 16-byte aligned, and the
    kernels read and write it 16 bytes an instruction rather than 4 (SASS
    for sm_90: LDG.E.128 and STG.E.128, not LDG.E and STG.E)."""
    return stride_pmu * SPLIT_ROW_ALIGN, stride_lmu * SPLIT_ROW_ALIGN


@triton.jit
def _dim_mask(rows_ok, d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """[R, HEAD_PAD] mask of valid rows and real (unpadded) columns; no
    column term at all when head_dim is a power of two."""
    mask = rows_ok[:, None]
    if HEAD_PAD != HEAD_DIM:
        mask = mask & (d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """``tl.dot``; "widen" multiplies 16-bit operands as fp32, for Triton's
    interpreter, which multiplies bfloat16 bit patterns (triton-lang/triton
    #11584). Products of 16-bit floats are exact in fp32, so this is the
    tensor cores' arithmetic (fp32 accumulation) up to summation order."""
    if DOT_PRECISION == "widen":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _load_kv(
    start, kv_hi, bt_row, k_cache_ptr, v_cache_ptr, kv_head, q,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys [start, start + BLOCK_N) through the page walk: (positions,
    which exist, K and V as [BLOCK_N, HEAD_PAD] tiles in the dtype of the
    queries ``q``). An fp8 cache's tiles are widened here, once for every
    query tile that reads them (kernels/cache_dtype.py); the test is on
    types, at compile time, so any other cache converts nothing."""
    d = tl.arange(0, HEAD_PAD)
    kpos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k_ok = kpos < kv_hi
    # Page walk: logical block -> physical block, per key.
    blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    off = kpos % BLOCK_SIZE
    kv_mask = _dim_mask(k_ok, d, HEAD_DIM, HEAD_PAD)
    k = tl.load(k_cache_ptr + (blk * stride_kb + off * stride_ks + kv_head * stride_kh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + (blk * stride_vb + off * stride_vs + kv_head * stride_vh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    return kpos, k_ok, k, v


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): +-1 where e^2x overflows or vanishes, no NaN.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 log2(e)


@triton.jit
def _attend_keys(q, m_i, l_i, acc, k, v, kpos, k_ok, pos, qk_scale, window, softcap,
                 HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
                 SOFTCAP: tl.constexpr = False):
    """One step of the online softmax: the rows ``q`` against one block of
    keys ``k`` and values ``v``. Unmasked (``MASKED`` False), every row may
    see every key: no causal or window test, and every score is finite, so
    neither is the running max. ``SOFTCAP`` (Gemma 2): each score capped as
    ``cap * tanh(score / cap)``, ``qk_scale`` then being scale / cap and
    ``softcap`` cap * log2(e)."""
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    if SOFTCAP:
        s = softcap * _tanh(s)
    if MASKED:
        allowed = k_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with no allowed key yet keeps m = -inf; shift by 0 instead
        # so that exp2(-inf - -inf) never produces NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _row_indices(q_lo, q_hi, pos0, kv_head, ROW0: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """Rows [ROW0, ROW0 + ROWS) of a tile: (token in the tile, query head,
    flat token as int64, row exists, position in the sequence)."""
    rows = ROW0 + tl.arange(0, ROWS)
    tok_local = rows // GROUP  # token of the tile
    head = kv_head * GROUP + rows % GROUP  # query head
    tok = q_lo + tok_local  # flat token index
    # 64-bit offsets: tokens x row stride passes 2^31 for long fused-QKV batches.
    return tok_local, head, tok.to(tl.int64), tok < q_hi, pos0 + tok_local


@triton.jit
def _load_queries(q_ptr, tok64, head, row_ok, stride_qt, stride_qh, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    d = tl.arange(0, HEAD_PAD)
    return tl.load(q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                   mask=_dim_mask(row_ok, d, HEAD_DIM, HEAD_PAD), other=0.0)


@triton.jit
def _store_rows(
    acc, m_i, l_i, out_ptr, part_out_ptr, part_lse_ptr, tok_local, head, tok64, row_ok, merge_row, split,
    stride_ot, stride_oh,
    stride_pm, stride_ps, stride_ph,
    stride_lm, stride_ls,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Normalise the rows and write them: the output where the item is a
    whole row's keys, else the partial and its lse for the merge."""
    d = tl.arange(0, HEAD_PAD)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    out_mask = _dim_mask(row_ok, d, HEAD_DIM, HEAD_PAD)
    if merge_row < 0:
        tl.store(
            out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        mrow = (merge_row + tok_local).to(tl.int64)
        tl.store(
            part_out_ptr + mrow[:, None] * stride_pm + split * stride_ps + head[:, None] * stride_ph + d[None, :],
            o,
            mask=out_mask,
        )
        tl.store(part_lse_ptr + mrow * stride_lm + split * stride_ls + head, lse, mask=row_ok)


@triton.jit
def _unmasked_end(kv_lo, kv_hi, pos0, BLOCK_N: tl.constexpr):
    """End of the whole key blocks before min(pos0 + 1, kv_hi): allowed to
    every row of a tile whose first position is pos0."""
    return kv_lo + tl.maximum(tl.minimum(pos0 + 1, kv_hi) - kv_lo, 0) // BLOCK_N * BLOCK_N


@triton.jit
def _attend_item(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    bt_row,  # this sequence's block-table row
    q_lo, q_hi, pos0, kv_lo, kv_hi, merge_row, split, kv_head,
    qk_scale, window, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pm, stride_ps, stride_ph,
    stride_lm, stride_ls,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_MASK: tl.constexpr = False,
    HALVES: tl.constexpr = 1,
    SOFTCAP: tl.constexpr = False,
):
    """One work item with a BLOCK_M-row tile: attention of tokens
    [q_lo, q_hi) over keys [kv_lo, kv_hi), output or partial written.

    ``SPLIT_MASK`` (the prefill tile) runs the key blocks every row may see
    (at or before the tile's first position) without the causal test, and
    only the blocks from there on with it: a long prompt's tile tests one
    block in many, not all of them. The scores are the same either way, so
    are the bits.

    ``HALVES`` 2 (the prefill tile, ``Tiles.prefill_halves``) holds the
    tile as two halves of BLOCK_M / 2 rows that share each K/V load, one
    half's scores and probabilities live at a time: each row's arithmetic is
    the same as in one tile, up to the order a GPU sums in."""
    ROWS: tl.constexpr = BLOCK_M // HALVES
    tok0, head0, tok64_0, ok0, pos_0 = _row_indices(q_lo, q_hi, pos0, kv_head, 0, ROWS, GROUP)
    q0 = _load_queries(q_ptr, tok64_0, head0, ok0, stride_qt, stride_qh, HEAD_DIM, HEAD_PAD)  # [ROWS, HEAD_PAD]
    m0 = tl.full([ROWS], float("-inf"), tl.float32)
    l0 = tl.zeros([ROWS], tl.float32)
    acc0 = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    if HALVES == 2:
        tok1, head1, tok64_1, ok1, pos_1 = _row_indices(q_lo, q_hi, pos0, kv_head, ROWS, ROWS, GROUP)
        q1 = _load_queries(q_ptr, tok64_1, head1, ok1, stride_qt, stride_qh, HEAD_DIM, HEAD_PAD)
        m1 = tl.full([ROWS], float("-inf"), tl.float32)
        l1 = tl.zeros([ROWS], tl.float32)
        acc1 = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    masked_lo = kv_lo
    if SPLIT_MASK and not HAS_WINDOW:
        masked_lo = _unmasked_end(kv_lo, kv_hi, pos0, BLOCK_N)
        for start in range(kv_lo, masked_lo, BLOCK_N):
            kpos, k_ok, k, v = _load_kv(start, kv_hi, bt_row, k_cache_ptr, v_cache_ptr, kv_head, q0,
                                        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                        BLOCK_SIZE, HEAD_DIM, HEAD_PAD, BLOCK_N)
            m0, l0, acc0 = _attend_keys(q0, m0, l0, acc0, k, v, kpos, k_ok, pos_0, qk_scale, window, softcap,
                                        HAS_WINDOW, DOT_PRECISION, False, SOFTCAP)
            if HALVES == 2:
                m1, l1, acc1 = _attend_keys(q1, m1, l1, acc1, k, v, kpos, k_ok, pos_1, qk_scale, window, softcap,
                                            HAS_WINDOW, DOT_PRECISION, False, SOFTCAP)
    for start in range(masked_lo, kv_hi, BLOCK_N):
        kpos, k_ok, k, v = _load_kv(start, kv_hi, bt_row, k_cache_ptr, v_cache_ptr, kv_head, q0,
                                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                    BLOCK_SIZE, HEAD_DIM, HEAD_PAD, BLOCK_N)
        m0, l0, acc0 = _attend_keys(q0, m0, l0, acc0, k, v, kpos, k_ok, pos_0, qk_scale, window, softcap,
                                    HAS_WINDOW, DOT_PRECISION, True, SOFTCAP)
        if HALVES == 2:
            m1, l1, acc1 = _attend_keys(q1, m1, l1, acc1, k, v, kpos, k_ok, pos_1, qk_scale, window, softcap,
                                        HAS_WINDOW, DOT_PRECISION, True, SOFTCAP)
    _store_rows(acc0, m0, l0, out_ptr, part_out_ptr, part_lse_ptr, tok0, head0, tok64_0, ok0, merge_row, split,
                stride_ot, stride_oh, stride_pm, stride_ps, stride_ph, stride_lm, stride_ls, HEAD_DIM, HEAD_PAD)
    if HALVES == 2:
        _store_rows(acc1, m1, l1, out_ptr, part_out_ptr, part_lse_ptr, tok1, head1, tok64_1, ok1, merge_row, split,
                    stride_ot, stride_oh, stride_pm, stride_ps, stride_ph, stride_lm, stride_ls, HEAD_DIM, HEAD_PAD)


@triton.jit
def _merge_pieces(
    out_ptr, part_out_ptr, part_lse_ptr, merge_count_ptr,
    n,  # the tile's pieces (its merge row's split count, loaded by the caller)
    q_lo, q_hi, merge_row, kv_head,
    stride_ot, stride_oh,
    stride_pm, stride_ps, stride_ph,
    stride_lm, stride_ls,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,
    MERGE_LSE_SPLITS: tl.constexpr,
):
    """Count this piece of a split tile done; the tile's last piece merges
    all of them into the output (``_merge_kernel``'s arithmetic) and rearms
    the counter for the next launch. No program waits on another: the merge
    is done by whichever piece finishes last, so no schedule of the grid
    can stall.

    The partials are read MERGE_ROWS (token, head) rows by MERGE_SPLITS
    pieces at a time (their lse MERGE_LSE_SPLITS at a time). Compiled for
    sm_90, an iteration waits for its own loads: a loop over single pieces
    waits for an L2 round trip per piece, twice over (the max, then the
    sums), 40 for a batch-1 decode split 32 ways, on the step's critical
    path; a row's 32 pieces at a time, 2 a (token, head) row, 8 for a GQA
    group of 4."""
    # Every thread's partial stores come before the count (one thread does
    # the atomic): the release then publishes them to the last piece.
    tl.debug_barrier()
    count = merge_count_ptr + merge_row.to(tl.int64) * tl.num_programs(1) + kv_head
    if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == n - 1:
        tl.store(count, 0)
        d = tl.arange(0, HEAD_PAD)
        chunk = tl.arange(0, MERGE_SPLITS)
        lse_chunk = tl.arange(0, MERGE_LSE_SPLITS)
        for r0 in range(0, (q_hi - q_lo) * GROUP, MERGE_ROWS):
            rows = r0 + tl.arange(0, MERGE_ROWS)
            tok_local = rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = tok_local < q_hi - q_lo
            mrow = (merge_row + tok_local).to(tl.int64)
            lse_row = part_lse_ptr + mrow * stride_lm + head  # [MERGE_ROWS]
            out_row = part_out_ptr + mrow * stride_pm + head * stride_ph  # [MERGE_ROWS]
            # Other SMs wrote the partials: read them from L2 (".cg"), never
            # from this SM's L1. Row maxima and sums are taken after the
            # loops, as _merge_kernel takes them (a row reduction carried by
            # a loop and read twice after it fails Triton 3.6's
            # thread-locality pass for sm_90).
            run_max = tl.full([MERGE_ROWS, MERGE_LSE_SPLITS], float("-inf"), tl.float32)
            for s0 in range(0, n, MERGE_LSE_SPLITS):
                sp = s0 + lse_chunk
                ok = row_ok[:, None] & (sp < n)[None, :]  # [MERGE_ROWS, MERGE_LSE_SPLITS]
                run_max = tl.maximum(run_max, tl.load(lse_row[:, None] + sp[None, :] * stride_ls, mask=ok,
                                                      other=float("-inf"), cache_modifier=".cg"))
            big = tl.max(run_max, 1)
            # A masked row has no finite lse; shift it by 0, not -inf.
            big = tl.where(big == float("-inf"), 0.0, big)
            num = tl.zeros([MERGE_ROWS, MERGE_SPLITS, HEAD_PAD], tl.float32)
            den = tl.zeros([MERGE_ROWS, MERGE_SPLITS], tl.float32)
            for s0 in range(0, n, MERGE_SPLITS):
                sp = s0 + chunk
                ok = row_ok[:, None] & (sp < n)[None, :]
                wgt = tl.exp2(tl.load(lse_row[:, None] + sp[None, :] * stride_ls, mask=ok, other=float("-inf"),
                                      cache_modifier=".cg") - big[:, None])  # [MERGE_ROWS, MERGE_SPLITS]
                o_ok = ok[:, :, None]
                if HEAD_PAD != HEAD_DIM:
                    o_ok = o_ok & (d < HEAD_DIM)[None, None, :]
                o = tl.load(out_row[:, None, None] + sp[None, :, None] * stride_ps + d[None, None, :], mask=o_ok,
                            other=0.0, cache_modifier=".cg")  # [MERGE_ROWS, MERGE_SPLITS, HEAD_PAD]
                num += wgt[:, :, None] * o
                den += wgt
            total = tl.sum(den, 1)
            merged = tl.sum(num, 1) / tl.where(total > 0.0, total, 1.0)[:, None]
            tok64 = (q_lo + tok_local).to(tl.int64)
            tl.store(out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     merged.to(out_ptr.dtype.element_ty), mask=_dim_mask(row_ok, d, HEAD_DIM, HEAD_PAD))


@triton.jit(do_not_specialize=_ATTENTION_DYNAMIC)
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
    merge_count_ptr,  # [num_merge_rows, num_kv_heads] int32, zeros between launches (FUSED_MERGE)
    merge_num_splits_ptr,  # [num_merge_rows] int32 (FUSED_MERGE)
    qk_scale,  # softmax scale * log2(e); scale / cap with SOFTCAP
    window,  # sliding window (used only if HAS_WINDOW)
    softcap,  # the scores' cap * log2(e) (used only if SOFTCAP)
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pmu, stride_ps, stride_ph,  # stride_pmu, stride_lmu: see _split_row_strides
    stride_lmu, stride_ls,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    DECODE_TOKENS: tl.constexpr,  # items of at most this many tokens use the decode tile
    DECODE_M: tl.constexpr,
    PREFILL_M: tl.constexpr,
    HAS_PREFILL: tl.constexpr,  # compile the prefill tile (mixed steps) or not (decode-only)
    BLOCK_N: tl.constexpr,
    PREFILL_BLOCK_N: tl.constexpr,  # keys per iteration of the prefill tile
    PREFILL_HALVES: tl.constexpr,  # 2: the prefill tile runs as two halves of its rows (_attend_item)
    NUM_FIELDS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32); "widen": see _dot
    FUSED_MERGE: tl.constexpr,  # split pieces merge here (_merge_pieces), not in _merge_kernel
    MERGE_ROWS: tl.constexpr,  # (token, head) rows _merge_pieces merges at a time
    MERGE_SPLITS: tl.constexpr,  # and pieces of each it reads at a time
    MERGE_LSE_SPLITS: tl.constexpr,  # pieces of each whose lse it reads at a time
    SOFTCAP: tl.constexpr,  # scores soft-capped (Gemma 2's attn_logit_softcapping)
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # Tiles.launch_dependents (sm_90)
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    unit = tl.program_id(0)
    kv_head = tl.program_id(1)
    stride_pm, stride_lm = _split_row_strides(stride_pmu, stride_lmu)
    w_begin = tl.load(unit_offsets_ptr + unit)
    w_end = tl.load(unit_offsets_ptr + unit + 1)
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
        bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        if FUSED_MERGE:
            # A merge row of one piece (a graph plan merges every row) is
            # its own output: written directly, the same bits as merged
            # with weight 1, without the partial, the count and the read back.
            pieces = 1
            if merge_row >= 0:
                pieces = tl.load(merge_num_splits_ptr + merge_row)
                if pieces == 1:
                    merge_row = -1
        # The decode-only variant never compiles the prefill tile (``wide``
        # stays a constexpr False there), so its register budget (and so its
        # occupancy) is the decode tile's.
        wide = False
        if HAS_PREFILL:
            wide = q_hi - q_lo > DECODE_TOKENS
        if wide:
            _attend_item(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_row,
                q_lo, q_hi, pos0, kv_lo, kv_hi, merge_row, split, kv_head, qk_scale, window, softcap,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_ot, stride_oh, stride_pm, stride_ps, stride_ph, stride_lm, stride_ls,
                BLOCK_SIZE, GROUP, HEAD_DIM, HEAD_PAD, PREFILL_M, PREFILL_BLOCK_N, HAS_WINDOW, DOT_PRECISION,
                True, PREFILL_HALVES, SOFTCAP,
            )  # fmt: skip
        else:
            _attend_item(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, bt_row,
                q_lo, q_hi, pos0, kv_lo, kv_hi, merge_row, split, kv_head, qk_scale, window, softcap,
                stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_ot, stride_oh, stride_pm, stride_ps, stride_ph, stride_lm, stride_ls,
                BLOCK_SIZE, GROUP, HEAD_DIM, HEAD_PAD, DECODE_M, BLOCK_N, HAS_WINDOW, DOT_PRECISION,
                False, 1, SOFTCAP,
            )  # fmt: skip
        if FUSED_MERGE:
            if merge_row >= 0:
                _merge_pieces(
                    out_ptr, part_out_ptr, part_lse_ptr, merge_count_ptr, pieces,
                    q_lo, q_hi, merge_row, kv_head, stride_ot, stride_oh, stride_pm, stride_ps, stride_ph,
                    stride_lm, stride_ls, GROUP, HEAD_DIM, HEAD_PAD, MERGE_ROWS, MERGE_SPLITS,
                    MERGE_LSE_SPLITS,
                )  # fmt: skip


_PAGED_ATTENTION = Relaunch(_paged_attention_kernel)


@triton.jit(do_not_specialize=_MERGE_DYNAMIC)
def _merge_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    part_out_ptr,  # [num_merge_rows, max_splits, num_q_heads, head_dim] fp32
    part_lse_ptr,  # [num_merge_rows, max_splits, num_q_heads] fp32
    merge_tokens_ptr,  # [num_merge_rows] int32
    merge_num_splits_ptr,  # [num_merge_rows] int32
    stride_ot, stride_oh,
    stride_pmu, stride_ps, stride_ph,  # stride_pmu, stride_lmu: see _split_row_strides
    stride_lmu, stride_ls,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    LSE_CHUNK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # Tiles.launch_dependents (sm_90)
):
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    stride_pm, stride_lm = _split_row_strides(stride_pmu, stride_lmu)
    tok = tl.load(merge_tokens_ptr + row).to(tl.int64)
    n = tl.load(merge_num_splits_ptr + row)
    d = tl.arange(0, HEAD_PAD)
    chunk = tl.arange(0, SPLIT_CHUNK)
    lse_row = part_lse_ptr + row * stride_lm + head
    out_row = part_out_ptr + row * stride_pm + head * stride_ph
    # The split count is a loop bound, not a constexpr: one compiled merge
    # serves every number of splits. Two passes: the max, then the sums.
    lse_chunk = tl.arange(0, LSE_CHUNK)
    run_max = tl.full([LSE_CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, n, LSE_CHUNK):
        sp = s0 + lse_chunk
        run_max = tl.maximum(run_max, tl.load(lse_row + sp * stride_ls, mask=sp < n, other=float("-inf")))
    # The piece holding a row's own position is never empty, so M is finite;
    # but a graph's padding row has only an empty piece: shift by 0, and its
    # weights are 0 rather than NaN.
    big = tl.max(run_max, 0)
    big = tl.where(big == float("-inf"), 0.0, big)
    # Sums kept per piece of the chunk and reduced after the loop: with
    # 16-byte loads a warp holds whole rows of a piece, so a sum over the
    # pieces inside the loop would cross warps (a barrier an iteration).
    num = tl.zeros([SPLIT_CHUNK, HEAD_PAD], tl.float32)
    den = tl.zeros([SPLIT_CHUNK], tl.float32)
    for s0 in range(0, n, SPLIT_CHUNK):
        sp = s0 + chunk
        sp_ok = sp < n
        wgt = tl.exp2(tl.load(lse_row + sp * stride_ls, mask=sp_ok, other=float("-inf")) - big)  # [SPLIT_CHUNK]
        o = tl.load(
            out_row + sp[:, None] * stride_ps + d[None, :],
            mask=_dim_mask(sp_ok, d, HEAD_DIM, HEAD_PAD),
            other=0.0,
        )  # [SPLIT_CHUNK, HEAD_PAD]
        num += wgt[:, None] * o
        den += wgt
    total = tl.sum(den, 0)
    # No splits (the start-up warm-up's scratch row) gives 0, not 0/0.
    merged = tl.sum(num, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_MERGE = Relaunch(_merge_kernel)


# --------------------------------------------------------------------------
# Variants: what a launch compiles, and how many programs of it fit an SM.


def specialization_key(args: dict[str, object], dynamic: tuple[str, ...]) -> tuple:
    """The part of Triton's compile-cache key that the arguments decide:
    constexprs (bools, None, strings) by value, the rest by their class
    (launch.arg_class: tensors by dtype and 16-byte alignment, integers by
    width and, unless listed in ``dynamic``, i.e. ``do_not_specialize``, by
    being 1 or a multiple of 16, floats as fp32)."""
    key = []
    for name, v in args.items():
        if isinstance(v, bool) or v is None or isinstance(v, str):
            key.append((name, v))
            continue
        c = arg_class(v, specialize=name not in dynamic)
        if c is None:
            raise TypeError(f"argument {name}: unexpected {type(v).__name__}")
        key.append((name, *c))
    return tuple(key)


@dataclass
class _Variants:
    """Process-wide record of the launchers' specialisation keys (while
    ``recording``), and of the occupancy of each compiled attention variant
    (Triton's own compile cache is process-wide too)."""

    keys: dict[str, set[tuple]]
    programs_per_sm: dict[tuple, int]
    recording: bool = False


_VARIANTS = _Variants(keys={"attention": set(), "merge": set()}, programs_per_sm={})


@contextmanager
def recording_variants() -> Iterator[None]:
    """Record the specialisation key of every launch inside the block (tests,
    benchmarks). Off while serving: computing a key costs about as much host
    time as the launch itself; there ``triton_compiled_count`` counts the
    real compiles for free."""
    before, _VARIANTS.recording = _VARIANTS.recording, True
    try:
        yield
    finally:
        _VARIANTS.recording = before


def variant_keys() -> dict[str, frozenset[tuple]]:
    """Distinct specialisation keys recorded so far, per kernel."""
    return {name: frozenset(keys) for name, keys in _VARIANTS.keys.items()}


def num_variants() -> int:
    return sum(len(keys) for keys in _VARIANTS.keys.values())


def occupancies() -> list[dict[str, object]]:
    """Programs per SM of each attention variant compiled on a GPU so far."""
    rows = []
    for (constexprs, _options, dtype, device), per_sm in _VARIANTS.programs_per_sm.items():
        c = dict(constexprs)
        rows.append(dict(device=device, dtype=dtype, head_dim=c["HEAD_DIM"], group=c["GROUP"],
                         has_prefill=c["HAS_PREFILL"], has_window=c["HAS_WINDOW"], programs_per_sm=per_sm))  # fmt: skip
    return rows


def triton_compiled_count() -> int | None:
    """Kernels Triton itself holds compiled for the attention and merge
    kernels; None where this Triton keeps its cache elsewhere (or interprets)."""
    total = 0
    for fn in (_paged_attention_kernel, _merge_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(entry[0]) for entry in caches.values())
    return total


def _record(kernel: str, args: dict[str, object], constexprs: dict[str, object], dynamic: tuple[str, ...],
            num_warps: int) -> None:  # fmt: skip
    # Arguments and constexprs merged only while recording: every launch of a step calls this.
    if _VARIANTS.recording:
        key = specialization_key({**args, **constexprs}, dynamic)
        _VARIANTS.keys[kernel].add((*key, ("num_warps", num_warps)))


@dataclass(frozen=True)
class SmLimits:
    """What one SM holds (an H100 SXM by default)."""

    registers: int = 65536
    threads: int = 2048
    shared_bytes: int = 228 * 1024
    blocks: int = 32

    @classmethod
    def of(cls, device: torch.device) -> SmLimits:
        props = torch.cuda.get_device_properties(device)
        return cls(
            registers=getattr(props, "regs_per_multiprocessor", cls.registers),
            threads=getattr(props, "max_threads_per_multi_processor", cls.threads),
            shared_bytes=getattr(props, "shared_memory_per_multiprocessor", cls.shared_bytes),
        )


def occupancy(n_regs: int, num_warps: int, shared_bytes: int, limits: SmLimits) -> int:
    """Resident programs per SM of a kernel: the tightest of the register
    file, shared memory, thread and block limits (at least 1)."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # allocated per warp in chunks of 256
    by_regs = limits.registers // (regs_per_warp * num_warps) if n_regs else limits.blocks
    by_threads = limits.threads // (32 * num_warps)
    by_smem = limits.shared_bytes // (shared_bytes + 1024)  # 1 KiB per block reserved by the system
    return max(1, min(by_regs, by_threads, by_smem, limits.blocks))


def _programs_per_sm(compiled, device: torch.device) -> int | None:
    """Occupancy of a compiled kernel on ``device``; None where the compiled
    kernel says nothing (the interpreter)."""
    n_regs = getattr(compiled, "n_regs", None)
    meta = getattr(compiled, "metadata", None)
    if not n_regs or meta is None:
        return None
    return occupancy(n_regs, meta.num_warps, meta.shared, SmLimits.of(device))


# --------------------------------------------------------------------------
# Host side: checks, arguments, launches.


def head_pad(head_dim: int) -> int:
    """Tile width of a head: the next power of two, at least 16 (tl.dot's K)."""
    return max(16, next_power_of_2(head_dim))


def decode_tokens_per_tile(group: int) -> int:
    """Tokens of a decode tile: a ``DECODE_ROWS``-row tile holds this many
    tokens' whole GQA groups (at least one token, however wide the group)."""
    return max(1, DECODE_ROWS // group)


def default_tokens_per_tile(group: int) -> int:
    """Tokens of a prefill tile (``TILES.prefill_rows`` rows)."""
    return max(1, TILES.prefill_rows // group)


def _tile_rows(tokens: int, group: int) -> int:
    return max(16, next_power_of_2(tokens * group))


def _check_layouts(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    if query.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"expected query [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]; got query "
            f"{tuple(query.shape)} and key_cache {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    head_dim = query.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is outside [1, {MAX_HEAD_DIM}]")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"num_q_heads {query.shape[1]} is not a multiple of num_kv_heads {key_cache.shape[2]}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in (query.dtype, *FP8):
        dtypes = f"query ({query.dtype}) and caches ({key_cache.dtype}, {value_cache.dtype})"
        raise ValueError(f"{dtypes} must share a dtype, or the caches an fp8 one")
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous head_dim")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a 2-D int32 tensor with contiguous rows")


def _check_plan(plan: WorkPlan, query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """The plan, the block tables and the cache must describe the same batch:
    the kernel trusts them and a mismatch reads another sequence's blocks."""
    if plan.num_tokens != query.shape[0]:
        raise ValueError(f"plan covers {plan.num_tokens} tokens, query has {query.shape[0]}")
    if plan.work.device != query.device:
        raise ValueError(f"plan is on {plan.work.device}, query on {query.device}: build it with plan_for")
    if plan.num_seqs > block_tables.shape[0]:
        raise ValueError(f"plan covers {plan.num_seqs} sequences, block_tables has {block_tables.shape[0]} rows")
    block_size = key_cache.shape[1]
    needed = -(-plan.max_seq_len // block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(
            f"a sequence of {plan.max_seq_len} tokens needs {needed} blocks of {block_size}, "
            f"block_tables rows hold {block_tables.shape[1]}"
        )
    if block_tables.device != query.device:
        raise ValueError(f"block_tables is on {block_tables.device}, query on {query.device}")


# Triton's interpreter (TRITON_INTERPRET=1, chosen when Triton is imported)
# runs the kernels: CPU tensors, the kernel tests and the engine's CPU lane.
INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"
    return "widen" if INTERPRETED and dtype == torch.bfloat16 else "tf32"


def _constexprs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    *,
    decode_tokens: int,
    tokens_per_tile: int,
    has_prefill: bool,
    has_window: bool,
) -> dict[str, object]:
    """The compile-time values of one attention variant."""
    group = query.shape[1] // key_cache.shape[2]
    head_dim = query.shape[2]
    pad = head_pad(head_dim)
    decode_m = _tile_rows(decode_tokens, group)
    prefill_m = _tile_rows(tokens_per_tile, group)
    # Every variant carries the merge tile: a two-launch step's decode
    # launch takes the mixed launch's constexprs and merges with them. It
    # takes a row's pieces first, then as many rows as the tile has room for.
    merge_splits = max(1, min(MAX_MERGE_SPLITS, MERGE_TILE // pad))
    merge_rows = max(1, min(decode_m, next_power_of_2(group), MERGE_TILE // (merge_splits * pad)))
    return dict(
        BLOCK_SIZE=key_cache.shape[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=pad,
        DECODE_TOKENS=decode_tokens,
        DECODE_M=decode_m,
        PREFILL_M=prefill_m,
        HAS_PREFILL=has_prefill,
        BLOCK_N=TILES.block_n,
        PREFILL_BLOCK_N=TILES.prefill_step,
        # Halves of at least 16 rows, tl.dot's smallest; 1 in the decode-only
        # variant, which has no prefill tile.
        PREFILL_HALVES=TILES.prefill_halves if has_prefill and prefill_m >= 32 else 1,
        NUM_FIELDS=WORK_FIELDS,
        HAS_WINDOW=has_window,
        DOT_PRECISION=_dot_precision(query.dtype),
        FUSED_MERGE=TILES.fused_merge and not has_prefill,
        MERGE_ROWS=merge_rows,
        MERGE_SPLITS=merge_splits,
        MERGE_LSE_SPLITS=MERGE_LSE_SPLITS,
        # The interpreter has no grid dependency control.
        LAUNCH_DEPENDENTS=TILES.launch_dependents and not INTERPRETED,
        SOFTCAP=False,  # set by _prepare for a capped model's launch
    )


def _plan_constexprs(query: torch.Tensor, key_cache: torch.Tensor, plan: WorkPlan) -> dict[str, object]:
    return _constexprs(
        query, key_cache, decode_tokens=plan.decode_tokens_per_tile, tokens_per_tile=plan.tokens_per_tile,
        has_prefill=plan.has_prefill_tiles, has_window=plan.sliding_window is not None,
    )  # fmt: skip


def _num_warps(constexprs: dict[str, object]) -> int:
    widest = constexprs["PREFILL_M"] if constexprs["HAS_PREFILL"] else constexprs["DECODE_M"]
    if widest <= 64:
        return TILES.narrow_warps
    # The fp32 accumulator is widest x HEAD_PAD: past 128 x 128 (a 256-wide
    # head) four warps would hold 256 values each, so eight at least.
    return TILES.wide_warps if widest * constexprs["HEAD_PAD"] <= 128 * 128 else max(TILES.wide_warps, 8)


def _launch_options(constexprs: dict[str, object]) -> dict[str, int]:
    """The launch options of a variant beside its constexprs: warps, and the
    pipeline depth and register cap where a sweep sets them."""
    options = {"num_warps": _num_warps(constexprs)}
    stages = TILES.num_stages if constexprs["HAS_PREFILL"] else TILES.decode_num_stages or TILES.num_stages
    if stages is not None:
        options["num_stages"] = stages
    cap = TILES.mixed_max_registers if constexprs["HAS_PREFILL"] else TILES.max_registers
    if cap is not None:
        options["maxnreg"] = cap
    return options


@dataclass
class _Launch:
    """Everything one attention launch passes, named as the kernel names it."""

    args: dict[str, object]
    constexprs: dict[str, object]
    options: dict[str, int]  # _launch_options
    out: torch.Tensor | None  # None in a layout's prototype (``_prepare``)
    part_out: torch.Tensor
    part_lse: torch.Tensor
    occupancy_key: tuple  # _occupancy_key of the variant, worked out once per layout

    @property
    def num_warps(self) -> int:
        return self.options["num_warps"]

    def with_tensors(self, args: dict[str, object], out: torch.Tensor) -> _Launch:
        """This launch with a layer's own arguments and output (a layout's
        prototype made a layer's launch: the constructor, since
        ``dataclasses.replace`` costs a few us of host time per layer)."""
        return _Launch(args, self.constexprs, self.options, out, self.part_out, self.part_lse, self.occupancy_key)


def _partials(
    plan: WorkPlan, num_q_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's split-K buffers, once per step rather than once per layer."""
    key = (num_q_heads, head_dim, str(device))
    if key not in plan.scratch:
        # Partials only for split rows; dummies keep the kernel signature fixed.
        plan.scratch[key] = split_buffers(max(plan.num_merge_rows, 1), max(plan.max_splits, 1), num_q_heads,
                                          head_dim, device=device)
    return plan.scratch[key]


def _split_rows(splits: int, num_q_heads: int, head_dim: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of a merge row of the partials and of their lse."""
    return (splits, num_q_heads, head_dim), (splits, num_q_heads)


def _row_stride(row_shape: tuple[int, ...]) -> int:
    """Elements from one merge row to the next: the row, padded to ``SPLIT_ROW_ALIGN``."""
    align = SPLIT_ROW_ALIGN.value
    return -(-math.prod(row_shape) // align) * align


def split_buffer_sizes(merge_rows: int, splits: int, num_q_heads: int, head_dim: int) -> tuple[int, int]:
    """Elements of the flat storage ``split_buffers`` views: partials, lse."""
    out, lse = (merge_rows * _row_stride(shape) for shape in _split_rows(splits, num_q_heads, head_dim))
    return out, lse


def split_buffers(
    merge_rows: int, splits: int, num_q_heads: int, head_dim: int, *, device: torch.device | None = None,
    storage: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K buffers, fp32: partials [merge_rows, splits, Hq, D] and
    their lse [merge_rows, splits, Hq], each merge row starting at a multiple
    of ``SPLIT_ROW_ALIGN`` elements, as the kernels assume. New on ``device``,
    or views of flat ``storage`` (as long as ``split_buffer_sizes`` at least)
    that plans of several shapes share."""
    shapes = _split_rows(splits, num_q_heads, head_dim)
    if storage is None:
        storage = tuple(torch.empty(merge_rows * _row_stride(shape), dtype=torch.float32, device=device)
                        for shape in shapes)
    views = []
    for flat, shape in zip(storage, shapes, strict=True):
        n = merge_rows * _row_stride(shape)
        if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() < n:
            raise ValueError(f"split-K storage needs {n} fp32 elements in one dimension, got {tuple(flat.shape)} "
                             f"{flat.dtype}")
        inner = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous within a row
        views.append(flat.as_strided((merge_rows, *shape), (_row_stride(shape), *inner)))
    return views[0], views[1]


def _split_strides(part_out: torch.Tensor, part_lse: torch.Tensor) -> dict[str, int]:
    """The split buffers' strides as the kernels take them (row strides in
    units of ``SPLIT_ROW_ALIGN``: ``_split_row_strides``)."""
    align = SPLIT_ROW_ALIGN.value
    return dict(stride_pmu=part_out.stride(0) // align, stride_ps=part_out.stride(1), stride_ph=part_out.stride(2),
                stride_lmu=part_lse.stride(0) // align, stride_ls=part_lse.stride(1))


def merge_counts_key(num_kv_heads: int, device: torch.device | str) -> tuple:
    """Where a plan's ``scratch`` keeps the fused merge's counters."""
    return ("merge_counts", num_kv_heads, str(device))


def _merge_counts(plan: WorkPlan, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The fused merge's counter per merge row and KV head: zeros, and zeros
    again after every launch (the last piece of a tile rearms its own), so
    every layer of the step shares them."""
    key = merge_counts_key(num_kv_heads, device)
    if key not in plan.scratch:
        plan.scratch[key] = torch.zeros((max(plan.num_merge_rows, 1), num_kv_heads), dtype=torch.int32,
                                        device=device)
    return plan.scratch[key]


def _prepare(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    plan: WorkPlan,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
) -> _Launch:
    """Check the batch against the plan, allocate output (``out``: the
    caller's, laid out as ``torch.empty_like(query)``) and partials, and
    build the kernel's arguments (``softcap``: the scores' cap, Gemma 2's). Every layer of a step passes the same
    layout with the same plan: the checks, strides and variant are worked
    out for the first and kept in the plan (a prototype without tensors),
    so the others only swap in their tensors (host time an eager step pays
    per layer)."""
    layout = ("launch", query.shape, query.stride(), query.dtype, query.device, key_cache.shape, key_cache.stride(),
              key_cache.dtype, value_cache.stride(), value_cache.dtype, block_tables.shape, block_tables.stride(),
              scale, softcap, TILES)  # fmt: skip
    proto = plan.scratch.get(layout)
    if proto is None:
        _check_layouts(query, key_cache, value_cache, block_tables)
        _check_plan(plan, query, key_cache, block_tables)
        num_q_heads, head_dim = query.shape[1], query.shape[2]
        out_strides = torch.empty_like(query).stride()  # as every layer's output of this layout is laid out
        part_out, part_lse = _partials(plan, num_q_heads, head_dim, query.device)
        constexprs = _plan_constexprs(query, key_cache, plan)
        if softcap:
            constexprs["SOFTCAP"] = True
        # Without the fused merge the counters are never touched: any int32 tensor keeps the signature.
        merge_counts = (_merge_counts(plan, key_cache.shape[2], query.device) if constexprs["FUSED_MERGE"]
                        else plan.merge_num_splits)
        args = dict(
            q_ptr=None, k_cache_ptr=None, v_cache_ptr=None, out_ptr=None,
            part_out_ptr=part_out, part_lse_ptr=part_lse, block_tables_ptr=None,
            work_ptr=plan.work, unit_offsets_ptr=plan.unit_offsets,
            merge_count_ptr=merge_counts, merge_num_splits_ptr=plan.merge_num_splits,
            qk_scale=float(scale / softcap if softcap else scale * LOG2E), window=int(plan.sliding_window or 0),
            softcap=float(softcap * LOG2E if softcap else 0.0), stride_qt=query.stride(0), stride_qh=query.stride(1),
            stride_kb=key_cache.stride(0), stride_ks=key_cache.stride(1), stride_kh=key_cache.stride(2),
            stride_vb=value_cache.stride(0), stride_vs=value_cache.stride(1), stride_vh=value_cache.stride(2),
            stride_ot=out_strides[0], stride_oh=out_strides[1],
            **_split_strides(part_out, part_lse),
            stride_bt=block_tables.stride(0),
        )  # fmt: skip
        options = _launch_options(constexprs)
        proto = plan.scratch[layout] = _Launch(args, constexprs, options, None, part_out, part_lse,
                                               _occupancy_key(constexprs, options, query.dtype, query.device,
                                                              key_cache.dtype))
    if out is None:
        out = torch.empty_like(query)  # [T, Hq, D]
    elif (out.shape != query.shape or out.dtype != query.dtype or out.device != query.device
          or out.stride() != (proto.args["stride_ot"], proto.args["stride_oh"], 1)):  # fmt: skip
        raise ValueError(f"out {tuple(out.shape)} ({out.dtype}, strides {out.stride()}) must be laid out as "
                         f"the query {tuple(query.shape)} ({query.dtype}) is")
    args = dict(proto.args, q_ptr=query, k_cache_ptr=key_cache, v_cache_ptr=value_cache, out_ptr=out,
                block_tables_ptr=block_tables)  # fmt: skip
    return proto.with_tensors(args, out)


def _merge_args(launch: _Launch, plan: WorkPlan) -> dict[str, object]:
    # The strides are the attention launch's, worked out once per layout.
    a = launch.args
    return dict(
        out_ptr=launch.out, part_out_ptr=launch.part_out, part_lse_ptr=launch.part_lse,
        merge_tokens_ptr=plan.merge_tokens, merge_num_splits_ptr=plan.merge_num_splits,
        stride_ot=a["stride_ot"], stride_oh=a["stride_oh"], stride_pmu=a["stride_pmu"], stride_ps=a["stride_ps"],
        stride_ph=a["stride_ph"], stride_lmu=a["stride_lmu"], stride_ls=a["stride_ls"],
    )  # fmt: skip


def _merge_constexprs(launch: _Launch) -> dict[str, object]:
    return dict(HEAD_DIM=launch.constexprs["HEAD_DIM"], HEAD_PAD=launch.constexprs["HEAD_PAD"],
                SPLIT_CHUNK=SPLIT_CHUNK, LSE_CHUNK=MERGE_LSE_SPLITS,
                LAUNCH_DEPENDENTS=launch.constexprs["LAUNCH_DEPENDENTS"])  # fmt: skip


def _decode_launch(launch: _Launch, plan: WorkPlan) -> _Launch:
    """A two-launch plan's decode launch: the same batch, output and
    partials, the decode part's work list, the decode-only variant (which,
    with ``Tiles.fused_merge``, merges the decode part's rows itself, as a
    decode-only step's launch does)."""
    part = plan.decode_part
    cached = (launch.occupancy_key, TILES.fused_merge)
    variant = part.scratch.get(cached)  # the same for every layer of the step
    if variant is None:
        # The decode part's own plan (no prefill tiles) gives what a decode-only step launches.
        constexprs = _plan_constexprs(launch.args["q_ptr"], launch.args["k_cache_ptr"], part)
        constexprs["SOFTCAP"] = launch.constexprs["SOFTCAP"]
        options = _launch_options(constexprs)
        variant = part.scratch[cached] = (
            constexprs, options, _occupancy_key(constexprs, options, launch.out.dtype, launch.out.device,
                                                launch.args["k_cache_ptr"].dtype))
    constexprs, options, key = variant
    # Its merge rows number on from the other part's: the whole plan's
    # splits, partials and counters serve both.
    args = dict(launch.args, work_ptr=part.work, unit_offsets_ptr=part.unit_offsets)
    if constexprs["FUSED_MERGE"]:
        args["merge_count_ptr"] = _merge_counts(plan, launch.args["k_cache_ptr"].shape[2], launch.out.device)
    return dataclasses.replace(launch, args=args, constexprs=constexprs, options=options, occupancy_key=key)


def _occupancy_key(constexprs: dict[str, object], options: dict[str, int], dtype: torch.dtype,
                   device: torch.device, cache_dtype: torch.dtype) -> tuple:
    # The cache's dtype too: an fp8 cache's variant widens K/V in its loop
    # (more registers, less shared memory) and may fit another count an SM.
    return (tuple(sorted(constexprs.items())), tuple(options.items()), str(dtype), str(device), str(cache_dtype))


def _attention_grid(launch: _Launch, grid_units: int) -> tuple[int, int]:
    return grid_units, launch.args["k_cache_ptr"].shape[2]  # units x KV heads


def _run(launch: _Launch, grid_units: int) -> None:
    _record("attention", launch.args, launch.constexprs, _ATTENTION_DYNAMIC, launch.num_warps)
    compiled = _PAGED_ATTENTION[_attention_grid(launch, grid_units)](*launch.args.values(), **launch.constexprs,
                                                                     **launch.options)
    if launch.occupancy_key not in _VARIANTS.programs_per_sm:
        # The interpreter has no compiled kernel to read: the fallback stands in.
        device = launch.out.device
        per_sm = _programs_per_sm(compiled, device) if device.type == "cuda" else None
        fallback = FALLBACK_PROGRAMS_PER_SM[bool(launch.constexprs["HAS_PREFILL"])]
        _VARIANTS.programs_per_sm[launch.occupancy_key] = per_sm or fallback


def _merge_grid(launch: _Launch, rows: int) -> tuple[int, int]:
    return rows, launch.out.shape[1]  # merge rows x query heads


def _run_merge(launch: _Launch, plan: WorkPlan, rows: int) -> None:
    args = _merge_args(launch, plan)
    consts = _merge_constexprs(launch)
    _record("merge", args, consts, _MERGE_DYNAMIC, MERGE_WARPS)
    _MERGE[_merge_grid(launch, rows)](*args.values(), **consts, num_warps=MERGE_WARPS)


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    plan: WorkPlan,
    softcap: float | None = None,
) -> torch.Tensor:
    """Check the plan against the batch, allocate partials, run both kernels."""
    return _execute(_prepare(query, key_cache, value_cache, block_tables, scale, plan, softcap=softcap), plan)


def _execute(launch: _Launch, plan: WorkPlan) -> torch.Tensor:
    """Run a prepared launch: the attention (a two-launch plan's decode
    part first) and the split-K merge where the attention leaves it."""
    attention, rows = _parts(launch, plan)
    for part, units in attention:
        _run(part, units)
    if rows:
        _run_merge(launch, plan, rows)
    return launch.out


def _parts(launch: _Launch, plan: WorkPlan) -> tuple[list[tuple[_Launch, int]], int]:
    """What a prepared launch runs: its attention launches with their units
    (a two-launch plan's decode part first; none for a plan of no work)
    and the rows left to the merge kernel (0: no merge launch)."""
    if plan.num_items == 0:
        return [], 0
    rows = 0 if launch.constexprs["FUSED_MERGE"] else plan.num_merge_rows  # left to the merge kernel
    attention = []
    if plan.decode_part is not None:
        decode = _decode_launch(launch, plan)
        attention.append((decode, plan.decode_part.num_units))
        if decode.constexprs["FUSED_MERGE"]:
            rows -= plan.decode_merge_rows  # the last rows: the merge kernel's grid stops before them
    attention.append((launch, plan.num_units))
    return attention, rows


class StepAttention:
    """``paged_attention`` for every layer of a step that attends from the
    same query tensor with the same tables and plan, each layer over its
    own caches (the batch-1 row layer's query: a view of one buffer every
    layer's QKV GEMV writes). The first layer's checks, strides and
    variant serve the rest; a layer passes only its caches, and every
    layer writes ``out``, one buffer (each layer's reader runs before the
    next layer's attention, in stream order). Caches laid out otherwise
    than the first layer's take ``paged_attention``'s checked path.

    The first layer runs the checked launch; from the second, each of its
    kernels launches from a ``launch.Site`` of its own, whose arguments
    differ between layers only in the caches: on a GPU, aligned caches of
    the first layer's layout launch with no key worked out (while the
    variants are being recorded, every layer takes the checked launch, so
    each is recorded as it runs)."""

    __slots__ = ("_query", "_tables", "_scale", "_softcap", "_plan", "_first", "_layout", "_sites", "out")

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, scale: float, plan: WorkPlan,
                 softcap: float | None = None) -> None:  # fmt: skip
        self._query, self._tables, self._scale, self._softcap, self._plan = query, block_tables, scale, softcap, plan
        self.out = torch.empty_like(query)
        self._first = _prepare(query, key_cache, value_cache, block_tables, scale, plan, out=self.out,
                               softcap=softcap)
        self._layout = cache_layout(key_cache, value_cache)
        # Per kernel of the step: its site, the arguments before the caches
        # (None: a merge, which reads no cache) and those after them.
        self._sites: list[tuple[Site, tuple, tuple]] | None = None

    def __call__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """Attend over this layer's caches into ``out``; returns it."""
        if cache_layout(key_cache, value_cache) != self._layout:
            launch = _prepare(self._query, key_cache, value_cache, self._tables, self._scale, self._plan,
                              out=self.out, softcap=self._softcap)  # fmt: skip
            return _execute(launch, self._plan)
        return self.launch(key_cache, value_cache, aligned(key_cache, value_cache))

    def launch(self, key_cache: torch.Tensor, value_cache: torch.Tensor, aligned_caches: bool) -> torch.Tensor:
        """``__call__`` for caches the caller has found of the first
        layer's layout (``aligned_caches``: both 16-byte aligned)."""
        sites = self._sites
        if sites is None or _VARIANTS.recording:
            first = self._first
            launch = first.with_tensors(dict(first.args, k_cache_ptr=key_cache, v_cache_ptr=value_cache), self.out)
            if sites is None:
                self._sites = self._make_sites(launch)
            return _execute(launch, self._plan)
        for site, head, tail in sites:
            site((*head, key_cache, value_cache, *tail) if head is not None else tail, aligned_caches)
        return self.out

    def _make_sites(self, launch: _Launch) -> list[tuple[Site, tuple, tuple]]:
        # ``_execute``'s launches, each split around its caches (the
        # attention's arguments start q, k cache, v cache).
        attention, rows = _parts(launch, self._plan)
        sites = []
        for part, units in attention:
            args = tuple(part.args.values())
            sites.append((Site(_PAGED_ATTENTION, _attention_grid(part, units), {**part.constexprs, **part.options}),
                          args[:1], args[3:]))  # fmt: skip
        if rows:
            kwargs = dict(_merge_constexprs(launch), num_warps=MERGE_WARPS)
            sites.append((Site(_MERGE, _merge_grid(launch, rows), kwargs), None,
                          tuple(_merge_args(launch, self._plan).values())))  # fmt: skip
        return sites


def _empty_plan(device: torch.device, group: int, has_prefill: bool, sliding_window: int | None) -> WorkPlan:
    """A plan with one unit and no items, of the variant asked for."""
    i32 = dict(dtype=torch.int32, device=device)
    dtpt = decode_tokens_per_tile(group)
    return WorkPlan(
        work=torch.zeros((0, WORK_FIELDS), **i32),
        unit_offsets=torch.zeros(2, **i32),
        merge_tokens=torch.zeros(1, **i32),
        merge_num_splits=torch.zeros(1, **i32),  # zero splits: the merge writes 0/0 into a scratch row
        num_tokens=0,
        tokens_per_tile=default_tokens_per_tile(group),
        decode_tokens_per_tile=dtpt,
        has_prefill_tiles=has_prefill,
        max_splits=1,
        sliding_window=sliding_window,
        num_seqs=0,
        max_seq_len=0,
    )


def warmup(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    sliding_window: int | None = None,
    variants: tuple[bool, ...] = (False, True),
    softcap: float | None = None,
) -> dict[bool, int]:
    """Compile the variants a model serves with (``variants``: has-prefill
    flags; decode-only and mixed by default, for this window and score cap) and the merge,
    by launching them on no work: nothing is read or written but a scratch
    row. ``query`` and ``key_cache`` must be laid out as in serving (a view
    of the fused QKV output, say), since the strides are part of the variant.
    Returns programs per SM per variant (``{has_prefill: programs}``)."""
    group = query.shape[1] // key_cache.shape[2]
    device = query.device
    tables = torch.zeros((1, 1), dtype=torch.int32, device=device)
    occupancy = {}
    for has_prefill in variants:
        plan = _empty_plan(device, group, has_prefill, sliding_window)
        launch = _prepare(query[:0], key_cache, key_cache, tables, 1.0, plan, softcap=softcap)
        # A one-token scratch output laid out as every real output is
        # (empty_like of a strided query view is contiguous).
        launch.out = torch.empty((1, *query.shape[1:]), dtype=query.dtype, device=device)
        launch.args.update(out_ptr=launch.out, stride_ot=launch.out.stride(0), stride_oh=launch.out.stride(1))
        _run(launch, 1)
        if not launch.constexprs["FUSED_MERGE"]:
            _run_merge(launch, plan, 1)  # one merge variant serves both
        occupancy[has_prefill] = programs_per_sm(query, key_cache, has_prefill, sliding_window, compile=False)
    return occupancy


def programs_per_sm(
    query: torch.Tensor, key_cache: torch.Tensor, has_prefill: bool, sliding_window: int | None,
    *, compile: bool = True,
) -> int:
    """Resident programs per SM of the variant a plan with these properties
    launches, read off the compiled kernel (compiled now if it is not yet;
    off CUDA, run once in the interpreter, which checks the layouts as a GPU
    launch does, and answered by ``FALLBACK_PROGRAMS_PER_SM``)."""
    group = query.shape[1] // key_cache.shape[2]
    constexprs = _constexprs(
        query, key_cache, decode_tokens=decode_tokens_per_tile(group), tokens_per_tile=default_tokens_per_tile(group),
        has_prefill=has_prefill, has_window=sliding_window is not None,
    )  # fmt: skip
    key = _occupancy_key(constexprs, _launch_options(constexprs), query.dtype, query.device, key_cache.dtype)
    if key not in _VARIANTS.programs_per_sm and compile:
        warmup(query, key_cache, sliding_window, variants=(has_prefill,))
    return _VARIANTS.programs_per_sm.get(key, FALLBACK_PROGRAMS_PER_SM[has_prefill])


def units_per_kv_head(sms: int, programs_per_sm: int, num_kv_heads: int) -> int:
    """Persistent programs per KV head such that all of them (``units x
    heads``) are resident at once. Rounded down, not up: a program past the
    resident slots starts only when a first-wave program ends, so its unit's
    work runs after the step's busiest unit, not beside it. On an H200 (132
    SMs, three decode programs each, 8 KV heads) 50 units leave four of 400
    programs for a second wave, and 64 x 16k decode ran at 67% of copy
    bandwidth against 99% with 49 (``decode_grid_nvidia_h200.md``)."""
    return max(1, sms * programs_per_sm // num_kv_heads)


def default_num_units(
    query: torch.Tensor, key_cache: torch.Tensor, has_prefill: bool, sliding_window: int | None = None
) -> int:
    """Persistent programs per KV head: every SM filled with as many programs
    of the launched variant as fit on it, over all KV heads. Off CUDA (the
    interpreter) ``INTERPRETER_UNITS``, after the same variant check.

    Every eager step asks (once per launch it plans), and working the answer
    out builds the variant's constexprs and key, about 20 us of host time;
    so it is kept per variant, keyed by all that decides it (the shapes,
    dtypes and device, the variant, and the launch shape ``TILES``)."""
    key = (tuple(query.shape[1:]), query.dtype, query.device, tuple(key_cache.shape[1:]), key_cache.dtype,
           has_prefill, sliding_window is not None, TILES)
    units = _UNITS.get(key)
    if units is None:
        per_sm = programs_per_sm(query, key_cache, has_prefill, sliding_window)
        if query.device.type != "cuda":
            units = INTERPRETER_UNITS
        else:
            sms = torch.cuda.get_device_properties(query.device).multi_processor_count
            units = units_per_kv_head(sms, per_sm, key_cache.shape[2])
        _UNITS[key] = units
    return units


_UNITS: dict[tuple, int] = {}  # default_num_units' answers


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
    separate: bool | None = None,
    decode_units: int | None = None,
    on_host: bool = False,
) -> WorkPlan:
    """The default plan for a batch, already on the query's device (with
    ``on_host``, still on the host, for a caller that uploads it with its
    own inputs: ``WorkPlan.stage``). The engine calls this once per step
    with host-side lengths and passes the plan to every layer. Decode tiles
    are ``decode_tokens_per_tile(group)`` tokens, prefill tiles
    ``tokens_per_tile`` (default ``TILES.prefill_rows // group``).

    ``separate`` runs a packed step's decode tiles in a launch of their own
    (on ``decode_units``, by default the decode-only variant's units) when
    the step also has prefill tiles. None gives such a step the plan
    ``packing.predicted_us`` finds faster, one more launch's host time
    included (``packing.plan_attention``'s ``choose``); True and False
    force it."""
    group = query.shape[1] // key_cache.shape[2]
    tpt = tokens_per_tile or default_tokens_per_tile(group)
    dtpt = min(decode_tokens_per_tile(group), tpt)
    has_prefill = max(q_lens, default=0) > dtpt
    if num_units is None:
        num_units = default_num_units(query, key_cache, has_prefill, sliding_window)

    if separate is not False and pack and has_prefill:
        decode_units = decode_units or default_num_units(query, key_cache, False, sliding_window)
    else:
        decode_units = None
    work = packing.plan_attention(
        q_lens, seq_lens, num_units=num_units, tokens_per_tile=tpt, decode_tokens_per_tile=dtpt,
        sliding_window=sliding_window, kv_chunk=kv_chunk, pack=pack, decode_units=decode_units,
        choose=separate is None,
    )  # fmt: skip
    return work if on_host else work.to(query.device)


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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of a flat ragged batch (``reference.paged_attention``
    semantics, ``softcap`` too). ``work`` is a plan from ``plan_for``/``packing.plan_attention``
    built from the same lengths and window, on the query's device; without it
    one is built here, which reads the lengths back to the host."""
    if work is None:
        starts = query_start_loc.tolist()
        q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
        work = plan_for(query, key_cache, q_lens, seq_lens.tolist(), sliding_window)
    elif work.sliding_window != sliding_window:
        raise ValueError("the plan was built for another sliding window")
    return _launch(query, key_cache, value_cache, block_tables, scale, work, softcap)
