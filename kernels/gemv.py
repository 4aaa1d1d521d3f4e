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

Packed weights (``reference.PackedLinear``: GPTQ/AWQ integer codes or
float8, as a quantized checkpoint stores them) take the same launches and
fusions: ``_packed_gemv_kernel`` runs the same body, which reads each step's
rows through kernels/int_linear.py's or fp8_linear.py's tile helper,
dequantized in registers and rounded to x's dtype as ``PackedLinear.
dequantize`` rounds it; the arithmetic after that is the dense kernel's, so
at the same BLOCK_N and BLOCK_K the output is the dense GEMV's over the
dequantized weight (bit for bit in the interpreter; on a GPU the compiler
lays out the dequantized tile, and with it the order of the row's sum, as
it will). Its K step is at most ``PACKED_BLOCK_K``'s, chosen from sm_90
compiles alone, not timed: no GPU has run the packed GEMV yet.

Dependent launch (``FLUIDSERVE_GEMV_PDL=1`` or ``l2``, sm_90 on; off until
a GPU times it). A decode token is 4 x layers GEMVs in a row, each a few to
a few hundred microseconds of weight reads, and between two of them HBM
idles while the last programs of one drain and the next launch's first
loads travel (on an H100, 4-6 us a launch of 15-360 us against the copy
rate: linear_bandwidth_*.md). Launched as programmatic dependents, each
GEMV's programs may start while the launch before it still runs: they load
their first weight step, which no kernel writes, then wait for that launch
to finish (``griddepcontrol.wait``) before reading x or writing anything,
and let the next launch start in turn. With ``l2`` each program first has
the L2 fetch up to ``L2_PREFETCH_BYTES`` of its rows (``cp.async.bulk.
prefetch.L2``), so the time it waits moves more of the weight. With the
attention's ``Tiles.launch_dependents`` the o projection's programs start
as the attention does.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from fluidserve.kernels import fp8_linear, int_linear
from fluidserve.kernels.launch import Relaunch, Site, aligned, cdiv, next_power_of_2
from fluidserve.kernels.reference import PackedLinear

BLOCK_N = 16  # output rows per program: 256+ programs on an 8B model's smallest matrix
# Output rows per program off CUDA (None: BLOCK_N). Triton's interpreter
# pays its own cost per op of a program, about the same for a tile of 16
# rows as of 128, and sums each row of a tile alike whatever the rows
# around it (numpy, row by row), so bigger tiles give the same bits in
# fewer programs. The kernel tests run BLOCK_N (tests/kernels/conftest.py).
INTERPRETER_BLOCK_N: int | None = 128
MAX_BLOCK_K = 512  # the fastest on every Llama-3-8B shape measured; smaller where K needs it
NUM_WARPS = 4
# Input features per step of a packed weight's GEMV, by (format, bits,
# scales gathered per code through g_idx): the widest power of two up to
# 512 whose launches at Llama-3-8B's row shapes (qkv normed, o and down
# with the residual, gate/up gated and normed; bf16) compile for sm_90 with
# no spills and at most 168 registers, three programs of four warps an SM
# (kernel_bench.py gemv_packed_compile_report; tests/kernels/
# test_gemv_packed.py). Per word or run (int4, int8 in groups of 128, e4m3
# in blocks of 128 or a scale a row) 512 takes 128-168, the dense kernel's
# 167; gathered codes hold each one's group and address: at 256, int4 and
# int8 take 239-252 (512 spills), e4m3 102-111 (512: 190-199); at 128,
# int4 80-165, int8 92 but 16 bytes of stack in the gated launch, which
# at 64 takes 80. Chosen from compiles alone, not timed. A launch steps the
# widest power of two up to its format's that divides K, as the dense GEMV
# steps; a K no power of two from 16 divides is refused (``supports``): the
# caller falls back to int_linear or fp8_linear.
PACKED_BLOCK_K = {("int", 4, False): 512, ("int", 4, True): 128, ("int", 8, False): 512, ("int", 8, True): 64,
                  ("float8", 8, False): 512, ("float8", 8, True): 256}  # fmt: skip
