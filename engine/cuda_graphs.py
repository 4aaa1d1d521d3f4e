"""Decode CUDA graphs: the model forward of decode-only steps, captured once
per batch-size bucket at start-up and replayed, so a decode step launches one
graph instead of a few hundred kernels.

Owns the buckets, their static input buffers, the fixed-shape attention plans
the captured Triton kernels read, the padding of a step up to its bucket, and
the choice between a bucket and the eager ``ModelRunner`` path. Capture is
on unless ``EngineConfig.enforce_eager`` is True
(``config.CUDA_GRAPHS_BY_DEFAULT`` says which way the flag defaults).

A step runs in a bucket when every sequence has exactly one query token, it
scores no prompt logprobs, it is not preemptible (the layer loop's safepoints
read a host flag between layers) and it has at most as many rows as the
largest bucket; anything else runs eagerly. A step of ``n`` rows takes the
smallest bucket ``b >= n``; rows ``n..b-1`` are padding::

    input_ids   [ x0 x1 x2 | 0  ]      b = 4, n = 3
    positions   [ p0 p1 p2 | 0  ]
    slot_mapping[ s0 s1 s2 | -1 ]      -1: the KV write skips the row
    seq_lens    [ l0 l1 l2 | 1  ]
    block_tables[ t0 t1 t2 | 0..]      [b, W], W = blocks of max_model_len
    hidden out  [ h0 h1 h2 | junk ]    sliced to [:n] before sampling

Padding rows write no KV anywhere (slot -1), so no real block changes, and
get no attention work (with the Triton kernels the merge writes their
attention output as 0; the CPU kernels leave it as the output buffer held
it). Every other op of the forward is per row, so padding rows never reach
a real row.

All integer inputs of a bucket travel in one int32 buffer, one host-to-device
copy per step (pinned on CUDA); every part starts on 16 bytes, as a fresh
tensor does, so the kernels launch the variants eager steps compiled::

    [ input_ids | positions | slot_mapping | sample_idx ]  int64, b each
    [ seq_lens b | query_start_loc b+1 | block_tables b*W ]
    [ per sliding window: unit_offsets U+1 | merge_tokens b | merge_num_splits b | work b*C*8
      then direct: unit_offsets min(U, b)+1 | work b*8 ]

**The static attention plan.** The Triton kernel's grid and its work list
come from a per-step plan (kernels/packing.py) whose shapes follow the
lengths; a graph fixes them. So a bucket's plan has a fixed grid of ``U``
units (``default_num_units`` of the decode-only variant; units past the
step's work get empty ranges), room for ``b * C`` items (``C`` split-K pieces
per row at most), and *every* row is a merge row, ``merge_tokens = 0..b-1``:
an unsplit row writes one partial and the merge copies it out exactly (its
weight is ``2^0 = 1``), a padding row has one piece over no keys and the
merge writes 0 (so does a merge inside the attention launch,
``Tiles.fused_merge``, which only a row's pieces can start).
Splits are cut as the eager planner cuts them (``auto_kv_chunk`` over the
real rows, pieces on multiples of the chunk), so the attention output equals
the eager path's bit for bit unless the cap ``C`` binds. ``C`` is
``MAX_SPLITS`` for buckets up to 64 rows and shrinks above so that the
split-K partial buffers (shared by every bucket and window) stay near
``PARTIAL_ROWS`` rows of ``[Hq, D]`` fp32: ``split_buffer_sizes`` of
``b`` rows by ``max_splits_for(b)`` pieces sizes them, and ``split_buffers``
cuts every bucket's views by the same formula.

**Direct plans.** With the Triton kernels every bucket is captured twice:
over the plans above, and over direct plans whose rows are one piece each
and write their own output, with no merge rows and no merge launch, on a
grid of at most ``b`` units. A step that splits no row (short contexts,
or more rows than units) replays the direct graph: a batch-1 decode at a
few hundred keys otherwise spends a merge launch a layer copying one
partial out. Both graphs give the same bits (an unsplit row's partial
merges with weight 1).

**Capture** runs at start-up (``Worker.warm_up``), after the KV cache exists
(a graph holds the cache's addresses; a new cache drops the graphs), largest
bucket first, every graph in one memory pool: they replay one at a time.
That pool and the partial buffers are not part of ``gpu_memory_utilization``'s
budget, which is sized before capture. One GPU only: under tensor
parallelism the worker stays eager.

Capture, eager on CPU: the path "copy into the static buffers, run the
forward over the padded bucket, slice the outputs" is the same on both
devices; only the replay differs (a graph's replay on CUDA, the model's
forward over the static buffers elsewhere: ``DeviceRuntime.capture``), so
CPU tests check the padding, the buffers and the bucket choice against the
eager path token for token. With ``FLUIDSERVE_KERNELS=triton`` they check the
static plans the Triton kernels read as well.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.layers import AttentionMetadata, PagedAttention
from fluidserve.engine.block_tables import BlockTableMirror
from fluidserve.engine.runtime import DeviceRuntime, runtime_for
from fluidserve.kernels import ops, packing
from fluidserve.kernels.packing import WORK_FIELDS, WorkPlan, aligned_words

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# vLLM's sizes below 256, in powers of two: a bucket costs one capture (and
# its activations in the shared graph pool); padding costs at most 2x rows.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Rows x split-K pieces the static plans' partial buffers aim at ([Hq, D]
# fp32 each): 64 MiB for 32 heads of 128. Buckets up to 64 rows keep
# MAX_SPLITS; a bucket of more rows than this still gets one piece a row.
PARTIAL_ROWS = 4096
_direct_plans = True  # buckets built from now on get direct plans (set_direct_plans)


def set_direct_plans(on: bool) -> bool:
    """Give buckets built from now on direct plans and graphs (the
    default), or not, to time what they save; returns the old setting."""
    global _direct_plans
    old, _direct_plans = _direct_plans, bool(on)
    return old


# -- buckets --------------------------------------------------------------------


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The buckets: ``sizes`` (default ``DEFAULT_CAPTURE_SIZES``) up to the
    step's row cap, with the cap itself as the last bucket when it lies
    below the largest size (a 100-row cap gets a 100 bucket, not none)."""
    sizes = tuple(sorted(set(sizes or DEFAULT_CAPTURE_SIZES)))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"cuda_graph_sizes: need positive sizes, got {sizes}")
    kept = [s for s in sizes if s < max_num_seqs]
    if max_num_seqs <= sizes[-1]:
        kept.append(max_num_seqs)
    return tuple(kept)


