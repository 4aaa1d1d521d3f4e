"""Linears over float8 weights with a scale per output row and group of
input features (transformers' and DeepSeek's block-scaled ``fp8``,
compressed-tensors' FP8 with a scale per tensor, channel or block), kept in
float8 on the device: the fused few-row kernel (``fp8_linear``) and the
dequantizing one (``dequantize``) that many-row steps run before cuBLAS.

The format (the loader writes it; kernels/reference.py owns its semantics):
a linear of N output and K input features,

* ``weight`` float8 [N, K], contiguous: ``torch.float8_e4m3fn`` or
  ``torch.float8_e5m2``, one byte a weight;
* ``scales`` float32 [N, G], contiguous: a block grid's scale repeated on
  every row of its block; a scale per tensor or per row is G = 1;
* ``g_idx`` int32 [K]: each input feature's group (``k // block_k``, or all
  0 for G = 1).

Arithmetic, as ``reference.fp8_dequantize``: ``W[n, k] = weight[n, k]`` as
fp32 (exact) times ``scales[n, g_idx[k]]``, one fp32 product, rounded once
to the activation dtype (fp32, fp16 or bf16); ``dequantize`` writes exactly
those bits. ``fp8_linear`` multiplies that rounded weight by x in fp32,
sums in fp32, adds the bias in fp32 and rounds the output once, as
kernels/int_linear.py does (whose rounding, dot and interpreter switches
these kernels share).

``fp8_linear`` is for decode steps (up to ``MAX_FUSED_ROWS``; the
dispatcher, ``ops.fp8_linear``, dequantizes for cuBLAS above it): each
program owns ``BLOCK_N`` output features and reads their weight bytes once
per K step, half the bytes of the bf16 GEMV (kernels/gemv.py). One row is
a multiply-and-sum per lane; more rows go through ``tl.dot``, each tile of
rows reading the weight once. A tile is [rows, runs, run]: ``RUN``
features share one scale column, so given a plain checkpoint's
``group_size`` a scale is read once per row and run (a 128-wide block's
scale once per row per block); without it each weight gathers its scale
through ``g_idx``. The e4m3 conversion needs sm_89 or newer (Triton has no
e4m3 type below it): there ``converts`` and ``supports`` say no and
``dequantize`` refuses, and such a weight takes the torch reference.

Its speed is unmeasured: no GPU has run these kernels yet
(benchmarks/int_linear_bandwidth.py has the fp8 rows to measure). The
launch shapes below are chosen from sm_90 compiles alone (registers,
spills), not timed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fluidserve.kernels.dot import dot_fp32
from fluidserve.kernels.int_linear import DOT_PRECISION, DTYPES, _round
from fluidserve.kernels.launch import Relaunch, cdiv

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Up to 32 rows one program holds every row in one tl.dot tile, so the
# weight is read once per step; past it each 32-row tile reads it again.
ROW_TILE = 32
# The most rows the dispatcher sends here rather than dequantizing for
# cuBLAS. By bytes a weight: dequantize + GEMM reads the float8 weight (1),
# writes the 16-bit one (2) and the GEMM reads it back (2), 5 in all; the
# fused kernel reads 1 per 32-row tile, so four tiles read 4, still less.
# At five tiles the two are even, and past that the steps are prefill
# chunks, where the GEMM's arithmetic, not the bytes, sets the time. The
# same limit as int_linear's. Unmeasured on a GPU: a byte count, not a
# timing.
MAX_FUSED_ROWS = 4 * ROW_TILE
BLOCK_N = 16  # output features per program: 256 programs on a 4096-row matrix, as kernels/gemv.py
# Input features per step of the one-row path: 256 bytes of each weight
# row, as int_linear's 8-bit path. Compiled for sm_90, every launch here
# (scales per run or gathered) takes at most 108 registers, three programs
# an SM, and spills nothing; its weight loads are 16 bytes wide and e4m3
# converts in hardware, two values an instruction (kernel_bench.py
# --compile-only; tests/kernels/test_fp8_linear.py).
ROW_BLOCK_K = 256
DOT_BLOCK_K = 128  # of a tl.dot tile: one 128-wide block's scale a row
NUM_WARPS = 4
# ``dequantize``'s tile: 16 KiB of bf16 written per program, as int_linear's;
# four warps hold a gathering tile's addresses without spilling.
DEQUANT_BLOCK_N = 32
DEQUANT_BLOCK_K = 256
DEQUANT_WARPS = 4


@triton.jit
def _weight_tile(weight_ptr, scales_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn, group_size,
                 dtype: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr, GROUPED: tl.constexpr):  # fmt: skip
    """Rows ``rows`` of the weight at input features k .. k + BLOCK_K as
    [BLOCK_N, BLOCK_K // RUN, RUN] of ``dtype``: element [r, j, i] is
    feature k + j * RUN + i (in feature order, row-major). ``GROUPED``: a
    run's features share group ``run_start // group_size`` (the launcher
    picks RUN so that they do), one scale a row and run; else each
    feature's group comes from ``g_idx`` and its scale is gathered.
    Features past K and rows past N come out 0: their weight reads as 0."""
    RUNS: tl.constexpr = BLOCK_K // RUN
    run_start = k + tl.arange(0, RUNS) * RUN  # [RUNS]
    feature = run_start[None, :, None] + tl.arange(0, RUN)[None, None, :]  # [1, RUNS, RUN]
    row_off = rows[:, None, None].to(tl.int64)  # [BLOCK_N, 1, 1]
    ok = row_ok[:, None, None] & (feature < K)
    q = tl.load(weight_ptr + row_off * stride_wn + feature, mask=ok, other=0.0,
                eviction_policy="evict_first")  # read once: kept out of L2's way
    if GROUPED:
        at = row_off * stride_sn + (run_start // group_size)[None, :, None]  # [BLOCK_N, RUNS, 1]
        scale = tl.load(scales_ptr + at, mask=row_ok[:, None, None] & (run_start < K)[None, :, None], other=0.0)
    else:
        group = tl.load(g_idx_ptr + feature, mask=feature < K, other=0)
        scale = tl.load(scales_ptr + row_off * stride_sn + group, mask=ok, other=0.0)  # [N, G]: L1 hits
    return _round(q.to(tl.float32) * scale, dtype)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, K], rows contiguous
    weight_ptr,  # [N, K] float8
    scales_ptr,  # [N, G] float32
    g_idx_ptr,  # [K] int32 (read unless GROUPED)
    bias_ptr,  # [N] (read only if HAS_BIAS)
    y_ptr,  # [M, N], contiguous
    M, N, K, stride_xm, stride_wn, stride_sn, group_size,
    BLOCK_M: tl.constexpr,  # 1: the one-row path; else a tl.dot tile of rows
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RUN: tl.constexpr,  # features a scale column covers in a tile (``_weight_tile``)
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_ok = rows < N
    dtype = y_ptr.dtype.element_ty
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        # One row: a dot would pad it to 16 rows and move every tile into
        # the tensor cores' layout. One accumulator per lane, as
        # kernels/gemv.py's, summed at the end; x laid out as the tile.
        RUNS: tl.constexpr = BLOCK_K // RUN
        feature = (tl.arange(0, RUNS) * RUN)[:, None] + tl.arange(0, RUN)[None, :]  # [RUNS, RUN]
        acc = tl.zeros((BLOCK_N, RUNS, RUN), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = _weight_tile(weight_ptr, scales_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn, group_size,
                             dtype, BLOCK_K, RUN, GROUPED)  # fmt: skip
            x = tl.load(x_ptr + k + feature, mask=k + feature < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :, :]
        y = tl.sum(tl.sum(acc, axis=2), axis=1) + bias
        tl.store(y_ptr + rows, _round(y, dtype), mask=row_ok)
    else:
        # A few rows: each dequantized tile serves all of them through one
        # tensor-core product, the weight still read once.
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        cols = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = _weight_tile(weight_ptr, scales_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn, group_size,
                             dtype, BLOCK_K, RUN, GROUPED)  # fmt: skip
            x = tl.load(x_rows + (k + cols)[None, :], mask=m_ok[:, None] & (k + cols < K)[None, :], other=0.0)
            acc = dot_fp32(x, tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K))), acc, DOT_PRECISION)
        y = acc + bias[None, :]
        tl.store(y_ptr + m[:, None].to(tl.int64) * N + rows[None, :], _round(y, dtype),
                 mask=m_ok[:, None] & row_ok[None, :])  # fmt: skip


@triton.jit
def _dequantize_kernel(
    weight_ptr,  # [N, K] float8
    scales_ptr,  # [N, G] float32
    g_idx_ptr,  # [K] int32
    out_ptr,  # [N, K], contiguous
    N, K, stride_wn, stride_sn, group_size,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RUN: tl.constexpr,
    GROUPED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    k = tl.program_id(1) * BLOCK_K
    RUNS: tl.constexpr = BLOCK_K // RUN
    feature = k + (tl.arange(0, RUNS) * RUN)[None, :, None] + tl.arange(0, RUN)[None, None, :]  # as the tile's
    w = _weight_tile(weight_ptr, scales_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn, group_size,
                     out_ptr.dtype.element_ty, BLOCK_K, RUN, GROUPED)  # fmt: skip
    tl.store(out_ptr + rows[:, None, None].to(tl.int64) * K + feature, w, mask=row_ok[:, None, None] & (feature < K))


_FP8_LINEAR = Relaunch(_fp8_linear_kernel)
_DEQUANTIZE = Relaunch(_dequantize_kernel)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` takes these: x [M, K] of fp32, fp16 or bf16
    with contiguous rows, ``weight`` float8 (e4m3fn or e5m2) [N, K]
    contiguous on x's device, which converts it (``converts``). Any M; the
    fused kernel is meant for up to ``MAX_FUSED_ROWS`` (the dispatcher's
    test)."""
    return (x.dim() == 2 and x.dtype in DTYPES and x.stride(-1) == 1 and weight.dim() == 2
            and weight.dtype in FP8_DTYPES and weight.is_contiguous() and weight.device == x.device
            and x.shape[1] == weight.shape[1] and converts(weight))  # fmt: skip


