"""MoE experts kept as a quantized checkpoint stores them
(``reference.PackedExperts``: GPTQ/AWQ int4 and int8 words, float8 e4m3)
through ``ops.fused_experts``: each expert's weight against one
dequantized by hand from its raw codes; the reference over packed weights
equal, bit for bit, to the reference over the dequantized stacks; the
Triton path over packed weights equal, bit for bit, to the Triton path
over those dense stacks (the tiles are dequantized and rounded as the
dense weight is), and within test_moe.py's tolerances of the reference;
dispatch and what is refused. Every expert has its own scales, zeros and
(act-order) groups, so a tile read from a wrong expert, row, group or
field changes the result. Without a GPU, the packed launches compiled for
sm_90."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fluidserve.kernels import fp8_linear, moe, ops, reference
from fluidserve.kernels.launch import cdiv
from fluidserve.kernels.reference import PackedExperts

# test_moe.py's tolerances of the Triton path against the reference in the
# interpreter (bf16: its fp32 -> bf16 conversion truncates in the epilogue).
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=5e-2, rtol=3e-2)}  # fmt: skip


def int_experts(experts: int, n: int, k: int, bits: int, group_size: int, *, act_order: bool,
                seed: int) -> tuple[PackedExperts, torch.Tensor]:  # fmt: skip
    """Packed integer experts [E, n, k] and their raw codes: codes and zero
    points over the whole range (every word's top field at its largest in
    a few rows, so its sign bit is set; zeros 0 and 2^bits - 1 included),
    scales that differ by expert, row and group, and with ``act_order``
    each expert's features in groups at a random order of its own. Outputs
    of unit-variance rows are ~1."""
    gen = torch.Generator().manual_seed(seed)
    groups, per_word = cdiv(k, group_size), 32 // bits
    raw = torch.randint(0, 1 << bits, (experts, n, k), generator=gen)
    raw[:, :3, per_word - 1::per_word] = (1 << bits) - 1  # the sign bit of every word of three rows
    zeros = torch.randint(0, 1 << bits, (experts, n, groups), generator=gen)
    zeros[:, 0], zeros[:, 1] = 0, (1 << bits) - 1
    scales = (0.5 + torch.rand(experts, n, groups, generator=gen)) * (6**0.5 / (1 << bits) / k**0.5)
    plain = torch.arange(k) // group_size
    g_idx = torch.stack([plain[torch.randperm(k, generator=gen)] if act_order else plain for _ in range(experts)])
    codes = torch.stack([reference.int_pack(raw[e], bits) for e in range(experts)])
    packed = PackedExperts(codes, scales, zeros.to(torch.uint8), g_idx.to(torch.int32), bits,
                           None if act_order else group_size)  # fmt: skip
    return packed, raw


def fp8_experts(experts: int, n: int, k: int, block: int | None, *, seed: int,
                fp8: torch.dtype = torch.float8_e4m3fn, gathered: bool = False) -> PackedExperts:  # fmt: skip
    """Float8 experts [E, n, k] (e4m3 unless ``fp8`` says): with ``block``,
    DeepSeek's block scales (a [n / block, k / block] grid an expert, each
    scale repeated on every row of its block), else one scale a row (G =
    1). Scales 0.5 to 1.5 times a common factor, so a wrong expert, row or
    block is off by up to 3x. ``gathered``: each expert's features in
    blocks at a random order of its own, no group size (scales gathered
    through g_idx)."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(experts, n, k, generator=gen) * 64).clamp(-448, 448).to(fp8)
    if block is None:
        scales = (0.5 + torch.rand(experts, n, 1, generator=gen)) / (64 * k**0.5)
        g_idx, group_size = torch.zeros(experts, k, dtype=torch.int32), k
    else:
        grid = (0.5 + torch.rand(experts, cdiv(n, block), cdiv(k, block), generator=gen)) / (64 * k**0.5)
        scales = grid.repeat_interleave(block, dim=1)[:, :n].contiguous()
        plain = torch.arange(k) // block
        g_idx = torch.stack([plain[torch.randperm(k, generator=gen)] if gathered else plain for _ in range(experts)])
        g_idx, group_size = g_idx.to(torch.int32), None if gathered else block
    return PackedExperts(weight, scales, None, g_idx, 8, group_size)