def pick_bucket(num_rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``num_rows`` rows; None if none does."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def ineligible(inp: ModelInput, largest: int, width: int) -> str | None:
    """Why a step must run eagerly (None: it fits a bucket)."""
    n = len(inp.input_ids)
    if n == 0:
        return "no tokens"
    if n != len(inp.seq_lens):
        return "not decode-only"
    if inp.prompt_logprobs:
        return "prompt logprobs"
    if inp.preemptible:
        return "preemptible"
    if n > largest:
        return "larger than the largest bucket"
    if inp.longest_table() > width:
        return "block table wider than max_model_len"
    return None


def max_splits_for(bucket: int) -> int:
    """Split-K pieces per row a bucket's static plan holds (``C``)."""
    return max(1, min(packing.MAX_SPLITS, PARTIAL_ROWS // bucket))


# -- the static attention plan -----------------------------------------------------


@dataclass
class DecodeWork:
    """The work of a decode-only batch in the static plan's form."""

    rows: np.ndarray  # [num_items, WORK_FIELDS] int32, grouped by unit
    unit_offsets: list[int]  # num_units + 1
    num_splits: list[int]  # pieces of each row (its merge row is its own index)


def decode_pieces(seq_lens: list[int], *, num_units: int, max_splits: int,
                  sliding_window: int | None) -> np.ndarray:
    """A decode-only batch's work items, split as ``packing.plan_attention``
    splits the same lengths on ``num_units`` units (while ``max_splits`` is
    ``MAX_SPLITS``): one item a row where no row is split."""
    tiles = packing.tile_rows([1] * len(seq_lens), seq_lens, 1, sliding_window, 1)
    kv_chunk = packing.auto_kv_chunk(packing.split_costs(tiles, 1), num_units, decode_only=True)
    return packing.split_rows(tiles, kv_chunk, max_splits=max_splits)[0]


def plan_decode(seq_lens: list[int], *, num_units: int, max_splits: int,
                sliding_window: int | None, size: int | None = None, pieces: np.ndarray | None = None,
                direct: bool = False) -> DecodeWork:
    """Plan a decode-only batch (one query per sequence) onto exactly
    ``num_units`` units with every row a merge row and at most
    ``max_splits`` pieces per row (``pieces``: ``decode_pieces`` of the
    batch, where the caller has them; their merge rows are overwritten). Rows from ``len(seq_lens)`` to
    ``size`` are padding: one piece each over no keys, which every merge
    turns into zeros (the merge kernel, and a merge inside the attention
    launch, which only a piece can start).

    ``direct``: the pieces are whole rows, and each writes its output
    itself (no merge row; a padding row's piece over no keys writes 0), as
    the eager plan of the same lengths does."""
    n = len(seq_lens)
    items = pieces if pieces is not None else decode_pieces(
        seq_lens, num_units=num_units, max_splits=max_splits, sliding_window=sliding_window)
    if direct and len(items) != n:
        raise ValueError("a direct decode plan needs every row whole")
    if size is not None and size > n:
        pad = np.zeros((size - n, WORK_FIELDS), dtype=items.dtype)
        rows = np.arange(n, size)
        pad[:, packing.F_SEQ] = pad[:, packing.F_Q_LO] = rows
        pad[:, packing.F_Q_HI] = rows + 1
        items = np.concatenate([items, pad])
    # Every row merges into its own merge row, or none does.
    items[:, packing.F_MERGE_ROW] = -1 if direct else items[:, packing.F_SEQ]
    order, offsets, _ = packing.pack_lpt(packing.item_costs(items, 1, False), num_units)
    num_splits = np.bincount(items[:, packing.F_SEQ], minlength=max(n, size or 0))
    return DecodeWork(items[order].astype(np.int32), offsets.tolist(), num_splits.tolist())


class StaticDecodePlan:
    """A ``WorkPlan`` for a bucket of ``size`` decode rows whose tensors keep
    their shapes and addresses from step to step: views of a region of the
    bucket's device buffer, refilled through the matching host region.

    Region layout (int32 words)::

        [ unit_offsets U+1 | merge_tokens b | merge_num_splits b | work b*C*8 ]

    ``direct``: a plan for steps that split no row, where every row's one
    piece writes its output and no merge runs::

        [ unit_offsets U+1 | work b*8 ]
    """

    @staticmethod
    def num_words(size: int, num_units: int, max_splits: int, direct: bool = False) -> int:
        if direct:
            return aligned_words(num_units + 1) + size * WORK_FIELDS
        return aligned_words(num_units + 1) + 2 * aligned_words(size) + size * max_splits * WORK_FIELDS

    def __init__(self, host: np.ndarray, dev: torch.Tensor, *, size: int, num_units: int, max_splits: int,
                 group: int, sliding_window: int | None, max_seq_len: int,
                 partials: tuple[torch.Tensor, torch.Tensor] | None = None,
                 merge_counts: torch.Tensor | None = None, direct: bool = False,
                 split_units: int | None = None) -> None:
        from fluidserve.kernels.paged_attention import (
            decode_tokens_per_tile,
            default_tokens_per_tile,
            merge_counts_key,
        )

        self.size, self.num_units, self.max_splits, self.sliding_window = size, num_units, max_splits, sliding_window
        self.direct = direct
        self.split_units = split_units or num_units  # the units rows are split for (the eager plan's)
        b = size
        o_tok = aligned_words(num_units + 1)
        o_split = o_tok + (0 if direct else aligned_words(b))
        o_work = o_split + (0 if direct else aligned_words(b))
        end = o_work + b * (1 if direct else max_splits) * WORK_FIELDS
        m = 0 if direct else b  # merge rows
        self._offsets, self._splits, self._work = host[:num_units + 1], host[o_split:o_split + m], host[o_work:end]
        if not direct:
            host[o_tok:o_tok + b] = np.arange(b, dtype=np.int32)  # merge row m is row m's: fixed for good
        self.clear()
        tpt = default_tokens_per_tile(group)
        self.plan = WorkPlan(
            work=dev[o_work:end].view(-1, WORK_FIELDS), unit_offsets=dev[:num_units + 1],
            merge_tokens=dev[o_tok:o_tok + m], merge_num_splits=dev[o_split:o_split + m],
            num_tokens=b, tokens_per_tile=tpt, decode_tokens_per_tile=min(decode_tokens_per_tile(group), tpt),
            has_prefill_tiles=False, max_splits=0 if direct else max_splits, sliding_window=sliding_window,
            num_seqs=b, max_seq_len=max_seq_len,
        )
        if partials is not None:
            part_out = partials[0]  # [b, C, Hq, D]: the key _partials looks up
            self.plan.scratch[(part_out.shape[2], part_out.shape[3], str(part_out.device))] = partials
        if merge_counts is not None:  # [b, Hkv]: the key _merge_counts looks up
            self.plan.scratch[merge_counts_key(merge_counts.shape[1], merge_counts.device)] = merge_counts

    def clear(self) -> None:
        """Every row padding: one empty piece each, merged to zeros."""
        self.fill([])

    def pieces(self, seq_lens: list[int]) -> np.ndarray:
        """``decode_pieces`` of a batch, split as for this plan's rows."""
        return decode_pieces(seq_lens, num_units=self.split_units, max_splits=self.max_splits,
                             sliding_window=self.sliding_window)

    def fill(self, seq_lens: list[int], pieces: np.ndarray | None = None) -> None:
        """Write the plan of a batch whose first ``len(seq_lens)`` rows are
        real (the rest padding) into the host region (``pieces``: the
        batch's ``pieces``, where the caller has them)."""
        if pieces is None:
            pieces = self.pieces(seq_lens)
        work = plan_decode(seq_lens, num_units=self.num_units, max_splits=self.max_splits,
                           sliding_window=self.sliding_window, size=self.size, pieces=pieces, direct=self.direct)
        self._offsets[:] = work.unit_offsets
        if not self.direct:
            self._splits[:] = work.num_splits
        self._work[:work.rows.size] = work.rows.ravel()


# -- one bucket ----------------------------------------------------------------------


@dataclass
class _PlanSpec:
    """What a bucket's static plans need to know of the model (Triton kernels only)."""

    windows: list[int | None]
    num_units: dict  # window -> units of the decode-only variant
    group: int
    partials: tuple[torch.Tensor, torch.Tensor]  # flat fp32 storage of split_buffers, sized for every bucket
    num_q_heads: int
    head_dim: int
    num_kv_heads: int
    merge_counts: torch.Tensor  # the fused merge's counters, flat [max size * Hkv] int32 zeros


@dataclass
class Bucket:
    """The static buffers of one bucket and, once captured, its replay."""

    size: int
    width: int  # block-table columns
    block_size: int
    device: torch.device
    spec: _PlanSpec | None = None
    replay: Callable[[], torch.Tensor] | None = None  # the captured forward: hidden states [size, hidden]
    replay_direct: Callable[[], torch.Tensor] | None = None  # the same over the direct plans
    plans: dict = field(default_factory=dict)  # window -> StaticDecodePlan
    direct_plans: dict = field(default_factory=dict)  # window -> StaticDecodePlan(direct=True)
    host_seq_lens: list[int] = field(default_factory=list)
    rows: int = 0  # real rows of the batch in the buffers
    direct: bool = False  # the batch in the buffers splits no row: it runs over the direct plans
    _copied: Any = None  # the event of the last upload

    def __post_init__(self) -> None:
        self.runtime = runtime_for(self.device)
        b, w = self.size, self.width
        i64 = aligned_words(2 * b)  # words of one int64 array
        self._o_seq = 4 * i64
        self._o_qsl = self._o_seq + aligned_words(b)
        self._o_bt = self._o_qsl + aligned_words(b + 1)
        words = self._o_bt + aligned_words(b * w)
        cap = max_splits_for(b)
        plan_words = direct_words = 0
        if self.spec is not None:
            units = max(self.spec.num_units.values())
            plan_words = aligned_words(StaticDecodePlan.num_words(b, units, cap))
            if _direct_plans:
                direct_words = aligned_words(StaticDecodePlan.num_words(b, min(units, b), 1, direct=True))
            words += len(self.spec.windows) * (plan_words + direct_words)
        self.host = self.runtime.host_buffer(words, torch.int32, zeroed=True)
        self.dev = self.runtime.device_mirror(self.host, zeroed=True)
        h = self.host.numpy()
        h64 = h[:4 * i64].view(np.int64).reshape(4, i64 // 2)
        self._ids, self._pos, self._slots, self._samp = (h64[i, :b] for i in range(4))
        self._h_seq = h[self._o_seq:self._o_seq + b]
        h[self._o_qsl:self._o_qsl + b + 1] = np.arange(b + 1, dtype=np.int32)  # query_start_loc: one token a row
        self._h_bt = h[self._o_bt:self._o_bt + b * w].reshape(b, w)
        d64 = self.dev[:4 * i64].view(torch.int64).view(4, i64 // 2)
        self.input_ids, self.positions, self.slot_mapping, self.sample_idx = (d64[i, :b] for i in range(4))
        self.seq_lens = self.dev[self._o_seq:self._o_seq + b]
        self.query_start_loc = self.dev[self._o_qsl:self._o_qsl + b + 1]
        self.block_tables = self.dev[self._o_bt:self._o_bt + b * w].view(b, w)
        if self.spec is not None:
            self._make_plans(h, self._o_bt + aligned_words(b * w), plan_words, direct_words, cap)
        self.write_padding()

    def _make_plans(self, h: np.ndarray, at: int, plan_words: int, direct_words: int, cap: int) -> None:
        """Per sliding window, the split plan and the direct one. The direct
        plan's grid is no wider than the bucket's rows: whole rows need no
        more units than that."""
        from fluidserve.kernels.paged_attention import split_buffers

        s, b = self.spec, self.size
        part_out, part_lse = split_buffers(b, cap, s.num_q_heads, s.head_dim, storage=s.partials)
        counts = s.merge_counts[:b * s.num_kv_heads].view(b, s.num_kv_heads)
        common = dict(size=b, max_splits=cap, group=s.group, max_seq_len=self.width * self.block_size,
                      partials=(part_out, part_lse), merge_counts=counts)
        for window in s.windows:
            units = s.num_units[window]
            n = StaticDecodePlan.num_words(b, units, cap)
            self.plans[window] = StaticDecodePlan(h[at:at + n], self.dev[at:at + n], num_units=units,
                                                  sliding_window=window, **common)
            at += plan_words
            if not direct_words:
                continue
            n = StaticDecodePlan.num_words(b, min(units, b), 1, direct=True)
            self.direct_plans[window] = StaticDecodePlan(
                h[at:at + n], self.dev[at:at + n], num_units=min(units, b), sliding_window=window, direct=True,
                split_units=units, **common)
            at += direct_words

    # -- host side ---------------------------------------------------------------
    def _wait_for_upload(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last upload may still read the host buffer

    def write_padding(self) -> None:
        """Every row padding (the capture's batch)."""
        self._wait_for_upload()
        self._ids.fill(0)
        self._pos.fill(0)
        self._slots.fill(-1)
        self._h_seq.fill(1)
        self._h_bt.fill(0)
        self._bt_columns = 0
        self.host_seq_lens = [1] * self.size
        self.rows = 0
        self.direct = False
        for plan in (*self.plans.values(), *self.direct_plans.values()):
            plan.clear()

    def write(self, inp: ModelInput, tables: BlockTableMirror) -> None:
        """The step's inputs into the host buffer, padded to the bucket;
        ``tables`` lays out the block tables."""
        self._wait_for_upload()
        n = len(inp.input_ids)
        self._ids[:n] = inp.input_ids
        self._ids[n:] = 0
        self._pos[:n] = inp.positions
        self._pos[n:] = 0
        self._slots[:n] = inp.slot_mapping
        self._slots[n:] = -1
        self._samp[:len(inp.sample_indices)] = inp.sample_indices
        self._h_seq[:n] = inp.seq_lens
        self._h_seq[n:] = 1
        # Only the first ``_bt_columns`` columns may hold blocks: the rest of a
        # long context's row (max_model_len's blocks) stays zero untouched.
        width = tables.sync(inp)
        if self._bt_columns > width:
            self._h_bt[:, width:self._bt_columns] = 0
        self._h_bt[n:, :width] = 0  # padding rows
        self._bt_columns = width
        tables.fill(self._h_bt[:n, :width])
        self.host_seq_lens = [*inp.seq_lens, *[1] * (self.size - n)]
        self.rows = n
        pieces = {w: plan.pieces(inp.seq_lens) for w, plan in self.plans.items()}
        # One graph holds every layer: direct only where no window splits a row.
        self.direct = bool(self.direct_plans) and all(len(p) == n for p in pieces.values())
        for w, plan in (self.direct_plans if self.direct else self.plans).items():
            plan.fill(inp.seq_lens, pieces[w])

    def upload(self) -> None:
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self._copied = self.runtime.event()
            self._copied.record()

    def metadata(self, kernels: str | None = None, direct: bool | None = None) -> AttentionMetadata:
        """Attention metadata over the static buffers; the Triton kernels
        find the static plans already made (``work_plan`` looks them up):
        the direct ones if ``direct`` (by default, if the batch in the
        buffers splits no row). The host query lengths of padding rows are
        0, so the CPU attention plans no work for them and groups the real
        rows as eager does."""
        plans = self.direct_plans if (self.direct if direct is None else direct) else self.plans
        return AttentionMetadata(
            slot_mapping=self.slot_mapping, block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start_loc=self.query_start_loc, host_q_lens=[1] * self.rows + [0] * (self.size - self.rows),
            host_seq_lens=list(self.host_seq_lens), kernels=kernels,
            _plans={w: p.plan for w, p in plans.items()},
        )


# -- the runner ----------------------------------------------------------------------


class DecodeGraphs:
    """Decode-only steps in buckets: ``forward`` returns the hidden states
    and sample indices of a step it can run, None for one the caller must
    run eagerly. ``capture=True`` (CUDA) records one graph per bucket now;
    ``capture=False`` replays a bucket by running the model eagerly over its
    static buffers (CPU, tests, ``FLUIDSERVE_KERNELS=triton``)."""

    def __init__(self, model: nn.Module, device: torch.device, kv_caches: KVCaches, sizes: tuple[int, ...],
                 max_blocks_per_seq: int, block_size: int, *, capture: bool,
                 tables: BlockTableMirror | None = None) -> None:
        self.runtime = runtime_for(device)
        if capture and not self.runtime.can_capture_graphs:
            raise ValueError("CUDA graphs need a CUDA device")
        self.model, self.device, self.kv_caches = model, device, kv_caches
        self.sizes = tuple(sorted(sizes))
        self.width = max_blocks_per_seq
        self.tables = tables if tables is not None else BlockTableMirror()  # the worker shares its eager steps' mirror
        self.replays: dict[int, int] = {}  # steps run in each bucket
        self.direct_replays: dict[int, int] = {}  # of those, steps over the direct plans (no row split)
        self.fallbacks: dict[str, int] = {}  # steps run eagerly, by reason
        self.kernels = ops.kernel_path(device)  # read once, as the model runner does
        spec = self._plan_spec() if self.kernels == "triton" else None
        self.buckets = {b: Bucket(b, self.width, block_size, device, spec) for b in self.sizes}
        if capture:
            self._capture_all()

    def _plan_spec(self) -> _PlanSpec | None:
        from fluidserve.kernels.paged_attention import default_num_units, split_buffer_sizes

        attn = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if not attn or not self.kv_caches:
            return None
        a, key_cache = attn[0], self.kv_caches[0][0]
        windows = sorted({m.sliding_window for m in attn}, key=lambda w: (w is not None, w or 0))
        query_like = torch.empty((0, a.num_heads, a.head_dim), dtype=key_cache.dtype, device=key_cache.device)
        units = {w: default_num_units(query_like, key_cache, False, w) for w in windows}
        f32 = dict(dtype=torch.float32, device=key_cache.device)
        # One flat pair of split-K buffers, viewed [b, C, Hq, D] and [b, C, Hq] by every bucket.
        sizes = [split_buffer_sizes(b, max_splits_for(b), a.num_heads, a.head_dim) for b in self.sizes]
        partials = tuple(torch.empty(max(n), **f32) for n in zip(*sizes))
        counts = torch.zeros(max(self.sizes) * a.num_kv_heads, dtype=torch.int32, device=key_cache.device)
        return _PlanSpec(windows, units, a.num_heads // a.num_kv_heads, partials, a.num_heads, a.head_dim,
                         a.num_kv_heads, counts)

    def _forward_static(self, bucket: Bucket) -> torch.Tensor:
        return self.model(bucket.input_ids, bucket.positions, self.kv_caches, bucket.metadata(self.kernels))

    def _capture_all(self) -> None:
        capture_largest_first(self.runtime, self.sizes, self._capture_bucket, "decode CUDA graphs for batch sizes")

    def _capture_bucket(self, b: int, pool: Any) -> None:
        """The bucket's graph, and with the Triton kernels a second over its
        direct plans: a step that splits no row then launches no merge."""
        bucket = self.buckets[b]
        bucket.write_padding()
        bucket.upload()

        def capture(meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
            return self.runtime.capture(lambda: self.model(bucket.input_ids, bucket.positions, self.kv_caches, meta),
                                        pool)

        bucket.replay = capture(bucket.metadata(self.kernels, direct=False))
        if bucket.direct_plans:
            bucket.replay_direct = capture(bucket.metadata(self.kernels, direct=True))

    def bucket_for(self, inp: ModelInput) -> int | None:
        """The bucket a step runs in; None (and the reason counted) if eager."""
        why = ineligible(inp, self.sizes[-1], self.width)
        if why is not None:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
            return None
        return pick_bucket(len(inp.input_ids), self.sizes)

    def forward(self, inp: ModelInput, feed: Callable[[torch.Tensor], None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hidden states ``[n, hidden]`` and sample indices of a step run in
        its bucket, or None: run it eagerly. The hidden states are a view of
        the bucket's output, valid until the bucket's next replay. ``feed``
        rewrites the step's uploaded input ids on the device before the replay."""
        b = self.bucket_for(inp)
        if b is None:
            return None
        bucket = self.buckets[b]
        bucket.write(inp, self.tables)
        bucket.upload()
        if feed is not None:
            feed(bucket.input_ids[:len(inp.input_ids)])
        replay = bucket.replay_direct if bucket.direct else bucket.replay
        hidden = replay() if replay is not None else self._forward_static(bucket)
        self.replays[b] = self.replays.get(b, 0) + 1
        if bucket.direct:
            self.direct_replays[b] = self.direct_replays.get(b, 0) + 1
        return hidden[:len(inp.input_ids)], bucket.sample_idx[:len(inp.sample_indices)]


@torch.inference_mode()
def capture_largest_first(runtime: DeviceRuntime, sizes: tuple[int, ...], capture: Callable[[int, Any], None],
                          what: str) -> None:
    """``capture(size, pool)`` for every bucket size, largest first, all into
    one memory pool: graphs replay one at a time, so their activations may
    share it (decode graphs and piecewise graphs alike)."""
    start = time.monotonic()
    pool = runtime.graph_pool()
    for size in sorted(sizes, reverse=True):
        capture(size, pool)
    runtime.synchronize()
    log.info("captured %s %s in %.1f s", what, list(sizes), time.monotonic() - start)


def graph_mode(enforce_eager: bool, runtime: DeviceRuntime, tp_size: int) -> str | None:
    """How a worker runs decode buckets: ``capture`` (CUDA graphs, one
    rank), ``eager`` (the buckets run over their static buffers without a
    graph: the Triton kernels off CUDA, ``FLUIDSERVE_KERNELS=triton``) or
    None (no buckets). Asked for where graphs cannot be, the worker says why
    and runs eagerly (vLLM runs eagerly on CPU too)."""
    if enforce_eager:
        return None
    if tp_size > 1:
        log.warning("CUDA graphs are not yet supported with tensor parallelism: running eagerly")
        return None
    path = ops.kernel_path(runtime.device)
    if path == "reference":
        return None  # the torch reference reads each batch's lengths on the host: no graph can hold it
    if runtime.can_capture_graphs:
        return "capture"
    if path == "triton":
        return "eager"
    log.info("CUDA graphs run only on CUDA devices: running eagerly on %s", runtime.device)
    return None
