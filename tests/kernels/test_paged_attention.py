"""Triton paged attention against ``reference.paged_attention``.

Without CUDA these run in the Triton interpreter in fp32; shapes are small and
parametrised sparingly because the interpreter executes every program in
Python. With CUDA the same tests compile and run on the GPU (fp32 with IEEE
dots), and the GPU-only tests add fp16/bf16. Tolerances come from the dtype
(conftest.TOLERANCES, which says why): fp32 atol=1e-4, rtol=2e-4; fp16
5e-4/1e-3; bf16 4e-3/6e-3, all against the fp32 reference. A kernel that ignores the block table, the causal
mask or a split is off by O(1).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import random

from fluidserve.kernels import launch, packing, reference
from fluidserve.kernels import paged_attention as pa

ATOL, RTOL = 1e-4, 2e-4  # fp32: conftest.TOLERANCES[torch.float32]


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """(q_len, seq_len): decodes at lengths 1, block-1, block, block+1 and a
    few hundred; whole prompts; prefill chunks over a cached prefix."""
    b = block_size
    return [
        (1, 1),
        (1, b - 1),
        (1, b),
        (1, b + 1),
        (1, 300),
        (b + 1, b + 1),  # whole prompt
        (40, 200),  # chunk after a 160-token prefix
        (b - 1, 2 * b + 3),
        (260, 260),  # a prompt of a few hundred tokens
    ]


def specs_q(specs: list[tuple[int, int]]) -> list[int]:
    return [q for q, _ in specs]


def specs_s(specs: list[tuple[int, int]]) -> list[int]:
    return [s for _, s in specs]


def run(batch, plan=None, sliding_window=None) -> torch.Tensor:
    return pa.paged_attention(*batch.args, sliding_window=sliding_window, work=plan).float().cpu()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_batch_matches_reference(device, make_batch, oracle, group, head_dim, block_size):
    # Two KV heads for MHA so the kv-head grid axis is exercised; one for the
    # wide groups (MQA-like) to keep the interpreter quick.
    num_kv_heads = 2 if group == 1 else 1
    batch = make_batch(
        mixed_specs(block_size), num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        device=device, seed=group * 1000 + head_dim + block_size,
    )  # fmt: skip
    torch.testing.assert_close(run(batch), oracle(batch), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("two_launch", [False, True], ids=["split-decode", "two-launch"])
def test_a_step_attention_gives_every_layer_the_checked_launchs_bits(device, make_batch, oracle, two_launch):
    """``StepAttention``: the attention of a step whose layers attend from
    one query tensor, prepared once and launched per layer with only that
    layer's caches, into one output buffer. The first layer runs the
    checked launch, later ones their kernels' call sites. Over a step's
    layers (two split long decodes, a short one, a prefill chunk: the
    merge runs over two rows; or the decode tiles in a launch of their
    own) each layer's output
    equals ``paged_attention``'s bit for bit and the reference's within
    tolerance, on caches of the first layer's layout (again, and at an
    address off Triton's 16-byte specialisation) and on caches laid out
    otherwise (more blocks), which take the checked path; caches of
    another head count are refused there rather than read on the first
    layer's strides."""
    batch = make_batch([(1, 300), (1, 17), (1, 150), (20, 40)], num_kv_heads=2, group=2, head_dim=32,
                       block_size=16, device=device, seed=7)  # fmt: skip
    plan = pa.plan_for(batch.query, batch.key_cache, batch.q_lens, batch.seq_len_list, num_units=4, kv_chunk=64,
                       separate=two_launch, decode_units=2)  # fmt: skip
    assert plan.num_merge_rows > 1 and (plan.decode_part is not None) == two_launch
    gen = torch.Generator().manual_seed(8)
    other = [torch.randn(batch.key_cache.shape, generator=gen).to(device) for _ in range(2)]
    more = [torch.cat([c, torch.randn(c[:3].shape, generator=gen).to(device)]) for c in other]
    # The same layout one element into a larger buffer: no longer 16-byte aligned.
    shifted = [torch.randn(c.numel() + 1, generator=gen).to(device)[1:].view(c.shape) for c in other]
    assert not any(launch.aligned(c) for c in shifted)
    step = pa.StepAttention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.scale, plan)
    layers = [(batch.key_cache, batch.value_cache), other, more, shifted, (batch.key_cache, batch.value_cache),
              other]  # fmt: skip
    for key_cache, value_cache in layers:
        expected = pa.paged_attention(batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                      batch.query_start_loc, batch.scale, work=plan)  # fmt: skip
        out = step(key_cache, value_cache)
        assert out is step.out and torch.equal(out, expected)
        layer = dataclasses.replace(batch, key_cache=key_cache, value_cache=value_cache)
        torch.testing.assert_close(out.float().cpu(), oracle(layer), atol=ATOL, rtol=RTOL)
    wrong = torch.randn((*batch.key_cache.shape[:2], 3, 32), generator=gen).to(device)
    with pytest.raises(ValueError, match="num_kv_heads"):
        step(wrong, wrong)


def test_ignoring_the_block_table_would_fail(device, make_batch, oracle):
    """The test batches are sensitive to the page walk: the same cache read
    through an identity table gives a clearly different answer."""
    batch = make_batch([(1, 70), (20, 50)], num_kv_heads=1, group=4, head_dim=64, block_size=16, device=device)
    out = run(batch)
    torch.testing.assert_close(out, oracle(batch), atol=ATOL, rtol=RTOL)
    batch.block_tables = torch.arange(batch.block_tables.numel(), dtype=torch.int32, device=device).reshape(
        batch.block_tables.shape
    ) % batch.key_cache.shape[0]
    assert (out - oracle(batch)).abs().max() > 0.1


