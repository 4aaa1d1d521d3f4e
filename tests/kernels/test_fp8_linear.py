"""The float8 linears (kernels/fp8_linear.py) against kernels/reference.py:
the reference's weight against one worked out in fp64, and every finite
float8 value against its bits decoded by hand; ``dequantize`` to the bit
(e4m3 and e5m2; fp32, fp16, bf16; block scales read per run or gathered
through ``g_idx``, and one scale a row); the fused ``fp8_linear`` within
the conftest's tolerances of the fp32 product of the dequantized weight,
for one row and for tiles of rows, ragged N and K, with and without a
bias; what the functions refuse; and that the operands tell a wrong scale
mapping apart (neighbouring group or row, gathered groups read as runs),
so the comparisons can fail. Without a GPU, every launch compiled for
sm_90 (benchmarks/kernel_bench.py --compile-only); on one, a Llama-3-8B
projection."""

from __future__ import annotations


import pytest
import torch
from torch.nn import functional as F

from fluidserve.kernels import fp8_linear, reference
from fluidserve.kernels.launch import cdiv

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (exponent bits, mantissa bits, bias) of each format, for decoding by hand
LAYOUT = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}


def operands(n: int, k: int, fmt: torch.dtype, block: int, *, layout: str, seed: int, device="cpu") -> dict:
    """A float8 [n, k] weight over most of the format's range, scales that
    differ by row and group (0.5 to 1.5 times a common factor, so a wrong
    row or group is off by up to 3x), and groups by ``layout``: "plain"
    (``k // block``, G = ceil(k / block)), "gathered" (the same groups in a
    random feature order) or "row" (G = 1: one scale a row, or a tensor's
    repeated). ``group_size`` is what a loader would pass. Outputs of
    unit-variance rows are ~1."""
    gen = torch.Generator().manual_seed(seed)
    groups = 1 if layout == "row" else cdiv(k, block)
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(fmt)  # within e4m3's range: no NaN
    scales = (0.5 + torch.rand(n, groups, generator=gen)) / (64 * k**0.5)
    g_idx = torch.zeros(k, dtype=torch.int64) if layout == "row" else torch.arange(k) // block
    if layout == "gathered":
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    group_size = {"plain": block, "row": k, "gathered": None}[layout]
    return dict(weight=weight.to(device), scales=scales.to(device), g_idx=g_idx.to(device, torch.int32),
                group_size=group_size)  # fmt: skip


def quantized(ops: dict) -> tuple:
    return ops["weight"], ops["scales"], ops["g_idx"]