def by_hand(w: PackedExperts, raw: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The stack [E, N, K] dequantized from the raw codes (int) or the
    float8 values, gathering each feature's scale (and zero) through g_idx:
    not through the functions under test."""
    group = w.g_idx.long()[:, None, :].expand(*w.shape)  # [E, N, K]
    scale = w.scales.gather(2, group)
    if w.float8:
        return (w.codes.float() * scale).to(dtype)
    return ((raw.to(torch.int32) - w.zeros.to(torch.int32).gather(2, group)).float() * scale).to(dtype)


def routing(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, *, seed: int,
            unused: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x and a router's routing (distinct experts a token, softmax weights
    renormalised, fp32) that never picks the ``unused`` experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(unused)] = -torch.inf
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return x, ids, weights / weights.sum(dim=-1, keepdim=True)


EXPERTS, HIDDEN = 4, 64


def weight(fmt: str, n: int, k: int, seed: int) -> tuple[PackedExperts, torch.Tensor | None]:
    """One stacked weight in format ``fmt``: "int4"/"int8" with plain groups
    (of 32 and 16 features: 4 and 4 words) or "-act" act-order ones,
    "e4m3-block" (blocks of 32), "e4m3-gathered" (the same, gathered),
    "e4m3-row" (G = 1) or "e5m2-block"."""
    if fmt.startswith("int"):
        bits = int(fmt[3])
        return int_experts(EXPERTS, n, k, bits, 32 if bits == 4 else 16, act_order=fmt.endswith("-act"), seed=seed)
    fp8 = torch.float8_e5m2 if fmt.startswith("e5m2") else torch.float8_e4m3fn
    block = None if fmt.endswith("row") else 32
    return fp8_experts(EXPERTS, n, k, block, seed=seed, fp8=fp8, gathered=fmt.endswith("gathered")), None


# (w13's format, w2's format, dtype, tokens, top_k, intermediate N): decode
# sizes (T = 1..4) and one larger step (36 tokens x 2 over 4 experts: 18
# pairs an expert, blocks of 32), an expert no token picks in each, and
# mixed formats (a packed weight beside a dense one, int beside float8),
# and e5m2 once.
CASES = [
    ("int4", "int4", torch.bfloat16, 3, 2, 32),
    ("int4-act", "int4-act", torch.float32, 4, 1, 32),
    ("int8", "int8-act", torch.float16, 1, 2, 64),
    ("int8-act", "dense", torch.bfloat16, 2, 2, 32),
    ("e4m3-block", "e4m3-gathered", torch.bfloat16, 4, 2, 64),
    ("e4m3-row", "e4m3-row", torch.float32, 2, 1, 32),
    ("dense", "e4m3-block", torch.float16, 3, 2, 32),
    ("e5m2-block", "int4", torch.bfloat16, 1, 1, 32),
    ("int4-act", "e4m3-row", torch.bfloat16, 36, 2, 32),
    # Blocks of 64 rows, whose integer tiles unpack in the operand's order (int_linear._weight_tile_t).
    ("int8", "int4-act", torch.bfloat16, 100, 2, 32),
]


def case_operands(w13_fmt: str, w2_fmt: str, dtype: torch.dtype, tokens: int, top_k: int, inter: int):
    """x, routing, the weights as given to the kernels (packed or dense) and
    their dense stacks dequantized by hand."""
    seed = tokens * 7 + top_k + inter
    given, dense = [], []
    for fmt, (n, k) in ((w13_fmt, (2 * inter, HIDDEN)), (w2_fmt, (HIDDEN, inter))):
        if fmt == "dense":
            gen = torch.Generator().manual_seed(seed + n)
            w = (torch.randn(EXPERTS, n, k, generator=gen) / k**0.5).to(dtype)
            given.append(w)
            dense.append(w)
            continue
        packed, raw = weight(fmt, n, k, seed + n)
        given.append(packed)
        dense.append(by_hand(packed, raw, dtype))
    unused = (2,) if top_k < EXPERTS - 1 else ()
    x, ids, weights = routing(tokens, EXPERTS, top_k, HIDDEN, dtype, seed=seed, unused=unused)
    return x, ids, weights, given, dense


@pytest.mark.parametrize("w13_fmt,w2_fmt,dtype,tokens,top_k,inter", CASES, ids=str)
def test_packed_experts_give_the_dense_stacks_bits(monkeypatch, w13_fmt, w2_fmt, dtype, tokens, top_k, inter):
    x, ids, weights, (w13, w2), (d13, d2) = case_operands(w13_fmt, w2_fmt, dtype, tokens, top_k, inter)
    # decode tiles, and blocks of 32 and 64 rows
    assert moe.block_m(tokens * top_k, EXPERTS) == (16 if tokens <= 4 else 32 if tokens <= 36 else 64)
    for w, d in ((w13, d13), (w2, d2)):
        if isinstance(w, PackedExperts):
            assert w.shape == tuple(d.shape)
            for e in range(EXPERTS):
                assert torch.equal(w.expert(e, dtype), d[e])
    expected = reference.fused_experts(x, d13, d2, ids, weights)
    assert torch.equal(reference.fused_experts(x, w13, w2, ids, weights), expected)
    got = moe.fused_experts(x, w13, w2, ids, weights)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    # The dense kernel at the packed launches' tiles (a packed weight's are
    # smaller than a dense one's): the same sums in the same order.
    real = moe.weight_tiles
    monkeypatch.setattr(moe, "weight_tiles", lambda w, bm, elem_bytes, gated: real(
        w13 if w is d13 else w2 if w is d2 else w, bm, elem_bytes, gated))
    assert torch.equal(got, moe.fused_experts(x, d13, d2, ids, weights))


def test_the_operands_tell_experts_groups_and_zeros_apart():
    """The comparisons above can fail: each expert's weight differs from
    the others', and reading another expert's g_idx or zeros, or the
    neighbouring group's scale, changes the dequantized weight."""
    packed, raw = int_experts(EXPERTS, 32, HIDDEN, 4, 32, act_order=True, seed=1)
    w = by_hand(packed, raw, torch.float32)
    assert all(not torch.equal(w[0], w[e]) for e in range(1, EXPERTS))
    swapped = replace(packed, g_idx=packed.g_idx.roll(1, 0).contiguous())
    assert not torch.equal(by_hand(swapped, raw, torch.float32), w)
    assert not torch.equal(by_hand(replace(packed, zeros=packed.zeros.roll(1, 0).contiguous()), raw, torch.float32), w)
    blocks = fp8_experts(EXPERTS, 64, HIDDEN, 32, seed=2)
    shifted = replace(blocks, scales=blocks.scales.roll(1, 2).contiguous())
    assert not torch.equal(by_hand(shifted, None, torch.float32), by_hand(blocks, None, torch.float32))


# -- dispatch and refusals -------------------------------------------------------------------


def test_ops_sends_packed_experts_to_the_kernel(monkeypatch):
    """On the Triton lane (``FLUIDSERVE_KERNELS=triton``) packed weights
    reach kernels/moe.py; e4m3 where Triton cannot convert it takes the
    reference, which the kernel refuses itself."""
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    x, ids, weights, (w13, w2), _ = case_operands("int4-act", "e4m3-block", torch.float32, 2, 2, 32)
    calls, real = [], moe.fused_experts

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(moe, "fused_experts", spy)
    got = ops.fused_experts(x, w13, w2, ids, weights)
    assert len(calls) == 1 and calls[0][1] is w13 and calls[0][2] is w2
    assert torch.equal(got, real(x, w13, w2, ids, weights))
    monkeypatch.setattr(fp8_linear, "converts", lambda weight: weight.dtype != torch.float8_e4m3fn)
    assert torch.equal(ops.fused_experts(x, w13, w2, ids, weights), reference.fused_experts(x, w13, w2, ids, weights))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="sm_89"):
        real(x, w13, w2, ids, weights)


