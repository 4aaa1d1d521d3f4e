"""The routed experts of a mixture-of-experts layer on the Triton lane:
``ops.fused_experts``, with the semantics and rounding of
``reference.fused_experts``, in three launches and a few torch ops that
never wait for the GPU, so a decode step holding it is captured once and
replayed whatever the routing.

The T * k (token, slot) pairs are sorted by expert and each expert's run
is padded to a multiple of ``BLOCK_M`` (``align``): every block of
``BLOCK_M`` sorted pairs then belongs to one expert, and a grouped GEMM
multiplies each block by its expert's weight. Every buffer is sized for
the worst routing, a function of (T, k, E, BLOCK_M) only; the padded total
stays on the device, and programs past it return at once.

1. ``_expert_gemm_kernel`` (gated): a pair's row of x times its expert's
   gate and up rows, ``silu(gate) * up`` in the epilogue -> [T * k, N].
   Rounded where ``F.linear``, ``F.silu`` and the product round apart
   (gate and up to x's dtype, the SiLU again, the product), as
   kernels/activation.py does; the [T * k, 2N] projection never reaches
   memory.
2. ``_expert_gemm_kernel`` (weighted): those rows times the expert's
   down_proj, rounded to x's dtype, then times the pair's routing weight
   and rounded again (torch's ``y * w`` then ``.to(x.dtype)``) ->
   [T * k, H].
3. ``_sum_slots_kernel``: each token's k rows added in x's dtype in
   increasing expert id, as the reference's ``index_add_`` adds them
   (skipped at k = 1, where the down GEMM writes the output).

What differs from the reference is the order of each GEMM's sums
(against cuBLAS's or the CPU's) and the last bits of the SiLU's exp, each
then rounded to x's dtype at the same steps. The block sizes depend on the
shapes alone, so a replayed graph gives an eager call's bits.

Either GEMM's weight may be dense (x's dtype) or ``reference.PackedExperts``,
as a quantized checkpoint stores it (GPTQ/AWQ integers, float8): the kernel
then reads each tile through the packed linears' own tile helpers
(``int_linear._weight_tile``, ``fp8_linear._weight_tile``), pointed at the
expert's slices, dequantized in registers and rounded to x's dtype as the
dequantized weight is, so with the same tiles its bits are the dense
kernel's over the dequantized stack. Their tile shapes are chosen from
sm_90 compiles alone (registers, spills), not timed: no GPU has run the
packed launches yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from fluidserve.kernels import fp8_linear, int_linear
from fluidserve.kernels.dot import dot_fp32
from fluidserve.kernels.launch import Relaunch, cdiv, next_power_of_2
from fluidserve.kernels.reference import PackedExperts

# Columns of a token's output row per ``_sum_slots_kernel`` program.
SUM_BLOCK = 1024
# The pairs' activations are [T * k, N] and [T * k, H] of x's dtype; past
# this many tokens a call runs in chunks, so that a long prefill does not
# hold gigabytes of them (8192 tokens at k = 8, H = 4096: 512 MiB).
CHUNK_TOKENS = 8192
# Consecutive row blocks a run of programs walks before the next column
# block: neighbouring blocks mostly share an expert, so its weight tile is
# read from L2 rather than HBM.
GROUP_M = 8


@triton.jit
def _packed_tile(b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, rows_ok, k, k_dim, stride_bn, stride_sn, group_size,
                 dtype: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, RUN: tl.constexpr, GROUPED: tl.constexpr,
                 UNPACK_T: tl.constexpr = False):  # fmt: skip
    """Rows ``rows`` of one expert's packed weight (the pointers at its
    slices) at input features k .. k + BLOCK_K as a product's B operand:
    [BLOCK_K, BLOCK_N] of ``dtype``, dequantized and rounded by the packed
    linears' own helpers (FORMAT "int": int_linear's format, "float8":
    fp8_linear's). Features past K and rows not ``rows_ok`` read 0.
    ``UNPACK_T`` (blocks of 64 rows and more): integer codes are unpacked
    in the operand's own order (``int_linear._weight_tile_t``), which
    Triton 3.6 compiles for Hopper's warpgroup products where it fails on
    the transpose of int8's; the same values. Not for smaller blocks,
    where that order takes more registers (Triton 3.9, int8 gated decode
    tile: 176 against 148)."""
    if FORMAT == "int" and UNPACK_T:
        return int_linear._weight_tile_t(b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, rows_ok, k, k_dim, stride_bn,
                                         stride_sn, group_size, dtype, BITS, BLOCK_N, BLOCK_K, GROUPED)
    if FORMAT == "int":
        tile = int_linear._weight_tile(b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, rows_ok, k, k_dim, stride_bn,
                                       stride_sn, group_size, dtype, BITS, BLOCK_N, BLOCK_K, GROUPED)
    else:
        tile = tl.reshape(fp8_linear._weight_tile(b_ptr, scales_ptr, g_idx_ptr, rows, rows_ok, k, k_dim, stride_bn,
                                                  stride_sn, group_size, dtype, BLOCK_K, RUN, GROUPED),
                          (BLOCK_N, BLOCK_K))  # fmt: skip
    return tl.trans(tile)


@triton.jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: x (gated: a pair's row is its token's) or the pairs' activations
    b_ptr,  # [E, N_b, ...]: w13 (gated: gate rows [0, n_out), up rows [n_out, 2 n_out)) or w2, dense or codes
    scales_ptr,  # [E, N_b, G] float32 (read if FORMAT is "int" or "float8")
    zeros_ptr,  # [E, N_b, G] uint8 (read if FORMAT is "int")
    g_idx_ptr,  # [E, K] int32 (read if quantized and not GROUPED)
    c_ptr,  # [T * k, n_out]: row = pair
    sorted_ids_ptr,  # [padded]: pairs by expert, each run padded with `pairs`
    expert_ptr,  # [padded / BLOCK_M]: the expert of each block
    total_ptr,  # [1]: the padded length in use
    weights_ptr,  # [T * k]: the routing weights (weighted)
    pairs, n_out, k_dim, num_blocks_m,
    stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_cm, group_size,
    TOP_K: tl.constexpr,  # a pair's row of a: pair // TOP_K
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    FORMAT: tl.constexpr,  # the weight as stored: "dense" (x's dtype), "int" or "float8" (``PackedExperts``)
    BITS: tl.constexpr,  # "int": bits a code
    RUN: tl.constexpr,  # "float8": features a scale column covers in a tile (``fp8_linear._weight_tile``)
    GROUPED: tl.constexpr,  # quantized: group k // group_size, scales read per word or run, not gathered
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_blocks_n = tl.cdiv(n_out, BLOCK_N)
    in_group = GROUP_M * num_blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the padded total: this routing needs fewer blocks than the worst one

    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    rows_ok = ids < pairs  # padding holds `pairs`
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    # The expert's slices: from here on the weight is one plain (or packed) linear.
    b_ptr += expert * stride_be
    scales_ptr += expert * stride_se
    zeros_ptr += expert * stride_se  # the zeros' layout is the scales'
    g_idx_ptr += expert * k_dim  # [E, K], contiguous
    dtype = c_ptr.dtype.element_ty
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (ids // TOP_K).to(tl.int64)[:, None] * stride_am + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + ks[:, None]  # [BLOCK_K, BLOCK_N] (dense)
    up_ptrs = b_ptrs + n_out * stride_bn
    for k0 in range(0, k_dim, BLOCK_K):
        ks_ok = ks < k_dim - k0
        a = tl.load(a_ptrs, mask=rows_ok[:, None] & ks_ok[None, :], other=0.0)
        if FORMAT == "dense":
            b_mask = ks_ok[:, None] & cols_ok[None, :]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        else:
            b = _packed_tile(b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, cols, cols_ok, k0, k_dim, stride_bn,
                             stride_sn, group_size, dtype, FORMAT, BITS, BLOCK_N, BLOCK_K, RUN, GROUPED,
                             BLOCK_M >= 64)  # fmt: skip
        acc = dot_fp32(a, b, acc, DOT_PRECISION)
        if GATED:
            if FORMAT == "dense":
                up = tl.load(up_ptrs, mask=b_mask, other=0.0)
            else:
                up = _packed_tile(b_ptr, scales_ptr, zeros_ptr, g_idx_ptr, cols + n_out, cols_ok, k0, k_dim,
                                  stride_bn, stride_sn, group_size, dtype, FORMAT, BITS, BLOCK_N, BLOCK_K, RUN,
                                  GROUPED, BLOCK_M >= 64)  # fmt: skip
            acc_up = dot_fp32(a, up, acc_up, DOT_PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out = acc.to(dtype).to(tl.float32)  # F.linear's rounding
    if GATED:
        up = acc_up.to(dtype).to(tl.float32)
        silu = (out / (1.0 + tl.exp(-out))).to(dtype).to(tl.float32)
        out = silu * up
    if WEIGHTED:
        out = out * tl.load(weights_ptr + ids, mask=rows_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, out.to(dtype), mask=rows_ok[:, None] & cols_ok[None, :])


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [T * k, H]: the weighted rows of each pair
    ids_ptr,  # [T * k]: the expert of each pair
    out_ptr,  # [T, H]
    hidden, stride_y, stride_o,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < hidden
    slots = tl.arange(0, K_PAD)
    ids = tl.load(ids_ptr + token * TOP_K + slots, mask=slots < TOP_K, other=2**31 - 1).to(tl.int32)
    # The reference adds a token's rows expert by expert, a repeated expert
    # slot by slot: each slot's place in that order, a permutation of 0..k-1.
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None]))
    place = tl.sum(before.to(tl.int32), axis=1)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        slot = tl.sum(tl.where(place == i, slots, 0))
        row = tl.load(y_ptr + (token * TOP_K + slot) * stride_y + cols, mask=cols_ok, other=0.0)
        acc = (acc + row.to(tl.float32)).to(dtype).to(tl.float32)  # index_add_ in x's dtype
    tl.store(out_ptr + token * stride_o + cols, acc.to(dtype), mask=cols_ok)


_EXPERT_GEMM = Relaunch(_expert_gemm_kernel)
_SUM_SLOTS = Relaunch(_sum_slots_kernel)
INTERPRETED = isinstance(_expert_gemm_kernel, InterpretedFunction)


def block_m(pairs: int, num_experts: int) -> int:
    """Rows of a GEMM tile, from the mean pairs per expert: 16 (tl.dot's
    least) at decode, where most blocks hold one to a few pairs and the
    weight reads are the cost; 64 in a long prefill."""
    per_expert = pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def padded_size(pairs: int, num_experts: int, bm: int) -> int:
    """Length of ``sorted_ids`` for any routing of ``pairs`` pairs: each
    expert hit (at most min(E, pairs)) pads its run by under ``bm``."""
    hit = min(num_experts, pairs)
    return (pairs + hit * (bm - 1)) // bm * bm


def tiles(bm: int, elem_bytes: int, gated: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a GEMM with ``bm``-row tiles.
    Untuned defaults of the usual shapes for grouped GEMMs: narrow column
    blocks at decode so that the few experts' weights spread over many
    programs, a gated tile half as wide (it holds a gate and an up
    accumulator; fp32 too, whose 64 x 128 tile spills on sm_90), K steps
    of 256 bytes of a row at decode and of 128 bytes otherwise."""
    if bm == 16:
        return (32 if gated else 64), 128 * 2 // elem_bytes, 4
    return (64 if gated or bm == 32 or elem_bytes > 2 else 128), 64 * 2 // elem_bytes, 4