def test_packings_are_bit_identical(device, make_batch, oracle):
    """Same split boundaries, different unit counts and orders: the same bits.
    The default (auto-split) and unpacked plans agree with the reference."""
    specs = [(1, 300), (33, 120), (1, 17), (1, 64), (1, 200), (5, 5)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=16, device=device)
    expected = oracle(batch)
    outs = []
    for num_units in (1, 3, 8):
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=num_units,
                           tokens_per_tile=16, kv_chunk=64)  # fmt: skip
        assert plan.num_merge_rows > 0  # really split
        outs.append(run(batch, plan))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0], expected, atol=ATOL, rtol=RTOL)
    for kw in (dict(pack=False), dict(num_units=2), dict(num_units=5, tokens_per_tile=3)):
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), **kw)
        torch.testing.assert_close(run(batch, plan), expected, atol=ATOL, rtol=RTOL)


def test_split_k_with_empty_pieces(device, make_batch, oracle):
    """Small KV chunks: long decodes split many ways, and prefill tiles whose
    last piece holds no allowed key for their early rows (lse = -inf)."""
    specs = [(1, 700), (40, 200), (1, 65)]
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=64, block_size=32, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=4,
                       tokens_per_tile=32, kv_chunk=64)  # fmt: skip
    assert plan.max_splits == 11  # 700 keys in 64-key pieces
    torch.testing.assert_close(run(batch, plan), oracle(batch), atol=ATOL, rtol=RTOL)


def test_decode_rows_cut_into_whole_waves_give_the_whole_rows_attention(device, make_batch, oracle):
    """Six equal decode rows on four units: the default plan cuts them into
    pieces that share out evenly (``packing.auto_kv_chunk``), and the
    pieces, merged, give the reference's attention, as the plan that
    keeps every row whole does."""
    specs = [(1, 1024)] * 6
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=32, block_size=32, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=4)
    whole = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=4, kv_chunk=1024)
    assert plan.max_splits >= 2 and whole.max_splits == 0
    assert max(plan.unit_costs) < max(whole.unit_costs)
    got = run(batch, plan)
    torch.testing.assert_close(got, oracle(batch), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, run(batch, whole), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window,block_size", [(16, 16), (37, 32)])
def test_sliding_window(device, make_batch, oracle, window, block_size):
    specs = [(1, 1), (1, 300), (40, 200), (block_size + 1, block_size + 1)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=block_size, device=device)
    expected = oracle(batch, sliding_window=window)
    torch.testing.assert_close(run(batch, sliding_window=window), expected, atol=ATOL, rtol=RTOL)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), window, num_units=3,
                       tokens_per_tile=8, kv_chunk=16)  # fmt: skip
    torch.testing.assert_close(run(batch, plan, sliding_window=window), expected, atol=ATOL, rtol=RTOL)


def test_the_reference_soft_caps_scores_as_transformers_gemma2_does(make_batch):
    """``reference.paged_attention`` with ``softcap`` against transformers'
    Gemma 2 eager arithmetic written out per sequence over its gathered
    keys: scores scaled, divided by the cap, tanh, times the cap, masked
    causally (and by the window), softmax in fp32."""
    specs = [(1, 40), (1, 7), (12, 30), (5, 5)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=32, block_size=16, device="cpu", seed=7)
    cap, window = 1.5, 9
    got = reference.paged_attention(*batch.args, sliding_window=window, softcap=cap)
    starts = batch.query_start_loc.tolist()
    for i, (q_len, seq_len) in enumerate(specs):
        q = batch.query[starts[i]:starts[i + 1]].float().transpose(0, 1)  # [Hq, q, d]
        k = reference.gather_kv(batch.key_cache, batch.block_tables[i], seq_len).float().transpose(0, 1)
        v = reference.gather_kv(batch.value_cache, batch.block_tables[i], seq_len).float().transpose(0, 1)
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        scores = torch.tanh(torch.matmul(q, k.transpose(1, 2)) * batch.scale / cap) * cap
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - window)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        torch.testing.assert_close(got[starts[i]:starts[i + 1]].float(), (probs @ v).transpose(0, 1),
                                   atol=1e-5, rtol=1e-5)
    uncapped = reference.paged_attention(*batch.args, sliding_window=window)
    assert (got - uncapped).abs().max() > 1e-2  # the cap bites at these scores


@pytest.mark.parametrize("window", [None, 37])
def test_soft_capped_scores_match_the_reference(device, make_batch, oracle, window):
    """Gemma 2's ``attn_logit_softcapping`` in the kernel: decode and prefill
    tiles, split keys merged, a sliding window, against the reference's cap."""
    specs = mixed_specs(16)
    batch = make_batch(specs, num_kv_heads=1, group=2, head_dim=64, block_size=16, device=device, seed=11)
    cap = 1.0
    expected = oracle(batch, window, softcap=cap)
    got = pa.paged_attention(*batch.args, sliding_window=window, softcap=cap).float().cpu()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), window, num_units=3,
                       tokens_per_tile=8, kv_chunk=16)  # fmt: skip
    split = pa.paged_attention(*batch.args, sliding_window=window, work=plan, softcap=cap).float().cpu()
    torch.testing.assert_close(split, expected, atol=ATOL, rtol=RTOL)
    assert (expected - oracle(batch, window)).abs().max() > 1e-2


