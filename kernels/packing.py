"""Attention work packing (FluidInfer §4.2): the host-side planner of the
Triton paged-attention kernel.

This module owns the *work list*: how one step's flat ragged batch (prefill
chunks and decode tokens mixed) is cut into work items and how those items are
packed onto the kernel's persistent programs ("work units"). The plan
depends only on the batch's lengths, so the engine builds it once per step
and every layer reuses it. It is built on the engine's thread before every
step, between the device's steps, so it works on whole arrays: tiles and
items are rows of an int64 numpy array in the kernel's column order
(``WORK_FIELDS``), each stage a few numpy operations over all of them, and
only the LPT loop is per item (ints on a heap). With a Python object per
item, planning a 256-decode step took 1.0 ms (1.7 ms before a graph
replay); as arrays, 0.15 ms (0.11) (benchmarks/plan_host_time.py). torch is
used only to hand the result to the kernel as int32 tensors.
``WorkItem`` is one row as an object, for tests and debugging.

Pipeline::

    sequences --tile queries--> tiles --split KV--> items --LPT--> units
                                                       \\--> merge rows

* A **tile** is up to ``tokens_per_tile`` consecutive queries of one sequence;
  the kernel processes a tile's queries for all query heads of one KV head at
  once (``tokens_per_tile * group`` rows). Its KV span is the union of its
  queries' causal (and sliding-window) ranges. A sequence with at most
  ``decode_tokens_per_tile`` queries (a decode token, a short speculative
  run) gets one small **decode tile** instead, which the kernel runs with a
  16-row tile rather than the 128-row prefill tile; so does the short tail of
  a prefill chunk. The kernel tells the two kinds apart by the tile's length.
* A tile whose span is longer than the chunk length is **split along the KV
  axis** (split-K). Each piece writes a partial (normalised output, log-sum-exp)
  into a merge row; a second small kernel merges the pieces. Every other tile
  writes the output directly.
* Items are packed **longest-processing-time first** onto ``num_units``
  programs: take the costliest item left and give it to the least loaded unit.
  This is the greedy of FluidInfer's Figure 9b: long prefill work is placed
  first and the short decode items fill the bubbles beside it. LPT's makespan
  is at most ``4/3 - 1/(3 * num_units)`` times the optimum. An item costs
  the time ``PLAN_COSTS`` predicts for it in the variant that runs it (per
  key and per item, by the kind of tile; in whole nanoseconds): the model
  that picks a step's plan also balances its units. The split length is
  counted in keys (``split_costs``).
* A step with both kinds of tile can instead be planned as **two launches**
  (``decode_units``): its decode tiles packed onto the units of the
  decode-only kernel variant (``WorkPlan.decode_part``), its prefill tiles
  onto the mixed variant's, one merge after both: each kind runs in the
  variant built for it and is balanced among its own kind, which the fitted
  model of the GPU timings (``benchmarks/plan_model.py``) predicts is worth
  more than the bubbles packing both together fills on every timed mixed
  step, but not on a small one, where one more launch costs the host more
  than it saves. ``paged_attention.plan_for`` gives a mixed step the plan
  ``predicted_us`` finds faster (``plan_attention``'s ``choose``,
  ``PLAN_COSTS``), building the second only where its floor leaves it a
  chance.

The packing never changes the numbers: an item's result does not depend on the
unit that runs it, and the merge visits splits in index order. The split
boundaries (``kv_chunk``) do change the floating-point rounding, so they are a
separate knob: two plans with the same ``kv_chunk`` give bit-identical outputs
whatever their ``num_units``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace

import numpy as np
import torch

# Columns of one work item (one row of ``WorkPlan.work``).
WORK_FIELDS = 8
F_SEQ, F_Q_LO, F_Q_HI, F_POS0, F_KV_LO, F_KV_HI, F_MERGE_ROW, F_SPLIT = range(WORK_FIELDS)

# What the split length counts (``split_costs``): a tile's keys, a prefill
# tile's PREFILL_KEY_COST times, plus ITEM_OVERHEAD for loading its queries
# and writing its output, which keeps the splits from cutting work into
# slivers. A prefill-tile key takes 1.7-2.1x a decode-tile key on the
# H200's kernel benchmark (1.1x in the fitted PLAN_COSTS). LPT itself
# balances predicted time (``item_costs``). Splitting by the fitted costs
# instead moves split lengths by an alignment step here and there, which
# unbalances some even decode batches (eight 2k decodes on 33 units: 576-key
# pieces where 512 fill the units), so the split keeps these weights.
ITEM_OVERHEAD = 64
PREFILL_KEY_COST = 2


@dataclass(frozen=True)
class PlanCosts:
    """Microseconds the attention kernel spends on a plan, as
    ``benchmarks/plan_model.py`` fits them to a GPU's stored timings: per
    key and per item by the kind of tile (a decode tile in the decode-only
    variant, in the mixed variant; a prefill tile), and a floor per launch.
    Beside them, the host time one more launch adds to an eager layer: the
    relaunched attention launch's 5.4 us before the launcher
    (launch_overhead-triton3.6.md) and about as much in the driver; a
    graph replays it for nothing, but mixed steps run eager."""

    decode_key: float = 0.0459
    decode_item: float = 5.14
    mixed_decode_key: float = 0.0369
    prefill_key: float = 0.0406
    prefill_item: float = 24.7
    launch: float = 0.0
    host_launch: float = 10.0

    def tiles_us(self, keys: float | np.ndarray, items: int, prefill: bool, mixed: bool) -> float | np.ndarray:
        """Microseconds of ``items`` tiles of one kind visiting ``keys`` keys
        in all (scalars, or arrays of one tile each), in the mixed variant
        or not."""
        if prefill:
            return self.prefill_key * keys + self.prefill_item * items
        return (self.mixed_decode_key if mixed else self.decode_key) * keys + self.decode_item * items


# Fitted to 71 plans timed on an H200 (plan_model_nvidia_h200.md, median
# error 4%), prefill tiles in halves (the default). Per key, a decode tile
# costs its program less in the mixed variant (33 programs a KV head) than
# in the decode-only one (49): fewer programs share the bandwidth, so each
# gets more of it, though all together get less. The launch floor fits to
# zero: every fitted plan is one launch, so it cannot be told apart from
# the items' constants. The H100's fit (37 plans) differs most in the
# decode tile's per-key rate, the same in both variants there.
PLAN_COSTS = PlanCosts()


def _item_us(rows: np.ndarray, decode_tokens_per_tile: int, mixed: bool, costs: PlanCosts) -> np.ndarray:
    """Each row's predicted microseconds, in the mixed variant or not."""
    keys, prefill = _keys_and_kind(rows, decode_tokens_per_tile)
    # One kind (decode steps, prompts): half the array work.
    if not prefill.any():
        return costs.tiles_us(keys, 1, False, mixed)
    if prefill.all():
        return costs.tiles_us(keys, 1, True, mixed)
    return np.where(prefill, costs.tiles_us(keys, 1, True, mixed), costs.tiles_us(keys, 1, False, mixed))


