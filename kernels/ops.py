"""The one dispatch point the models call, and the switch that picks the
kernels: the Triton kernels on CUDA tensors; elsewhere the CPU kernels
(kernels/cpu_attention.py, which the engine's layers call themselves) or, in
this module, the torch reference. Signatures and semantics are reference.py's.

``FLUIDSERVE_KERNELS=triton`` (default ``auto``) sends CPU tensors down the
GPU's path too: the same plans, the same kernels, run by Triton's
interpreter. CI runs engine tests that way, so the code that only ran on a
GPU runs on every commit. The interpreter must be chosen before Triton
is imported (kernels/__init__.py sees to it) and the switch refuses to go on
if Triton was imported for a GPU.

The Triton modules are imported lazily so that CPU-only code paths (the
scheduler, the tests of the engine on CPU) never pay for importing Triton.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch

from fluidserve.kernels import reference

if TYPE_CHECKING:
    from fluidserve.kernels.packing import WorkPlan


KERNELS_ENV = "FLUIDSERVE_KERNELS"
BATCH_STEPS_ENV = "FLUIDSERVE_BATCH_STEPS"
KERNEL_CHOICES = ("auto", "triton")

_reference_only = False
_interpreter_checked = False

KernelPath = Literal["triton", "cpu", "reference"]


def kernel_choice() -> str:
    """``FLUIDSERVE_KERNELS``, checked: ``auto`` (Triton on CUDA, the CPU
    kernels elsewhere) or ``triton`` (Triton on every device)."""
    choice = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return choice


def kernel_path(device: torch.device) -> KernelPath:
    """Which kernels serve tensors on ``device``: ``triton``, ``cpu`` (the
    engine's CPU kernels) or ``reference`` (``reference_path``, tests)."""
    if _reference_only:
        return "reference"
    if device.type == "cuda":
        return "triton"
    if kernel_choice() == "triton":
        _require_interpreter()
        return "triton"
    return "cpu"


def _require_interpreter() -> None:
    """Off CUDA the Triton kernels can only run interpreted, and Triton
    takes that choice when it is first imported (kernels/__init__.py turns
    the interpreter on for FLUIDSERVE_KERNELS=triton): check it once."""
    global _interpreter_checked
    if _interpreter_checked:
        return
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.max, InterpretedFunction):
        raise RuntimeError(f"{KERNELS_ENV}=triton on a CPU device runs Triton's interpreter, but Triton was "
                           "imported without it: set TRITON_INTERPRET=1 before starting")
    problem = interpreter_incompatibility()
    if problem:
        raise RuntimeError(problem)
    _interpreter_checked = True


def interpreter_incompatibility(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter cannot run our kernels beside numpy at these
    versions (default: the installed ones), or None. Triton before 3.7
    turns a loop bound passed at run time (``range(0, K, BLOCK_K)``) into
    an int with ``int()`` of a one-element array, which numpy 2.4 refuses
    (deprecated since 1.25); every kernel with such a loop then fails inside
    the interpreter with a TypeError that names neither package."""
    import numpy
    import triton

    triton_version = triton_version or triton.__version__
    numpy_version = numpy_version or numpy.__version__
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run with numpy {numpy_version} (Triton before 3.7 "
                "calls int() on one-element arrays, which numpy 2.4 refuses): install numpy<2.4 or triton>=3.7")
    return None


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)(?:\.(\d+))?", version)
    return (int(found[1]), int(found[2] or 0)) if found else (0, 0)


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


def _on_triton(*tensors: torch.Tensor) -> bool:
    device = tensors[0].device
    for t in tensors:  # a loop, not all(...): every layer asks several times a step
        if t.device.type != device.type:
            return False
    return kernel_path(device) == "triton"


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
    path: KernelPath | None = None,
) -> None:
    """``path``: the caller's ``kernel_path`` (None: worked out here)."""
    if path == "triton" if path is not None else _on_triton(key, value, key_cache, value_cache, slot_mapping):
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
    path: KernelPath | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``work`` (a per-step plan from ``paged_attention.plan_for``) is used only
    by the Triton kernels; the reference needs none. ``path``: the caller's
    ``kernel_path`` (None: worked out here). ``softcap``: the scores' cap
    (Gemma 2's ``attn_logit_softcapping``)."""
    if path == "triton" if path is not None else _on_triton(query, key_cache, value_cache, block_tables):
        from fluidserve.kernels import paged_attention as triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, work,
            softcap,
        )
    return reference.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap
    )


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> torch.Tensor:
    if _on_triton(cache, block_ids):
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
    if _on_triton(cache, block_ids):
        from fluidserve.kernels import cache_ops

        cache_ops.scatter_blocks(staging.to(cache.device, non_blocking=True), cache, block_ids)
    else:
        reference.scatter_blocks(staging, cache, block_ids)