def test_plan_must_match_window_and_batch(device, make_batch):
    batch = make_batch([(3, 10)], num_kv_heads=1, group=1, head_dim=64, block_size=16, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, [3], [10], sliding_window=4)
    with pytest.raises(ValueError, match="window"):
        run(batch, plan)
    plan = pa.plan_for(batch.query, batch.key_cache, [2], [10])
    with pytest.raises(ValueError, match="tokens"):
        run(batch, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "group,head_dim,block_size", [(1, 128, 16), (4, 64, 32), (8, 128, 16), (1, 80, 16), (4, 96, 16)]
)
def test_gpu_half_precision(cuda_only, make_batch, oracle, tol, dtype, group, head_dim, block_size):
    specs = mixed_specs(block_size) + [(1, 4096), (512, 2048), (1, 9000)]
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, device="cuda")  # fmt: skip
    expected = oracle(batch)
    torch.testing.assert_close(run(batch), expected, **tol(dtype))
    unpacked = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), pack=False)
    torch.testing.assert_close(run(batch, unpacked), expected, **tol(dtype))
    outs = [
        run(batch, pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=n,
                               kv_chunk=512))  # fmt: skip
        for n in (7, 64)
    ]
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(run(batch, sliding_window=1000), oracle(batch, 1000), **tol(dtype))


@pytest.mark.gpu
def test_gpu_ops_dispatch(cuda_only, make_batch, oracle, tol):
    from fluidserve.kernels import ops

    batch = make_batch([(1, 100), (30, 60)], num_kv_heads=2, group=4, head_dim=128, block_size=16,
                       dtype=torch.float16, device="cuda")  # fmt: skip
    out = ops.paged_attention(*batch.args)
    assert out.is_cuda and out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), oracle(batch), **tol(torch.float16))


def test_ops_uses_reference_on_cpu(make_batch):
    from fluidserve.kernels import ops

    batch = make_batch([(1, 20), (4, 9)], num_kv_heads=1, group=2, head_dim=64, block_size=16)
    plan = packing.plan_attention([1, 4], [20, 9], num_units=1, tokens_per_tile=1)  # ignored on CPU
    assert torch.equal(ops.paged_attention(*batch.args, work=plan), reference.paged_attention(*batch.args))


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dim_not_a_power_of_two(device, make_batch, oracle, head_dim):
    """OPT-2.7B's 80 and 96: tiles padded to 128 columns, the padding masked,
    through direct items and through the merge of split pieces."""
    specs = [(1, 70), (1, 300), (20, 50), (3, 3)]
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=head_dim, block_size=16, device=device,
                       seed=head_dim)  # fmt: skip
    expected = oracle(batch)
    torch.testing.assert_close(run(batch), expected, atol=ATOL, rtol=RTOL)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), num_units=3, kv_chunk=64)
    assert plan.num_merge_rows > 0
    torch.testing.assert_close(run(batch, plan), expected, atol=ATOL, rtol=RTOL)


def test_decode_and_prefill_tiles_in_one_step(device, make_batch, oracle):
    """GQA group 4: decode tiles of 4 tokens (16 rows), prefill tiles of 32
    (128 rows). A short speculative run and a chunk's short tail take the
    decode tile; a decode-only step needs no prefill tile at all."""
    specs = [(1, 90), (4, 40), (5, 45), (36, 36)]  # 36 = a 32-token tile + a 4-token tail
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=32, block_size=16, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=4096)
    assert (plan.decode_tokens_per_tile, plan.tokens_per_tile) == (4, 32) and plan.has_prefill_tiles
    assert sorted(it.q_hi - it.q_lo for it in plan.items()) == [1, 4, 4, 5, 32]
    torch.testing.assert_close(run(batch, plan), oracle(batch), atol=ATOL, rtol=RTOL)
    decodes = [(1, 90), (3, 40)]
    batch = make_batch(decodes, num_kv_heads=1, group=4, head_dim=32, block_size=16, device=device, seed=1)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(decodes), specs_s(decodes))
    assert not plan.has_prefill_tiles
    torch.testing.assert_close(run(batch, plan), oracle(batch), atol=ATOL, rtol=RTOL)


def test_two_launch_plan_gives_the_one_launch_bits(device, make_batch, oracle):
    """A mixed step's decode tiles in a launch of their own (the decode-only
    variant) give the same splits packed into one launch: the same bits in
    the interpreter (one source for the decode tile); on a GPU two compiled
    variants, so fp32 rounding. With each part's own split length, the
    reference's answer."""
    specs = [(1, 300), (36, 36), (1, 90), (4, 40), (40, 200), (1, 17)]
    batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=32, block_size=16, device=device)
    one = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=64, separate=False)
    two = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=64, separate=True,
                      decode_units=3)  # fmt: skip
    assert one.decode_part is None and two.decode_part is not None
    assert two.has_prefill_tiles and not two.decode_part.has_prefill_tiles
    assert two.decode_part.num_units == 3 and two.num_merge_rows == one.num_merge_rows > 0

    def pieces(plan):  # the items but for their merge rows' numbering
        return sorted((it.seq, it.q_lo, it.q_hi, it.kv_lo, it.kv_hi, it.split) for it in plan.items())

    assert pieces(two) == pieces(one)
    if pa.INTERPRETED:
        assert torch.equal(run(batch, two), run(batch, one))
    else:
        torch.testing.assert_close(run(batch, two), run(batch, one), atol=1e-6, rtol=1e-6)
    auto = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), separate=True)
    assert auto.decode_part is not None
    torch.testing.assert_close(run(batch, auto), oracle(batch), atol=ATOL, rtol=RTOL)


