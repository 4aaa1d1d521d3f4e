"""The CPU fast path (``kernels/cpu_attention.py``) against the reference, on
ragged batches over shuffled block tables: decodes of many lengths (several
buckets), whole prompts, chunks over a cached prefix, GQA and MHA, sliding
windows, soft-capped scores (Gemma 2), fp32 and bf16.

Tolerances, against the fp32 reference on the same (rounded) inputs: fp32
atol=rtol=1e-5 (observed ~6e-7); bf16 atol=rtol=2e-2 (observed ~8e-3: the
fast path keeps K/V in bf16 and rounds its output to bf16). A path that
ignores the block table, a mask or a bucket boundary is off by O(1).
"""

from __future__ import annotations

import random

import pytest
import torch

from fluidserve.engine.layers import AttentionMetadata, PagedAttention
from fluidserve.kernels import cpu_attention, reference

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """(q_len, seq_len): decodes at 1, block-1, block, block+1 and a few
    hundred (so more than one bucket); whole prompts; chunks over a prefix."""
    b = block_size
    return [
        (1, 1), (1, b - 1), (1, b), (1, b + 1), (1, 3 * b), (1, 3 * b + 5), (1, 300),
        (b + 1, b + 1),  # a whole prompt
        (40, 200),  # a chunk after a 160-token prefix
        (1, 7),
        (b - 1, 2 * b + 3),  # a chunk shorter than a block
        (130, 130),
    ]