# From this K step a tile of BLOCK_N / 2 rows still gives every thread a whole
# 16-byte vector, as the plain kernel's tile does: Triton lays both out alike.
HALF_ROWS_MIN_K = 256

PDL_ENV = "FLUIDSERVE_GEMV_PDL"
# How GEMVs launch: "off" (plainly); "on" (as programmatic dependents, the
# first weight step loaded ahead of the wait); "l2" (as "on", and first
# each program has up to L2_PREFETCH_BYTES of its rows fetched into L2).
DEPENDENT_MODES = ("off", "on", "l2")
_ENV_MODES = {"0": "off", "1": "on", **{m: m for m in DEPENDENT_MODES}}
_dependent_mode = _ENV_MODES.get(os.environ.get(PDL_ENV, "0").strip().lower(), "off")
# Per program: at three resident programs an SM that is about 25 MB of
# a 132-SM chip's 50 MB L2, room for the launch before's own reads.
L2_PREFETCH_BYTES = 64 * 1024
L2_PARTS = 8  # bulk prefetches a row's stretch is cut into: with BLOCK_N 16, one a thread of four warps
_L2_PARTS = tl.constexpr(L2_PARTS)  # the same, for the kernel


def set_dependent_launch(mode: bool | str) -> str:
    """Launch GEMVs as programmatic dependents where the device can (the
    module's docstring): a ``DEPENDENT_MODES`` name, or True ("on") /
    False ("off"); returns the old mode."""
    global _dependent_mode
    old, _dependent_mode = _dependent_mode, _mode_name(mode)
    return old


def _mode_name(mode: bool | str) -> str:
    """A ``DEPENDENT_MODES`` name, from itself or True ("on") / False ("off")."""
    mode = {True: "on", False: "off"}.get(mode, mode)
    if mode not in DEPENDENT_MODES:
        raise ValueError(f"dependent launch mode {mode!r}: one of {', '.join(DEPENDENT_MODES)}")
    return mode


@functools.cache
def _can_depend(device_index: int) -> bool:
    # Grid dependency control and the L2 bulk prefetch are sm_90's; Triton
    # has the instructions and the launch option from 3.4 (the GPU machines
    # run 3.6).
    return (torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9
            and hasattr(tl.extra.cuda, "gdc_wait"))  # fmt: skip


def dependent_launch(x: torch.Tensor) -> str:
    """How a GEMV on ``x``'s device launches now: "off" where the device
    cannot depend, else the process's mode."""
    if _dependent_mode == "off" or not x.is_cuda or not _can_depend(x.device.index or 0):
        return "off"
    return _dependent_mode