def test_fused_merge_is_the_merge_kernels_attention_without_its_launch(device, make_batch, oracle, monkeypatch):
    """``Tiles.fused_merge``: in a decode-only step the last piece of each
    split tile merges, in the attention launch. Decodes split many ways
    (eleven pieces, a last piece of one key, unsplit rows beside them): the
    reference's answer, no merge launch, every counter rearmed to zero, and
    the same bits launch after launch (the next layer finds the counters as
    the first did). A mixed step, whose variant has no registers to spare,
    still merges in the merge kernel; in two launches, its decode launch
    merges the decode tiles' rows and the merge kernel only the others."""
    merges, merge = [], pa._run_merge
    monkeypatch.setattr(pa, "_run_merge",
                        lambda launch, plan, rows: merges.append((plan, rows)) or merge(launch, plan, rows))
    specs = [(1, 700), (1, 65), (1, 30), (1, 300), (1, 641)]
    batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=32, block_size=16, device=device, seed=3)
    with pa.tiles(fused_merge=True):
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=64)
        first, again = run(batch, plan), run(batch, plan)
    assert plan.max_splits == 11 and not plan.has_prefill_tiles
    counts = plan.scratch[pa.merge_counts_key(2, batch.query.device)]
    assert counts.shape == (plan.num_merge_rows, 2) and not counts.any()
    torch.testing.assert_close(first, oracle(batch), atol=ATOL, rtol=RTOL)
    assert torch.equal(first, again) and not [p for p, _ in merges if p.num_items]  # warm-up's empty plans aside
    mixed = [(1, 700), (40, 200), (1, 65)]
    batch = make_batch(mixed, num_kv_heads=2, group=4, head_dim=32, block_size=16, device=device, seed=4)
    expected = oracle(batch)
    for separate in (False, True):
        with pa.tiles(fused_merge=True):
            plan = pa.plan_for(batch.query, batch.key_cache, specs_q(mixed), specs_s(mixed), kv_chunk=64,
                               separate=separate, decode_units=3)  # fmt: skip
            out = run(batch, plan)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
        assert (plan.decode_part is not None) == separate and plan.decode_merge_rows == (2 if separate else 0)
        assert merges[-1][0] is plan and merges[-1][1] == plan.num_merge_rows - plan.decode_merge_rows
        assert not plan.scratch.get(pa.merge_counts_key(2, batch.query.device), torch.zeros(1)).any()