def step_slots(batch, block_size: int) -> torch.Tensor:
    """The slot of every query token: where this step's K/V were written."""
    slots = []
    for i, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_len_list)):
        for p in range(seq_len - q_len, seq_len):
            slots.append(int(batch.block_tables[i, p // block_size]) * block_size + p % block_size)
    return torch.tensor(slots)


def kv_width(batch) -> int:
    return batch.key_cache.shape[2] * batch.key_cache.shape[3]


def run_fast(batch, block_size: int, sliding_window: int | None, with_step_kv: bool,
             softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    slots = step_slots(batch, block_size)
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables, slots, block_size,
                                    sliding_window, kv_width(batch))
    kv_heads, head_dim = batch.key_cache.shape[2:]
    key = value = None
    if with_step_kv:  # the step's own K/V, exactly what the cache holds at its slots
        key = batch.key_cache.view(-1, kv_heads, head_dim)[slots]
        value = batch.value_cache.view(-1, kv_heads, head_dim)[slots]
    out = cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, batch.scale,
                                        key, value, softcap)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    return out.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("with_step_kv", [True, False])
def test_mixed_batch_matches_reference(make_batch, oracle, dtype, group, block_size, with_step_kv):
    batch = make_batch(mixed_specs(block_size), num_kv_heads=2, group=group, head_dim=64, block_size=block_size,
                       dtype=dtype, seed=group * 100 + block_size)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(run_fast(batch, block_size, None, with_step_kv), oracle(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("with_step_kv", [True, False])
def test_chunks_over_a_prefix_match_reference(make_batch, oracle, dtype, group, with_step_kv):
    """Chunks over a cached prefix (prefix and own keys in two calls, merged
    by log-sum-exp): a one-token prefix, a prefix ending mid-block, a chunk
    much shorter and one longer than its prefix."""
    specs = [(2, 3), (5, 6), (64, 1000), (17, 33), (300, 310), (16, 32)]
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=64, block_size=16, dtype=dtype, seed=group)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(run_fast(batch, 16, None, with_step_kv), oracle(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 24, 100])
def test_sliding_window_matches_reference(make_batch, oracle, dtype, window):
    batch = make_batch(mixed_specs(16), num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=dtype, seed=window)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(run_fast(batch, 16, window, True), oracle(batch, window), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, with_step_kv", [(None, True), (None, False), (24, True)])
def test_soft_capped_scores_match_reference(make_batch, oracle, dtype, window, with_step_kv):
    """Gemma 2's score cap on every path of a step: decode buckets, whole
    prompts, chunks over a prefix (one explicit call over both key sets),
    a window; and decodes sharing their leading blocks, which take the
    plain bucket path under a cap."""
    specs = mixed_specs(16) + [(1, 70), (1, 75)]
    batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=dtype, seed=29)
    batch.block_tables[len(specs) - 1, :3] = batch.block_tables[len(specs) - 2, :3]
    atol, rtol = TOLERANCES[dtype]
    expected = oracle(batch, window, softcap=1.0)
    torch.testing.assert_close(run_fast(batch, 16, window, with_step_kv, softcap=1.0), expected, atol=atol, rtol=rtol)
    assert (expected - oracle(batch, window)).abs().max() > 1e-2


def test_many_decodes_split_into_buckets_and_chunks(make_batch, oracle, monkeypatch):
    """Sixty decodes of lengths 1..400 in shuffled order; the gather budget is
    cut so buckets also split by rows, and a second, larger step reuses (and
    grows) the workspace of the first."""
    rng = random.Random(0)
    monkeypatch.setattr(cpu_attention, "MAX_GATHER_TOKENS", 1024)
    for n, seed in ((20, 1), (60, 2)):
        specs = [(1, rng.randint(1, 400)) for _ in range(n)]
        batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=seed)
        plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                        step_slots(batch, 16), 16, None, kv_width(batch))
        assert len(plan.decodes) > 3
        for bucket in plan.decodes:
            rows = set(bucket.q_rows.tolist())  # decode i's token sits at index i
            lens = [batch.seq_len_list[i] for i in range(n) if i in rows]
            assert max(lens) <= cpu_attention.BUCKET_RATIO * min(lens)
            assert len(lens) == 1 or len(lens) * bucket.num_blocks * 16 <= 1024
        torch.testing.assert_close(run_fast(batch, 16, None, False), oracle(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_call", [1, 3])
def test_a_bucket_attends_a_few_rows_per_call(make_batch, oracle, monkeypatch, dtype, rows_per_call):
    """A decode bucket bigger than DECODE_GROUP_ELEMENTS gathers and attends
    its rows a few at a time (the last group short); every row as the
    reference has it."""
    specs = [(1, n) for n in (200, 230, 250, 260, 290, 300, 310)] + [(40, 200)]
    batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=16, dtype=dtype, seed=rows_per_call)
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, 16), 16, None, kv_width(batch))
    [bucket] = plan.decodes
    monkeypatch.setattr(cpu_attention, "DECODE_GROUP_ELEMENTS",
                        rows_per_call * bucket.num_blocks * 16 * kv_width(batch))
    calls = []
    sdpa = cpu_attention.F.scaled_dot_product_attention
    monkeypatch.setattr(cpu_attention.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append(q.shape[0]) or sdpa(q, *a, **k))
    fast = run_fast(batch, 16, None, True)
    # the bucket's calls (the chunk over its prefix calls the flash kernel itself)
    assert calls == [rows_per_call] * (7 // rows_per_call) + ([7 % rows_per_call] if 7 % rows_per_call else [])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(fast, oracle(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    cache_shape = (12, 16, 2, 64)
    slots = torch.randperm(12 * 16, generator=gen)[:40]
    slots[[3, 17]] = -1  # padding tokens: not written
    key, value = torch.randn(40, 2, 64, generator=gen), torch.randn(40, 2, 64, generator=gen)
    ours = [torch.zeros(cache_shape, dtype=dtype) for _ in range(2)]
    ref = [torch.zeros(cache_shape, dtype=dtype) for _ in range(2)]
    cpu_attention.reshape_and_cache(key, value, *ours, slots)
    reference.reshape_and_cache(key, value, *ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert ours[0].count_nonzero() == 38 * 2 * 64


def test_layer_plans_once_per_step_and_matches_reference(make_batch, oracle):
    """The attention layer on CPU goes through the fast path, with one plan
    per step shared by every layer (per sliding window)."""
    specs = [(1, 50), (30, 30), (1, 9), (20, 70)]
    batch = make_batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=16, seed=5)
    slots = step_slots(batch, 16)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                             query_start_loc=batch.query_start_loc)
    kv = (batch.key_cache.clone(), batch.value_cache.clone())
    key = batch.key_cache.view(-1, 2, 64)[slots]
    value = batch.value_cache.view(-1, 2, 64)[slots]
    layer = PagedAttention(8, 2, 64, batch.scale)
    out = layer(batch.query, key, value, kv, meta).view(-1, 8, 64)
    plan = meta.cpu_plan(kv[0], None)
    layer(batch.query, key, value, kv, meta)
    assert meta.cpu_plan(kv[0], None) is plan and list(meta._cpu_plans) == [None]
    torch.testing.assert_close(out, oracle(batch), atol=1e-5, rtol=1e-5)
    assert torch.equal(kv[0], batch.key_cache)  # it wrote the step's K/V into their own slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("shared_blocks", [2, 5])