def align(topk_ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert (stable), each expert's run padded to a
    multiple of ``bm`` with the sentinel T * k: ``(sorted_ids
    [padded_size] int32, expert_of_block [padded_size / bm] int32,
    total [1] int64)``, total being the padded length this routing uses.
    Torch ops of fixed shapes, none of which waits for the device."""
    flat = topk_ids.reshape(-1).long()
    pairs, dev = flat.numel(), flat.device
    size = padded_size(pairs, num_experts, bm)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (bm - 1)).div_(bm, rounding_mode="floor").mul_(bm)
    ends = padded.cumsum(0)
    # A pair's slot: its expert's padded start plus its rank in the expert's
    # run, which is its place in the sorted order less the pairs of smaller experts.
    shift = ends - padded - (counts.cumsum(0) - counts)
    experts, order = torch.sort(flat, stable=True)
    dest = torch.arange(pairs, device=dev).add_(shift[experts])
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=dev).scatter_(0, dest, order.int())
    starts = torch.arange(0, size, bm, device=dev)
    # Blocks past the total get the last expert: their programs return before reading it.
    expert_of_block = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).int()
    return sorted_ids, expert_of_block, ends[-1:]


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"  # as F.linear in fp32 (torch's default leaves TF32 off)
    return "widen" if INTERPRETED else "tf32"  # tf32 is not read for 16-bit operands


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | PackedExperts,  # [E, 2N, H]
    w2: torch.Tensor | PackedExperts,  # [E, H, N]
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """``reference.fused_experts`` on the Triton kernels: [T, H] of x's dtype.
    Each weight dense, of x's dtype with contiguous rows, or
    ``PackedExperts`` (float8 e4m3 where ``fp8_linear.converts`` it)."""
    _check(x, w13, w2, topk_ids, topk_weights)
    tokens = x.shape[0]
    out = torch.empty_like(x)
    if tokens == 0 or topk_ids.shape[1] == 0:
        return out.zero_()
    for lo in range(0, tokens, CHUNK_TOKENS):
        hi = min(tokens, lo + CHUNK_TOKENS)
        _experts(x[lo:hi], w13, w2, topk_ids[lo:hi], topk_weights[lo:hi], out[lo:hi])
    return out


def _check(x: torch.Tensor, w13: torch.Tensor | PackedExperts, w2: torch.Tensor | PackedExperts,
           topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:  # fmt: skip
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, PackedExperts):
            problem = _packed_problem(x, w)
            if problem:
                raise ValueError(f"{name}: packed experts, codes {tuple(w.codes.shape)} ({w.codes.dtype}), bits "
                                 f"{w.bits}, scales {tuple(w.scales.shape)} ({w.scales.dtype}), g_idx "
                                 f"{tuple(w.g_idx.shape)} ({w.g_idx.dtype}), x {x.dtype}: needs {problem}")
        elif w.dim() != 3:
            raise ValueError(f"{name}: expected a stack of experts [E, N, K], got {tuple(w.shape)}")
    tokens, hidden = x.shape
    num_experts, two_n, h13 = w13.shape
    inter = two_n // 2
    if (two_n % 2 or h13 != hidden or tuple(w2.shape) != (num_experts, hidden, inter)
            or topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"expected x [T, H], w13 [E, 2N, H], w2 [E, H, N], topk ids and weights [T, k]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(topk_ids.shape)}, "
                         f"{tuple(topk_weights.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, PackedExperts):
            continue
        if w.dtype != x.dtype:
            raise ValueError(f"x and a dense {name} must share a dtype, got {x.dtype} and {w.dtype}")
        if w.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows")
    if x.stride(-1) != 1:
        raise ValueError("x must have contiguous rows")


def _packed_problem(x: torch.Tensor, w: PackedExperts) -> str | None:
    """What the kernel cannot read in ``w`` (None: nothing), in words."""
    problem = w.layout_problem(x.device)
    if problem is None and w.float8 and not fp8_linear.converts(w.codes):
        problem = "float8 e4m3 on sm_89 or newer (Triton has no e4m3 below it): the reference runs it"
    if problem is None and x.dtype not in int_linear.DTYPES:
        problem = "x of fp32, fp16 or bf16 (the dtype the weight is dequantized to)"
    return problem


# Elements of dequantized weight a program holds per K step (the gated
# GEMM's gate and up tiles together), by whether each code gathers its
# scale (and zero) through g_idx: the values, their scales and, gathered,
# each one's group and address live in registers beside the accumulators.
# Compiled for sm_90 at a Qwen3-30B-A3B layer, bf16, decode and prefill
# (kernel_bench.py moe_packed_compile_report; tests/kernels/
# test_moe_packed.py): ``tiles``' own shapes (8192 elements) take 148-243
# registers with scales per word or run (int8's gated decode tile 192) and
# spill when gathered (255 registers, 8-88 stack bytes). 4096 elements take
# at most 144 per word or run (int8, gated decode: 16 x 16 x 128) but
# 174-180 gathered (int4 act-order, gated), so gathered tiles get 2048: at
# most 104. Every launch spills nothing. A 32-bit x's tiles hold half as
# many (its values, and the dequantized weight, take twice the registers):
# at the full count 27 (Triton 3.6) and 23 (3.9) of the 30 fp32 launches
# of five formats at 1, 512 and 4096 tokens spilled (up to 4976 stack
# bytes), at half 11 and 16, the blocks of 64 rows still 200-584 bytes (the
# dense kernel's 0-32).
# Chosen from compiles alone, not timed: no GPU has run the packed launches.
TILE_ELEMENTS = {False: 4096, True: 2048}


def quantized_tiles(bm: int, elem_bytes: int, gated: bool, gathered: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a GEMM over ``PackedExperts``:
    ``tiles``', halved, columns first (down to tl.dot's 16), until the
    tile(s) hold at most ``TILE_ELEMENTS`` (half with 32-bit x). Every BLOCK_K stays a multiple
    of 32, whole words of 4-bit codes (8 a word)."""
    block_n, block_k, warps = tiles(bm, elem_bytes, gated)
    while block_n * block_k * (2 if gated else 1) > TILE_ELEMENTS[gathered] * 2 // elem_bytes:
        if block_n > 16:
            block_n //= 2
        else:
            block_k //= 2
    return block_n, block_k, warps


def weight_tiles(w: torch.Tensor | PackedExperts, bm: int, elem_bytes: int, gated: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of a GEMM over weight ``w``."""
    if not isinstance(w, PackedExperts):
        return tiles(bm, elem_bytes, gated)
    shape = quantized_tiles(bm, elem_bytes, gated, gathered=False)
    grouped = (fp8_linear._run(w.group_size, w.shape[2], shape[1])[1] if w.float8
               else int_linear._grouped(w.bits, w.group_size))  # fmt: skip
    return shape if grouped else quantized_tiles(bm, elem_bytes, gated, gathered=True)


def _operand(w: torch.Tensor | PackedExperts, block_k: int) -> tuple[tuple, tuple[int, int, int, int], int, dict]:
    """A GEMM's weight as ``_expert_gemm_kernel`` reads it: (b, scales,
    zeros, g_idx), (stride_be, stride_bn, stride_se, stride_sn),
    group_size and the format's constexprs. A dense weight passes itself
    for the tensors it has not, which its launch never reads."""
    if not isinstance(w, PackedExperts):
        return (w, w, w, w), (w.stride(0), w.stride(1), 0, 0), 0, dict(FORMAT="dense", BITS=0, RUN=0, GROUPED=False)
    if w.float8:
        run, grouped = fp8_linear._run(w.group_size, w.shape[2], block_k)
        fmt, zeros = "float8", w.scales
    else:
        run, grouped = 0, int_linear._grouped(w.bits, w.group_size)
        fmt, zeros = "int", w.zeros
    strides = w.codes.stride(0), w.codes.stride(1), w.scales.stride(0), w.scales.stride(1)
    return ((w.codes, w.scales, zeros, w.g_idx), strides, w.group_size if grouped else 0,
            dict(FORMAT=fmt, BITS=w.bits, RUN=run, GROUPED=grouped))  # fmt: skip


def _experts(x: torch.Tensor, w13: torch.Tensor | PackedExperts, w2: torch.Tensor | PackedExperts,
             topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
    """``fused_experts`` of one chunk of tokens, into ``out``."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w13.shape[0], w2.shape[2]
    pairs = tokens * top_k
    bm = block_m(pairs, num_experts)
    sorted_ids, expert_of_block, total = align(topk_ids, num_experts, bm)
    blocks_m = sorted_ids.numel() // bm
    weights = topk_weights.reshape(-1)
    precision, elem = _dot_precision(x.dtype), x.element_size()

    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    bn, bk, warps = weight_tiles(w13, bm, elem, gated=True)
    (b, scales, zeros, g_idx), strides, group_size, fmt = _operand(w13, bk)
    _EXPERT_GEMM[(blocks_m * cdiv(inter, bn),)](
        x, b, scales, zeros, g_idx, act, sorted_ids, expert_of_block, total, weights, pairs, inter, hidden, blocks_m,
        x.stride(0), *strides, act.stride(0), group_size, TOP_K=top_k, GATED=True, WEIGHTED=False, **fmt,
        DOT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps,
    )  # fmt: skip

    # At k = 1 a pair is its token: the down GEMM writes the output.
    y = out if top_k == 1 else torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    bn, bk, warps = weight_tiles(w2, bm, elem, gated=False)
    (b, scales, zeros, g_idx), strides, group_size, fmt = _operand(w2, bk)
    _EXPERT_GEMM[(blocks_m * cdiv(hidden, bn),)](
        act, b, scales, zeros, g_idx, y, sorted_ids, expert_of_block, total, weights, pairs, hidden, inter, blocks_m,
        act.stride(0), *strides, y.stride(0), group_size, TOP_K=1, GATED=False, WEIGHTED=True, **fmt,
        DOT_PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, num_warps=warps,
    )  # fmt: skip
    if top_k > 1:
        _SUM_SLOTS[(tokens, cdiv(hidden, SUM_BLOCK))](
            y, topk_ids.reshape(-1), out, hidden, y.stride(0), out.stride(0),
            TOP_K=top_k, K_PAD=next_power_of_2(top_k), BLOCK=SUM_BLOCK,
        )  # fmt: skip