def test_both_merges_read_the_pieces_a_chunk_at_a_time(device, make_batch, oracle, monkeypatch):
    """The last piece reads the partials MERGE_ROWS rows by MERGE_SPLITS
    pieces at a time (the lse, MERGE_LSE_SPLITS at a time). Made small here
    so that every boundary is crossed: eleven and seven pieces end inside a
    chunk of two and of four; items of two and three tokens of a GQA group
    of 3 (a 12-row decode tile) span three row blocks of 4, whose rows
    straddle tokens; a 24-wide head pads to 32 columns. The merge kernel,
    its chunks made as small (SPLIT_CHUNK, and the lse's), gives the same
    attention, and the reference does. The lse's rows (11 pieces x 6 heads)
    are padded from 66 to 80 elements, which both merges must follow."""
    specs = [(2, 700), (3, 400), (1, 30), (1, 641)]
    batch = make_batch(specs, num_kv_heads=2, group=3, head_dim=24, block_size=16, device=device, seed=5)
    monkeypatch.setattr(pa, "MERGE_TILE", 4 * 32 * 2)
    monkeypatch.setattr(pa, "MAX_MERGE_SPLITS", 2)  # and so 4 rows a tile
    monkeypatch.setattr(pa, "MERGE_LSE_SPLITS", 4)
    monkeypatch.setattr(pa, "SPLIT_CHUNK", 2)
    plans, outs = {}, {}
    for fused in (True, False):
        with pa.tiles(fused_merge=fused):
            plans[fused] = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=64)
            outs[fused] = run(batch, plans[fused])
    c = pa._plan_constexprs(batch.query, batch.key_cache, plans[True])
    assert (c["MERGE_ROWS"], c["MERGE_SPLITS"], c["MERGE_LSE_SPLITS"]) == (4, 2, 4)
    assert c["DECODE_M"] == 16 and c["HEAD_PAD"] == 32
    assert plans[True].max_splits == 11 and not plans[True].has_prefill_tiles
    assert not plans[True].scratch[pa.merge_counts_key(2, batch.query.device)].any()
    part_out, part_lse = plans[True].scratch[(6, 24, str(batch.query.device))]
    assert part_lse.stride() == (80, 6, 1) and part_out.stride() == (11 * 6 * 24, 6 * 24, 24, 1)
    torch.testing.assert_close(outs[True], outs[False], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(outs[True], oracle(batch), atol=ATOL, rtol=RTOL)


def test_split_buffers_start_each_merge_row_on_16_elements():
    """The kernels take the split buffers' row strides in units of
    SPLIT_ROW_ALIGN (16 elements, so 16-byte accesses): rows are padded up
    to it, views of shared flat storage are cut the same way, and storage
    too short for a shape is refused rather than overrun."""
    out, lse = pa.split_buffers(3, 5, 3, 24, device="cpu")
    assert out.shape == (3, 5, 3, 24) and out.stride() == (368, 72, 24, 1)  # 360 -> 368
    assert lse.shape == (3, 5, 3) and lse.stride() == (16, 3, 1)  # 15 -> 16
    sizes = pa.split_buffer_sizes(3, 5, 3, 24)
    assert sizes == (3 * 368, 3 * 16)
    storage = tuple(torch.zeros(n + 7) for n in sizes)
    out, lse = pa.split_buffers(3, 5, 3, 24, storage=storage)
    out[2, 4, 2, 23], lse[2, 4, 2] = 1.0, 2.0
    assert storage[0][2 * 368 + 4 * 72 + 2 * 24 + 23] == 1.0 and storage[1][2 * 16 + 14] == 2.0
    with pytest.raises(ValueError, match="needs 1104 fp32 elements"):
        pa.split_buffers(3, 5, 3, 24, storage=(torch.zeros(1103), storage[1]))


# Units per KV head on an H200 for Llama-3-8B's attention: 132 SMs x 2
# programs of the mixed variant // 8 heads, and x 3 of the decode-only one.
H200_UNITS = dict(num_units=33, decode_units=49)


def test_a_mixed_step_takes_the_plan_predicted_faster(device, make_batch, monkeypatch):
    """plan_for gives a step with prefill and decode tiles the plan, one
    launch or two, ``packing.predicted_us`` finds faster: long decodes beside
    a prompt chunk get a launch of their own, a short step stays in one
    (two launches run one after the other, where one runs every tile at
    once). Never a
    decode-only step, an unpacked plan or a forced one launch. Planning
    reads only shapes, so a small cache stands in, with the units an H200
    gives Llama-3-8B's attention (33 a KV head in the mixed variant, 49 in
    the decode-only one: ``H200_UNITS``); a GPU's own would give this
    cache's two KV heads over a hundred a head."""
    batch = make_batch([(1, 8)], num_kv_heads=2, group=4, head_dim=32, block_size=16, device=device)
    units = H200_UNITS

    def plan(q_lens, seq_lens, **kw):
        return pa.plan_for(batch.query, batch.key_cache, q_lens, seq_lens, on_host=True, **units, **kw)

    long_step = ([512] + [1] * 32, [512] + [4096] * 32)
    short_step = ([40, 1, 1], [40, 90, 17])
    for q, s in (long_step, short_step):
        one, two = plan(q, s, separate=False), plan(q, s, separate=True)
        assert one.decode_part is None and two.decode_part is not None
        faster = min((one, two), key=packing.predicted_us)
        assert (plan(q, s).decode_part is None) == (faster is one)
    assert plan(*long_step).decode_part is not None and plan(*short_step).decode_part is None
    assert plan([1, 1], [4096, 4096]).decode_part is None  # decode-only: one launch, its own variant
    assert plan(*long_step, pack=False).decode_part is None
    # One more launch's host time counts: were it dear, no step would split.
    monkeypatch.setattr(packing, "PLAN_COSTS", dataclasses.replace(packing.PLAN_COSTS, host_launch=1e9))
    assert plan(*long_step).decode_part is None


def test_launch_floors_spare_building_a_plan_that_cannot_win(device, make_batch, monkeypatch):
    """``packing.launch_floors_us``, read off a step's tiles, are never
    above the predicted times of its one-launch and two-launch plans;
    where the plan built first beats the other's floor, plan_for keeps it
    without building the other (the choice is the one comparing both plans
    would make)."""
    rng = random.Random(0)
    step = dict(num_units=33, tokens_per_tile=32, decode_tokens_per_tile=4)
    for chunk, n, longest in [(16, 2, 1024), (512, 16, 4096), (2048, 128, 32768), (8192, 128, 4096)]:
        q, s = [chunk] + [1] * n, [chunk] + [rng.randint(512, longest) for _ in range(n)]
        floor_one, floor_two = packing.launch_floors_us(packing.tile_rows(q, s, 32, None, 4), 4, 33, 49)
        one = packing.plan_attention(q, s, **step)
        two = packing.plan_attention(q, s, decode_units=49, **step)
        assert floor_one <= packing.predicted_us(one) and floor_two <= packing.predicted_us(two)
    batch = make_batch([(1, 8)], num_kv_heads=2, group=4, head_dim=32, block_size=16, device=device)
    built, pack = [], packing._pack
    monkeypatch.setattr(packing, "_pack", lambda tiles, prefill, decode_units, *a: built.append(decode_units)
                        or pack(tiles, prefill, decode_units, *a))
    long_step = ([2048] + [1] * 32, [2048] + [32768] * 32)  # two launches win by more than the floors differ
    work = pa.plan_for(batch.query, batch.key_cache, *long_step, **H200_UNITS, on_host=True)
    assert work.decode_part is not None and built == [49]
    built.clear()
    short_step = ([32] + [1] * 4, [32] + [512] * 4)  # one launch wins by more than a launch's host time
    work = pa.plan_for(batch.query, batch.key_cache, *short_step, **H200_UNITS, on_host=True)
    assert work.decode_part is None and built == [None]


def test_predicted_time_is_the_busiest_unit_of_each_launch():
    """``predicted_us`` by hand: one launch of three units, one item each
    (a prefill tile of 100 keys; decode tiles of 300 and 50 keys at the
    mixed variant's rate), then the same step as two launches (the decode
    tiles on two units of the decode-only variant)."""
    c = packing.PLAN_COSTS
    step = dict(num_units=3, tokens_per_tile=8, decode_tokens_per_tile=1, kv_chunk=1 << 20)
    one = packing.plan_attention([8, 1, 1], [100, 300, 50], **step)
    assert [len(u) for u in np.split(np.arange(3), one.unit_offsets[1:-1].numpy())] == [1, 1, 1]
    prefill = c.prefill_key * 100 + c.prefill_item
    assert packing.predicted_us(one) == pytest.approx(
        max(prefill, c.mixed_decode_key * 300 + c.decode_item) + c.launch)
    two = packing.plan_attention([8, 1, 1], [100, 300, 50], decode_units=2, **step)
    decode = c.decode_key * 300 + c.decode_item  # the busier of the decode part's two units
    assert packing.predicted_us(two) == pytest.approx(prefill + decode + 2 * c.launch + c.host_launch)


@pytest.mark.parametrize("changes", [dict(block_n=32, prefill_rows=64), dict(block_n=128, num_stages=2),
                                     dict(max_registers=168, fused_merge=True), dict(prefill_block_n=32),
                                     dict(prefill_halves=2),
                                     dict(narrow_warps=1, block_n=16, num_stages=5),
                                     dict(wide_warps=8, mixed_max_registers=128, prefill_block_n=32, num_stages=4)])
def test_every_launch_shape_a_sweep_tries_gives_the_same_attention(device, make_batch, oracle, changes):
    """``benchmarks/attention_tuning.py`` times other tiles than the
    defaults; each must still be the reference's attention, and the
    defaults come back after the block."""
    specs = [(1, 90), (1, 300), (40, 200), (70, 70)]
    batch = make_batch(specs, num_kv_heads=1, group=4, head_dim=32, block_size=16, device=device, seed=7)
    with pa.tiles(**changes) as tiles:
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), kv_chunk=64)
        assert plan.tokens_per_tile == tiles.prefill_rows // 4 and plan.max_splits > 1
        torch.testing.assert_close(run(batch, plan), oracle(batch), atol=ATOL, rtol=RTOL)
    assert pa.TILES == pa.Tiles()


