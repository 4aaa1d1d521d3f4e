"""The fp32-accumulating tile product that every GEMM kernel here shares
(kernels/moe.py, kernels/int_linear.py, kernels/fp8_linear.py). It lives
apart from them so that the MoE kernel can import the quantized linears'
tile helpers, which import this, without an import cycle."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_fp32(a, b, acc, DOT_PRECISION: tl.constexpr):
    """``acc + a @ b`` in fp32. "widen" multiplies 16-bit operands as fp32,
    for Triton's interpreter, which multiplies bfloat16 bit patterns
    (triton-lang/triton#11584); products of 16-bit floats are exact in
    fp32, so it is the tensor cores' arithmetic up to summation order."""
    if DOT_PRECISION == "widen":
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out