def predicted_us(plan: WorkPlan, costs: PlanCosts | None = None) -> float:
    """Kernel time of a packed plan still on the host, by ``costs`` (default
    ``PLAN_COSTS``): each launch takes its busiest unit's items (its
    programs run in one wave) plus the floor, and every launch after the
    first adds ``host_launch``."""
    costs = costs or PLAN_COSTS
    total, part, first = 0.0, plan, True
    while part is not None:
        item = _item_us(part.work.numpy(), part.decode_tokens_per_tile, part.has_prefill_tiles, costs)
        done = np.concatenate([[0.0], np.cumsum(item)])
        offsets = part.unit_offsets.numpy()
        total += float((done[offsets[1:]] - done[offsets[:-1]]).max(initial=0.0)) + costs.launch
        total += 0.0 if first else costs.host_launch
        part, first = part.decode_part, False
    return total


def launch_floors_us(tiles: np.ndarray, decode_tokens_per_tile: int, num_units: int, decode_units: int,
                     costs: PlanCosts | None = None) -> tuple[float, float]:
    """Floors under ``predicted_us`` of a step's one-launch plan and of its
    two-launch plan (decode tiles on ``decode_units``), read off its tiles
    (unsplit work rows) before either is built. A launch's busiest unit
    carries at least the mean of its tiles' costs (split pieces share their
    tile's keys, and each piece past the first adds an item's cost), and
    the unit holding an item carries at least that item's fixed cost."""
    c = costs or PLAN_COSTS
    keys, prefill = _keys_and_kind(tiles, decode_tokens_per_tile)
    prefill_keys, num_prefill = float(keys[prefill].sum()), int(prefill.sum())
    decode_keys, num_decode = float(keys.sum()) - prefill_keys, len(keys) - num_prefill
    prefill_us = c.tiles_us(prefill_keys, num_prefill, True, True)
    one_prefill = c.prefill_item if num_prefill else 0.0
    one_decode = c.decode_item if num_decode else 0.0
    one = max((prefill_us + c.tiles_us(decode_keys, num_decode, False, True)) / num_units, one_prefill, one_decode)
    two = (max(prefill_us / num_units, one_prefill) + c.launch + c.host_launch
           + max(c.tiles_us(decode_keys, num_decode, False, False) / decode_units, one_decode))  # fmt: skip
    return one + c.launch, two + c.launch