@pytest.mark.parametrize("window", [None, 37])
def test_prefill_tile_in_halves_is_the_one_tile_attention(device, make_batch, oracle, window):
    """``Tiles.prefill_halves``: the prefill tile as two halves of its rows
    sharing each K/V load. A GQA group of 3 puts one token's heads on both
    sides of the cut (row 31 of 64 is token 10's second head, row 32 its
    third), a 24-wide head is padded to 32, and pieces of 64 keys (16 in a
    37-key window) make merge rows of prefill tiles, some pieces before the
    rows' positions (no allowed key); a 40-token chunk follows a 160-token
    prefix. Both halves must
    give what one tile gives, and the reference's attention."""
    specs = [(40, 200), (70, 70), (1, 90), (21, 21)]
    batch = make_batch(specs, num_kv_heads=2, group=3, head_dim=24, block_size=16, device=device, seed=11)
    expected = oracle(batch, sliding_window=window)

    def attention() -> torch.Tensor:
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), window,
                           tokens_per_tile=21, kv_chunk=64 if window is None else 16)  # fmt: skip
        assert plan.max_splits > 1
        return run(batch, plan, sliding_window=window)

    one_tile = attention()
    with pa.tiles(prefill_halves=2):
        constexprs = pa._constexprs(batch.query, batch.key_cache, decode_tokens=1, tokens_per_tile=21,
                                    has_prefill=True, has_window=window is not None)  # fmt: skip
        assert constexprs["PREFILL_M"] == 64 and constexprs["PREFILL_HALVES"] == 2
        halves = attention()
    torch.testing.assert_close(halves, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(halves, one_tile, atol=1e-6, rtol=1e-6)
    # A tile of 16 rows has no halves of 16 (tl.dot's smallest): it runs whole.
    with pa.tiles(prefill_halves=2):
        small = pa._constexprs(batch.query, batch.key_cache, decode_tokens=1, tokens_per_tile=5, has_prefill=True,
                               has_window=False)  # fmt: skip
    assert small["PREFILL_M"] == 16 and small["PREFILL_HALVES"] == 1


def test_each_variant_takes_its_own_register_cap():
    """``max_registers`` caps the decode-only variant and
    ``mixed_max_registers`` the one with prefill tiles: a cap tuned for one
    must not reach the other, whose registers hold another tile."""
    def maxnreg(has_prefill: bool) -> int | None:
        constexprs = pa._constexprs(torch.empty((0, 8, 128)), torch.empty((1, 16, 2, 128)), decode_tokens=4,
                                    tokens_per_tile=32, has_prefill=has_prefill, has_window=False)
        return pa._launch_options(constexprs).get("maxnreg")

    assert (maxnreg(False), maxnreg(True)) == (None, None)
    with pa.tiles(max_registers=168):
        assert (maxnreg(False), maxnreg(True)) == (168, None)
    with pa.tiles(mixed_max_registers=128, wide_warps=8):
        assert (maxnreg(False), maxnreg(True)) == (None, 128)


def test_warps_per_tile_keep_the_accumulator_in_registers():
    """Four warps for tiles of up to 128 x 128 (the prefill tile of a
    128-wide head ran twice as fast so on an H100), eight once the fp32
    accumulator is wider (a 256-wide head), four for decode tiles."""
    def warps(head_dim: int, has_prefill: bool) -> int:
        query = torch.empty((0, 8, head_dim))
        key_cache = torch.empty((1, 16, 2, head_dim))
        return pa._num_warps(pa._constexprs(query, key_cache, decode_tokens=4, tokens_per_tile=32,
                                            has_prefill=has_prefill, has_window=False))

    assert [warps(d, True) for d in (64, 128, 256)] == [4, 4, 8]
    assert [warps(d, False) for d in (64, 128, 256)] == [4, 4, 4]
    with pa.tiles(wide_warps=8):
        assert warps(128, True) == 8


def test_host_checks_name_the_mismatch(device, make_batch):
    """Block-table width, rows, plan device and cache shapes are checked
    before any launch: the kernel would read another sequence's blocks."""
    specs = [(1, 70), (20, 50)]
    batch = make_batch(specs, num_kv_heads=1, group=2, head_dim=32, block_size=16, device=device)
    plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs))
    args = list(batch.args)
    args[3] = batch.block_tables[:, :4].contiguous()  # 70 tokens need 5 blocks of 16
    with pytest.raises(ValueError, match="needs 5 blocks of 16, block_tables rows hold 4"):
        pa.paged_attention(*args, work=plan)
    args[3] = batch.block_tables[:1]
    with pytest.raises(ValueError, match="2 sequences, block_tables has 1 rows"):
        pa.paged_attention(*args, work=plan)
    args[3] = batch.block_tables.long()
    with pytest.raises(ValueError, match="int32"):
        pa.paged_attention(*args, work=plan)
    with pytest.raises(ValueError, match="plan is on meta"):
        pa.paged_attention(*batch.args, work=plan.to("meta"))
    args = list(batch.args)
    args[2] = batch.value_cache[..., :16]
    with pytest.raises(ValueError, match="value_cache"):
        pa.paged_attention(*args, work=plan)
    args = list(batch.args)
    args[0] = batch.query.half()
    with pytest.raises(ValueError, match="share a dtype"):
        pa.paged_attention(*args, work=plan)


