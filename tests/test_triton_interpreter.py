"""The test suite's patch of Triton's interpreter (tests/triton_interpreter.py):
kernels that call other jit functions compute what they did, the language is
patched once a launch, not once a call, and nothing stays patched after it."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton's interpreter")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scaled(x, scale):
    return x * scale


@triton.jit
def _helpers_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros([BLOCK], tl.float32)  # triton.language.standard: a jit function that sees tl.core
    acc += _scaled(tl.load(x_ptr + offs, mask=ok, other=0.0), 3.0)  # one of this module's
    acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + offs, acc + tl.cdiv(n, BLOCK), mask=ok)


def test_device_function_calls_patch_the_language_once_a_launch(monkeypatch):
    from triton.runtime import interpreter

    from triton_interpreter import install

    why = install()
    if why is not None:
        pytest.skip(f"the patch is not installed on this Triton: {why}")
    calls = []
    monkeypatch.setattr(interpreter, "_patch_lang",
                        lambda fn, f=interpreter._patch_lang: calls.append(fn.__name__) or f(fn))  # fmt: skip
    x = torch.linspace(-2.0, 2.0, 100)
    y = torch.empty_like(x)
    programs = 100 // 8 + 1
    _helpers_kernel[(programs,)](x, y, 100, BLOCK=8)
    torch.testing.assert_close(y, torch.clamp(3.0 * x, min=0.0) + programs, rtol=0, atol=0)
    # The launch's own patch, and tl.core's for triton.language.standard's
    # zeros, in one program of thirteen; Triton patches at all 26 calls.
    assert calls == ["_helpers_kernel", "zeros"]
    # What the launch patched is restored (Triton leaves the inner calls' patches in place).
    for fn in (tl.core.full, tl.full, tl.core.tensor.__add__, tl.maximum):
        assert tl.core.is_builtin(fn), fn
    calls.clear()
    _helpers_kernel[(programs,)](x, y, 100, BLOCK=8)  # the next launch patches afresh
    assert calls == ["_helpers_kernel", "zeros"]


def test_remembered_numpy_dtypes_are_the_interpreters():
    """Every Triton type the kernels use, scalar, pointer and block, maps to
    the numpy dtype Triton's own function gives, asked once or many times."""
    from triton.runtime import interpreter

    from triton_interpreter import install

    why = install()
    if why is not None:
        pytest.skip(f"the patch is not installed on this Triton: {why}")
    original = getattr(interpreter._get_np_dtype, "original", None)
    assert original is not None, "install() left _get_np_dtype as Triton's"
    scalars = [tl.int1, tl.int8, tl.int16, tl.int32, tl.int64, tl.uint8, tl.uint32, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64]
    types = [*scalars, *(tl.pointer_type(t) for t in scalars), *(tl.block_type(t, [4, 8]) for t in scalars),
             tl.block_type(tl.pointer_type(tl.bfloat16), [16])]
    for _ in range(2):
        for t in types:
            assert interpreter._get_np_dtype(t) == original(t), t


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, B_ROWS_ARE_N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    if B_ROWS_ARE_N:  # b stored [N, K], as a dense weight: its tile transposed, a column-major view
        b = tl.trans(tl.load(b_ptr + n[:, None] * K + k[None, :]))
    else:  # b stored [K, N]: a row-major tile, as a tile built by arithmetic is
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b, input_precision="ieee"))


def test_a_product_has_the_same_bits_whichever_way_its_tiles_lie():
    """One product of a transposed tile and of the same values laid out
    row-major: the same bits, as a GPU's matrix instructions give, on every
    CPU (the shapes of a packed MoE test whose bits OpenBLAS's AVX-512
    kernels once told apart)."""
    from triton_interpreter import install

    why = install()
    if why is not None:
        pytest.skip(f"the patch is not installed on this Triton: {why}")
    g = torch.Generator().manual_seed(0)
    for m, k, n in ((16, 64, 32), (16, 64, 64), (16, 32, 16)):
        a = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g) / k**0.5
        out = [torch.empty(m, n) for _ in range(2)]
        _dot_kernel[(1,)](a, w, out[0], m, k, n, True)
        _dot_kernel[(1,)](a, w.t().contiguous(), out[1], m, k, n, False)
        assert torch.equal(out[0], out[1]), (m, k, n)
        torch.testing.assert_close(out[0], a @ w.t())