# -- linears ---------------------------------------------------------------------------


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor | reference.PackedLinear,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [T, N], accumulated into in place
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``x W^T + bias``, plus ``residual`` where given: without a bias in
    the same kernel, written over ``residual`` (which the caller must own);
    with one the linear is rounded before the add, as the unfused sum is.

    One row on the Triton lane runs kernels/gemv.py, which reads the weight
    at up to 1.2x cuBLAS's rate at batch 1 (``linear_bandwidth_*.md``),
    where ``gemv_row`` says. Elsewhere cuBLAS (or whatever torch runs on
    the device). A packed weight (``reference.PackedLinear``) takes the
    same GEMV where it supports the weight, else ``packed_linear`` with the
    residual added after (the product rounded first). ``path``: the
    caller's ``kernel_path`` (None: worked out here)."""
    if gemv_row(x, _stored(weight), path):
        from fluidserve.kernels import gemv

        fused = residual if bias is None else None  # with a bias, rounded before the add as below
        if gemv.supports(x, weight, bias, fused):
            y = gemv.launch(x, weight, bias, fused)
            return y if fused is residual else y.add_(residual)
    if isinstance(weight, reference.PackedLinear):
        y = packed_linear(x, weight, bias, path)
        return y if residual is None else y.add_(residual) if bias is not None else residual.add_(y)
    if residual is None:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is not None:
        return torch.nn.functional.linear(x, weight, bias).add_(residual)
    return residual.addmm_(x, weight.t())


def linear_silu_and_mul(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor | reference.PackedLinear,  # [2I, K]: gate rows, then up rows
    bias: torch.Tensor | None = None,  # [2I]
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))``, [T, K] -> [T, I]: the
    gated MLP's first half. One row on the Triton lane (where ``linear``
    runs the GEMV) is one launch, the activation in the GEMV's epilogue,
    with the same bits as the two launches. A packed weight likewise."""
    if bias is None and gemv_row(x, _stored(weight), path):
        from fluidserve.kernels import gemv

        if gemv.supports_gated(x, weight):
            return gemv.launch(x, weight, None, None, gated=True)
    return silu_and_mul(linear(x, weight, bias, path=path), path)


def norm_linear(
    x: torch.Tensor,  # [T, K], left as it is
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor | reference.PackedLinear,  # [N, K] ([2I, K] gated)
    bias: torch.Tensor | None = None,
    gated: bool = False,
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``linear(rms_norm(x), weight, bias)`` (``gated``: its
    ``silu_and_mul``). Where ``gemv_row`` says, one launch: the GEMV takes
    the row's norm in its prologue, rounded as ``rms_norm`` rounds; only
    the order of the sum of squares may differ (not at all in the
    interpreter). A packed weight likewise."""
    if gemv_row(x, _stored(weight), path) and not (gated and bias is not None):
        from fluidserve.kernels import gemv

        fits = gemv.supports_gated(x, weight) if gated else gemv.supports(x, weight, bias, None)
        if fits and gemv.supports_norm(x, norm_weight):
            return gemv.launch(x, weight, bias, None, gated=gated, norm=(norm_weight, eps))
    normed = rms_norm(x, norm_weight, eps, path=path)[0]
    return linear_silu_and_mul(normed, weight, bias, path) if gated else linear(normed, weight, bias, path=path)


