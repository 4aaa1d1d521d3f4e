"""One row of activations times a weight matrix, ``y = x W^T (+ bias)
(+ residual)``: the linears of batch-1 decode, where reading the weight
once from HBM is the whole cost.

cuBLAS reaches 60-75% of the copy bandwidth on the decoder layer's smaller
matrices at one row (the output and QKV projections of a Llama-3-8B layer on
an H100: ``benchmarks/results/linear_bandwidth_*.md``); this kernel reads
each program's ``BLOCK_N`` rows of the weight front to back and reaches
73-98%. The engine runs it for every one-row linear on the Triton lane,
eager steps and decode graphs alike (``ops.gemv_row`` says why).

Arithmetic: fp32 products and sums, then bias and residual added in fp32,
rounded once to the output dtype, as cuBLAS's epilogue with ``beta = 1``
rounds ``addmm_``.

What a batch-1 decoder layer does around its projections goes into the
same launch, rounded where the separate kernels round, so a layer is six
launches instead of nine (engine/models/llama.py):

* ``gated``: the gate/up projection with its activation in the epilogue.
  Each program reads its rows of the gate half and the same rows of the up
  half and writes ``silu(gate) * up``, rounded as the projection and
  kernels/activation.py round it apart (gate and up to the output dtype, the
  SiLU again, then the product); the ``[1, 2 * I]`` intermediate never
  reaches memory.
* ``norm``: the RMSNorm before the qkv and gate/up projections, in the
  prologue. Each program takes the row's sum of squares itself (K values,
  read from L2 by all but the first) and normalises every step of x as
  kernels/fused_norm.py does. Only the order of that sum may differ from the
  norm kernel's (in the interpreter it does not).
* ``round_before_residual`` into a fresh output: the o projection plus the
  residual stream, rounded as the separate add rounds, the residual left as
  it is (the down projection keeps ``addmm_``'s one rounding, in place).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fluidserve.kernels.launch import Relaunch, cdiv, next_power_of_2

BLOCK_N = 16  # output rows per program: 256+ programs on an 8B model's smallest matrix
MAX_BLOCK_K = 512  # the fastest on every Llama-3-8B shape measured; smaller where K needs it
NUM_WARPS = 4
# From this K step a tile of BLOCK_N / 2 rows still gives every thread a whole
# 16-byte vector, as the plain kernel's tile does: Triton lays both out alike.
HALF_ROWS_MIN_K = 256


@triton.jit
def _gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (read only if HAS_BIAS)
    residual_ptr,  # [N] (read only if HAS_RESIDUAL)
    norm_ptr,  # [K]: the RMSNorm's weight (read only if NORM)
    y_ptr,  # [N]
    N, K, stride_wn,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_RESIDUAL: tl.constexpr,  # the residual added to the rounded product, as a separate add
    GATED: tl.constexpr,  # y = silu(rows [0, N)) * rows [N, 2N) of the weight
    NORM: tl.constexpr,  # x is RMS-normalised first (norm_ptr, eps)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two of K (NORM's one-load reduction)
):  # fmt: skip
    if NORM:  # every program takes the row's norm itself: K values, from L2 after the first
        d = tl.arange(0, BLOCK_D)
        whole = tl.load(x_ptr + d, mask=d < K, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(whole * whole, axis=0) / K + eps)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    up_rows = w_ptr + (rows + N)[:, None].to(tl.int64) * stride_wn  # read only if GATED
    # One accumulator per lane, summed across K once at the end: the loop
    # body is loads and FMAs only. K is a multiple of BLOCK_K (the caller's
    # choice), so no load needs a mask along K.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K) if GATED else (1, 1), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        # The weight is read once and never again in this step: keep it out
        # of L2's way.
        w = tl.load(w_rows + (k + cols)[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptr + k + cols)
        if NORM:  # rounded where kernels/fused_norm.py rounds: the normalised x, then times the weight
            normed = (x.to(tl.float32) * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (tl.load(norm_ptr + k + cols).to(tl.float32) * normed).to(x_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        if GATED:
            u = tl.load(up_rows + (k + cols)[None, :], mask=row_ok[:, None], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            acc_up += u.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        if ROUND_BEFORE_RESIDUAL:
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(residual_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GATED:  # rounded where the unfused projection and activation round
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(y_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        y = silu * up
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


_GEMV = Relaunch(_gemv_kernel)


@functools.cache
def block_k(k: int) -> int | None:
    """The widest power-of-two step up to ``MAX_BLOCK_K`` that divides ``k``
    (None below 16: such a matrix is not worth a kernel of its own)."""
    step = MAX_BLOCK_K
    while step >= 16:
        if k % step == 0:
            return step
        step //= 2
    return None


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             residual: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether ``gemv`` takes these: one contiguous row of x, a weight with
    contiguous rows, all of one dtype and device, K a multiple of 16."""
    n, k = weight.shape
    return (x.dim() == 2 and x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.dtype == weight.dtype and block_k(k) is not None
            and (bias is None or _fits(bias, x, n)) and (residual is None or _fits(residual, x, n)))  # fmt: skip


