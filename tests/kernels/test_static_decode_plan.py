"""The static decode plan of a CUDA-graph bucket (engine/cuda_graphs.py)
through the Triton attention kernel: a fixed grid, every row a merge row,
padding rows one empty piece each. Without CUDA the kernel runs in the interpreter,
so these are the CPU's check of what a captured graph launches; with CUDA
they run on the GPU.

Against the eager plan of the same lengths the real rows are bit-identical
(same split boundaries; an unsplit row's partial is merged with weight 1),
against the reference within fp32 tolerance; padding rows come out 0, as
much with the merge inside the attention launch (``Tiles.fused_merge``) as
with the merge kernel."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine.cuda_graphs import StaticDecodePlan, max_splits_for
from fluidserve.kernels import packing
from fluidserve.kernels import paged_attention as pa

ATOL, RTOL = 1e-4, 2e-4  # fp32: conftest.TOLERANCES[torch.float32]


def padded(batch, bucket: int, width: int):
    """The batch's tensors padded to ``bucket`` rows as a graph bucket pads
    them: junk queries, block 0 tables, length 1."""
    n, device = batch.query.shape[0], batch.query.device
    gen = torch.Generator().manual_seed(bucket)
    query = torch.randn((bucket, *batch.query.shape[1:]), generator=gen).to(device, batch.query.dtype)
    query[:n] = batch.query
    tables = torch.zeros((bucket, width), dtype=torch.int32, device=device)
    tables[:n, :batch.block_tables.shape[1]] = batch.block_tables
    seq_lens = torch.ones(bucket, dtype=torch.int32, device=device)
    seq_lens[:n] = batch.seq_lens
    qsl = torch.arange(bucket + 1, dtype=torch.int32, device=device)
    return query, tables, seq_lens, qsl


class Region:
    """A host int32 region and its device copy, as a bucket's buffer holds them."""

    def __init__(self, words: int, device: str) -> None:
        self.host = torch.zeros(words, dtype=torch.int32)
        self.dev = self.host if device == "cpu" else torch.zeros(words, dtype=torch.int32, device=device)

    def upload(self) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host)


def static_plan(batch, bucket: int, width: int, window, max_splits: int | None = None, direct: bool = False):
    group = batch.query.shape[1] // batch.key_cache.shape[2]
    split_units = pa.default_num_units(batch.query, batch.key_cache, False, window)
    units = min(split_units, bucket) if direct else split_units  # as a bucket sizes its direct plans
    cap = max_splits or max_splits_for(bucket)
    region = Region(StaticDecodePlan.num_words(bucket, units, cap, direct=direct), str(batch.query.device))
    plan = StaticDecodePlan(region.host.numpy(), region.dev, size=bucket, num_units=units, max_splits=cap,
                            group=group, sliding_window=window, max_seq_len=width * batch.key_cache.shape[1],
                            direct=direct, split_units=split_units)
    return plan, region


def run_static(batch, plan, region, bucket: int, width: int, window) -> torch.Tensor:
    plan.fill(batch.seq_len_list)
    region.upload()
    query, tables, seq_lens, qsl = padded(batch, bucket, width)
    return pa.paged_attention(query, batch.key_cache, batch.value_cache, tables, seq_lens, qsl, batch.scale,
                              window, work=plan.plan).float().cpu()


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("window", [None, 150])
# [1000] * 6: more equal rows than units, cut into whole waves as the eager plan cuts them
@pytest.mark.parametrize("lens, bucket", [([70, 1000, 5], 4), ([700, 33, 16, 17, 260], 8), ([1], 1),
                                          ([1000] * 6, 8)])
def test_static_plan_rows_equal_the_eager_plan(device, make_batch, oracle, lens, bucket, window, fused_merge):
    batch = make_batch([(1, s) for s in lens], num_kv_heads=2, group=2, head_dim=32, block_size=16, device=device)
    width = batch.block_tables.shape[1] + 3
    with pa.tiles(fused_merge=fused_merge):
        plan, region = static_plan(batch, bucket, width, window)
        out = run_static(batch, plan, region, bucket, width, window)
        eager = pa.paged_attention(*batch.args, sliding_window=window).float().cpu()
    n = len(lens)
    assert torch.equal(out[:n], eager)
    torch.testing.assert_close(out[:n], oracle(batch, window), atol=ATOL, rtol=RTOL)
    assert (out[n:] == 0).all()  # padding rows: an empty piece, merged to 0
    if bucket > 1 and window is None:
        assert max(plan._splits) > 1  # the long rows did split