def linear_add(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor | reference.PackedLinear,  # [N, K]
    residual: torch.Tensor,  # [T, N], left as it is
    bias: torch.Tensor | None = None,
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``linear(x, weight, bias) + residual`` as a new tensor, rounded as
    that separate add rounds (the product first): at one row where the GEMV
    runs, one launch. A packed weight likewise."""
    if bias is None and gemv_row(x, _stored(weight), path):
        from fluidserve.kernels import gemv

        if gemv.supports(x, weight, None, residual):
            return gemv.launch(x, weight, None, residual, out=torch.empty_like(residual), round_before_residual=True)
    return linear(x, weight, bias, path=path).add_(residual)


def packed_linear(
    x: torch.Tensor,  # [T, K]
    weight: reference.PackedLinear,  # [N, K] as stored
    bias: torch.Tensor | None = None,  # [N]
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``x W^T + bias`` for a packed weight, a new [T, N]: ``fp8_linear`` or
    ``int_linear`` of its tensors, W rounded to x's dtype as
    ``weight.dequantize(x.dtype)`` is. No GEMV: ``linear`` is the entry
    that runs one where it can."""
    if weight.float8:
        return fp8_linear(x, weight.codes, weight.scales, weight.g_idx, bias, weight.group_size, path)
    return int_linear(x, weight.codes, weight.scales, weight.zeros, weight.g_idx, weight.bits, bias, weight.group_size,
                      path)  # fmt: skip


def int_linear(
    x: torch.Tensor,  # [T, K]
    codes: torch.Tensor,  # [N, K / (32 / bits)] int32
    scales: torch.Tensor,  # [N, G] fp32
    zeros: torch.Tensor,  # [N, G] uint8
    g_idx: torch.Tensor,  # [K] int32
    bits: int,
    bias: torch.Tensor | None = None,  # [N]
    group_size: int | None = None,  # g_idx is k // group_size (``reference.plain_group_size``)
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``x W^T + bias`` for a weight held as GPTQ/AWQ integers (kernels/
    int_linear.py has the format), W rounded to x's dtype as the
    dequantized checkpoint's weight is. On the Triton lane up to
    ``MAX_FUSED_ROWS`` rows run one kernel that reads the packed weight
    (what decode is: a quarter of a 16-bit weight's bytes at 4 bits); more
    rows dequantize the weight into a temporary for the device's GEMM,
    whose time then grows with the rows, not the bytes. Elsewhere the torch
    reference, which dequantizes on every call."""
    if path == "triton" if path is not None else _on_triton(x, codes):
        from fluidserve.kernels import int_linear as kernel

        if x.shape[0] <= kernel.MAX_FUSED_ROWS and kernel.supports(x, codes, bits):
            return kernel.int_linear(x, codes, scales, zeros, g_idx, bits, bias, group_size=group_size)
        weight = kernel.dequantize(codes, scales, zeros, g_idx, bits, x.dtype, group_size=group_size)
        return torch.nn.functional.linear(x, weight, bias)
    return reference.int_linear(x, codes, scales, zeros, g_idx, bits, bias, group_size)


def fp8_linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] float8
    scales: torch.Tensor,  # [N, G] fp32
    g_idx: torch.Tensor,  # [K] int32
    bias: torch.Tensor | None = None,  # [N]
    group_size: int | None = None,  # g_idx is k // group_size (``reference.plain_group_size``)
    path: KernelPath | None = None,
) -> torch.Tensor:
    """``x W^T + bias`` for a weight held in float8 with a scale a row a
    group (kernels/fp8_linear.py has the format), W rounded to x's dtype as
    the dequantized checkpoint's weight is; dispatched as ``int_linear`` is
    (half a 16-bit weight's bytes a decode step)."""
    if path == "triton" if path is not None else _on_triton(x, weight):
        from fluidserve.kernels import fp8_linear as kernel

        # Triton converts e4m3 from sm_89 on (Ada, Hopper); an older GPU
        # dequantizes through torch, as the CPU does.
        if kernel.converts(weight):
            if x.shape[0] <= kernel.MAX_FUSED_ROWS and kernel.supports(x, weight):
                return kernel.fp8_linear(x, weight, scales, g_idx, bias, group_size=group_size)
            dense = kernel.dequantize(weight, scales, g_idx, x.dtype, group_size=group_size)
            return torch.nn.functional.linear(x, dense, bias)
    return reference.fp8_linear(x, weight, scales, g_idx, bias, group_size)


# Whether an eager CUDA step runs the batch-1 row kernels (a decode graph
# always does). Process-wide: benchmarks time the eager layer both ways
# (kernel_bench.py --batch1-decode, mode eager-cublas).
_eager_row_kernels = True


def set_eager_row_kernels(on: bool) -> bool:
    """Turn the row kernels of eager CUDA steps on or off; returns the old setting."""
    global _eager_row_kernels
    old, _eager_row_kernels = _eager_row_kernels, bool(on)
    return old


# Whether a step of several rows on the Triton kernels runs its decoder
# layers from buffers and launches the step's first layer prepares
# (models/llama.py, the batch path) rather than through the modules.
# Process-wide: benchmarks time both (mixed_steps.py); read once, for
# ruling the path out, not for flipping per request.
_batch_steps = os.environ.get(BATCH_STEPS_ENV, "1").strip() != "0"


def set_batch_steps(on: bool) -> bool:
    """Turn the layers' batch path on or off; returns the old setting."""
    global _batch_steps
    old, _batch_steps = _batch_steps, bool(on)
    return old


def batch_steps() -> bool:
    """Whether the layers' batch path is on (``set_batch_steps``)."""
    return _batch_steps


def gemv_row(x: torch.Tensor, weight: torch.Tensor, path: KernelPath | None = None) -> bool:
    """One row on the Triton lane: the batch-1 GEMV and, in the decoder
    layer, its six-launch form. Eagerly on CUDA too: the eager H100 profile
    (profile_decode_*-eager.md) puts a cuBLAS linear's host time at or
    above a Triton launch's, and the row layer replaces seven launches
    (three linears, addmm_, two norms, the SiLU-mul) with four GEMVs that
    also read the weights faster (linear_bandwidth_*.md). ``path``: the
    caller's ``kernel_path`` (None: worked out here)."""
    if x.shape[0] != 1 or not (path == "triton" if path is not None else _on_triton(x, weight)):
        return False
    return x.device.type != "cuda" or _eager_row_kernels or torch.cuda.is_current_stream_capturing()


# -- the decoder layer's fused ops ----------------------------------------------------
# Triton on its lane (one launch each); elsewhere the same arithmetic in as
# few torch ops as it takes, in place where the caller owns the tensor.


def rms_norm(
    x: torch.Tensor,  # [T, D] (any leading dims off the Triton lane)
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
    path: KernelPath | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s) * weight, s)`` with ``s = x + residual`` written over
    ``x`` in place (``s = x`` without a residual), as the reference rounds:
    the sum in x's dtype, the norm in fp32, cast back, then the weight."""
    if x.dim() == 2 and (path == "triton" if path is not None else _on_triton(x, weight)):
        from fluidserve.kernels import fused_norm

        return fused_norm.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = x.add_(residual)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps), x  # the reference's arithmetic, one op
    return weight * torch.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype), x


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any strides) in place by [T, R] tables laid out
    as ``rope_cache`` describes: the halves swapped into a copy, then a
    multiply and a fused multiply-add. Tables narrower than the head (a
    partial rope) rotate its first R features and leave the rest."""
    if cos.shape[-1] != x.shape[-1]:
        rope_torch(x[..., :cos.shape[-1]], cos, sin)
        return x
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [x2 | x1]
    return x.mul_(cos.unsqueeze(1)).addcmul_(swapped, sin.unsqueeze(1))


def rope_and_cache(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hk, D]
    v: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D], sign folded (kernels/rope_cache.py)
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, -1 = do not write
    path: KernelPath | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # q's and k's [D] weights, eps
) -> None:
    """Rotate q and k in place, then write k and v into their cache slots;
    with ``qk_norm``, each head of q and k RMS-normed first (Qwen3), in
    place too."""
    if path == "triton" if path is not None else _on_triton(q, key_cache, slot_mapping):
        from fluidserve.kernels import rope_cache

        if qk_norm is not None and not (qk_norm[0].dtype == qk_norm[1].dtype == q.dtype):
            _norm_heads(q, k, qk_norm)  # weights of another dtype than the heads: torch norms them
            qk_norm = None
        rope_cache.rope_and_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, qk_norm)
        return
    if qk_norm is not None:
        _norm_heads(q, k, qk_norm)
    rope_torch(q, cos, sin)
    rope_torch(k, cos, sin)
    reference.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)


def _norm_heads(q: torch.Tensor, k: torch.Tensor, qk_norm: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    """RMS-norm each head of q [T, Hq, D] and k [T, Hk, D] in place, as
    ``rms_norm`` rounds."""
    q_weight, k_weight, eps = qk_norm
    q.copy_(rms_norm(q, q_weight, eps, path="reference")[0])
    k.copy_(rms_norm(k, k_weight, eps, path="reference")[0])


def silu_and_mul(x: torch.Tensor, path: KernelPath | None = None) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> silu(gate) * up, [T, I]."""
    if x.dim() == 2 and (path == "triton" if path is not None else _on_triton(x)):
        from fluidserve.kernels import activation

        return activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