# Shortest KV piece the auto split makes, and the most pieces of one tile:
# bounds the merge kernel's work and its partial buffers.
MIN_KV_CHUNK = 256
MAX_SPLITS = 64


def aligned_words(words: int) -> int:
    """``words`` 32-bit words rounded up to a whole 16 bytes, so that every
    tensor laid out after them in a shared int32 buffer starts aligned, as
    a fresh allocation does: Triton specialises a kernel on whether each
    pointer is 16-byte aligned, and a view whose alignment followed the
    batch's size would compile a second variant in the middle of serving."""
    return -(-words // 4) * 4


def attention_cost(q_len: int, seq_len: int, sliding_window: int | None = None) -> int:
    """Number of (query, key) pairs one sequence's step computes: the
    FluidInfer cost model. A decode token costs ``seq_len`` (linear in the
    context); a prefill chunk costs about ``q_len * (context + q_len / 2)``
    (quadratic in the chunk)."""
    first = seq_len - q_len  # position of the first query
    if sliding_window is None:
        # sum over p in [first, seq_len) of (p + 1)
        return q_len * (first + 1) + q_len * (q_len - 1) // 2
    return sum(min(p + 1, sliding_window) for p in range(first, seq_len))


@dataclass(frozen=True)
class WorkItem:
    """One program-iteration of the kernel: a query tile against a KV range.

    Queries are flat-batch token indices ``[q_lo, q_hi)`` of sequence ``seq``;
    token ``q_lo`` sits at position ``pos0``. Keys visited are positions
    ``[kv_lo, kv_hi)``. ``merge_row < 0`` means the item writes the output
    directly; otherwise its token ``q_lo + j`` writes partial ``split`` of merge
    row ``merge_row + j``.
    """

    seq: int
    q_lo: int
    q_hi: int
    pos0: int
    kv_lo: int
    kv_hi: int
    merge_row: int = -1
    split: int = 0
    prefill: bool = False  # a prefill tile (the kernel's 128-row tile), not a decode tile

    def cost(self, mixed: bool) -> int:
        """What LPT balances: the item's predicted nanoseconds in the mixed
        variant or the decode-only one (``item_costs``)."""
        return int(1000 * PLAN_COSTS.tiles_us(self.kv_hi - self.kv_lo, 1, self.prefill, mixed))

    def as_row(self) -> list[int]:
        return [self.seq, self.q_lo, self.q_hi, self.pos0, self.kv_lo, self.kv_hi, self.merge_row, self.split]


# The tensors of a WorkPlan, in the order ``WorkPlan.stage`` lays them out.
_ARRAYS = ("work", "unit_offsets", "merge_tokens", "merge_num_splits")


@dataclass(frozen=True)
class WorkPlan:
    """Everything the Triton kernel needs besides the tensors of the batch.

    The ``unit_offsets`` row pointer gives unit ``u`` the items
    ``work[unit_offsets[u]:unit_offsets[u + 1]]``. Merge row ``m`` collects
    ``merge_num_splits[m]`` partials of flat token ``merge_tokens[m]``.
    """

    work: torch.Tensor  # [num_items, WORK_FIELDS] int32, grouped by unit
    unit_offsets: torch.Tensor  # [num_units + 1] int32
    merge_tokens: torch.Tensor  # [num_merge_rows] int32
    merge_num_splits: torch.Tensor  # [num_merge_rows] int32
    num_tokens: int
    tokens_per_tile: int
    decode_tokens_per_tile: int  # tiles this short run as decode tiles
    has_prefill_tiles: bool  # any tile longer (the kernel needs its prefill-tile variant)
    max_splits: int  # most partials of any merge row (0 when nothing is split)
    sliding_window: int | None
    num_seqs: int  # block-table rows the kernel reads
    max_seq_len: int  # longest KV length: block-table columns needed = ceil(/ block_size)
    unit_costs: tuple[int, ...] = field(default=())  # planned load of each unit (item_costs, ns)
    # A two-launch plan's decode tiles, for the decode-only variant: its own
    # work list and units; its merge rows are numbered in (and merged by) this
    # plan's. None: one launch runs every item.
    decode_part: WorkPlan | None = None
    # The last merge rows, the decode part's: those a decode-only launch that
    # merges its own pieces (paged_attention.Tiles.fused_merge) leaves the
    # merge kernel without.
    decode_merge_rows: int = 0
    # Split-K partial buffers, allocated by the first layer that launches
    # with this plan and reused by the others (one stream: layer i's merge
    # has run before layer i + 1 writes them again).
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_units(self) -> int:
        return self.unit_offsets.numel() - 1

    @property
    def num_items(self) -> int:
        """Items of every launch of the plan."""
        return self.work.shape[0] + (self.decode_part.num_items if self.decode_part is not None else 0)

    @property
    def num_merge_rows(self) -> int:
        return self.merge_tokens.numel()

    def to(self, device: torch.device | str) -> WorkPlan:
        """The same plan with its tensors on ``device`` (one copy per step)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            work=move(self.work),
            unit_offsets=move(self.unit_offsets),
            merge_tokens=move(self.merge_tokens),
            merge_num_splits=move(self.merge_num_splits),
            decode_part=self.decode_part.to(device) if self.decode_part is not None else None,
            scratch={},
        )

    def num_words(self) -> int:
        """32-bit words ``stage`` lays the plan out in, every launch's."""
        own = sum(aligned_words(getattr(self, name).numel()) for name in _ARRAYS)
        return own + (self.decode_part.num_words() if self.decode_part is not None else 0)

    def stage(self, host: np.ndarray, dev: torch.Tensor, at: int) -> WorkPlan:
        """The same plan with its tensors views of the int32 buffer ``dev``
        from word ``at`` on (``num_words()`` words), written through
        ``host``, the host side of the same words: the plan travels in the
        caller's upload of the step's inputs instead of in four (a two-launch
        plan eight) small pageable copies of its own. Every tensor starts on
        16 bytes (``aligned_words``), as a fresh allocation does."""
        views = {}
        base = dev.storage_offset()
        for name in _ARRAYS:
            t = getattr(self, name)
            n = t.numel()
            host[at:at + n] = t.numpy().reshape(-1)
            views[name] = dev.as_strided(t.shape, t.stride(), base + at)  # one op, where slicing takes two
            at += aligned_words(n)
        part = self.decode_part.stage(host, dev, at) if self.decode_part is not None else None
        return replace(self, **views, decode_part=part, scratch={})

    def items(self) -> list[WorkItem]:
        """The work list as Python objects (tests, debugging): this launch's
        items, then the decode part's."""
        own = [WorkItem(*row, prefill=row[F_Q_HI] - row[F_Q_LO] > self.decode_tokens_per_tile)
               for row in self.work.tolist()]
        return own + (self.decode_part.items() if self.decode_part is not None else [])


def tile_rows(
    q_lens: list[int],
    seq_lens: list[int],
    tokens_per_tile: int,
    sliding_window: int | None = None,
    decode_tokens_per_tile: int | None = None,
) -> np.ndarray:
    """Cut every sequence's queries into tiles with their KV spans: one work
    row per tile (``[num_tiles, WORK_FIELDS]`` int64, unsplit: merge row -1).
    A sequence of at most ``decode_tokens_per_tile`` queries is one tile.

    A tile of queries at positions ``[p0, p1]`` needs keys
    ``[max(0, p0 - window + 1), p1]``::

        positions   0 1 2 3 4 5 6 7 8 9      seq_len 10, q_len 4, window 4
        tile                    q q q q      p0 = 6, p1 = 9
        keys visited      x x x x x x x      [3, 10)
    """
    short = tokens_per_tile if decode_tokens_per_tile is None else min(decode_tokens_per_tile, tokens_per_tile)
    q = np.asarray(q_lens, dtype=np.int64).reshape(-1)
    s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero(q > s)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sequence {i}: q_len {q[i]} > seq_len {s[i]}")
    size = np.where(q <= short, short, tokens_per_tile)  # tokens per tile of each sequence
    count = -(-q // size)
    if (count == 1).all():  # one tile a sequence (a decode batch)
        seq, t0, t1, q_start, context = np.arange(q.size), 0, q, q.cumsum() - q, s - q
    else:
        seq = np.repeat(np.arange(q.size), count)
        first = count.cumsum() - count  # each sequence's first tile
        t0 = (np.arange(seq.size) - first[seq]) * size[seq]  # offset of the tile in its sequence's queries
        t1 = np.minimum(t0 + size[seq], q[seq])
        q_start = (q.cumsum() - q)[seq]
        context = (s - q)[seq]  # position of the sequence's first query
    rows = np.empty((seq.size, WORK_FIELDS), dtype=np.int64)
    rows[:, F_SEQ] = seq
    rows[:, F_Q_LO] = q_start + t0
    rows[:, F_Q_HI] = q_start + t1
    rows[:, F_POS0] = context + t0
    rows[:, F_KV_LO] = 0 if sliding_window is None else np.maximum(0, context + t0 - sliding_window + 1)
    rows[:, F_KV_HI] = context + t1  # last query position + 1
    rows[:, F_MERGE_ROW] = -1
    rows[:, F_SPLIT] = 0
    return rows


def _keys_and_kind(rows: np.ndarray, decode_tokens_per_tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Each work row's keys, and whether it is a prefill tile (more than
    ``decode_tokens_per_tile`` queries)."""
    return rows[:, F_KV_HI] - rows[:, F_KV_LO], rows[:, F_Q_HI] - rows[:, F_Q_LO] > decode_tokens_per_tile


# What LPT balances, as the benchmarks record it beside plans they time:
# benchmarks/plan_model.py rebuilds a stored plan the way it was built.
LPT_COSTS = "plan_costs"


def item_costs(rows: np.ndarray, decode_tokens_per_tile: int, mixed: bool) -> np.ndarray:
    """``WorkItem.cost`` of every row, in the mixed variant or the
    decode-only one: what ``PLAN_COSTS`` predicts it takes, in whole
    nanoseconds. Balancing by the fitted costs rather than by keys matters
    where the kinds share a launch: a prefill key takes 1.1x a decode key,
    and a prefill tile's fixed cost is worth ~670 decode keys, a decode
    tile's ~140 (plan_model_nvidia_h200.md)."""
    return (1000 * _item_us(rows, decode_tokens_per_tile, mixed, PLAN_COSTS)).astype(np.int64)


def split_costs(rows: np.ndarray, decode_tokens_per_tile: int) -> np.ndarray:
    """Each row's keys, a prefill tile's counted ``PREFILL_KEY_COST`` times,
    plus ``ITEM_OVERHEAD``: what ``auto_kv_chunk`` spreads over the units."""
    keys, prefill = _keys_and_kind(rows, decode_tokens_per_tile)
    return np.where(prefill, keys * PREFILL_KEY_COST, keys) + ITEM_OVERHEAD


# Pieces per tile ``auto_kv_chunk`` weighs when there are more decode tiles
# than units, the gain its estimate must show before it cuts finer, and how
# ragged the tiles may be for the estimate to hold.
WAVE_SPLITS = np.array((1, 2, 3, 4, 6, 8), dtype=np.int64)
WAVE_GAIN = 0.95
WAVE_SPREAD = 1.5  # the longest tile at most this many times the shortest


def auto_kv_chunk(costs: np.ndarray, num_units: int, align: int = 64, decode_only: bool = False) -> int:
    """Split length that lets LPT balance (``costs``: ``split_costs``): no
    item longer than the average unit load, but no piece shorter than
    ``MIN_KV_CHUNK`` keys.

    With more decode tiles than units (``decode_only``: a launch without
    prefill tiles) nothing is longer than the average load, but whole tiles
    may still not share out evenly: 64 equal decode rows on an H200's 49
    units leave 15 units two rows and the rest one, the busiest 1.53x the
    mean load (batch 64 at 16k ran 80.8% of copy bandwidth whole, 99.0%
    cut; decode_grid_nvidia_h200.md). There
    the chunk is the average load cut into k pieces, for the k whose
    estimate, units busy for ``ceil(pieces / units)`` mean pieces, is
    lowest, each piece paying ``ITEM_OVERHEAD``; a finer cut wins only
    where the estimate gains ``1 - WAVE_GAIN`` or more, and at least
    ``MIN_KV_CHUNK`` keys (about an eager merge launch's host time). The
    estimate is exact for equal tiles and holds for tiles within
    ``WAVE_SPREAD`` of each other; more ragged ones LPT balances by pairing
    long with short, which the estimate cannot see (it would cut 128 decode
    rows of 512-32k keys finer for no gain), so they keep the average load.
    So do prefill tiles, ragged by their causal spans: on the timed mixed
    steps the finer cut moved the cost model's prediction by -3% to +1%."""
    units = max(num_units, 1)
    target = max(MIN_KV_CHUNK, int(costs.sum()) // units)
    chunk = -(-target // align) * align
    if not decode_only or len(costs) <= units:
        return chunk
    keys = costs - ITEM_OVERHEAD
    if keys.max() > WAVE_SPREAD * keys.min():
        return chunk
    chunks = np.maximum(MIN_KV_CHUNK, -(-(target // WAVE_SPLITS) // align) * align)
    pieces = np.maximum(1, -(-keys[:, None] // chunks)).sum(axis=0)
    estimates = (-(-pieces // units) * (keys.sum() + pieces * ITEM_OVERHEAD) / pieces).tolist()
    best, best_est = chunk, estimates[0]  # WAVE_SPLITS[0] is 1: the average load itself
    for c, est in zip(chunks.tolist()[1:], estimates[1:]):
        if est < best_est * WAVE_GAIN and est < best_est - MIN_KV_CHUNK:
            best, best_est = c, est
    return best


def split_rows(
    rows: np.ndarray, kv_chunk: int, first_row: int = 0, max_splits: int = MAX_SPLITS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split every tile whose span exceeds ``kv_chunk`` into pieces.

    Piece boundaries sit on absolute multiples of the chunk length, so a piece
    never straddles the same keys as its neighbour and the pieces of a tile
    cover ``[kv_lo, kv_hi)`` exactly. At most ``max_splits`` pieces per tile
    (the chunk grows for very long spans). Returns the pieces (a tile's in
    order, each split one numbered into its merge rows) and the merge rows'
    flat tokens and piece counts, the rows numbered from ``first_row``.
    """
    kv_lo, kv_hi = rows[:, F_KV_LO], rows[:, F_KV_HI]
    span = kv_hi - kv_lo
    # max_splits - 1 because an unaligned start can add one piece.
    chunk = np.maximum(kv_chunk, -(-span // max(max_splits - 1, 1)))
    split = span > chunk
    if not split.any():
        return rows.copy(), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    edge = (kv_lo // chunk + 1) * chunk  # the first boundary after kv_lo
    # A tile longer than its chunk always crosses `edge`, so it splits in two or more.
    pieces = np.where(split, 1 + -(-(kv_hi - edge) // chunk), 1)
    tokens = rows[:, F_Q_HI] - rows[:, F_Q_LO]
    # Each split tile's first merge row: its tokens follow the earlier split tiles'.
    merge_tokens_per_tile = np.where(split, tokens, 0)
    first_merge = first_row + merge_tokens_per_tile.cumsum() - merge_tokens_per_tile
    tile = np.repeat(np.arange(rows.shape[0]), pieces)
    j = np.arange(tile.size) - (pieces.cumsum() - pieces)[tile]  # piece index within its tile
    out = rows[tile]
    cut = split[tile]
    tile, j = tile[cut], j[cut]
    out[cut, F_KV_LO] = np.where(j == 0, kv_lo[tile], edge[tile] + (j - 1) * chunk[tile])
    out[cut, F_KV_HI] = np.minimum(edge[tile] + j * chunk[tile], kv_hi[tile])
    out[cut, F_MERGE_ROW] = first_merge[tile]
    out[cut, F_SPLIT] = j
    # Merge rows: the tokens of each split tile in order, with its piece count.
    n = tokens[split]
    merged = np.repeat(np.flatnonzero(split), n)
    merge_tokens = rows[merged, F_Q_LO] + np.arange(merged.size) - (n.cumsum() - n).repeat(n)
    return out, merge_tokens, pieces[merged]


def pack_lpt(costs: np.ndarray, num_units: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Longest-processing-time-first greedy: costliest item to the least
    loaded unit. Ties go to the lower unit and the earlier item, so plans are
    deterministic. Returns the items' order grouped by unit (each unit's in
    the order it took them), the row pointer and each unit's load."""
    order = np.argsort(-costs, kind="stable")
    # One int per unit, load * num_units + unit: the heap's least is the
    # least loaded unit, the lower on a tie, with no tuple per step.
    heap = list(range(num_units))
    taken = []
    for c in costs[order].tolist():
        key = heap[0]
        taken.append(key % num_units)
        heapq.heapreplace(heap, key + c * num_units)
    unit_of = np.array(taken, dtype=np.int64)
    by_unit = order[np.argsort(unit_of, kind="stable")]
    offsets = np.zeros(num_units + 1, dtype=np.int64)
    np.cumsum(np.bincount(unit_of, minlength=num_units), out=offsets[1:])
    loads = [0] * num_units
    for key in heap:
        loads[key % num_units] = key // num_units
    return by_unit, offsets, tuple(loads)


def plan_attention(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_units: int,
    tokens_per_tile: int,
    sliding_window: int | None = None,
    kv_chunk: int | None = None,
    pack: bool = True,
    decode_tokens_per_tile: int | None = None,
    decode_units: int | None = None,
    choose: bool = False,
) -> WorkPlan:
    """Plan one step's attention work.

    ``num_units`` is the number of persistent programs per KV head (about the
    number of SMs times programs per SM, divided by the KV heads).
    ``kv_chunk=None`` picks the split length from the load; pass a number to fix
    the split boundaries (and so the exact rounding). ``pack=False`` is the
    baseline without FluidInfer packing: no splits unless ``kv_chunk`` is given,
    and one item per program in batch order. ``decode_tokens_per_tile``
    (default: ``tokens_per_tile``, one tile size) is the longest decode tile.
    ``decode_units`` (packed plans only) plans a step that has both kinds of
    tile as two launches: its decode tiles on this many units of the
    decode-only variant (``decode_part``), the rest on ``num_units``; each
    part picks its own split length unless ``kv_chunk`` fixes both. With
    ``choose``, such a step gets the two-launch plan or the one-launch plan,
    whichever ``predicted_us`` finds faster (one launch on a tie); the plan
    with the lower floor (``launch_floors_us``) is built first, and the
    other only where its floor leaves it a chance, so most steps plan once.
    """
    if num_units < 1 or tokens_per_tile < 1:
        raise ValueError("num_units and tokens_per_tile must be positive")
    short = tokens_per_tile if decode_tokens_per_tile is None else min(decode_tokens_per_tile, tokens_per_tile)
    if short < 1:
        raise ValueError("decode_tokens_per_tile must be positive")
    if len(q_lens) != len(seq_lens):
        raise ValueError(f"{len(q_lens)} query lengths for {len(seq_lens)} sequences")
    if decode_units is not None and decode_units < 1:
        raise ValueError("decode_units must be positive")
    tiles = tile_rows(q_lens, seq_lens, tokens_per_tile, sliding_window, short)
    common = dict(num_tokens=sum(q_lens), tokens_per_tile=tokens_per_tile, decode_tokens_per_tile=short,
                  sliding_window=sliding_window, num_seqs=len(seq_lens), max_seq_len=max(seq_lens, default=0))
    prefill = tiles[:, F_Q_HI] - tiles[:, F_Q_LO] > short
    if not (pack and decode_units is not None and 0 < int(prefill.sum()) < len(tiles)):
        return _pack(tiles, prefill, None, num_units, kv_chunk, pack, common)
    if not choose:
        return _pack(tiles, prefill, decode_units, num_units, kv_chunk, pack, common)
    floor_one, floor_two = launch_floors_us(tiles, short, num_units, decode_units)
    # Build the plan with the lower floor; the other costs at least its
    # floor, so it is built only where that leaves it a chance.
    first, other, other_floor = (None, decode_units, floor_two) if floor_one <= floor_two else \
        (decode_units, None, floor_one)  # fmt: skip
    plan = _pack(tiles, prefill, first, num_units, kv_chunk, pack, common)
    first_us = predicted_us(plan)
    if first_us < other_floor or (first is None and first_us == other_floor):
        return plan
    rival = _pack(tiles, prefill, other, num_units, kv_chunk, pack, common)
    one, two = (plan, rival) if first is None else (rival, plan)
    return one if predicted_us(one) <= predicted_us(two) else two


def _pack(tiles: np.ndarray, prefill: np.ndarray, decode_units: int | None, num_units: int, kv_chunk: int | None,
          pack: bool, common: dict) -> WorkPlan:  # fmt: skip
    """``plan_attention``'s plan of the step's tiles: in one launch, or in
    two where ``decode_units`` is given (the caller checks the step has
    both kinds of tile)."""
    short = common["decode_tokens_per_tile"]
    mixed = bool(prefill.any())  # the variant that runs the (first) launch: the one with prefill tiles
    decode_part, decode_rows = None, 0
    if decode_units is not None:
        decode_tiles, tiles = tiles[~prefill], tiles[prefill]
        items, merge_tokens, merge_splits = split_rows(
            tiles, kv_chunk or auto_kv_chunk(split_costs(tiles, short), num_units))
        decode_items, decode_tokens, decode_splits = split_rows(
            decode_tiles, kv_chunk or auto_kv_chunk(split_costs(decode_tiles, short), decode_units, decode_only=True),
            first_row=len(merge_tokens))  # fmt: skip
        decode_rows = len(decode_tokens)
        merge_tokens = np.concatenate([merge_tokens, decode_tokens])
        merge_splits = np.concatenate([merge_splits, decode_splits])
        order, offsets, loads = pack_lpt(item_costs(decode_items, short, False),
                                         min(decode_units, len(decode_items)))  # fmt: skip
        decode_part = WorkPlan(work=_i32(decode_items[order]), unit_offsets=_i32(offsets), merge_tokens=_i32([]),
                               merge_num_splits=_i32([]), has_prefill_tiles=False, max_splits=0, unit_costs=loads,
                               **common)  # fmt: skip
    else:
        if kv_chunk is None:
            kv_chunk = auto_kv_chunk(split_costs(tiles, short), num_units, decode_only=not mixed) if pack else 1 << 62
        items, merge_tokens, merge_splits = split_rows(tiles, kv_chunk)
    item_cost = item_costs(items, short, mixed)
    if pack:
        order, offsets, loads = pack_lpt(item_cost, min(num_units, max(len(items), 1)))  # no idle programs
        items = items[order]
    else:  # one item per program, in batch order
        offsets, loads = np.arange(len(items) + 1), tuple(item_cost.tolist())
    return WorkPlan(
        work=_i32(items),
        unit_offsets=_i32(offsets),
        merge_tokens=_i32(merge_tokens),
        merge_num_splits=_i32(merge_splits),
        has_prefill_tiles=mixed,
        max_splits=int(merge_splits.max(initial=0)),
        unit_costs=loads,
        decode_part=decode_part,
        decode_merge_rows=decode_rows,
        **common,
    )


def _i32(values: np.ndarray | list[int]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))