@pytest.mark.parametrize("fused_merge", [False, True])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("lens, bucket", [([70, 200, 5], 4), ([1], 1), ([256, 3], 2)])
def test_direct_plan_rows_equal_the_eager_plan(device, make_batch, oracle, lens, bucket, window, fused_merge):
    """Rows no plan splits (at most ``MIN_KV_CHUNK`` keys here), in the
    bucket's direct plan: every row's one piece writes its output, no merge
    row, no merge launch. The rows are the eager plan's bit for bit (it
    writes unsplit rows directly too); padding rows write 0."""
    batch = make_batch([(1, s) for s in lens], num_kv_heads=2, group=2, head_dim=32, block_size=16, device=device)
    width = batch.block_tables.shape[1] + 3
    with pa.tiles(fused_merge=fused_merge):
        plan, region = static_plan(batch, bucket, width, window, direct=True)
        assert len(plan.pieces(batch.seq_len_list)) == len(lens)  # no row splits: the bucket would go direct
        out = run_static(batch, plan, region, bucket, width, window)
        eager = pa.paged_attention(*batch.args, sliding_window=window).float().cpu()
    n = len(lens)
    assert plan.plan.num_merge_rows == 0 and plan.plan.max_splits == 0
    assert all(it.merge_row == -1 for it in plan.plan.items())
    assert torch.equal(out[:n], eager)
    torch.testing.assert_close(out[:n], oracle(batch, window), atol=ATOL, rtol=RTOL)
    assert (out[n:] == 0).all()


def test_a_direct_plan_refuses_split_rows():
    """A direct plan has no merge rows, so it cannot hold a split row."""
    host = torch.zeros(StaticDecodePlan.num_words(2, 2, 4, direct=True), dtype=torch.int32)
    plan = StaticDecodePlan(host.numpy(), host, size=2, num_units=2, max_splits=4, group=1, sliding_window=None,
                            max_seq_len=4096, direct=True)
    long_rows = [3000]  # one row on two units: split in two
    assert len(plan.pieces(long_rows)) == 2
    with pytest.raises(ValueError, match="every row whole"):
        plan.fill(long_rows)


def test_one_plan_refilled_for_changing_batches(device, make_batch, oracle):
    """The same tensors (as a graph holds them) serve batches of other sizes
    and lengths; stale work of a bigger batch never leaks into a smaller."""
    bucket, width = 8, 70
    first = make_batch([(1, s) for s in [900, 40, 300, 17, 64, 2]], num_kv_heads=1, group=4, head_dim=32,
                       block_size=16, device=device, seed=1)
    plan, region = static_plan(first, bucket, width, None)
    addresses = [t.data_ptr() for t in (plan.plan.work, plan.plan.unit_offsets, plan.plan.merge_num_splits)]
    for seed, lens in enumerate([[900, 40, 300, 17, 64, 2], [5, 1000], [33, 33, 33, 33, 33, 33, 33, 33]]):
        batch = make_batch([(1, s) for s in lens], num_kv_heads=1, group=4, head_dim=32, block_size=16,
                           device=device, seed=seed + 1)
        out = run_static(batch, plan, region, bucket, width, None)
        torch.testing.assert_close(out[:len(lens)], oracle(batch), atol=ATOL, rtol=RTOL)
        assert (out[len(lens):] == 0).all()
    assert [t.data_ptr() for t in (plan.plan.work, plan.plan.unit_offsets, plan.plan.merge_num_splits)] == addresses


def test_split_cap_still_matches_the_reference(device, make_batch, oracle):
    """With at most 3 pieces a row (the cap of a big bucket binding) the
    pieces differ from eager's, the answer does not."""
    lens = [1200, 3, 640]
    batch = make_batch([(1, s) for s in lens], num_kv_heads=2, group=2, head_dim=32, block_size=16, device=device)
    width = batch.block_tables.shape[1]
    plan, region = static_plan(batch, 4, width, None, max_splits=3)
    out = run_static(batch, plan, region, 4, width, None)
    assert 1 < max(plan._splits) <= 3
    torch.testing.assert_close(out[:3], oracle(batch), atol=ATOL, rtol=RTOL)


