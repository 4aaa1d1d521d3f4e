"""The batch-1 GEMV over packed weights (kernels/gemv.py with a
``reference.PackedLinear``) and the ops that take one: against the dense
GEMV over ``PackedLinear.dequantize`` to the bit at the same launch shape,
with every fusion (bias, residual in place, rounded before a fresh
residual, SiLU-mul, the RMSNorm prologue, both), int4 and int8 in plain
groups and act-order, e4m3 in blocks, a scale a row and gathered, fp32,
bf16 and fp16; ``ops.linear`` and the fused ops sending one row to the
packed GEMV and more rows to int_linear / fp8_linear on the Triton lane,
and to the reference elsewhere, with the dense ops' results; what the
GEMV refuses; and every engine launch compiled for sm_90 without spills."""

from __future__ import annotations

import pytest
import torch

from fluidserve.kernels import fp8_linear, gemv, int_linear, ops, reference
from fluidserve.kernels.launch import cdiv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (name, bits, group_size, act-order / layout, float8, K step of the kernel tests):
# steps within, across and at a group's width, and e4m3's two runs a step.
FORMATS = {
    "int4, groups of 32": (4, 32, False, False, 128),
    "int4, act-order": (4, 32, True, False, 128),
    "int8, groups of 128": (8, 128, False, False, 64),
    "int8, act-order": (8, 64, True, False, 64),
    "e4m3, blocks of 128": (8, 128, False, True, 256),
    "e4m3, a scale a row": (8, None, False, True, 128),
    "e4m3, gathered": (8, 128, True, True, 128),
}


def packed_weight(name: str, n: int, k: int, seed: int, device: str = "cpu") -> reference.PackedLinear:
    """A packed [n, k] weight in format ``name``: codes over their whole
    range, scales (and zeros) that differ by row and group, act-order or
    gathered groups scattered over K; outputs of unit-variance rows ~1."""
    bits, block, scattered, float8, _ = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    block = block or k  # a scale a row: one group of all K
    groups = cdiv(k, block)
    g_idx = torch.arange(k) // block
    if scattered:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    group_size = None if scattered else block
    if float8:
        codes = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = (0.5 + torch.rand(n, groups, generator=gen)) / (64 * k**0.5)
        zeros = None
    else:
        codes = reference.int_pack(torch.randint(0, 1 << bits, (n, k), generator=gen), bits)
        zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8).to(device)
        scales = (0.5 + torch.rand(n, groups, generator=gen)) * (6**0.5 / (1 << bits) / k**0.5)
    return reference.PackedLinear(codes.to(device), scales.to(device), zeros, g_idx.to(device, torch.int32), bits,
                                  group_size)  # fmt: skip