# -- mixture of experts ---------------------------------------------------------------


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | reference.PackedExperts,  # [E, 2N, H]: per expert gate_proj rows [0, N), then up_proj rows
    w2: torch.Tensor | reference.PackedExperts,  # [E, H, N]: per expert down_proj
    topk_ids: torch.Tensor,  # [T, k] int64 or int32: the expert of each (token, slot)
    topk_weights: torch.Tensor,  # [T, k] fp32 or x's dtype: the routing weight of each (token, slot)
    path: KernelPath | None = None,
) -> torch.Tensor:
    """The routed experts of an MoE layer, [T, H] of x's dtype:
    ``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) *
    up_e(x[t]))`` with ``e = topk_ids[t, j]``, rounded as reference.py says.
    Each weight dense or ``reference.PackedExperts`` (a quantized
    checkpoint's experts as stored, dequantized to x's dtype tile by tile).
    On the Triton lane kernels/moe.py (no host sync, CUDA-graph safe);
    elsewhere the reference, which syncs once. ``path``: the caller's
    ``kernel_path`` (None: worked out here)."""
    b13, b2 = _stored(w13), _stored(w2)
    if path == "triton" if path is not None else _on_triton(x, b13, b2, topk_ids, topk_weights):
        # Triton converts e4m3 from sm_89 on (Ada, Hopper); an older GPU's
        # float8 experts take the reference, as its fp8 linears do.
        if _converts(w13) and _converts(w2):
            from fluidserve.kernels import moe

            return moe.fused_experts(x, w13, w2, topk_ids, topk_weights)
    return reference.fused_experts(x, w13, w2, topk_ids, topk_weights)


def _stored(w: torch.Tensor | reference.PackedLinear | reference.PackedExperts) -> torch.Tensor:
    """The tensor that holds a weight's values (what the lane is picked
    by): a dense weight, or a packed one's codes."""
    return w.codes if isinstance(w, (reference.PackedLinear, reference.PackedExperts)) else w


def _converts(w: torch.Tensor | reference.PackedExperts) -> bool:
    """Whether Triton reads this weight on its device (``fp8_linear.converts``)."""
    if not isinstance(w, reference.PackedExperts) or not w.float8:
        return True
    from fluidserve.kernels import fp8_linear

    return fp8_linear.converts(w.codes)