def test_decodes_sharing_leading_blocks_attend_them_once(make_batch, oracle, dtype, group, shared_blocks):
    """Decode rows whose tables start with the same physical blocks (a prefix
    the cache shares): the bucket attends those once for every row and merges
    with each row's own blocks; the result equals the reference, including a
    row whose query sits in the first block after the shared ones."""
    bs = 16  # one bucket whatever MIN_SHARED_SAVING says: every decode row is of the family
    lens = [shared_blocks * bs + 1, shared_blocks * bs + 9, shared_blocks * bs + 30, shared_blocks * bs + 17]
    specs = [(1, n) for n in lens] + [(20, 60)]  # and a prefill in the same step
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=32, block_size=bs, dtype=dtype, seed=3)
    for i in range(1, len(lens)):
        batch.block_tables[i, :shared_blocks] = batch.block_tables[0, :shared_blocks]
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, bs), bs, None, kv_width(batch))
    (bucket,) = plan.decodes
    assert bucket.shared_ids is not None and bucket.shared_ids.numel() == shared_blocks
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(run_fast(batch, bs, None, False), oracle(batch), atol=atol, rtol=rtol)


def test_rows_that_share_one_block_or_a_window_take_the_plain_path(make_batch):
    bs = 16
    batch = make_batch([(1, 40), (1, 50)], num_kv_heads=1, group=2, head_dim=16, block_size=bs)
    batch.block_tables[1, :1] = batch.block_tables[0, :1]
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, bs), bs, None, kv_width(batch))
    assert plan.decodes[0].shared_ids is None  # one shared block: below MIN_SHARED_BLOCKS
    batch.block_tables[1, :2] = batch.block_tables[0, :2]
    windowed = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                        step_slots(batch, bs), bs, 24, kv_width(batch))
    assert windowed.decodes[0].shared_ids is None


def family_batch(make_batch):
    """Five decodes; rows 0, 2 and 4 start at the same 3 blocks (2 x 48
    tokens their sharing saves), rows 1 and 3 start elsewhere."""
    bs = 16
    specs = [(1, 70), (1, 90), (1, 75), (1, 80), (1, 85)]
    batch = make_batch(specs, num_kv_heads=2, group=2, head_dim=32, block_size=bs, seed=5)
    for i in (2, 4):
        batch.block_tables[i, :3] = batch.block_tables[0, :3]
    return batch


def plan_rows(batch) -> list[tuple[list[int], bool]]:
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, 16), 16, None, kv_width(batch))
    return sorted((sorted(b.q_rows.tolist()), b.shared_ids is not None) for b in plan.decodes)


def test_rows_of_one_prefix_family_bucket_apart_from_the_rest(make_batch, oracle, monkeypatch):
    """A family whose sharing saves enough: the three share their prefix in
    a bucket of their own, the other two still go together in one bucket,
    and the outputs equal the reference."""
    batch = family_batch(make_batch)
    saved = 2 * 3 * 16 * kv_width(batch)
    monkeypatch.setattr(cpu_attention, "MIN_SHARED_SAVING", saved)
    assert plan_rows(batch) == [([0, 2, 4], True), ([1, 3], False)]
    torch.testing.assert_close(run_fast(batch, 16, None, False), oracle(batch), atol=1e-5, rtol=1e-5)


def test_a_family_that_shares_little_stays_in_the_common_bucket(make_batch, oracle, monkeypatch):
    """Below MIN_SHARED_SAVING a bucket of its own costs more than the copies
    it saves (many 2-4 row families of a short prompt made a decode step
    several times slower): one bucket for all five rows. The bound is the
    blocks the rows share, not their length: rows that share one block of a
    long context stay together too."""
    batch = family_batch(make_batch)
    saved = 2 * 3 * 16 * kv_width(batch)
    monkeypatch.setattr(cpu_attention, "MIN_SHARED_SAVING", saved + 1)
    assert plan_rows(batch) == [([0, 1, 2, 3, 4], False)]
    torch.testing.assert_close(run_fast(batch, 16, None, False), oracle(batch), atol=1e-5, rtol=1e-5)
    for i in (2, 4):  # now only the first block is shared; the rows are as long as before
        batch.block_tables[i, 1:3] = batch.block_tables[3, 1:3]
    monkeypatch.setattr(cpu_attention, "MIN_SHARED_SAVING", 2 * 16 * kv_width(batch) + 1)
    assert plan_rows(batch) == [([0, 1, 2, 3, 4], False)]