def test_static_plan_launches_the_eager_decode_variant(device, make_batch):
    """A bucket launches the kernels eager decode steps compiled (same
    constexprs, argument types and alignments): capturing compiles nothing."""
    batch = make_batch([(1, s) for s in [70, 300, 5]], num_kv_heads=2, group=2, head_dim=32, block_size=16,
                       device=device)
    width = batch.block_tables.shape[1]
    keys, saved = [], pa._VARIANTS.keys
    try:
        for static in (False, True):
            pa._VARIANTS.keys = {"attention": set(), "merge": set()}
            with pa.recording_variants():
                if static:
                    plan, region = static_plan(batch, 4, width, None)
                    run_static(batch, plan, region, 4, width, None)
                else:  # kv_chunk 256: the 300-token row splits, so eager merges too
                    pa.paged_attention(*batch.args, work=pa.plan_for(batch.query, batch.key_cache, [1] * 3,
                                                                     batch.seq_len_list, kv_chunk=256))
            keys.append(pa.variant_keys())
    finally:
        pa._VARIANTS.keys = saved
    assert keys[0] == keys[1]
    assert len(keys[0]["attention"]) == len(keys[0]["merge"]) == 1


def test_plan_layout_is_aligned_and_fixed():
    units, bucket, cap = 5, 3, 4
    words = StaticDecodePlan.num_words(bucket, units, cap)
    host = torch.zeros(words, dtype=torch.int32)
    plan = StaticDecodePlan(host.numpy(), host, size=bucket, num_units=units, max_splits=cap, group=1,
                            sliding_window=None, max_seq_len=64)
    p = plan.plan
    assert p.num_units == units and p.num_merge_rows == bucket and p.work.shape == (bucket * cap, packing.WORK_FIELDS)
    for t in (p.work, p.unit_offsets, p.merge_tokens, p.merge_num_splits):
        assert t.data_ptr() % 16 == 0
    assert p.merge_tokens.tolist() == [0, 1, 2]
    plan.fill([40, 7])
    assert p.unit_offsets.tolist()[-1] == sum(p.merge_num_splits.tolist()) and p.merge_num_splits.tolist()[2] == 1
    plan.clear()  # every row padding: one piece over no keys
    assert p.unit_offsets.tolist()[-1] == 3 and p.merge_num_splits.tolist() == [1, 1, 1]
    assert all(it.kv_lo == it.kv_hi == 0 and it.merge_row == it.seq for it in p.items())