def test_occupancy_from_the_compiled_kernel():
    """The grid follows what fits on an SM: the 128-row prefill variant (224
    registers x 256 threads) fits once on an H100 SM, a light decode variant
    several times, and shared memory can bind too."""
    h100 = pa.SmLimits()
    assert pa.occupancy(224, 8, 64 * 1024, h100) == 1
    assert pa.occupancy(96, 4, 32 * 1024, h100) == 5  # registers bind: 65536 // (3072 * 4)
    assert pa.occupancy(40, 4, 100 * 1024, h100) == 2  # shared memory binds
    assert pa.occupancy(16, 1, 0, h100) == 32  # the block limit
    assert pa.occupancy(255, 16, 300 * 1024, h100) == 1  # never 0


# Tiny shape for the variant tests: the interpreter runs many batches of it.
VARIANT_SHAPE = dict(num_kv_heads=1, group=2, head_dim=32, block_size=16)


def variant_workload() -> list[tuple[list[tuple[int, int]], dict]]:
    """(specs, plan_for options) of batches as serving sees them: 1 to 16
    sequences, one-block tables (row stride 1) and 16-block ones, decode-only
    and mixed steps, 0 to 8 KV splits, one launch or two."""
    rng = random.Random(7)
    return [
        ([(1, 5)], {}),  # block table [1, 1]: row stride 1
        ([(1, 5), (1, 9), (1, 16)], {}),
        ([(1, 250), (1, 3)], dict(kv_chunk=32)),  # 16 blocks: row stride 16; 8 splits
        ([(1, rng.randint(1, 120)) for _ in range(16)], {}),
        ([(1, 500)], dict(kv_chunk=64)),  # 8 splits: partial-buffer strides multiples of 16
        ([(1, 300), (1, 70)], dict(kv_chunk=128)),
        ([(30, 30), (1, 200), (1, 17)], {}),  # mixed
        ([(7, 7)], {}),
        ([(40, 90), (1, 33)], dict(kv_chunk=32)),  # mixed, split prefill tiles
        ([(30, 30), (1, 200), (1, 17)], dict(separate=True)),  # mixed in two launches
        ([(40, 90), (1, 250)], dict(kv_chunk=32, separate=True)),  # both parts split
    ]