def converts(weight: torch.Tensor) -> bool:
    """Whether Triton can convert ``weight``'s float8 on its device: e5m2
    everywhere, e4m3fn on sm_89 (Ada) and newer; Triton's interpreter, both."""
    if weight.device.type != "cuda" or weight.dtype == torch.float8_e5m2:
        return True
    return _capability(weight.device.index) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bias: torch.Tensor | None = None, *, group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` for the float8 weight (the module's docstring): x
    [M, K] -> [M, N] of x's dtype, the weight never dequantized to memory.
    ``group_size``: the caller vouches that ``g_idx[k] == k // group_size``
    (``reference.plain_group_size`` checks it once, at load); then a run of
    features shares its scale, read once per row and run instead of
    gathered per weight through ``g_idx``."""
    _check(x, weight, scales, g_idx, bias, group_size)
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid, block_m, block_k, run, grouped = _shape(m, n, x.shape[1], group_size)
    _FP8_LINEAR[grid](x, weight, scales, g_idx, bias if bias is not None else y, y, m, n, x.shape[1], x.stride(0),
                      weight.stride(0), scales.stride(0), group_size if grouped else 0, BLOCK_M=block_m,
                      BLOCK_N=BLOCK_N, BLOCK_K=block_k, RUN=run, GROUPED=grouped, HAS_BIAS=bias is not None,
                      DOT_PRECISION=DOT_PRECISION, num_warps=NUM_WARPS)  # fmt: skip
    return y


def dequantize(weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None, *, group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] in ``dtype``, bit for bit ``reference.fp8_dequantize``,
    into ``out`` (contiguous [N, K] of ``dtype``) or a new tensor.
    ``group_size`` as ``fp8_linear``'s."""
    if (weight.dim() != 2 or weight.dtype not in FP8_DTYPES or dtype not in DTYPES or not weight.is_contiguous()
            or not converts(weight)):  # fmt: skip
        raise ValueError(f"dequantize: weight {tuple(weight.shape)} ({weight.dtype}) to {dtype}: needs a contiguous "
                         "2-D float8 (e4m3fn or e5m2, e4m3fn on sm_89 or newer) weight and an fp32, fp16 or bf16 "
                         "result")  # fmt: skip
    n, k = weight.shape
    _check_groups(weight, scales, g_idx, group_size)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous() or out.device != weight.device:
        raise ValueError(f"dequantize: out {tuple(out.shape)} ({out.dtype}) is not a contiguous [{n}, {k}] {dtype}")
    if n and k:
        run, grouped = _run(group_size, k, DEQUANT_BLOCK_K)
        _DEQUANTIZE[(cdiv(n, DEQUANT_BLOCK_N), cdiv(k, DEQUANT_BLOCK_K))](
            weight, scales, g_idx, out, n, k, weight.stride(0), scales.stride(0), group_size if grouped else 0,
            BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, RUN=run, GROUPED=grouped,
            num_warps=DEQUANT_WARPS)  # fmt: skip
    return out


def _check(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
           bias: torch.Tensor | None, group_size: int | None) -> None:  # fmt: skip
    if not supports(x, weight):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} ({x.dtype}), weight {tuple(weight.shape)} "
                         f"({weight.dtype}): needs x of fp32, fp16 or bf16 with contiguous rows and a contiguous "
                         "float8 (e4m3fn or e5m2, e4m3fn on sm_89 or newer) [N, K] weight on its device")  # fmt: skip
    _check_groups(weight, scales, g_idx, group_size)
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()
                             or bias.device != x.device):  # fmt: skip
        raise ValueError(f"fp8_linear: bias {tuple(bias.shape)} ({bias.dtype}) is not a contiguous [{n}] {x.dtype}")


def _check_groups(weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, group_size: int | None) -> None:
    """Scales float32 [N, G] and g_idx int32 [K], contiguous, on the
    weight's device; with ``group_size``, G groups of it cover K (their
    values, ``g_idx < G``, are the loader's)."""
    n, k = weight.shape
    groups = scales.shape[1] if scales.dim() == 2 else -1
    ok = (scales.dtype == torch.float32 and g_idx.dtype == torch.int32 and scales.shape == (n, groups)
          and g_idx.shape == (k,) and scales.is_contiguous() and g_idx.is_contiguous()
          and scales.device == g_idx.device == weight.device
          and (group_size is None or (group_size > 0 and groups == cdiv(k, group_size))))  # fmt: skip
    if not ok:
        raise ValueError(f"float8 weight [{n}, {k}]: scales {tuple(scales.shape)} ({scales.dtype}), g_idx "
                         f"{tuple(g_idx.shape)} ({g_idx.dtype}), group_size {group_size}: needs contiguous float32 "
                         "scales [N, G] and int32 g_idx [K] on the weight's device, and G = ceil(K / group_size)")


def _run(group_size: int | None, k: int, block_k: int) -> tuple[int, bool]:
    """(RUN, GROUPED) of a launch stepping ``block_k`` features: with a plain
    checkpoint's groups, a step inside one group (one group in all, or
    groups a multiple of the step) is one run, and groups that divide the
    step are runs; else (no group size, or groups of another size) the
    scales are gathered, the tile one run."""
    if group_size is None:
        return block_k, False
    if group_size >= k or group_size % block_k == 0:
        return block_k, True
    if block_k % group_size == 0:
        return group_size, True
    return block_k, False


@functools.cache
def _shape(m: int, n: int, k: int, group_size: int | None) -> tuple[tuple[int, int], int, int, int, bool]:
    """(grid, BLOCK_M, BLOCK_K, RUN, GROUPED) of an ``fp8_linear`` launch,
    worked out once per shape: every layer of a step asks again."""
    block_m = 1 if m == 1 else 16 if m <= 16 else ROW_TILE
    block_k = ROW_BLOCK_K if m == 1 else DOT_BLOCK_K
    run, grouped = _run(group_size, k, block_k)
    return (cdiv(n, BLOCK_N), cdiv(m, block_m)), block_m, block_k, run, grouped
