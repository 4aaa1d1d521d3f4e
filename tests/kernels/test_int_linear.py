"""The weight-only integer linears (kernels/int_linear.py) against
kernels/reference.py: the packing itself, word by word; ``dequantize`` to
the bit (fp32, fp16, bf16; act-order groups and plain ones); the fused
``int_linear`` within the conftest's tolerances of the fp32 product of the
dequantized weight, for one row and for tiles of rows, ragged N and K,
with and without a bias; the sign bit of a word; what the functions refuse;
and that the operands tell a wrong format apart (field order, zero points,
groups), so the comparisons can fail. Without a GPU, every launch compiled
for sm_90 (benchmarks/kernel_bench.py --compile-only); on one, a
Llama-3-8B projection."""

from __future__ import annotations


import pytest
import torch
from torch.nn import functional as F

from fluidserve.kernels import int_linear, reference
from fluidserve.kernels.launch import cdiv

BITS = [4, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def operands(n: int, k: int, bits: int, group_size: int, *, act_order: bool, seed: int, device="cpu") -> dict:
    """A packed [n, k] weight: random codes and zero points over the whole
    range (a wrong field or zero is off by whole codes), scales that differ
    by row and group, and with ``act_order`` each feature's group at random
    (a group's features scattered over K, as GPTQ's act-order leaves them).
    Outputs of unit-variance rows are ~1."""
    gen = torch.Generator().manual_seed(seed)
    groups = cdiv(k, group_size)
    raw = torch.randint(0, 1 << bits, (n, k), generator=gen)
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=gen).to(torch.uint8)
    # (code - zero) has a standard deviation of about 2^bits / sqrt(6)
    scales = (0.5 + torch.rand(n, groups, generator=gen)) * (6**0.5 / (1 << bits) / k**0.5)
    g_idx = torch.arange(k) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    put = dict(device=device)
    return dict(raw=raw.to(**put), codes=reference.int_pack(raw, bits).to(**put), scales=scales.to(**put),
                zeros=zeros.to(**put), g_idx=g_idx.to(device=device, dtype=torch.int32))  # fmt: skip


def packed(ops: dict) -> tuple:
    return ops["codes"], ops["scales"], ops["zeros"], ops["g_idx"]


def from_codes(ops: dict, dtype: torch.dtype) -> torch.Tensor:
    """The weight computed from the unpacked codes themselves, not from the
    words: what ``int_dequantize`` must give."""
    group = ops["g_idx"].long()
    q = ops["raw"].to(torch.int32) - ops["zeros"].to(torch.int32)[:, group]
    return (q.float() * ops["scales"][:, group]).to(dtype)