def spec_step(block_size: int) -> list[tuple[int, int]]:
    """A speculative step: rows of one token and its 1-4 drafts, at lengths
    that put a row's queries across a block boundary, beside plain decodes
    and a chunk too long to fold."""
    b = block_size
    return [(1, 40), (3, 41), (5, b), (2, 2), (4, b + 2), (5, 3 * b + 3), (1, 200), (2, 210), (5, 230),
            (cpu_attention.MAX_FOLDED_QUERIES + 1, 90), (cpu_attention.MAX_FOLDED_QUERIES, 120)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window, softcap", [(None, None), (24, None), (None, 1.0), (5, 1.0)])
def test_short_rows_bucket_like_decodes_and_match_reference(make_batch, oracle, dtype, group, window, softcap):
    """Rows of up to MAX_FOLDED_QUERIES queries go into buckets apart from
    single-token rows, padded to their bucket's longest; each query sees
    the keys up to its own position (and its window), as the reference's
    causal chunk does. Longer rows stay chunks."""
    bs = 16
    specs = spec_step(bs)
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=32, block_size=bs, dtype=dtype, seed=11)
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, bs), bs, window, kv_width(batch))
    assert [(p.q_hi - p.q_lo, p.seq_len) for p in plan.prefills] == [specs[-2]]
    short = [b for b in plan.decodes if b.queries > 1]
    assert short and all(b.q_rows.numel() == b.queries * b.key_mask.shape[0] for b in plan.decodes)
    assert sum(int(b.keep.sum()) if b.keep is not None else b.q_rows.numel() for b in plan.decodes) == \
        sum(q for q, _ in specs[:-2]) + specs[-1][0]
    assert any(b.keep is not None for b in short)  # a bucket of rows of different lengths pads them
    atol, rtol = TOLERANCES[dtype]
    expected = oracle(batch, window, softcap=softcap)
    torch.testing.assert_close(run_fast(batch, bs, window, True, softcap), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 4])
def test_short_rows_sharing_leading_blocks_attend_them_once(make_batch, oracle, group):
    """Verifying rows of one prompt (n > 1 samples, or one system prompt)
    read the shared blocks in one call; a row whose first query sits right
    after them still sees them and its own keys."""
    bs, shared = 16, 3
    lens = [shared * bs + 3, shared * bs + 9, shared * bs + 30, shared * bs + 17]
    specs = [(3, lens[0]), (4, lens[1]), (5, lens[2]), (2, lens[3]), (1, 70)]
    batch = make_batch(specs, num_kv_heads=2, group=group, head_dim=32, block_size=bs, seed=7)
    for i in range(1, len(lens)):
        batch.block_tables[i, :shared] = batch.block_tables[0, :shared]
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables,
                                    step_slots(batch, bs), bs, None, kv_width(batch))
    (bucket,) = [b for b in plan.decodes if b.queries > 1]
    assert bucket.shared_ids is not None and bucket.shared_ids.numel() == shared and bucket.queries == 5
    torch.testing.assert_close(run_fast(batch, bs, None, False), oracle(batch), atol=1e-5, rtol=1e-5)


def test_short_rows_stay_chunks_when_a_slot_was_not_written(make_batch, oracle):
    """A bucket reads a row's own keys from the cache: with a slot left
    unwritten (-1) the short rows attend their step K/V as chunks do."""
    bs = 16
    batch = make_batch([(3, 40), (1, 50), (2, 20)], num_kv_heads=2, group=2, head_dim=32, block_size=bs)
    slots = step_slots(batch, bs)
    slots[-1] = -1
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables, slots, bs, None,
                                    kv_width(batch))
    assert [b.queries for b in plan.decodes] == [1] and len(plan.prefills) == 2 and not plan.slots_all_valid
