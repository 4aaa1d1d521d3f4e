"""The gated MLP's activation in one kernel: ``silu(gate) * up`` over the
fused gate/up projection's output ``[T, 2 * I]`` (gate columns first), where
torch takes two ops and an intermediate tensor.

Arithmetic is the reference's: the SiLU is rounded to the input dtype (as
torch's ``silu`` output is) before the product, which is rounded again, as
``ops.silu_and_mul`` does in torch off the Triton lane.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fluidserve.kernels.launch import Relaunch, Site, aligned, cdiv, row_tiling

# Output columns per program.
BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I]: gate | up
    out_ptr,  # [T, I]
    stride_x, stride_o,
    inter,
    num_rows,  # read only with BLOCK_T > 1
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr = 1,  # rows a program (``launch.row_tiling``)
):
    if BLOCK_T == 1:  # a GPU's launch: BLOCK columns of the program's row
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
    else:  # [rows, BLOCK] tiles; rows past the last masked
        row = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None]
        cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        mask = (cols < inter) & (row < num_rows)
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_AND_MUL = Relaunch(_silu_and_mul_kernel)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate | up) -> [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate] with contiguous rows, got {tuple(x.shape)}")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t:
        block_t, rows = row_tiling(x)
        _SILU_AND_MUL[(cdiv(t, block_t), cdiv(inter, BLOCK))](x, out, x.stride(0), out.stride(0), inter, rows,
                                                              BLOCK=BLOCK, BLOCK_T=block_t)  # fmt: skip
    return out



class StepSiluAndMul:
    """``silu_and_mul`` for every layer of a step, from one [T, 2 * I]
    buffer into one [T, I] buffer (a step's): laid out once, then each
    layer launches with no argument worked out."""

    __slots__ = ("_args", "_usual", "_site")

    def __init__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] % 2 or not x.is_contiguous():
            raise ValueError(f"x must be contiguous [num_tokens, 2 * intermediate], got {tuple(x.shape)}")
        t, inter = x.shape[0], x.shape[1] // 2
        if out.shape != (t, inter) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(f"out must be contiguous [{t}, {inter}] of {x.dtype}, got {tuple(out.shape)} {out.dtype}")
        block_t, rows = row_tiling(x)
        self._args, self._usual = (x, out, x.stride(0), out.stride(0), inter, rows), aligned(x, out)
        self._site = Site(_SILU_AND_MUL, (cdiv(t, block_t), cdiv(inter, BLOCK)), dict(BLOCK=BLOCK, BLOCK_T=block_t))

    def __call__(self) -> None:
        """``out = silu(gate) * up`` of this step's buffers."""
        self._site(self._args, self._usual)