def _fits(t: torch.Tensor, x: torch.Tensor, n: int) -> bool:
    """A bias or residual: x's dtype and device, n contiguous elements."""
    return t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.numel() == n


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias``, [1, K] x [N, K] -> [1, N]; with ``residual`` [1, N]
    the result is accumulated into it in place and returned (the caller
    must own it), as ``residual.addmm_(x, W.t())`` does."""
    if not supports(x, weight, bias, residual):
        raise ValueError(f"gemv: x {tuple(x.shape)} ({x.dtype}), weight {tuple(weight.shape)} ({weight.dtype}): "
                         "needs one contiguous row, matching dtypes and K a multiple of 16")
    return launch(x, weight, bias, residual)


def supports_gated(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv_silu_and_mul`` takes these: ``supports`` without bias
    or residual, and a weight of two equal halves."""
    return weight.shape[0] % 2 == 0 and supports(x, weight, None, None)


def supports_norm(x: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    """Whether the GEMV can RMS-normalise ``x`` with this weight first."""
    return (norm_weight.shape == (x.shape[-1],) and norm_weight.dtype == x.dtype and norm_weight.stride(-1) == 1
            and norm_weight.device == x.device)  # fmt: skip


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x G^T) * (x U^T)`` for the stacked weight ``[G; U]`` [2I, K]:
    [1, K] -> [1, I], bit for bit ``silu_and_mul(gemv(x, weight))``."""
    if not supports_gated(x, weight):
        raise ValueError(f"gemv_silu_and_mul: x {tuple(x.shape)} ({x.dtype}), weight {tuple(weight.shape)} "
                         f"({weight.dtype}): needs one contiguous row, matching dtypes, K a multiple of 16 "
                         "and an even number of weight rows")
    return launch(x, weight, None, None, gated=True)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
           out: torch.Tensor | None = None, block_n: int | None = None, k_step: int | None = None,
           num_warps: int = NUM_WARPS, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
           round_before_residual: bool = False) -> torch.Tensor:  # fmt: skip
    """``gemv`` (``gated``: ``gemv_silu_and_mul``, no bias or residual) for
    inputs ``supports`` has passed, unchecked (the dispatch checks once).
    ``norm`` (weight [K], eps): x RMS-normalised first, as
    kernels/fused_norm.py rounds it. ``round_before_residual``: the product
    rounded before the residual's add, as a separate add rounds (default:
    one rounding, as ``addmm_``). ``out`` (default: ``residual``, else a
    new [1, N]) may be a fresh tensor with a residual, leaving the residual
    as it is. The launch shape is for benchmarks: the engine's is the
    default."""
    rows, k = weight.shape
    k_step = k_step or block_k(k)
    n, grid, block_n, block_d = _shape(rows, k, gated, norm is not None, block_n, k_step)
    if out is None:
        out = residual if residual is not None else torch.empty((1, n), dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    _GEMV[grid](
        x, weight, bias if bias is not None else out, residual if residual is not None else out, norm_weight, out,
        n, k, weight.stride(0), float(eps), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        ROUND_BEFORE_RESIDUAL=round_before_residual, GATED=gated, NORM=norm is not None, BLOCK_N=block_n,
        BLOCK_K=k_step, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return out


@functools.cache
def _shape(rows: int, k: int, gated: bool, norm: bool, block_n: int | None,
           k_step: int) -> tuple[int, tuple[int], int, int]:  # fmt: skip
    """(output columns, grid, BLOCK_N, BLOCK_D) of a launch: worked out once
    per weight shape, since every layer of a step asks again."""
    n = rows // 2 if gated else rows
    # A gated program reads BLOCK_N / 2 gate rows and as many up rows: the
    # plain kernel's loads per step, in 132 registers on sm_90 (the plain
    # kernel's 167: three programs per SM either way); a full BLOCK_N of
    # each takes 246, two per SM (kernels_compile_sm90.md). Only from a K
    # step of HALF_ROWS_MIN_K: Triton spreads a tile over the threads by its
    # size, so a smaller tile of half the rows sums each row in another
    # order than the plain kernel, and the fused MLP no longer rounds as the
    # unfused one does (fp32 on an H200, K step 16).
    if block_n is None:
        block_n = BLOCK_N // 2 if gated and k_step >= HALF_ROWS_MIN_K else BLOCK_N
    return n, (cdiv(n, block_n),), block_n, next_power_of_2(k) if norm else 1
