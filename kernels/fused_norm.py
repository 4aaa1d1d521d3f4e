"""RMSNorm, optionally after a residual add, in one kernel: the decoder
layer's ``h = x + attn_out; n = rms_norm(h)`` as one read of each input and
one write of each output, instead of the seven or so ops of the torch
expression.

Arithmetic is the Hugging Face reference's (``LlamaRMSNorm``): the residual
sum is rounded to the input dtype (as ``x + y`` in that dtype rounds), the
norm is taken in fp32 over the rounded sum, cast back to the input dtype, and
only then multiplied by the weight, in that dtype. ``ops.rms_norm`` runs the
same arithmetic in torch off the Triton lane.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fluidserve.kernels.launch import Relaunch, Site, aligned, cdiv, next_power_of_2, row_tiling


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, D]
    residual_ptr,  # [T, D] (read only if HAS_RESIDUAL)
    weight_ptr,  # [D]
    out_ptr,  # [T, D]: the normalised rows
    sum_ptr,  # [T, D]: x + residual (written only if HAS_RESIDUAL; may be x itself)
    stride_x, stride_r, stride_o, stride_s,
    dim,
    eps,
    num_rows,  # read only with BLOCK_T > 1
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr = 1,  # rows a program (``launch.row_tiling``)
):
    if BLOCK_T == 1:  # a GPU's launch: the program's row
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < dim
    else:  # [rows, D] tiles; rows past the last masked
        row = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        mask = (cols < dim) & (row < num_rows)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    if BLOCK_T == 1:
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    else:
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=1) / dim + eps)[:, None]
    normed = (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM = Relaunch(_rms_norm_kernel)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, dim] with contiguous rows, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be [{x.shape[1]}]")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1 or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype, with contiguous rows")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = x + residual`` (``s = x`` without a
    residual). The sum is written over ``x`` in place, so ``x`` must be a
    tensor the caller owns; x: [T, D] -> two [T, D] tensors."""
    _check(x, weight, residual)
    out = torch.empty_like(x)
    if x.shape[0]:
        has_residual = residual is not None
        r = residual if has_residual else x
        block_t, rows = row_tiling(x)
        _RMS_NORM[(cdiv(x.shape[0], block_t),)](
            x, r, weight, out, x, x.stride(0), r.stride(0), out.stride(0), x.stride(0), x.shape[1], float(eps),
            rows, HAS_RESIDUAL=has_residual, BLOCK_D=next_power_of_2(x.shape[1]), BLOCK_T=block_t,
        )  # fmt: skip
    return out, x



class StepNorm:
    """``rms_norm`` for every layer of a step over rows of one shape, each
    layer with its own weight, into an output of the caller's (a step's
    buffer), with or without a residual: checked and laid out once, then a
    layer passes only its tensors. For rows laid out as the first call's
    (contiguous [T, D] of its dtype, which the caller's buffers are); a
    weight or row of another dtype or address alignment takes the key,
    still correct."""

    __slots__ = ("_residual", "_dtype", "_scalars", "_site")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: bool) -> None:
        _check(x, weight, x if residual else None)
        if not x.is_contiguous():
            raise ValueError("a step's norm takes contiguous rows")
        t, d = x.shape
        self._residual, self._dtype = residual, x.dtype
        # Every row tensor of the step is contiguous [T, D]: one stride for all.
        block_t, rows = row_tiling(x)
        self._scalars = (d, d, d, d, d, float(eps), rows)
        self._site = Site(_RMS_NORM, (cdiv(t, block_t),),
                          dict(HAS_RESIDUAL=residual, BLOCK_D=next_power_of_2(d), BLOCK_T=block_t))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``out = rms_norm(s) * weight`` with ``s = x + residual`` written
        over ``x`` (``s = x`` without one, ``x`` left as it is); returns
        ``out``. Rows of the first call's shape, contiguous."""
        if (residual is not None) is not self._residual:
            raise ValueError(f"a norm prepared {'with' if self._residual else 'without'} a residual")
        r = residual if residual is not None else x
        dtype = self._dtype
        self._site((x, r, weight, out, x, *self._scalars),
                   x.dtype is dtype and r.dtype is dtype and out.dtype is dtype and weight.dtype is dtype
                   and aligned(x, r, weight, out))  # fmt: skip
        return out