@triton.jit
def _prefetch_l2(starts, nbytes: tl.constexpr):
    """Fetch ``nbytes`` from each of ``starts`` (16-byte aligned) into L2:
    one bulk prefetch per element, nothing waits for it."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [starts, tl.full(starts.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)  # fmt: skip


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
    PREFETCH: tl.constexpr = False,  # the first K step's weight loaded before anything that reads x
    GDC: tl.constexpr = False,  # launched as a dependent (sm_90 on): wait for the kernel before only there
    L2_K: tl.constexpr = 0,  # sm_90: the first L2_K values of each row fetched into L2 first (0: none)
    L2_PART_BYTES: tl.constexpr = 0,  # bytes of each of the L2_PARTS stretches of a row's L2_K
):  # fmt: skip
    """``_gemv`` over a dense weight of x's dtype. An entry of its own, so
    that a dense launch's arguments, relaunch key and compiled code hold
    nothing of the packed formats (the decode step's hottest launch)."""
    _gemv(x_ptr, w_ptr, w_ptr, w_ptr, w_ptr, bias_ptr, residual_ptr, norm_ptr, y_ptr, N, K, stride_wn, 0, 0, eps,
          HAS_BIAS, HAS_RESIDUAL, ROUND_BEFORE_RESIDUAL, GATED, NORM, "dense", 0, 0, False, BLOCK_N, BLOCK_K, BLOCK_D,
          PREFETCH, GDC, L2_K, L2_PART_BYTES)  # fmt: skip


@triton.jit
def _packed_gemv_kernel(
    x_ptr,  # [K]
    w_ptr,  # the codes: int [N, K / (32 // BITS)] int32; float8 [N, K]
    scales_ptr,  # [N, G] float32
    zeros_ptr,  # [N, G] uint8 (read if FORMAT is "int")
    g_idx_ptr,  # [K] int32 (read unless GROUPED)
    bias_ptr,  # [N] (read only if HAS_BIAS)
    residual_ptr,  # [N] (read only if HAS_RESIDUAL)
    norm_ptr,  # [K]: the RMSNorm's weight (read only if NORM)
    y_ptr,  # [N]
    N, K, stride_wn, stride_sn, group_size,
    eps,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    NORM: tl.constexpr,
    FORMAT: tl.constexpr,  # "int" (kernels/int_linear.py's format) or "float8" (kernels/fp8_linear.py's)
    BITS: tl.constexpr,  # "int": bits a code
    RUN: tl.constexpr,  # "float8": features a scale column covers in a tile (``fp8_linear._weight_tile``)
    GROUPED: tl.constexpr,  # group k // group_size: scales read per word or run, not gathered through g_idx
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC: tl.constexpr = False,
):  # fmt: skip
    """``_gemv`` over a ``reference.PackedLinear``'s codes. No first step
    loaded ahead and no L2 prefetch (``_PACKED_CHAIN`` says why)."""
    _gemv(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, residual_ptr, norm_ptr, y_ptr, N, K, stride_wn,
          stride_sn, group_size, eps, HAS_BIAS, HAS_RESIDUAL, ROUND_BEFORE_RESIDUAL, GATED, NORM, FORMAT, BITS, RUN,
          GROUPED, BLOCK_N, BLOCK_K, BLOCK_D, False, GDC, 0, 0)  # fmt: skip


@triton.jit
def _gemv(x_ptr, w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, residual_ptr, norm_ptr, y_ptr, N, K, stride_wn,
          stride_sn, group_size, eps, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
          ROUND_BEFORE_RESIDUAL: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, FORMAT: tl.constexpr,
          BITS: tl.constexpr, RUN: tl.constexpr, GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, GDC: tl.constexpr, L2_K: tl.constexpr,
          L2_PART_BYTES: tl.constexpr):  # fmt: skip
    """The GEMV, one program a ``BLOCK_N`` rows (the entries' arguments).
    FORMAT "dense": the weight's rows are loaded as they are; "int" or
    "float8": each step's tile is dequantized from the codes by the packed
    linears' own helpers, rounded to x's dtype as ``PackedLinear.
    dequantize`` rounds it, so the products and sums are the dense
    kernel's over the dequantized weight."""
    tl.static_assert(FORMAT == "dense" or (not PREFETCH and L2_K == 0), "a packed weight has no step loaded ahead")
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    up_rows = w_ptr + (rows + N)[:, None].to(tl.int64) * stride_wn  # read only if GATED
    if L2_K > 0:
        # More of the weight on its way, into L2: the stretch a program
        # reads next, for the time it waits (rows past N fetch row N - 1).
        part = (tl.arange(0, _L2_PARTS) * (L2_K // _L2_PARTS))[None, :]
        held = tl.minimum(rows, N - 1)
        _prefetch_l2(w_ptr + held[:, None].to(tl.int64) * stride_wn + part, L2_PART_BYTES)
        if GATED:
            _prefetch_l2(w_ptr + (held + N)[:, None].to(tl.int64) * stride_wn + part, L2_PART_BYTES)
    if PREFETCH:
        # The weight is no earlier kernel's output: its first step is in
        # flight while this program waits for the kernel before it (GDC)
        # and reads x.
        w_first = tl.load(w_rows + cols[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        u_first = w_first
        if GATED:
            u_first = tl.load(up_rows + cols[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
    if GDC:
        # Everything below may read what the kernel before wrote (x, the
        # residual) or write what it reads (the output): only after it has
        # finished. The next launch may start as this one runs.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv = 0.0
    if NORM:  # every program takes the row's norm itself: K values, from L2 after the first
        d = tl.arange(0, BLOCK_D)
        whole = tl.load(x_ptr + d, mask=d < K, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(whole * whole, axis=0) / K + eps)
    # One accumulator per lane, summed across K once at the end: the loop
    # body is loads and FMAs only. K is a multiple of BLOCK_K (the caller's
    # choice), so no load needs a mask along K.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K) if GATED else (1, 1), dtype=tl.float32)
    start = 0
    if PREFETCH:  # the first step, as the loop would take it
        acc, acc_up = _gemv_step(acc, acc_up, w_first, u_first, up_rows, row_ok, x_ptr, norm_ptr, inv, cols, 0,
                                 GATED, NORM, True)  # fmt: skip
        start = BLOCK_K
    for k in range(start, K, BLOCK_K):
        if FORMAT == "dense":
            # The weight is read once and never again in this step: keep it
            # out of L2's way.
            w = tl.load(w_rows + (k + cols)[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            acc, acc_up = _gemv_step(acc, acc_up, w, w, up_rows, row_ok, x_ptr, norm_ptr, inv, cols, k, GATED, NORM,
                                     False)  # fmt: skip
        else:
            dtype = x_ptr.dtype.element_ty
            w = _packed_rows(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn,
                             group_size, dtype, FORMAT, BITS, BLOCK_N, BLOCK_K, RUN, GROUPED)  # fmt: skip
            u = w
            if GATED:  # the same rows of the up half, N rows on
                u = _packed_rows(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows + N, row_ok, k, K, stride_wn,
                                 stride_sn, group_size, dtype, FORMAT, BITS, BLOCK_N, BLOCK_K, RUN, GROUPED)
            acc, acc_up = _gemv_step(acc, acc_up, w, u, up_rows, row_ok, x_ptr, norm_ptr, inv, cols, k, GATED, NORM,
                                     True)  # fmt: skip
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


@triton.jit
def _packed_rows(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn, stride_sn, group_size,
                 dtype: tl.constexpr, FORMAT: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, RUN: tl.constexpr, GROUPED: tl.constexpr):  # fmt: skip
    """Rows ``rows`` of a packed weight at input features k .. k + BLOCK_K:
    [BLOCK_N, BLOCK_K] of ``dtype`` in feature order, the dense kernel's
    tile, dequantized by the packed linears' helpers (rows not ``row_ok``
    read 0, as the dense load's)."""
    if FORMAT == "int":
        tile = int_linear._weight_tile(w_ptr, scales_ptr, zeros_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn,
                                       stride_sn, group_size, dtype, BITS, BLOCK_N, BLOCK_K, GROUPED)  # fmt: skip
    else:
        tile = tl.reshape(fp8_linear._weight_tile(w_ptr, scales_ptr, g_idx_ptr, rows, row_ok, k, K, stride_wn,
                                                  stride_sn, group_size, dtype, BLOCK_K, RUN, GROUPED),
                          (BLOCK_N, BLOCK_K))  # fmt: skip
    return tile


@triton.jit
def _gemv_step(acc, acc_up, w, u, up_rows, row_ok, x_ptr, norm_ptr, inv, cols, k, GATED: tl.constexpr,
               NORM: tl.constexpr, UP_LOADED: tl.constexpr):  # fmt: skip
    """One K step's products added to the accumulators: ``w`` the step's
    weight rows (the gate half's, when GATED), ``u`` the up half's if
    UP_LOADED, else loaded here, after x."""
    x = tl.load(x_ptr + k + cols)
    if NORM:  # rounded where kernels/fused_norm.py rounds: the normalised x, then times the weight
        normed = (x.to(tl.float32) * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (tl.load(norm_ptr + k + cols).to(tl.float32) * normed).to(x_ptr.dtype.element_ty)
    acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if GATED:
        if not UP_LOADED:
            u = tl.load(up_rows + (k + cols)[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        acc_up += u.to(tl.float32) * x.to(tl.float32)[None, :]
    return acc, acc_up


_GEMV = Relaunch(_gemv_kernel)
_PACKED_GEMV = Relaunch(_packed_gemv_kernel)


@functools.cache
def block_k(k: int, most: int = MAX_BLOCK_K) -> int | None:
    """The widest power-of-two step up to ``most`` that divides ``k``
    (None below 16: such a matrix is not worth a kernel of its own)."""
    step = most
    while step >= 16:
        if k % step == 0:
            return step
        step //= 2
    return None


def supports(x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None,
             residual: torch.Tensor | None) -> bool:  # fmt: skip
    """Whether ``gemv`` takes these: one contiguous row of x, a weight with
    contiguous rows, all of one dtype and device, K a multiple of 16. A
    packed weight: ``_packed_supports``."""
    if isinstance(weight, PackedLinear):
        return _packed_supports(x, weight, bias, residual)
    n, k = weight.shape
    return (x.dim() == 2 and x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.dtype == weight.dtype and block_k(k) is not None
            and (bias is None or _fits(bias, x, n)) and (residual is None or _fits(residual, x, n)))  # fmt: skip


def _fits(t: torch.Tensor, x: torch.Tensor, n: int) -> bool:
    """A bias or residual: x's dtype and device, n contiguous elements."""
    return t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.numel() == n


def _packed_supports(x: torch.Tensor, w: PackedLinear, bias: torch.Tensor | None,
                     residual: torch.Tensor | None) -> bool:  # fmt: skip
    """``supports`` of a packed weight: one contiguous row of x of fp32,
    fp16 or bf16, a layout the packed kernels read (``layout_problem``)
    on x's device, which converts its float8 kind, and a K step
    (``_packed_format``)."""
    n, k = w.shape
    return (x.shape == (1, k) and x.stride(-1) == 1 and x.dtype in int_linear.DTYPES
            and w.layout_problem(x.device) is None and (not w.float8 or fp8_linear.converts(w.codes))
            and _packed_format(w.float8, w.bits, w.group_size, k, None) is not None
            and (bias is None or _fits(bias, x, n)) and (residual is None or _fits(residual, x, n)))  # fmt: skip


@functools.cache
def _packed_format(float8: bool, bits: int, group_size: int | None, k: int,
                   k_step: int | None) -> tuple[int, dict, int] | None:  # fmt: skip
    """(BLOCK_K, the format's constexprs, the group_size the kernel is
    passed) of a packed weight's GEMV stepping ``k_step`` (None: the
    widest power of two up to ``PACKED_BLOCK_K``'s that divides K, as the
    dense GEMV steps); None where K is no multiple of the step."""
    if float8:
        step = k_step or block_k(k, PACKED_BLOCK_K["float8", 8, group_size is None])
        if step is None:
            return None
        run, grouped = fp8_linear._run(group_size, k, step)
        if not grouped and k_step is None:  # groups the step cannot cut into runs: gathered, at that format's step
            step = block_k(k, PACKED_BLOCK_K["float8", 8, True])
            run, grouped = fp8_linear._run(group_size, k, step)
        constexprs = dict(FORMAT="float8", BITS=8, RUN=run, GROUPED=grouped)
    else:
        grouped = int_linear._grouped(bits, group_size)
        step = k_step or block_k(k, PACKED_BLOCK_K["int", bits, not grouped])
        constexprs = dict(FORMAT="int", BITS=bits, RUN=0, GROUPED=grouped)
    if step is None or k % step:
        return None
    return step, constexprs, group_size if grouped else 0


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias``, [1, K] x [N, K] -> [1, N]; with ``residual`` [1, N]
    the result is accumulated into it in place and returned (the caller
    must own it), as ``residual.addmm_(x, W.t())`` does."""
    if not supports(x, weight, bias, residual):
        raise ValueError(f"gemv: x {tuple(x.shape)} ({x.dtype}), weight {tuple(weight.shape)} ({weight.dtype}): "
                         "needs one contiguous row, matching dtypes and K a multiple of 16")
    return launch(x, weight, bias, residual)


def supports_gated(x: torch.Tensor, weight: torch.Tensor | PackedLinear) -> bool:
    """Whether ``gemv_silu_and_mul`` takes these: ``supports`` without bias
    or residual, and a weight (dense or packed) of two equal halves."""
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


def launch(x: torch.Tensor, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None,
           residual: torch.Tensor | None,
           out: torch.Tensor | None = None, block_n: int | None = None, k_step: int | None = None,
           num_warps: int = NUM_WARPS, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
           round_before_residual: bool = False, dependent: bool | str | None = None,
           prefetch: bool = False) -> torch.Tensor:  # fmt: skip
    """``gemv`` (``gated``: ``gemv_silu_and_mul``, no bias or residual) for
    inputs ``supports`` has passed, unchecked (the dispatch checks once).
    ``norm`` (weight [K], eps): x RMS-normalised first, as
    kernels/fused_norm.py rounds it. ``round_before_residual``: the product
    rounded before the residual's add, as a separate add rounds (default:
    one rounding, as ``addmm_``). ``out`` (default: ``residual``, else a
    new [1, N]) may be a fresh tensor with a residual, leaving the residual
    as it is. ``dependent``: a ``DEPENDENT_MODES`` name (True: "on",
    False: "off", None: ``dependent_launch(x)``); a dependent launch loads
    the first weight step ahead, and ``prefetch`` does that in a plain one,
    on any device (the interpreter has no grid dependency control). The
    launch shape is for benchmarks: the engine's is the default. A packed
    weight (``PackedLinear``) launches ``_packed_gemv_kernel``, which loads
    nothing ahead: ``prefetch`` is ignored and "l2" is "on" for it."""
    mode = dependent_launch(x) if dependent is None else _mode_name(dependent)
    if isinstance(weight, PackedLinear):
        return _launch_packed(x, weight, bias, residual, out, block_n, k_step, num_warps, gated, norm,
                              round_before_residual, mode)  # fmt: skip
    n, grid, scalars, norm_weight, constexprs = _spec(weight, bias, residual is not None, block_n, k_step, num_warps,
                                                      gated, norm, round_before_residual, mode, prefetch)  # fmt: skip
    if out is None:
        out = residual if residual is not None else torch.empty((1, n), dtype=x.dtype, device=x.device)
    _GEMV[grid](x, weight, bias if bias is not None else out, residual if residual is not None else out,
                norm_weight if norm_weight is not None else out, out, *scalars, **constexprs)  # fmt: skip
    return out


def _launch_packed(x: torch.Tensor, w: PackedLinear, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   out: torch.Tensor | None, block_n: int | None, k_step: int | None, num_warps: int, gated: bool,
                   norm: tuple[torch.Tensor, float] | None, round_before_residual: bool, mode: str) -> torch.Tensor:
    """``launch`` of a packed weight."""
    n, grid, weights, scalars, norm_weight, constexprs = _packed_spec(
        w, bias, residual is not None, block_n, k_step, num_warps, gated, norm, round_before_residual, mode)
    if out is None:
        out = residual if residual is not None else torch.empty((1, n), dtype=x.dtype, device=x.device)
    _PACKED_GEMV[grid](x, *weights, bias if bias is not None else out, residual if residual is not None else out,
                       norm_weight if norm_weight is not None else out, out, *scalars, **constexprs)  # fmt: skip
    return out


def _packed_spec(w: PackedLinear, bias: torch.Tensor | None, residual: bool, block_n: int | None,
                 k_step: int | None, num_warps: int, gated: bool, norm: tuple[torch.Tensor, float] | None,
                 round_before_residual: bool, mode: str) -> tuple[int, tuple[int], tuple, tuple, torch.Tensor | None,
                                                                  dict]:  # fmt: skip
    """``_spec`` of a packed weight: (output columns, grid, the codes'
    tensors as the kernel takes them, the scalars after its tensors, the
    norm's weight, the constexprs and launch options)."""
    rows, k = w.shape
    step, fmt, group_size = _packed_format(w.float8, w.bits, w.group_size, k, k_step)
    if block_n is None and not w.codes.is_cuda:
        block_n = INTERPRETER_BLOCK_N
    n, grid, block_n, block_d = _shape(rows, k, gated, norm is not None, block_n, step)
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    weights = (w.codes, w.scales, w.zeros if w.zeros is not None else w.scales, w.g_idx)
    constexprs = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual, ROUND_BEFORE_RESIDUAL=round_before_residual,
                      GATED=gated, NORM=norm is not None, **fmt, BLOCK_N=block_n, BLOCK_K=step, BLOCK_D=block_d,
                      num_warps=num_warps, **_PACKED_CHAIN[mode])  # fmt: skip
    return n, grid, weights, (n, k, w.codes.stride(0), w.scales.stride(0), group_size, float(eps)), norm_weight, \
        constexprs


def _spec(weight: torch.Tensor, bias: torch.Tensor | None, residual: bool, block_n: int | None, k_step: int | None,
          num_warps: int, gated: bool, norm: tuple[torch.Tensor, float] | None, round_before_residual: bool,
          mode: str, prefetch: bool) -> tuple[int, tuple[int], tuple, torch.Tensor | None, dict]:  # fmt: skip
    """(output columns, grid, the scalars after the kernel's tensors, the
    norm's weight, the constexprs and launch options) of ``launch``."""
    rows, k = weight.shape
    k_step = k_step or block_k(k)
    if block_n is None and not weight.is_cuda:
        block_n = INTERPRETER_BLOCK_N
    n, grid, block_n, block_d = _shape(rows, k, gated, norm is not None, block_n, k_step)
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    constexprs = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual, ROUND_BEFORE_RESIDUAL=round_before_residual,
                      GATED=gated, NORM=norm is not None, BLOCK_N=block_n, BLOCK_K=k_step, BLOCK_D=block_d,
                      num_warps=num_warps, **chain_options(mode, prefetch, k, block_n * (2 if gated else 1), weight))
    return n, grid, (n, k, weight.stride(0), float(eps)), norm_weight, constexprs  # fmt: skip


class PreparedGemv:
    """``launch`` for one weight with its bias, norm, residual and launch
    mode fixed, worked out once (grid, scalars, constexprs): a decoder
    layer's batch-1 row path launches each of its GEMVs with only the
    step's rows, every step, without ``launch``'s per-call work. For
    inputs ``supports`` (and, with a norm, ``supports_norm``) has passed
    on rows of the weight's dtype and device, unchecked."""

    __slots__ = ("n", "residual", "_weights", "_bias", "_norm_weight", "_scalars", "_dtype", "_site")

    def __init__(self, weight: torch.Tensor | PackedLinear, bias: torch.Tensor | None = None, *,
                 residual: bool = False, gated: bool = False, norm: tuple[torch.Tensor, float] | None = None,
                 round_before_residual: bool = False, mode: str = "off",
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """``dtype``: the rows' (a packed weight's activations; by default
        a dense weight's own)."""
        self.residual = residual
        self._bias, self._dtype = bias, dtype or weight.dtype
        mode = _mode_name(mode)
        if isinstance(weight, PackedLinear):
            self.n, grid, self._weights, self._scalars, self._norm_weight, constexprs = _packed_spec(
                weight, bias, residual, None, None, NUM_WARPS, gated, norm, round_before_residual, mode)
            relaunch = _PACKED_GEMV
        else:
            self._weights = (weight,)
            self.n, grid, self._scalars, self._norm_weight, constexprs = _spec(
                weight, bias, residual, None, None, NUM_WARPS, gated, norm, round_before_residual, mode,
                False)  # fmt: skip
            relaunch = _GEMV
        # Its rows are the only arguments that change: on a GPU, rows of the
        # weight's dtype, 16-byte aligned, launch without a key.
        self._site = Site(relaunch, grid, constexprs)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [1, K] -> ``out`` [1, n] (plus ``residual`` [1, n] where prepared
        with one; ``out`` may be the residual itself)."""
        if (residual is not None) is not self.residual:
            raise ValueError(f"a GEMV prepared {'with' if self.residual else 'without'} a residual")
        bias, norm_weight = self._bias, self._norm_weight
        args = (x, *self._weights, bias if bias is not None else out, residual if residual is not None else out,
                norm_weight if norm_weight is not None else out, out, *self._scalars)  # fmt: skip
        dtype = self._dtype
        self._site(args, x.dtype is dtype and out.dtype is dtype
                   and (aligned(x, out) if residual is None else aligned(x, out, residual)))  # fmt: skip
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


_PREFETCH = dict(PREFETCH=True)
_DEPENDENT = dict(PREFETCH=True, GDC=True, launch_pdl=True)
# A packed weight's launch by mode: dependent or not, nothing loaded ahead.
# A dense program holds its first step's load across the wait; a packed one
# would hold its codes, scales and their addresses too, beside registers
# its K step (PACKED_BLOCK_K) was chosen to fill with the loop alone. The
# L2 prefetch fetches stretches of rows of bytes; a packed row's step reads
# its scales (and, gathered, g_idx) as well, which it would not fetch, and
# is a quarter to half the dense row's bytes. Neither is timed on a GPU.
_PACKED_CHAIN = {"off": {}, "on": dict(GDC=True, launch_pdl=True), "l2": dict(GDC=True, launch_pdl=True)}


def chain_options(mode: str, prefetch: bool, k: int, rows: int, weight: torch.Tensor) -> dict:
    """The constexprs and launch option of a launch in ``mode`` (``launch``'s
    ``dependent`` and ``prefetch``), a program reading ``rows`` rows of
    ``weight`` (gated: its gate and up rows) of K ``k``. The "l2" stretch is
    the longest of each row, a multiple of L2_PARTS 16-byte pieces, that
    keeps a program within L2_PREFETCH_BYTES; none where a row's start is
    not 16-byte aligned, which the bulk prefetch needs."""
    if mode == "off":
        return _PREFETCH if prefetch else {}
    elem = weight.element_size()
    if mode == "on" or (weight.stride(0) * elem) % 16 or weight.data_ptr() % 16:
        return _DEPENDENT
    return _l2_shape(k, rows, elem)


@functools.cache
def _l2_shape(k: int, rows: int, elem: int) -> dict:
    piece = L2_PARTS * 16 // elem  # values: every part a whole number of 16-byte pieces
    l2_k = min(k, L2_PREFETCH_BYTES // (rows * elem)) // piece * piece
    if l2_k == 0:
        return _DEPENDENT
    return dict(_DEPENDENT, L2_K=l2_k, L2_PART_BYTES=l2_k // L2_PARTS * elem)