def launch_workload(make_batch, device: str, oracle=None) -> None:
    for i, (specs, options) in enumerate(variant_workload()):
        batch = make_batch(specs, device=device, seed=i, **VARIANT_SHAPE)
        # Tables exactly as wide as the longest sequence needs.
        width = max(-(-s // VARIANT_SHAPE["block_size"]) for s in specs_s(specs))
        batch.block_tables = batch.block_tables[:, :width].contiguous()
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), **options)
        assert (plan.decode_part is not None) == options.get("separate", False)
        out = run(batch, plan)
        if oracle is not None:
            torch.testing.assert_close(out, oracle(batch), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("changes", [{}, dict(fused_merge=True), dict(prefill_halves=2)])
def test_varied_batches_compile_no_new_variant_after_warmup(device, make_batch, oracle, changes):
    """Start-up compiles the fixed set (decode-only, mixed, merge); a
    workload of varied batches then launches no new specialisation, with the
    split-K merge in its own kernel or, for decode tiles, in the launch (a
    two-launch plan's decode part then runs the decode-only step's variant),
    and with the prefill tile in halves (which the decode-only variant,
    a two-launch plan's decode part's included, does not carry)."""
    base = make_batch([(1, 8)], device=device, **VARIANT_SHAPE)
    with pa.tiles(**changes), pa.recording_variants():
        pa.warmup(base.query, base.key_cache)
        warm = pa.variant_keys()
        compiled = pa.triton_compiled_count()  # None in the interpreter
        launch_workload(make_batch, device, oracle)
    assert pa.variant_keys() == warm
    assert pa.triton_compiled_count() == compiled


def test_variant_count_would_catch_a_specialised_batch_argument(device, make_batch):
    """The same workload with no argument exempt from specialisation gives
    several keys per variant (a one-block table, 16-multiple split strides):
    the check above can fail."""
    exempt, none = set(), set()
    for i, (specs, options) in enumerate(variant_workload()):
        batch = make_batch(specs, device=device, seed=i, **VARIANT_SHAPE)
        width = max(-(-s // VARIANT_SHAPE["block_size"]) for s in specs_s(specs))
        batch.block_tables = batch.block_tables[:, :width].contiguous()
        plan = pa.plan_for(batch.query, batch.key_cache, specs_q(specs), specs_s(specs), **options)
        launch = pa._prepare(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, 1.0, plan)
        launches = [launch] + ([pa._decode_launch(launch, plan)] if plan.decode_part else [])
        for each in launches:
            args = {**each.args, **each.constexprs}
            exempt.add(pa.specialization_key(args, pa._ATTENTION_DYNAMIC))
            none.add(pa.specialization_key(args, ()))
    assert len(exempt) == 2  # decode-only and mixed
    assert len(none) > len(exempt)
    assert pa.specialization_key({"x": 1}, ()) != pa.specialization_key({"x": 7}, ())
    assert pa.specialization_key({"x": 32}, ()) != pa.specialization_key({"x": 7}, ())
    assert pa.specialization_key({"x": 1}, ("x",)) == pa.specialization_key({"x": 7}, ("x",))


@pytest.mark.gpu
def test_gpu_grid_follows_the_compiled_occupancy(cuda_only, make_batch):
    """On a GPU the occupancy comes from the compiled kernels, and the
    decode-only variant (no 128-row tile) fits at least as many programs per
    SM as the mixed one; the default plan's units follow from it, every
    program of the grid resident at once."""
    batch = make_batch([(1, 64)], num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16,
                       device="cuda")  # fmt: skip
    per_sm = pa.warmup(batch.query, batch.key_cache)
    assert per_sm[False] >= per_sm[True] >= 1
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    units = pa.default_num_units(batch.query, batch.key_cache, False)
    assert units == sms * per_sm[False] // 8 and units * 8 <= sms * per_sm[False]
    assert any(o["programs_per_sm"] == per_sm[False] and not o["has_prefill"] for o in pa.occupancies())


@pytest.mark.gpu
def test_gpu_serving_shapes_compile_once(cuda_only, make_batch, oracle, tol):
    """A Llama-3-8B-shaped layer in bf16: after start-up, batches of 1 to 256
    sequences, decode-only and mixed, long and short, compile nothing new."""
    shape = dict(num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    base = make_batch([(1, 16)], **shape)
    with pa.recording_variants():
        pa.warmup(base.query, base.key_cache)
    warm, compiled = pa.variant_keys(), pa.triton_compiled_count()
    rng = random.Random(3)
    workload = [
        [(1, 16)],
        [(1, rng.randint(1, 1024)) for _ in range(256)],
        [(1, 30000)],
        [(1, rng.randint(1, 300)) for _ in range(33)],
        [(512, 2048)] + [(1, rng.randint(1, 4000)) for _ in range(64)],
        [(3, 3), (17, 400), (1, 5)],
    ]
    for i, specs in enumerate(workload):
        batch = make_batch(specs, seed=i, **shape)
        width = max(-(-s // 16) for s in specs_s(specs))
        batch.block_tables = batch.block_tables[:, :width].contiguous()
        with pa.recording_variants():
            out = run(batch)
        if i in (2, 5):  # the oracle is slow on the large ones
            torch.testing.assert_close(out, oracle(batch), **tol(torch.bfloat16))
    assert pa.variant_keys() == warm
    assert pa.triton_compiled_count() == compiled


@pytest.mark.gpu
def test_gpu_offsets_past_2_31(cuda_only, make_batch, oracle, tol):
    """A query row stride of 2^20 elements over 2,100 tokens (a view into a
    4.4 GB buffer) puts the last rows past 2^31 elements: 32-bit offsets would
    wrap and read another row."""
    tokens, stride = 2100, 1 << 20
    batch = make_batch([(tokens, tokens)], num_kv_heads=1, group=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, device="cuda")  # fmt: skip
    big = torch.empty((tokens, stride), dtype=torch.bfloat16, device="cuda")
    query = big[:, : 2 * 64].view(tokens, 2, 64)
    query.copy_(batch.query)
    assert query.stride(0) * (tokens - 1) >= 2**31
    batch.query = query
    torch.testing.assert_close(run(batch), oracle(batch), **tol(torch.bfloat16))