def oracle(x: torch.Tensor, ops: dict, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of x and the weight rounded to x's dtype, in fp32."""
    w = reference.fp8_dequantize(*quantized(ops), x.dtype).float()
    return F.linear(x.float(), w, None if bias is None else bias.float())


def decoded(codes: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """float8 bit patterns (int64) as values, from the format's fields."""
    e_bits, m_bits, bias = LAYOUT[fmt]
    sign = 1 - 2 * ((codes >> 7) & 1).double()
    exp = (codes >> m_bits) & ((1 << e_bits) - 1)
    mant = (codes & ((1 << m_bits) - 1)).double() / (1 << m_bits)
    normal = torch.where(exp > 0, 1 + mant, mant) * torch.exp2(torch.clamp(exp, min=1).double() - bias)
    return sign * normal


# -- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_finite_float8_value_is_its_bits(device, fmt):
    """Each finite bit pattern, subnormals and the largest included, is the
    value its sign, exponent and mantissa fields say, in the reference and
    in ``dequantize`` (scale 1, so the fp32 result is the value itself)."""
    codes = torch.arange(256)
    if fmt == torch.float8_e4m3fn:
        finite = (codes & 0x7F) != 0x7F  # e4m3fn: only S.1111.111 is NaN; no infinity
    else:
        finite = ((codes >> 2) & 0x1F) != 0x1F  # e5m2: the top exponent is infinity and NaN
    codes = codes[finite]  # 254 (e4m3fn) or 248 (e5m2) values
    weight = codes.to(torch.uint8).view(fmt).reshape(2, -1)
    scales, g_idx = torch.ones(2, 1), torch.zeros(weight.shape[1], dtype=torch.int32)
    expected = decoded(codes, fmt).float().reshape(2, -1)
    assert expected.abs().max() == (448 if fmt == torch.float8_e4m3fn else 57344)
    assert torch.equal(reference.fp8_dequantize(weight, scales, g_idx, torch.float32), expected)
    got = fp8_linear.dequantize(weight.to(device), scales.to(device), g_idx.to(device), torch.float32)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_reference_is_one_fp32_product_rounded_once(fmt):
    """Against fp64: a float8 value times an fp32 scale is exact in fp64,
    so rounding it to fp32 and then to the dtype is the single fp32
    product rounded once."""
    ops = operands(24, 200, fmt, 64, layout="gathered", seed=1)
    exact = ops["weight"].double() * ops["scales"].double()[:, ops["g_idx"].long()]
    for dtype in DTYPES:
        assert torch.equal(reference.fp8_dequantize(*quantized(ops), dtype), exact.float().to(dtype))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_the_references_broadcast_groups_give_the_gathered_bits(fmt):
    """The CPU's path: with a plain checkpoint's group size the reference
    broadcasts each group's scale over its run of features, same bits,
    the last run cut short where K is no whole number of groups."""
    cases = [("plain", 256, 64), ("plain", 264, 64), ("row", 200, 64), ("plain", 256, 256)]
    for layout, k, block in cases:
        ops = operands(40, k, fmt, block, layout=layout, seed=k)
        for dtype in (torch.float32, torch.bfloat16):
            gathered = reference.fp8_dequantize(*quantized(ops), dtype)
            assert torch.equal(reference.fp8_dequantize(*quantized(ops), dtype, group_size=ops["group_size"]),
                               gathered)  # fmt: skip
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ops = operands(40, 256, fmt, 64, layout="plain", seed=2)
    assert torch.equal(reference.fp8_linear(x, *quantized(ops), group_size=64),
                       F.linear(x, reference.fp8_dequantize(*quantized(ops), torch.bfloat16)))  # fmt: skip


def test_the_operands_tell_wrong_scale_mappings_apart():
    """The weights a kernel would get with the neighbouring group's or
    row's scales, gathered groups read as plain runs, or no scale at all,
    are all far from the right one: a comparison within the tolerances
    catches each."""
    ops = operands(40, 256, torch.float8_e4m3fn, 64, layout="gathered", seed=3)
    right = reference.fp8_dequantize(*quantized(ops), torch.float32)
    wrong = [
        dict(ops, scales=ops["scales"].roll(1, dims=1)),  # the neighbouring group's scales
        dict(ops, scales=ops["scales"].roll(1, dims=0)),  # the neighbouring row's scales
        dict(ops, g_idx=(torch.arange(256) // 64).to(torch.int32)),  # gathered groups read as plain runs
        dict(ops, scales=ops["scales"][:, :1].expand(-1, 4).contiguous()),  # the row's first scale for all
    ]
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    for case in wrong:
        w = reference.fp8_dequantize(*quantized(case), torch.float32)
        assert (w - right).abs().max() > 0.5 * right.abs().max()
        assert (F.linear(x, w) - F.linear(x, right)).abs().max() > 0.1  # outputs ~1, fp32 tolerance 1e-4


# -- dequantize --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["plain", "gathered", "row"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_dequantize_is_the_reference_to_the_bit(device, fmt, dtype, layout):
    """[40, 264]: rows past a tile of 32, K past a tile of 256 and a last
    group of 8 features; plain groups of 64 gathered through ``g_idx`` and
    read per run (``group_size``), groups of 32 read per run, gathered
    groups, and one scale a row."""
    ops = operands(40, 264, fmt, 64, layout=layout, seed=len(layout), device=device)
    expected = reference.fp8_dequantize(*quantized(ops), dtype)
    got = fp8_linear.dequantize(*quantized(ops), dtype)
    assert got.shape == (40, 264) and got.dtype == dtype
    assert torch.equal(got, expected)
    if ops["group_size"] is not None:
        out = torch.empty_like(got)
        assert fp8_linear.dequantize(*quantized(ops), dtype, out, group_size=ops["group_size"]) is out
        assert torch.equal(out, expected)
    if layout == "plain":
        ops = operands(40, 264, fmt, 32, layout=layout, seed=5, device=device)
        assert torch.equal(fp8_linear.dequantize(*quantized(ops), dtype, group_size=32),
                           reference.fp8_dequantize(*quantized(ops), dtype))  # fmt: skip


def test_dequantize_rounds_to_bf16_as_torch_does(device):
    """Scales of 1 + 2^-8 and 1 + 3 * 2^-8 put float8 values times the
    scale on bf16's rounding ties and just past them: rounded to nearest
    even, as torch rounds (truncating would differ, and so would rounding
    ties away from zero)."""
    values = torch.tensor([1 + i / 8 for i in range(8)] + [-1.0, -1.5, 3.0, 0.25, 448.0, 2**-9, 0.0, 5.0])
    weight = values.to(torch.float8_e4m3fn).repeat(4, 2)  # [4, 32]
    scales = torch.tensor([[1 + 2**-8], [1 + 3 * 2**-8], [-(1 + 2**-8)], [1 + 2**-7 + 2**-8]])
    args = (weight.to(device), scales.to(device), torch.zeros(32, dtype=torch.int32, device=device))
    expected = reference.fp8_dequantize(*args, torch.bfloat16)
    exact = weight.double() * scales.double()
    assert (expected.double().cpu() != exact).any(), "no value needed rounding"
    assert torch.equal(fp8_linear.dequantize(*args, torch.bfloat16), expected)
    assert torch.equal(fp8_linear.dequantize(*args, torch.bfloat16, group_size=32), expected)


# -- the fused linear --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [256, 200], ids=["K256", "K200"])  # 200: no K step divides it
@pytest.mark.parametrize("m", [1, 3, 17, 40])  # one row; a 16-row tile; a 32-row tile; two tiles
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_linear_matches_the_reference(device, tol, dtype, m, k):
    """N = 40 (ragged against 16-row programs), e4m3 and e5m2 in turn:
    gathered groups of 64 (a last group of 8 at K = 200) with a bias; plain
    ones through ``g_idx``, and per run (``group_size`` 64, two or four
    runs a step) with a bias; blocks of 128 per run (a run a step); one
    scale a row with a bias."""
    gen = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    bias = torch.randn(40, generator=gen).to(device, dtype)
    cases = [("gathered", 64, bias, False), ("plain", 64, None, False), ("plain", 64, bias, True),
             ("plain", 128, None, True), ("row", 64, bias, True)]  # fmt: skip
    for i, (layout, block, b, per_run) in enumerate(cases):
        fmt = FORMATS[(i + m) % 2]
        ops = operands(40, k, fmt, block, layout=layout, seed=m + k + i, device=device)
        y = fp8_linear.fp8_linear(x, *quantized(ops), b, group_size=ops["group_size"] if per_run else None)
        assert y.shape == (m, 40) and y.dtype == dtype
        torch.testing.assert_close(y.float(), oracle(x, ops, b), **tol(dtype), msg=lambda s: f"{fmt} {layout}: {s}")


def test_fp8_linear_takes_rows_with_a_stride(device, tol):
    """x a view of every other row of a wider tensor, rows contiguous."""
    ops = operands(40, 64, torch.float8_e4m3fn, 32, layout="gathered", seed=5, device=device)
    wide = torch.randn(6, 128, generator=torch.Generator().manual_seed(6)).to(device)
    x = wide[::2, 32:96]
    assert fp8_linear.supports(x, ops["weight"]) and not x.is_contiguous()
    torch.testing.assert_close(fp8_linear.fp8_linear(x, *quantized(ops)), oracle(x, ops, None), **tol(torch.float32))


def test_launch_shapes():
    """Up to ``ROW_TILE`` rows one tile of rows reads the weight; scales
    are read per run where a plain checkpoint's groups allow it."""
    for m in (1, 2, 16, 17, fp8_linear.ROW_TILE):
        grid, block_m, _, _, _ = fp8_linear._shape(m, 4096, 4096, 128)
        assert grid == (4096 // fp8_linear.BLOCK_N, 1) and block_m >= m
    assert fp8_linear._shape(fp8_linear.ROW_TILE + 1, 4096, 4096, 128)[0][1] == 2
    assert fp8_linear._shape(fp8_linear.MAX_FUSED_ROWS, 4096, 4096, 128)[0][1] == 4
    assert fp8_linear._shape(1, 4096, 4096, 128)[2:] == (256, 128, True)  # two blocks a step
    assert fp8_linear._shape(16, 4096, 4096, 128)[2:] == (128, 128, True)  # a block a step
    assert fp8_linear._shape(1, 4096, 4096, 4096)[2:] == (256, 256, True)  # one scale a row
    assert fp8_linear._shape(1, 4096, 4000, 4000)[2:] == (256, 256, True)  # one group, K ragged
    assert fp8_linear._run(384, 4096, 128) == (128, True)  # a group is three steps
    assert fp8_linear._run(None, 4096, 256) == (256, False)  # gathered
    assert fp8_linear._run(96, 4096, 256) == (256, False)  # groups across steps: gathered


def test_what_the_kernels_refuse(device):
    ops = operands(40, 64, torch.float8_e4m3fn, 32, layout="plain", seed=2, device=device)
    weight, scales, g_idx = quantized(ops)
    x = torch.randn(2, 64).to(device)
    assert fp8_linear.supports(x, weight)
    for bad_x, bad_weight in [
        (x.double(), weight),  # x's dtype
        (x.t().contiguous().t(), weight),  # rows not contiguous
        (x[:, :32], weight),  # K differs
        (x, weight.to(torch.bfloat16)),  # not float8
        (x, weight.view(torch.uint8)),  # bytes, not float8
        (x, torch.cat([weight.view(torch.uint8)] * 2, 1)[:, ::2].view(torch.float8_e4m3fn)),  # not contiguous
        (x, weight.reshape(-1)),  # not 2-D
    ]:
        assert not fp8_linear.supports(bad_x, bad_weight)
    with pytest.raises(ValueError, match="contiguous rows"):
        fp8_linear.fp8_linear(x.double(), *quantized(ops))
    for bad, group_size in [((weight, scales.double(), g_idx), None), ((weight, scales[:20], g_idx), None),
                            ((weight, scales.reshape(-1), g_idx), None), ((weight, scales, g_idx[:32]), None),
                            ((weight, scales, g_idx.long()), None), ((weight, scales, g_idx), 16),
                            ((weight, scales, g_idx), 0)]:  # fmt: skip
        with pytest.raises(ValueError, match="int32 g_idx"):
            fp8_linear.fp8_linear(x, *bad, group_size=group_size)
        with pytest.raises(ValueError, match="int32 g_idx"):
            fp8_linear.dequantize(*bad, torch.float32, group_size=group_size)
    with pytest.raises(ValueError, match="bias"):
        fp8_linear.fp8_linear(x, *quantized(ops), torch.zeros(41, device=device))
    with pytest.raises(ValueError, match="bias"):
        fp8_linear.fp8_linear(x, *quantized(ops), torch.zeros(40, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="out"):
        fp8_linear.dequantize(*quantized(ops), torch.float32, torch.empty(40, 64, dtype=torch.bfloat16))
    for bad_weight, dtype in [(weight, torch.float64), (weight.to(torch.float16), torch.float16)]:
        with pytest.raises(ValueError, match="float8"):
            fp8_linear.dequantize(bad_weight, scales, g_idx, dtype)
    assert fp8_linear.fp8_linear(x[:0], *quantized(ops)).shape == (0, 40)


# -- compiled for a GPU ------------------------------------------------------------------------


def test_every_launch_compiles_for_hopper_without_spilling(offline_compile):
    """What the interpreter cannot show: each launch at a Llama-3-8B shape
    (kernel_bench.fp8_linear_compile_report: e4m3 and e5m2; 1, 16 and 32
    rows and dequantize; blocks of 128, a scale a row, gathered) compiles
    for sm_90 with no spills and registers for three programs an SM (64K
    registers), as the module's launch shapes claim."""
    report = offline_compile("fp8_linear_compile_report()")
    assert len(report) == 24
    for row in report:
        assert row["stack_bytes"] == 0 and row["local_bytes"] == 0, row
        assert row["registers"] * 32 * row["num_warps"] * 3 <= 65536, row


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Llama-3-8B-sized weight needs a GPU")
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_a_llama3_8b_projection_on_the_gpu(fmt):
    """The o projection's shape (4096 x 4096, blocks of 128), bf16: one row
    and a 16-row tile, blocks read per run and gathered, and one scale a
    row."""
    if not fp8_linear.converts(torch.empty(0, dtype=fmt, device="cuda")):
        pytest.skip(f"{fmt} needs sm_89 or newer")
    tol = dict(atol=4e-3, rtol=6e-3)
    for layout in ("plain", "gathered", "row"):
        ops = operands(4096, 4096, fmt, 128, layout=layout, seed=len(layout), device="cuda")
        expected = reference.fp8_dequantize(*quantized(ops), torch.bfloat16)
        got = fp8_linear.dequantize(*quantized(ops), torch.bfloat16, group_size=ops["group_size"])
        assert torch.equal(got, expected)
        for m in (1, 16):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            y = fp8_linear.fp8_linear(x, *quantized(ops), group_size=ops["group_size"])
            torch.testing.assert_close(y.float(), F.linear(x.float(), expected.float()), **tol)