@pytest.mark.parametrize("fused_merge", [False, True])
def test_bucket_buffers_feed_the_kernel(device, make_batch, oracle, fused_merge):
    """A whole bucket as the CUDA path builds it (one buffer with the inputs
    and a static plan per sliding window, partials and merge counters viewed
    from shared buffers) run through the kernel over the bucket's own block
    tables, with either merge; layer after layer, the fused merge's counters
    come back to zero."""
    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.block_tables import BlockTableMirror
    from fluidserve.engine.cuda_graphs import Bucket, _PlanSpec

    lens, window, block_size, width = [700, 33, 90], 40, 16, 50
    batch = make_batch([(1, s) for s in lens], num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                       device=device)
    hq, d = batch.query.shape[1], batch.query.shape[2]
    f32 = {"dtype": torch.float32, "device": device}
    counts = torch.zeros(4 * 2, dtype=torch.int32, device=device)
    spec = _PlanSpec(windows=[None, window], num_units={None: 5, window: 3}, group=2, num_q_heads=hq, head_dim=d,
                     partials=(torch.empty(4096 * hq * d, **f32), torch.empty(4096 * hq, **f32)),
                     num_kv_heads=2, merge_counts=counts)
    bucket = Bucket(4, width, block_size, torch.device(device), spec)
    mirror = BlockTableMirror()
    tables = [row[:-(-s // block_size)] for row, s in zip(batch.block_tables.tolist(), lens)]
    bucket.write(ModelInput(input_ids=[1, 2, 3], positions=[s - 1 for s in lens], slot_mapping=[-1] * 3,
                            query_start_loc=[0, 1, 2, 3], seq_lens=lens, block_tables=tables,
                            table_keys=[0, 1, 2], sample_indices=[0, 1, 2]), mirror)
    bucket.upload()
    assert bucket.block_tables.shape == (4, width) and bucket.seq_lens.tolist() == [*lens, 1]
    assert bucket.slot_mapping.tolist() == [-1] * 4 and bucket.sample_idx[:3].tolist() == [0, 1, 2]
    meta = bucket.metadata()
    query = torch.cat([batch.query, torch.randn_like(batch.query[:1])])
    assert not bucket.direct  # the 700-key row splits
    for w in (None, window, None):
        plan = meta.work_plan(query, batch.key_cache, w) if device == "cuda" else meta._plans[w]
        assert plan is bucket.plans[w].plan and plan.scratch  # partials come from the shared buffer
        with pa.tiles(fused_merge=fused_merge):
            out = pa.paged_attention(query, batch.key_cache, batch.value_cache, bucket.block_tables,
                                     bucket.seq_lens, bucket.query_start_loc, batch.scale, w, work=plan).float().cpu()
        torch.testing.assert_close(out[:3], oracle(batch, w), atol=ATOL, rtol=RTOL)
        assert not counts.any()
        assert (out[3] == 0).all()  # the padding row
    # Rows no window splits: the bucket's direct plans, whose grid is no wider than its rows.
    short = [200, 33, 90]
    batch = make_batch([(1, s) for s in short], num_kv_heads=2, group=2, head_dim=32, block_size=block_size,
                       device=device, seed=3)
    tables = [row[:-(-s // block_size)] for row, s in zip(batch.block_tables.tolist(), short)]
    bucket.write(ModelInput(input_ids=[1, 2, 3], positions=[s - 1 for s in short], slot_mapping=[-1] * 3,
                            query_start_loc=[0, 1, 2, 3], seq_lens=short, block_tables=tables,
                            table_keys=[3, 4, 5], sample_indices=[0, 1, 2]), mirror)
    bucket.upload()
    # Narrower tables than the last step's: the columns that step wrote are zero again.
    assert bucket.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables] + [[0] * width]
    assert bucket.direct
    meta = bucket.metadata()
    query = torch.cat([batch.query, torch.randn_like(batch.query[:1])])
    for w in (None, window):
        plan = meta.work_plan(query, batch.key_cache, w) if device == "cuda" else meta._plans[w]
        assert plan is bucket.direct_plans[w].plan and plan.num_merge_rows == 0 and plan.num_units <= 4
        assert meta._plans[w] is not bucket.metadata(direct=False)._plans[w]
        with pa.tiles(fused_merge=fused_merge):
            out = pa.paged_attention(query, batch.key_cache, batch.value_cache, bucket.block_tables,
                                     bucket.seq_lens, bucket.query_start_loc, batch.scale, w, work=plan).float().cpu()
        torch.testing.assert_close(out[:3], oracle(batch, w), atol=ATOL, rtol=RTOL)
        assert (out[3] == 0).all()


def test_buckets_built_without_direct_plans_always_merge():
    """``set_direct_plans(False)`` (what the batch-1 benchmark times the
    direct graphs against): buckets built then hold only the merging plans,
    and a batch no plan splits runs over them."""
    from fluidserve.engine import cuda_graphs
    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.block_tables import BlockTableMirror

    spec = cuda_graphs._PlanSpec(windows=[None], num_units={None: 4}, group=2, num_q_heads=4, head_dim=32,
                                 partials=(torch.empty(4096 * 4 * 32), torch.empty(4096 * 4)), num_kv_heads=2,
                                 merge_counts=torch.zeros(8, dtype=torch.int32))
    short = ModelInput(input_ids=[1, 2], positions=[9, 19], slot_mapping=[-1] * 2, query_start_loc=[0, 1, 2],
                       seq_lens=[10, 20], block_tables=[[0], [1, 2]], sample_indices=[0, 1])
    old = cuda_graphs.set_direct_plans(False)
    try:
        bucket = cuda_graphs.Bucket(2, 4, 16, torch.device("cpu"), spec)
    finally:
        assert cuda_graphs.set_direct_plans(old) is False
    with_direct = cuda_graphs.Bucket(2, 4, 16, torch.device("cpu"), spec)
    assert not bucket.direct_plans and with_direct.direct_plans
    for b in (bucket, with_direct):
        b.write(short, BlockTableMirror())
    assert not bucket.direct and bucket.metadata()._plans[None] is bucket.plans[None].plan
    assert with_direct.direct and with_direct.metadata()._plans[None] is with_direct.direct_plans[None].plan