def oracle(x: torch.Tensor, ops: dict, bits: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of x and the weight rounded to x's dtype, in fp32."""
    w = reference.int_dequantize(*packed(ops), bits, x.dtype).float()
    return F.linear(x.float(), w, None if bias is None else bias.float())


# -- the packed format -----------------------------------------------------------------------


def test_int_pack_writes_fields_lowest_first_into_the_sign_bit():
    four = reference.int_pack(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [15] * 8]), 4)
    assert four.dtype == torch.int32 and four.tolist() == [[0x87654321 - (1 << 32)], [-1]]
    eight = reference.int_pack(torch.tensor([[0x78, 0x56, 0x34, 0x12, 255, 0, 0, 255]]), 8)
    assert eight.tolist() == [[0x12345678, 0xFF0000FF - (1 << 32)]]
    with pytest.raises(ValueError, match="outside"):
        reference.int_pack(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        reference.int_pack(torch.zeros((1, 6), dtype=torch.int64), 8)


@pytest.mark.parametrize("bits", BITS)
def test_int_pack_round_trips(bits):
    ops = operands(24, 64, bits, 32, act_order=False, seed=bits)
    ops["raw"][0] = (1 << bits) - 1  # every word of row 0 is -1
    codes = reference.int_pack(ops["raw"], bits)
    assert codes.shape == (24, 64 * bits // 32) and (codes[0] == -1).all() and (codes < 0).any()
    assert torch.equal(reference.int_unpack(codes, bits), ops["raw"].to(torch.int32))


@pytest.mark.parametrize("bits", BITS)
def test_the_operands_tell_wrong_formats_apart(bits):
    """The weights a kernel would get with its fields in the wrong order,
    the zero points ignored or of the wrong group, or the groups taken as
    plain runs under act-order, are all far from the right one: a
    comparison within the tolerances catches each."""
    ops = operands(40, 256, bits, 64, act_order=True, seed=3)
    right = reference.int_dequantize(*packed(ops), bits, torch.float32)
    per_word = 32 // bits
    swapped = ops["raw"].view(40, -1, per_word).flip(-1).reshape(40, 256)
    wrong = [
        dict(ops, codes=reference.int_pack(swapped, bits)),  # fields highest first
        dict(ops, zeros=torch.zeros_like(ops["zeros"])),  # zero points ignored
        dict(ops, zeros=ops["zeros"].roll(1, dims=1)),  # the neighbouring group's zero points
        dict(ops, g_idx=(torch.arange(256) // 64).to(torch.int32)),  # act-order read as plain runs
        dict(ops, scales=ops["scales"].roll(1, dims=1)),  # the neighbouring group's scales
    ]
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    for case in wrong:
        w = reference.int_dequantize(*packed(case), bits, torch.float32)
        assert (w - right).abs().max() > 0.5 * right.abs().max()
        assert (F.linear(x, w) - F.linear(x, right)).abs().max() > 0.1  # outputs ~1, fp32 tolerance 1e-4


# -- dequantize --------------------------------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_is_the_reference_to_the_bit(device, bits, dtype, act_order):
    """[40, 264]: rows past a tile of 32, K past a tile of 256 and a last
    group of 8 features; the plain groups also read once per word."""
    ops = operands(40, 264, bits, 64, act_order=act_order, seed=bits + 7 * act_order, device=device)
    expected = reference.int_dequantize(*packed(ops), bits, dtype)
    assert torch.equal(expected, from_codes(ops, dtype))
    got = int_linear.dequantize(*packed(ops), bits, dtype)
    assert got.shape == (40, 264) and got.dtype == dtype
    assert torch.equal(got, expected)
    if not act_order:
        out = torch.empty_like(got)
        assert int_linear.dequantize(*packed(ops), bits, dtype, out, group_size=64) is out
        assert torch.equal(out, expected)


def test_dequantize_rounds_to_bf16_as_torch_does(device):
    """Scales of 1 + 2^-8 and 1 + 3 * 2^-8 put (code - zero) times the
    scale on bf16's rounding ties and just past them: rounded to nearest
    even, as torch rounds (truncating would differ, and so would rounding
    ties away from zero)."""
    raw = torch.arange(16).repeat(4, 2)  # [4, 32]
    zeros = torch.tensor([[0], [5], [15], [8]], dtype=torch.uint8)
    scales = torch.tensor([[1 + 2**-8], [1 + 3 * 2**-8], [-(1 + 2**-8)], [1 + 2**-7 + 2**-8]])
    args = (reference.int_pack(raw, 4).to(device), scales.to(device), zeros.to(device),
            torch.zeros(32, dtype=torch.int32, device=device))  # fmt: skip
    expected = reference.int_dequantize(*args, 4, torch.bfloat16)
    exact = (raw - zeros.long()).double() * scales.double()
    assert (expected.double().cpu() != exact).any(), "no value needed rounding"
    assert torch.equal(int_linear.dequantize(*args, 4, torch.bfloat16), expected)


@pytest.mark.parametrize("bits", BITS)
def test_a_top_field_in_the_sign_bit_decodes_right(device, bits):
    """Every word's top field at 15 (255) makes every word negative: an
    arithmetic shift without the mask, or a logical one on the wrong type,
    would sign-extend into the field. Both kernels, against the weight made
    from the codes themselves."""
    ops = operands(24, 128, bits, 32, act_order=True, seed=11)
    per_word = 32 // bits
    ops["raw"][:, per_word - 1::per_word] = (1 << bits) - 1
    ops["codes"] = reference.int_pack(ops["raw"], bits)
    assert (ops["codes"] < 0).all()
    ops = {name: t.to(device) for name, t in ops.items()}
    weight = from_codes(ops, torch.float32)
    assert torch.equal(int_linear.dequantize(*packed(ops), bits, torch.float32), weight)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(12)).to(device)
    torch.testing.assert_close(int_linear.int_linear(x, *packed(ops), bits), F.linear(x, weight), atol=1e-4, rtol=2e-4)


# -- the fused linear --------------------------------------------------------------------------


@pytest.mark.parametrize("k", [256, 200], ids=["K256", "K200"])  # 200: no K step divides it
@pytest.mark.parametrize("m", [1, 3, 17, 40])  # one row; a 16-row tile; a 32-row tile; two tiles
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_int_linear_matches_the_reference(device, tol, bits, dtype, m, k):
    """N = 40 (ragged against 16-row programs), groups of 64 (a last group
    of 8 at K = 200): act-order groups through ``g_idx``, with a bias; plain
    ones through ``g_idx``, and per word (``group_size``) with a bias."""
    gen = torch.Generator().manual_seed(m * k + bits)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    bias = torch.randn(40, generator=gen).to(device, dtype)
    for act_order, b, group_size in ((True, bias, None), (False, None, None), (False, bias, 64)):
        ops = operands(40, k, bits, 64, act_order=act_order, seed=m + k, device=device)
        y = int_linear.int_linear(x, *packed(ops), bits, b, group_size=group_size)
        assert y.shape == (m, 40) and y.dtype == dtype
        torch.testing.assert_close(y.float(), oracle(x, ops, bits, b), **tol(dtype))


def test_int_linear_takes_rows_with_a_stride(device, tol):
    """x a view of every other row of a wider tensor, rows contiguous."""
    ops = operands(40, 64, 4, 32, act_order=True, seed=5, device=device)
    wide = torch.randn(6, 128, generator=torch.Generator().manual_seed(6)).to(device)
    x = wide[::2, 32:96]
    assert int_linear.supports(x, ops["codes"], 4) and not x.is_contiguous()
    torch.testing.assert_close(int_linear.int_linear(x, *packed(ops), 4), oracle(x, ops, 4, None),
                               **tol(torch.float32))  # fmt: skip


def test_up_to_max_fused_rows_one_tile_of_rows_reads_the_weight():
    for m in (1, 2, 16, 17, int_linear.ROW_TILE):
        grid, block_m, _, _ = int_linear._shape(m, 4096, 4, 128)
        assert grid == (4096 // int_linear.BLOCK_N, 1) and block_m >= m
    assert int_linear._shape(int_linear.ROW_TILE + 1, 4096, 4, 128)[0][1] == 2
    assert int_linear._shape(int_linear.MAX_FUSED_ROWS, 4096, 4, 128)[0][1] == 4


def test_plain_group_size_reads_the_groups_of_a_plain_checkpoint():
    assert reference.plain_group_size((torch.arange(200) // 64).to(torch.int32)) == 64
    assert reference.plain_group_size(torch.zeros(96, dtype=torch.int32)) == 96  # one group
    act_order = operands(4, 256, 4, 64, act_order=True, seed=1)["g_idx"]
    assert reference.plain_group_size(act_order) is None
    uneven = torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32)
    assert reference.plain_group_size(uneven) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_the_references_broadcast_groups_give_the_gathered_bits(bits):
    """The CPU's path: with a plain checkpoint's group size the reference
    broadcasts each group's scale over its run of features, same bits."""
    ops = operands(40, 256, bits, 64, act_order=False, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        gathered = reference.int_dequantize(*packed(ops), bits, dtype)
        assert torch.equal(reference.int_dequantize(*packed(ops), bits, dtype, group_size=64), gathered)


def test_what_the_kernels_refuse(device):
    ops = operands(40, 64, 4, 32, act_order=False, seed=2, device=device)
    codes, scales, zeros, g_idx = packed(ops)
    x = torch.randn(2, 64).to(device)
    assert int_linear.supports(x, codes, 4)
    for bad_x, bad_codes, bits in [
        (x.double(), codes, 4),  # dtype
        (x.t().contiguous().t(), codes, 4),  # rows not contiguous
        (x[:, :32], codes, 4),  # K differs
        (x, codes, 8),  # the words hold 8-bit codes of K / 2 features
        (x, codes.long(), 4),  # not int32 words
        (x, torch.cat([codes, codes], 1)[:, ::2], 4),  # words not contiguous
        (x, codes, 2),  # 2-bit
    ]:
        assert not int_linear.supports(bad_x, bad_codes, bits)
    with pytest.raises(ValueError, match="contiguous rows"):
        int_linear.int_linear(x.double(), *packed(ops), 4)
    for bad in [(codes, scales.double(), zeros, g_idx), (codes, scales, zeros.int(), g_idx),
                (codes, scales, zeros[:, :1], g_idx), (codes, scales, zeros, g_idx[:32]),
                (codes, scales, zeros, g_idx.long())]:  # fmt: skip
        with pytest.raises(ValueError, match="uint8 zeros"):
            int_linear.int_linear(x, *bad, 4)
        with pytest.raises(ValueError, match="uint8 zeros"):
            int_linear.dequantize(*bad, 4, torch.float32)
    with pytest.raises(ValueError, match="bias"):
        int_linear.int_linear(x, *packed(ops), 4, torch.zeros(41, device=device))
    with pytest.raises(ValueError, match="out"):
        int_linear.dequantize(*packed(ops), 4, torch.float32, torch.empty(40, 64, dtype=torch.bfloat16))
    assert int_linear.int_linear(x[:0], *packed(ops), 4).shape == (0, 40)


# -- compiled for a GPU ------------------------------------------------------------------------


def test_every_launch_compiles_for_hopper_without_spilling(offline_compile):
    """What the interpreter cannot show: each launch at a Llama-3-8B shape
    (kernel_bench.int_linear_compile_report) compiles for sm_90 with no
    spills and registers for three programs an SM (64K registers), as the
    module's launch shapes claim."""
    report = offline_compile("int_linear_compile_report()")
    assert len(report) == 16
    for row in report:
        assert row["stack_bytes"] == 0 and row["local_bytes"] == 0, row
        assert row["registers"] * 32 * row["num_warps"] * 3 <= 65536, row


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Llama-3-8B-sized weight needs a GPU")
@pytest.mark.parametrize("bits", BITS)
def test_a_llama3_8b_projection_on_the_gpu(bits):
    """The o projection's shape (4096 x 4096, groups of 128), bf16: one row
    and a 16-row tile, act-order and plain (per word) groups."""
    tol = dict(atol=4e-3, rtol=6e-3)
    for act_order in (True, False):
        ops = operands(4096, 4096, bits, 128, act_order=act_order, seed=bits, device="cuda")
        expected = reference.int_dequantize(*packed(ops), bits, torch.bfloat16)
        assert torch.equal(int_linear.dequantize(*packed(ops), bits, torch.bfloat16), expected)
        group_size = None if act_order else 128
        for m in (1, 16):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            y = int_linear.int_linear(x, *packed(ops), bits, group_size=group_size)
            torch.testing.assert_close(y.float(), F.linear(x.float(), expected.float()), **tol)