def activations(device: str, dtype: torch.dtype, n: int, k: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(x=(3 * torch.randn(1, k, generator=gen)).to(device, dtype),  # a norm that is not ~1
                bias=torch.randn(n, generator=gen).to(device, dtype),
                residual=torch.randn(1, n, generator=gen).to(device, dtype),
                norm=(1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype))  # fmt: skip


def fusions(x: torch.Tensor, w, a: dict, **how) -> dict[str, torch.Tensor]:
    """Every launch the decoder layer makes, over weight ``w`` (dense or
    packed; ``w``'s rows halve for the gated ones)."""
    norm = (a["norm"], 1e-5)
    return {
        "plain": gemv.launch(x, w, None, None, **how),
        "bias": gemv.launch(x, w, a["bias"], None, **how),
        "residual in place": gemv.launch(x, w, None, a["residual"].clone(), **how),
        "bias and residual": gemv.launch(x, w, a["bias"], a["residual"].clone(), **how),
        "round before residual": gemv.launch(x, w, None, a["residual"], out=torch.empty_like(a["residual"]),
                                             round_before_residual=True, **how),
        "norm": gemv.launch(x, w, a["bias"], None, norm=norm, **how),
        "gated": gemv.launch(x, w, None, None, gated=True, **how),
        "norm and gated": gemv.launch(x, w, None, None, gated=True, norm=norm, **how),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_a_packed_gemv_is_the_dense_gemv_over_the_dequantized_weight(device, name, dtype):
    """At one launch shape the packed GEMV's products and sums are the
    dense kernel's over ``dequantize(x.dtype)``: in the interpreter to the
    bit, with every fusion. Compiled, the dequantized tile's layout may
    order a row's sum otherwise: within a rounding of the output."""
    n, k = 32, 256
    w = packed_weight(name, n, k, seed=len(name), device=device)
    a = activations(device, dtype, n, k, seed=k)
    step = FORMATS[name][4]
    packed = fusions(a["x"], w, a, k_step=step)
    dense = fusions(a["x"], w.dequantize(dtype), a, k_step=step)
    exact = torch.float64
    for what, y in packed.items():
        assert y.dtype == dtype and y.shape == (1, n // 2 if "gated" in what else n), what
        if device == "cpu":
            assert torch.equal(y, dense[what]), what
        else:
            torch.testing.assert_close(y, dense[what], atol=2e-2, rtol=2e-2, msg=what)
    # Not two wrong answers alike: the plain product is the float64 one of the dequantized weight.
    want = a["x"].to(exact) @ w.dequantize(dtype).to(exact).t()
    torch.testing.assert_close(packed["plain"].to(exact), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["int4, groups of 32", "e4m3, blocks of 128"])
def test_a_prepared_packed_gemv_launches_as_gemv_launch(device, name):
    """``PreparedGemv`` over a packed weight (the decoder layer's batch-1
    row path, worked out once per load) gives ``launch``'s bits with each
    of the layer's four fusions, launch after launch."""
    n, k, dtype = 32, 256, torch.bfloat16
    w = packed_weight(name, n, k, seed=9, device=device)
    a = activations(device, dtype, n, k, seed=9)
    x, norm = a["x"], (a["norm"], 1e-5)
    qkv = gemv.PreparedGemv(w, norm=norm, dtype=dtype)
    o = gemv.PreparedGemv(w, residual=True, round_before_residual=True, dtype=dtype)
    gate_up = gemv.PreparedGemv(w, gated=True, norm=norm, dtype=dtype)
    down = gemv.PreparedGemv(w, residual=True, dtype=dtype)
    for _ in range(2):  # the first call keeps a launcher, the second runs it
        assert torch.equal(qkv(x, torch.empty(1, n, dtype=dtype, device=device)),
                           gemv.launch(x, w, None, None, norm=norm))
        got = o(x, torch.empty_like(a["residual"]), a["residual"])
        assert torch.equal(got, gemv.launch(x, w, None, a["residual"], out=torch.empty_like(a["residual"]),
                                            round_before_residual=True))  # fmt: skip
        assert torch.equal(gate_up(x, torch.empty(1, n // 2, dtype=dtype, device=device)),
                           gemv.launch(x, w, None, None, gated=True, norm=norm))
        residual = a["residual"].clone()
        assert down(x, residual, residual) is residual
        assert torch.equal(residual, gemv.launch(x, w, None, a["residual"].clone()))


def test_the_packed_gemv_reads_the_formats_groups_and_zeros():
    """The equality above can fail: a weight of other zeros, scales read by
    the wrong groups, or the act-order map taken as plain give other bits."""
    n, k = 32, 256
    w = packed_weight("int4, act-order", n, k, seed=1)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(1))
    y = gemv.launch(x, w, None, None, k_step=128)
    others = [reference.PackedLinear(w.codes, w.scales, w.zeros.roll(1, 1), w.g_idx, 4),
              reference.PackedLinear(w.codes, w.scales, w.zeros, torch.arange(k, dtype=torch.int32) // 32, 4, 32)]
    for other in others:
        assert not torch.equal(gemv.launch(x, other, None, None, k_step=128), y)
    e = packed_weight("e4m3, blocks of 128", n, k, seed=2)
    ye = gemv.launch(x, e, None, None, k_step=256)
    swapped = reference.PackedLinear(e.codes, e.scales.flip(1).contiguous(), None, e.g_idx, 8, 128)
    assert not torch.equal(gemv.launch(x, swapped, None, None, k_step=256), ye)


# -- the ops that take a packed weight ------------------------------------------------------


def _count_launches(monkeypatch, *kernels) -> list[str]:
    launches: list[str] = []
    for kernel in kernels:
        # In the instance's dict, which the undo empties again (as tests/kernels/test_gemv.py does).
        monkeypatch.setitem(vars(kernel), "run", (lambda run, name: lambda *a, **k: launches.append(name) or run(
            *a, **k))(kernel.run, kernel.fn.__name__))
    return launches


# (format, K): K the format's own GEMV step, which the dense GEMV takes for that K too (both step
# through K at once), so that their sums and bits agree.
OPS_CASES = [("int4, groups of 32", 512), ("int4, act-order", 128), ("e4m3, blocks of 128", 512)]


@pytest.mark.parametrize("name,k", OPS_CASES)
def test_ops_run_the_packed_gemv_at_one_row_and_the_packed_linears_above(device, monkeypatch, tol, name, k):
    """On the Triton lane (CI's GPU-path lane on CPU tensors): one row of
    ``linear`` (with a bias, a residual, both), ``linear_add``,
    ``linear_silu_and_mul`` and ``norm_linear`` (plain, gated) is one
    packed GEMV launch, to the bit the dense ops over the dequantized
    weight; three rows run int_linear / fp8_linear with the norm and the
    activation apart, within the int linears' tolerance of the dense ops
    rounded as the packed ones are (a residual added to the rounded
    product), a residual accumulated in place or left as it is as the
    dense ops leave it."""
    if device == "cuda":
        pytest.skip("the dispatch is the same on a GPU; the kernel test above covers the arithmetic")
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    n, dtype = 32, torch.bfloat16
    w = packed_weight(name, n, k, seed=k)
    assert gemv._packed_format(w.float8, w.bits, w.group_size, k, None)[0] == gemv.block_k(k) == k
    dense = w.dequantize(dtype)
    product = fp8_linear._fp8_linear_kernel if w.float8 else int_linear._int_linear_kernel
    launches = _count_launches(monkeypatch, gemv._packed_gemv_kernel, product)
    for rows in (1, 3):
        gen = torch.Generator().manual_seed(rows)
        x = (3 * torch.randn(rows, k, generator=gen)).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        residual = torch.randn(rows, n, generator=gen).to(dtype)
        norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
        calls = {
            "linear": lambda v: ops.linear(x, v),
            "linear, bias": lambda v: ops.linear(x, v, bias),
            "linear, residual": lambda v: ops.linear(x, v, None, residual.clone()),
            "linear, bias, residual": lambda v: ops.linear(x, v, bias, residual.clone()),
            "linear_add": lambda v: ops.linear_add(x, v, residual),
            "linear_silu_and_mul": lambda v: ops.linear_silu_and_mul(x, v),
            "norm_linear": lambda v: ops.norm_linear(x, norm, 1e-5, v, bias),
            "norm_linear, gated": lambda v: ops.norm_linear(x, norm, 1e-5, v, gated=True),
        }
        for what, call in calls.items():
            launches.clear()
            got = call(w)
            want = call(dense)
            if rows > 1 and what == "linear, residual":
                # addmm_ rounds the sum once; the packed product is rounded, then added: as the add rounds it
                want = residual + ops.linear(x, dense)
            if rows == 1:
                assert launches == ["_packed_gemv_kernel"], what
                assert torch.equal(got, want), what
            else:
                assert launches == [product.fn.__name__], what
                torch.testing.assert_close(got, want, **tol(dtype), msg=what)
    # A residual without a bias is accumulated in place at any rows; linear_add leaves its residual as it is.
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 3):
        x, residual = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(rows, n, generator=gen).to(dtype)
        kept = residual.clone()
        assert ops.linear(x, w, None, residual) is residual
        assert not torch.equal(residual, kept)
        before = kept.clone()
        assert ops.linear_add(x, w, kept) is not kept and torch.equal(kept, before)


def test_ops_take_a_packed_weight_the_gemv_refuses_through_the_packed_linear(monkeypatch):
    """K a multiple of no power of two from 16 (40: the GEMV's step must
    divide it): one row falls back to int_linear, with the norm and
    SiLU-mul apart."""
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    n, k, dtype = 32, 40, torch.float32
    w = packed_weight("int4, groups of 32", n, k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3))
    assert not gemv.supports(x, w, None, None)
    launches = _count_launches(monkeypatch, gemv._packed_gemv_kernel, int_linear._int_linear_kernel)
    norm = torch.ones(k)
    got = ops.norm_linear(x, norm, 1e-5, w, gated=True)
    assert launches == ["_int_linear_kernel"]
    want = ops.silu_and_mul(ops.linear(ops.rms_norm(x, norm, 1e-5)[0], w.dequantize(dtype)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert ops.packed_linear(x, w).shape == (1, n)


@pytest.mark.parametrize("name", ["int4, act-order", "e4m3, blocks of 128"])
def test_ops_on_the_reference_path_match_the_dense_ops(tol, name):
    """Off the Triton lane (the CPU path, or ``reference_path``) the packed
    ops dequantize through the reference: the dense ops' results over the
    dequantized weight, at one row and at several."""
    n, k, dtype = 32, 256, torch.bfloat16
    w = packed_weight(name, n, k, seed=4)
    dense = w.dequantize(dtype)
    gen = torch.Generator().manual_seed(4)
    with ops.reference_path():
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            residual, norm = torch.randn(rows, n, generator=gen).to(dtype), torch.rand(k, generator=gen).to(dtype)
            # addmm_ rounds a residual's sum once; the packed product is rounded, then added: as the add rounds it
            torch.testing.assert_close(ops.linear(x, w, None, residual.clone()), residual + ops.linear(x, dense),
                                       **tol(dtype))  # fmt: skip
            for call in (lambda v: ops.linear(x, v), lambda v: ops.linear_add(x, v, residual),
                         lambda v: ops.linear_silu_and_mul(x, v), lambda v: ops.norm_linear(x, norm, 1e-5, v),
                         lambda v: ops.norm_linear(x, norm, 1e-5, v, gated=True)):  # fmt: skip
                torch.testing.assert_close(call(w), call(dense), **tol(dtype))


# -- what the packed GEMV takes ------------------------------------------------------------


def test_the_packed_gemv_refuses_what_it_cannot_run():
    n, k = 32, 256
    w = packed_weight("int4, act-order", n, k, seed=5)
    e = packed_weight("e4m3, gathered", n, k, seed=6)
    x, bias = torch.randn(1, k), torch.randn(n)
    assert gemv.supports(x, w, bias, None) and gemv.supports(x, e, None, None)
    assert gemv.supports_gated(x, w) and gemv.supports_norm(x, torch.ones(k))
    P = reference.PackedLinear
    refused = [
        (torch.randn(2, k), w, None, None),  # two rows
        (x.double(), w, None, None),  # not fp32, fp16 or bf16
        (x, w, bias[:16], None),  # bias of the wrong length
        (x, w, bias.half(), None),  # bias of another dtype
        (x, P(w.codes.float(), w.scales, w.zeros, w.g_idx, 4), None, None),  # codes not int32
        (x, P(w.codes, w.scales, None, w.g_idx, 4), None, None),  # int codes with no zeros
        (x, P(w.codes, w.scales.t().contiguous().t(), w.zeros, w.g_idx, 4), None, None),  # scales not contiguous
        (x, P(w.codes, w.scales.double(), w.zeros, w.g_idx, 4), None, None),  # scales not float32
        (x, P(w.codes, w.scales, w.zeros, w.g_idx[:128], 4), None, None),  # g_idx not [K]
        (x, P(w.codes, w.scales, w.zeros, w.g_idx, 8), None, None),  # int8 reads [N, K / 4] words: K differs
        (x, P(e.codes, e.scales, torch.zeros_like(e.scales, dtype=torch.uint8), e.g_idx, 8, 128), None, None),
        (x, P(e.codes, e.scales, None, e.g_idx, 8, 64), None, None),  # G = 2 groups of 64 do not cover K
    ]
    for i, args in enumerate(refused):
        assert not gemv.supports(*args), i
    # K a multiple of 8 (whole words) but of no step from 16; a step narrower than the format's where K asks.
    plain = packed_weight("int4, groups of 32", n, 40, seed=7)
    assert not gemv.supports(torch.randn(1, 40), plain, None, None)
    assert gemv._packed_format(False, 4, 32, 96, None)[0] == 32 and gemv.PACKED_BLOCK_K["int", 4, False] == 512
    assert not gemv.supports_gated(x, packed_weight("int4, act-order", 31, k, seed=8))  # no two equal halves


def test_a_dependent_packed_launch_loads_nothing_ahead(monkeypatch):
    """Dependent modes wait for the kernel before (GDC) but neither load a
    step ahead nor prefetch into L2 (``gemv._PACKED_CHAIN`` says why)."""
    seen = []

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    monkeypatch.setattr(gemv, "_PACKED_GEMV", Recorded())
    w = packed_weight("int4, act-order", 32, 256, seed=9)
    for mode in ("off", "on", "l2"):
        gemv.launch(torch.randn(1, 256), w, None, None, dependent=mode, prefetch=True)
    assert [k.get("GDC", False) for k in seen] == [False, True, True]
    assert not any("PREFETCH" in k or "L2_K" in k for k in seen)
    assert seen[1]["launch_pdl"] and seen[0]["FORMAT"] == "int" and seen[0]["GROUPED"] is False


# -- compiled for a GPU ------------------------------------------------------------------------


def test_every_packed_gemv_launch_compiles_for_hopper_without_spilling(offline_compile):
    """Llama-3-8B's four row launches (qkv normed, o and down with the
    residual, gate/up gated and normed) in every format at its
    ``PACKED_BLOCK_K`` step (kernel_bench.gemv_packed_compile_report)
    compile for sm_90 with no spills and registers for three programs an
    SM, as the step's choice claims."""
    report = offline_compile("gemv_packed_compile_report()")
    assert len(report) == 7 * 4
    steps = {"int4, plain": gemv.PACKED_BLOCK_K["int", 4, False], "int4, act": gemv.PACKED_BLOCK_K["int", 4, True],
             "int8, plain": gemv.PACKED_BLOCK_K["int", 8, False], "int8, act": gemv.PACKED_BLOCK_K["int", 8, True],
             "e4m3, blocks": gemv.PACKED_BLOCK_K["float8", 8, False], "e4m3, a scale": gemv.PACKED_BLOCK_K[
                 "float8", 8, False], "e4m3, gathered": gemv.PACKED_BLOCK_K["float8", 8, True]}  # fmt: skip
    for row in report:
        assert row["stack_bytes"] == 0 and row["local_bytes"] == 0, row
        assert row["registers"] * 32 * row["num_warps"] * 3 <= 65536, row
        assert row["block_k"] == next(s for f, s in steps.items() if row["format"].startswith(f)), row