def test_what_the_kernel_refuses(monkeypatch):
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    x, ids, weights, (w13, w2), _ = case_operands("int8", "int4", torch.float32, 2, 2, 32)
    fp8 = fp8_experts(EXPERTS, 64, HIDDEN, 32, seed=3)
    bad = [
        (weight("int8", 64, 32, 5)[0], w2, "expected x"),  # K = 32, not H
        (w13, weight("int4", 32, 32, 5)[0], "expected x"),  # [E, 32, N], not [E, H, N]
        (w13, replace(w2, g_idx=w2.g_idx[:, :16].contiguous()), "int32 g_idx"),
        (w13, replace(w2, g_idx=w2.g_idx.long()), "int32 g_idx"),
        (replace(w13, zeros=None), w2, "uint8 zeros"),
        (replace(w13, zeros=w13.zeros[:, :, :1].contiguous()), w2, "uint8 zeros"),
        (replace(w13, scales=w13.scales.double()), w2, "float32 scales"),
        (replace(w13, bits=4), w2, "int32 g_idx"),  # the words read as 4-bit codes: K doubles
        (replace(w13, bits=2), w2, "4 or 8 bits"),
        (w13, replace(w2, codes=w2.codes.long()), "int32 codes"),
        (w13, replace(w2, codes=w2.codes.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
        (replace(fp8, zeros=fp8.scales.to(torch.uint8)), w2, "no zeros"),
        (replace(fp8, group_size=64), w2, "group_size"),
    ]
    for b13, b2, match in bad:
        with pytest.raises(ValueError, match=match):
            ops.fused_experts(x, b13, b2, ids, weights)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        moe.fused_experts(x.double(), w13, w2, ids, weights)
    with pytest.raises(ValueError, match="share a dtype"):
        moe.fused_experts(x, w13, torch.zeros(EXPERTS, HIDDEN, 32, dtype=torch.float16), ids, weights)
    assert moe.fused_experts(x[:0], w13, w2, ids[:0], weights[:0]).shape == (0, HIDDEN)


# -- compiled for a GPU ------------------------------------------------------------------------

# The most registers a packed expert launch may take: its tiles are meant to
# leave room for three programs an SM at four warps (65536 / (3 * 128) = 170).
MAX_REGISTERS = 168


def test_packed_expert_launches_compile_for_hopper_without_spilling(offline_compile):
    """What the interpreter cannot show: the gated and the down GEMM over
    packed experts (int4 with scales per word and gathered, int8, e4m3 in
    128-wide blocks and gathered) at a decode token and a prefill, at a
    Qwen3-30B-A3B layer's shape (kernel_bench.moe_packed_compile_report),
    compile for sm_90 with no spills and at most ``MAX_REGISTERS``
    registers (``moe.TILE_ELEMENTS``)."""
    report = offline_compile("moe_packed_compile_report()")
    assert len(report) == 20
    assert {row["format"] for row in report} == {"int4, plain groups", "int4, act-order", "int8, plain groups",
                                                 "e4m3, blocks of 128", "e4m3, gathered"}  # fmt: skip
    assert {(row["tokens"], row["gated"]) for row in report} == {(1, True), (1, False), (4096, True), (4096, False)}
    for row in report:
        assert row["stack_bytes"] == 0 and row["local_bytes"] == 0, row
        assert row["registers"] <= MAX_REGISTERS, row


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Qwen3-30B-A3B-sized layer needs a GPU")
@pytest.mark.parametrize("fmt", ["int4-act", "int8", "e4m3-block"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_gpu_packed_experts_at_a_real_shape(monkeypatch, fmt, tokens):
    """16 experts of a Qwen3-30B-A3B layer (hidden 2048, intermediate 768),
    4 a token, bf16: the dense kernel's bits at the packed launches' tiles,
    and within test_moe.py's GPU tolerance of the reference. At 300 tokens
    the blocks hold 64 rows: int8's there failed to compile under Triton
    3.6 until their codes unpacked in the operand's order."""
    if fmt.startswith("e4m3") and not fp8_linear.converts(torch.empty(0, dtype=torch.float8_e4m3fn, device="cuda")):
        pytest.skip("e4m3 needs sm_89 or newer")
    experts, top_k, hidden, inter, dtype = 16, 4, 2048, 768, torch.bfloat16
    shapes = ((2 * inter, hidden), (hidden, inter))
    if fmt.startswith("int"):
        bits, act_order = (4, True) if fmt == "int4-act" else (8, False)
        (w13, r13), (w2, r2) = (int_experts(experts, n, k, bits, 128, act_order=act_order, seed=n) for n, k in shapes)
    else:
        (w13, r13), (w2, r2) = ((fp8_experts(experts, n, k, 128, seed=n), None) for n, k in shapes)
    d13, d2 = by_hand(w13, r13, dtype).cuda(), by_hand(w2, r2, dtype).cuda()
    w13, w2 = (replace(w, codes=w.codes.cuda(), scales=w.scales.cuda(), g_idx=w.g_idx.cuda(),
                       zeros=None if w.zeros is None else w.zeros.cuda()) for w in (w13, w2))  # fmt: skip
    x, ids, weights = (t.cuda() for t in routing(tokens, experts, top_k, hidden, dtype, seed=tokens))
    got = ops.fused_experts(x, w13, w2, ids, weights)
    with ops.reference_path():
        expected = ops.fused_experts(x, d13, d2, ids, weights)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    real = moe.weight_tiles
    monkeypatch.setattr(moe, "weight_tiles", lambda w, bm, elem_bytes, gated: real(
        w13 if w is d13 else w2 if w is d2 else w, bm, elem_bytes, gated))
    assert torch.equal(got, moe.fused_experts(x, d13, d2, ids, weights))
