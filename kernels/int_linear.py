"""Linears over weight-only quantized integer weights (GPTQ- and AWQ-style,
4 or 8 bits with a scale and a zero point per group of input features),
kept packed on the device: the fused few-row kernel (``int_linear``) and the
dequantizing one (``dequantize``) that many-row steps run before cuBLAS.

The packed format (the loader writes it; kernels/reference.py owns its
semantics): a linear of N output and K input features, ``per_word = 32 //
bits``,

* ``codes`` int32 [N, K / per_word], contiguous: the code of input feature k
  of row n is the field ``k % per_word`` (``bits`` wide, lowest first) of
  word ``codes[n, k // per_word]``, unsigned;
* ``scales`` float32 and ``zeros`` uint8 [N, G], contiguous: G groups of
  input features;
* ``g_idx`` int32 [K]: each input feature's group, in any order (GPTQ's
  act-order); a plain checkpoint's is ``k // group_size``.

Arithmetic, as ``reference.int_dequantize``: ``W[n, k] = (code - zero)`` as
fp32 times the group's scale, rounded once to the activation dtype (fp32,
fp16 or bf16); ``dequantize`` writes exactly those bits. ``int_linear``
multiplies that rounded weight by x in fp32 (products of 16-bit values are
exact), sums in fp32, adds the bias in fp32 and rounds the output once, as
kernels/gemv.py does.

``int_linear`` is for decode steps (up to ``MAX_FUSED_ROWS``; the
dispatcher dequantizes for cuBLAS above it): each program owns ``BLOCK_N``
output features and reads their packed words once per K step, unpacking
them in registers, so a 4-bit weight is a quarter of the bytes the bf16
GEMV (kernels/gemv.py) reads, an 8-bit one half. One row is a
multiply-and-sum per lane; more rows go through ``tl.dot``, each tile of
rows reading the weight once. Scales and zeros are gathered per code
through ``g_idx`` (any group order), or, given a plain checkpoint's
``group_size``, read once per word.

Its speed is unmeasured: no GPU has run these kernels yet
(benchmarks/int_linear_bandwidth.py is the measurement to make). The
launch shapes below are chosen from sm_90 compiles alone (registers,
spills), not timed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from fluidserve.kernels.dot import dot_fp32
from fluidserve.kernels.launch import Relaunch, cdiv

BITS = (4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Up to 32 rows one program holds every row in one tl.dot tile, so the
# weight is read once per step; past it each 32-row tile reads the packed
# weight again.
ROW_TILE = 32
# The most rows the dispatcher (``ops.int_linear``) sends here rather than
# dequantizing into a temporary for cuBLAS. By bytes: dequantizing reads
# the packed weight, then writes and reads the 16-bit one (2 bytes each way
# an element); the fused kernel reads the packed weight once per row tile,
# so at 4 bits four tiles still read no more than one 16-bit weight's bytes
# (at 8 bits, twice). Past it the steps are prefill chunks, where the GEMM's
# arithmetic, not the bytes, sets the time. Unmeasured on a GPU: a byte
# count, not a timing.
MAX_FUSED_ROWS = 4 * ROW_TILE
BLOCK_N = 16  # output features per program: 256 programs on a 4096-row matrix, as kernels/gemv.py
# Input features per step of the one-row path, by (bits, scales per word):
# 256 bytes of each weight row, 128 where each code gathers its scale and
# zero, whose addresses take the registers (at 256 bytes the 4-bit path
# spills, the 8-bit one takes 212 registers). Compiled for sm_90, every
# launch keeps registers for three programs an SM and spills nothing
# (kernel_bench.py --compile-only; tests/kernels/test_int_linear.py).
ROW_BLOCK_K = {(4, True): 512, (8, True): 256, (4, False): 256, (8, False): 128}
DOT_BLOCK_K = 128  # of a tl.dot tile
NUM_WARPS = 4
# ``dequantize``'s tile: 16 KiB of bf16 written per program; eight warps
# hold a gathering tile's addresses without spilling.
DEQUANT_BLOCK_N = 32
DEQUANT_BLOCK_K = 256
DEQUANT_WARPS = 8


@triton.jit
def _words(codes_ptr, rows, row_ok, k, K, stride_cn, PER_WORD: tl.constexpr, BLOCK_W: tl.constexpr):
    """The packed words of input features k .. k + BLOCK_W * PER_WORD of
    ``rows``: [BLOCK_N, BLOCK_W] int32, each loaded once. K is a multiple
    of PER_WORD, so masking words masks whole codes; words past K and rows
    past N read 0."""
    at = k // PER_WORD + tl.arange(0, BLOCK_W)
    return tl.load(codes_ptr + rows[:, None].to(tl.int64) * stride_cn + at[None, :],
                   mask=row_ok[:, None] & (at < K // PER_WORD)[None, :], other=0,
                   eviction_policy="evict_first")  # read once: kept out of L2's way


@triton.jit
def _dequant(q, feature, word_feature, row_off, row_ok, K, scales_ptr, zeros_ptr, g_idx_ptr, stride_sn, group_size,
             dtype: tl.constexpr, GROUPED: tl.constexpr):  # fmt: skip
    """Codes ``q`` (int32, any shape) as weights rounded to ``dtype``, with
    ``feature`` (each code's input feature), ``word_feature`` (the first
    feature of its word), ``row_off`` (its row, int64) and ``row_ok``
    broadcast to q's shape. ``GROUPED``: feature k is in group ``k //
    group_size``, a multiple of the codes a word holds, so a word's codes
    share one scale and zero, loaded per word; else each code's group is
    read from ``g_idx`` and its scale and zero gathered. Features past K
    and rows past N come out 0: their scale reads as 0."""
    if GROUPED:
        ok = row_ok & (word_feature < K)
        at = row_off * stride_sn + word_feature // group_size
    else:
        feature_ok = feature < K
        ok = row_ok & feature_ok
        at = row_off * stride_sn + tl.load(g_idx_ptr + feature, mask=feature_ok, other=0)
    scale = tl.load(scales_ptr + at, mask=ok, other=0.0)  # a small [N, G] table, read again and again: L1 hits
    zero = tl.load(zeros_ptr + at, mask=ok, other=0)
    return _round((q - zero.to(tl.int32)).to(tl.float32) * scale, dtype)


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_cn, stride_sn, group_size,
                 dtype: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUPED: tl.constexpr):  # fmt: skip
    """Rows ``rows`` of the weight at input features k .. k + BLOCK_K,
    dequantized, in feature order: [BLOCK_N, BLOCK_K] of ``dtype``."""
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD
    words = _words(codes_ptr, rows, row_ok, k, K, stride_cn, PER_WORD, BLOCK_W)
    # An arithmetic shift, then the mask: the sign bit of a word whose top
    # field is 2^(BITS-1) or more never leaks into a field. Field i of word
    # j is feature j * PER_WORD + i: [row, word, field] reshapes to
    # [row, feature] in feature order.
    fields = tl.arange(0, PER_WORD)
    q = (words[:, :, None] >> (fields * BITS)[None, None, :]) & ((1 << BITS) - 1)
    word_feature = k + (tl.arange(0, BLOCK_W) * PER_WORD)[None, :, None]
    w = _dequant(q, word_feature + fields[None, None, :], word_feature, rows[:, None, None].to(tl.int64),
                 row_ok[:, None, None], K, scales_ptr, zeros_ptr, g_idx_ptr, stride_sn, group_size, dtype,
                 GROUPED)  # fmt: skip
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_tile_t(codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_cn, stride_sn, group_size,
                   dtype: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUPED: tl.constexpr):  # fmt: skip
    """``_weight_tile`` transposed, [BLOCK_K, BLOCK_N]: the same values,
    unpacked as [word, field, row], which reshapes to [feature, row]. For a
    product whose B operand Hopper's warpgroup instructions read from
    shared memory (kernels/moe.py's 64-row blocks): there Triton 3.6 fails
    to compile the transpose of ``_weight_tile``'s [row, word, field] int8
    unpacking (TritonGPUOptimizeDotOperands: "Illegal shared layout;
    expected collapsed shapePerCTA to be at least [8, 32],
    collapsedTmaShape: [4, 512]", four codes a word), and compiles this
    one (kernels_compile_sm90-triton3.6.md)."""
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD
    words = tl.trans(_words(codes_ptr, rows, row_ok, k, K, stride_cn, PER_WORD, BLOCK_W))  # [BLOCK_W, BLOCK_N]
    fields = tl.arange(0, PER_WORD)
    q = (words[:, None, :] >> (fields * BITS)[None, :, None]) & ((1 << BITS) - 1)
    word_feature = k + (tl.arange(0, BLOCK_W) * PER_WORD)[:, None, None]
    w = _dequant(q, word_feature + fields[None, :, None], word_feature, rows[None, None, :].to(tl.int64),
                 row_ok[None, None, :], K, scales_ptr, zeros_ptr, g_idx_ptr, stride_sn, group_size, dtype,
                 GROUPED)  # fmt: skip
    return tl.reshape(w, (BLOCK_K, BLOCK_N))


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype``, to nearest even, as torch rounds.
    Triton's interpreter converts fp32 to bf16 by truncation, even when
    asked for "rtne", so there the bits are rounded here: half an ulp less
    one, plus the kept lowest bit, then the low half dropped (exact for
    finite values). A GPU's conversion rounds this way itself."""
    if BF16_BY_BITS and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = v.to(dtype)
    return out


@triton.jit
def _int_linear_kernel(
    x_ptr,  # [M, K], rows contiguous
    codes_ptr,  # [N, K / per_word] int32
    scales_ptr,  # [N, G] float32
    zeros_ptr,  # [N, G] uint8
    g_idx_ptr,  # [K] int32 (read unless GROUPED)
    bias_ptr,  # [N] (read only if HAS_BIAS)
    y_ptr,  # [M, N], contiguous
    M, N, K, stride_xm, stride_cn, stride_sn, group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1: the one-row path; else a tl.dot tile of rows
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    dtype = y_ptr.dtype.element_ty
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        # One row: a dot would pad it to 16 rows and move every dequantized
        # tile into the tensor cores' layout. The tile is [field, row, word]
        # with the fields leading, so that each thread unpacks whole words
        # (for a [row, feature] tile the compiler spreads a word's fields
        # over eight threads), and x is rearranged to match. One accumulator
        # per lane, as kernels/gemv.py's, summed at the end.
        PER_WORD: tl.constexpr = 32 // BITS
        BLOCK_W: tl.constexpr = BLOCK_K // PER_WORD
        fields = tl.arange(0, PER_WORD)
        word_feature = (tl.arange(0, BLOCK_W) * PER_WORD)[None, None, :]  # [1, 1, BLOCK_W]
        row_off = rows[None, :, None].to(tl.int64)  # [1, BLOCK_N, 1]
        acc = tl.zeros((PER_WORD, BLOCK_N, BLOCK_W), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            words = _words(codes_ptr, rows, row_ok, k, K, stride_cn, PER_WORD, BLOCK_W)
            q = (words[None, :, :] >> (fields * BITS)[:, None, None]) & ((1 << BITS) - 1)
            w = _dequant(q, k + word_feature + fields[:, None, None], k + word_feature, row_off, row_ok[None, :, None],
                         K, scales_ptr, zeros_ptr, g_idx_ptr, stride_sn, group_size, dtype, GROUPED)  # fmt: skip
            x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
            x = tl.trans(tl.reshape(x, (BLOCK_W, PER_WORD)))[:, None, :]  # [PER_WORD, 1, BLOCK_W], as the fields
            acc += w.to(tl.float32) * x.to(tl.float32)
        y = tl.sum(tl.sum(acc, axis=2), axis=0) + bias
        tl.store(y_ptr + rows, _round(y, dtype), mask=row_ok)
    else:
        # A few rows: each dequantized tile serves all of them through one
        # tensor-core product, the weight still read once.
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = _weight_tile(codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_cn, stride_sn,
                             group_size, dtype, BITS, BLOCK_N, BLOCK_K, GROUPED)  # fmt: skip
            x = tl.load(x_rows + (k + cols)[None, :], mask=m_ok[:, None] & (k + cols < K)[None, :], other=0.0)
            acc = dot_fp32(x, tl.trans(w), acc, DOT_PRECISION)
        y = acc + bias[None, :]
        tl.store(y_ptr + m[:, None].to(tl.int64) * N + rows[None, :], _round(y, dtype),
                 mask=m_ok[:, None] & row_ok[None, :])  # fmt: skip


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # [N, K / per_word] int32
    scales_ptr,  # [N, G] float32
    zeros_ptr,  # [N, G] uint8
    g_idx_ptr,  # [K] int32
    out_ptr,  # [N, K], contiguous
    N, K, stride_cn, stride_sn, group_size,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    k = tl.program_id(1) * BLOCK_K
    cols = k + tl.arange(0, BLOCK_K)
    w = _weight_tile(codes_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_cn, stride_sn,
                     group_size, out_ptr.dtype.element_ty, BITS, BLOCK_N, BLOCK_K, GROUPED)  # fmt: skip
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w, mask=row_ok[:, None] & (cols < K)[None, :])


_INT_LINEAR = Relaunch(_int_linear_kernel)
_DEQUANTIZE = Relaunch(_dequantize_kernel)
INTERPRETED = isinstance(_int_linear_kernel, InterpretedFunction)
BF16_BY_BITS = tl.constexpr(INTERPRETED)  # ``_round``: the interpreter's bf16 conversion truncates
# fp32 rows as F.linear multiplies them (torch leaves TF32 off); 16-bit
# operands ignore it. The interpreter widens them (``dot.dot_fp32``).
DOT_PRECISION = "widen" if INTERPRETED else "ieee"


def supports(x: torch.Tensor, codes: torch.Tensor, bits: int) -> bool:
    """Whether ``int_linear`` takes these: x [M, K] of fp32, fp16 or bf16
    with contiguous rows, ``codes`` int32 [N, K / per_word] contiguous on
    x's device, bits 4 or 8. Any M; the fused kernel is meant for up to
    ``MAX_FUSED_ROWS`` (the dispatcher's test)."""
    return (bits in BITS and x.dim() == 2 and x.dtype in DTYPES and x.stride(-1) == 1 and codes.dim() == 2
            and codes.dtype == torch.int32 and codes.is_contiguous() and codes.device == x.device
            and x.shape[1] == codes.shape[1] * (32 // bits))  # fmt: skip


def int_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               bits: int, bias: torch.Tensor | None = None, *,
               group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` for the packed weight (the module's docstring): x
    [M, K] -> [M, N] of x's dtype, the weight never unpacked to memory.
    ``group_size``: the caller vouches that ``g_idx[k] == k // group_size``
    (``reference.plain_group_size`` checks it once, at load); where it is a multiple of
    the codes a word holds, a word's codes share their scale and zero, read
    once per word instead of gathered per code through ``g_idx``."""
    _check(x, codes, scales, zeros, g_idx, bits, bias)
    m, n = x.shape[0], codes.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid, block_m, block_k, grouped = _shape(m, n, bits, group_size)
    _INT_LINEAR[grid](x, codes, scales, zeros, g_idx, bias if bias is not None else y, y, m, n, x.shape[1],
                      x.stride(0), codes.stride(0), scales.stride(0), group_size if grouped else 0, BITS=bits,
                      BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k, GROUPED=grouped, HAS_BIAS=bias is not None,
                      DOT_PRECISION=DOT_PRECISION, num_warps=NUM_WARPS)  # fmt: skip
    return y


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
               dtype: torch.dtype, out: torch.Tensor | None = None, *,
               group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] in ``dtype``, bit for bit ``reference.int_dequantize``,
    into ``out`` (contiguous [N, K] of ``dtype``) or a new tensor.
    ``group_size`` as ``int_linear``'s."""
    if bits not in BITS or dtype not in DTYPES or codes.dtype != torch.int32 or not codes.is_contiguous():
        raise ValueError(f"dequantize: {bits}-bit codes {codes.dtype} to {dtype}: needs bits 4 or 8, contiguous "
                         "int32 codes and an fp32, fp16 or bf16 weight")  # fmt: skip
    n, k = codes.shape[0], codes.shape[1] * (32 // bits)
    _check_groups(codes, scales, zeros, g_idx, n, k)
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=codes.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous() or out.device != codes.device:
        raise ValueError(f"dequantize: out {tuple(out.shape)} ({out.dtype}) is not a contiguous [{n}, {k}] {dtype}")
    if n and k:
        grouped = _grouped(bits, group_size)
        _DEQUANTIZE[(cdiv(n, DEQUANT_BLOCK_N), cdiv(k, DEQUANT_BLOCK_K))](
            codes, scales, zeros, g_idx, out, n, k, codes.stride(0), scales.stride(0), group_size if grouped else 0,
            BITS=bits, BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, GROUPED=grouped,
            num_warps=DEQUANT_WARPS)  # fmt: skip
    return out


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
           bits: int, bias: torch.Tensor | None) -> None:  # fmt: skip
    if not supports(x, codes, bits):
        raise ValueError(f"int_linear: x {tuple(x.shape)} ({x.dtype}), {bits}-bit codes {tuple(codes.shape)} "
                         f"({codes.dtype}): needs x of fp32, fp16 or bf16 with contiguous rows, contiguous int32 "
                         "codes on its device, bits 4 or 8 and K = codes' columns x 32 / bits")  # fmt: skip
    n = codes.shape[0]
    _check_groups(codes, scales, zeros, g_idx, n, x.shape[1])
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()
                             or bias.device != x.device):  # fmt: skip
        raise ValueError(f"int_linear: bias {tuple(bias.shape)} ({bias.dtype}) is not a contiguous [{n}] {x.dtype}")


def _check_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, n: int,
                  k: int) -> None:  # fmt: skip
    """Scales float32 and zeros uint8 [N, G] and g_idx int32 [K], contiguous,
    on the codes' device (their values, ``g_idx < G``, are the loader's)."""
    groups = scales.shape[1] if scales.dim() == 2 else -1
    ok = (scales.dtype == torch.float32 and zeros.dtype == torch.uint8 and g_idx.dtype == torch.int32
          and scales.shape == (n, groups) and zeros.shape == (n, groups) and g_idx.shape == (k,)
          and scales.is_contiguous() and zeros.is_contiguous() and g_idx.is_contiguous()
          and scales.device == zeros.device == g_idx.device == codes.device)  # fmt: skip
    if not ok:
        raise ValueError(f"int packed weight [{n}, {k}]: scales {tuple(scales.shape)} ({scales.dtype}), zeros "
                         f"{tuple(zeros.shape)} ({zeros.dtype}), g_idx {tuple(g_idx.shape)} ({g_idx.dtype}): needs "
                         "contiguous float32 scales and uint8 zeros [N, G] and int32 g_idx [K] on the codes' device")


def _grouped(bits: int, group_size: int | None) -> bool:
    """Whether a launch reads scales per word: a plain checkpoint's groups,
    each a whole number of words (else ``g_idx``, which is right either way)."""
    return group_size is not None and group_size > 0 and group_size % (32 // bits) == 0


@functools.cache
def _shape(m: int, n: int, bits: int, group_size: int | None) -> tuple[tuple[int, int], int, int, bool]:
    """(grid, BLOCK_M, BLOCK_K, grouped) of an ``int_linear`` launch, worked
    out once per shape: every layer of a step asks again."""
    grouped = _grouped(bits, group_size)
    block_m = 1 if m == 1 else 16 if m <= 16 else ROW_TILE
    block_k = ROW_BLOCK_K[bits, grouped] if m == 1 else DOT_BLOCK_K
    return (cdiv(n, BLOCK_N), cdiv(m, block_m)), block_m, block_k, grouped
