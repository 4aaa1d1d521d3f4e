"""Which launch shape of the Triton paged attention runs fastest on this GPU:
a sweep over ``kernels.paged_attention.Tiles`` (prefill tile rows, keys per
iteration, warps, pipeline depth, register caps, the merge inside the launch)
and, for batch-1 decode, the persistent programs per KV head. The plans run first, then decode, then
prefill, so a short budget cuts the prefill grid.

* **prefill**: whole prompts of ``--prefill-lens`` tokens at each launch
  shape ``PREFILL_SHAPES`` lists, against torch's flash SDPA on the same
  shapes (as ``kernel_bench.py`` measures it);
* **decode, batch 1**: one sequence of ``--contexts`` keys, timed as a CUDA
  graph replays it (the engine's default decode path), against the
  device-to-device copy bandwidth;
* **decode floor, batch 1**: what the same sequence's keys and values
  take to read with no attention around them (``_kv_read_kernel``: each
  program sums its share of one KV head's keys, tile by tile as the
  attention iterates), through the block table and in order, in the
  engine's cache layout and head-major, and what one empty kernel takes in
  a graph: how much of the attention's gap to the copy bandwidth is
  reading the cache this way, and how much the rest;
* **plans**: mixed steps of one prefill chunk and a few to many decodes
  (``PLAN_SHAPES``), each with the packed plan (LPT + split-K) in one
  launch and in two (decode tiles in the decode-only variant), unpacked,
  and split at 2k keys unpacked: which plan wins where, for the cost model
  the engine chooses plans by (``packing.PLAN_COSTS``, refitted by
  ``plan_model.py`` from these timings).

Every configuration's output is compared with the default configuration's
(bf16: max abs difference, stated per row); one that fails to compile or
launch is recorded with its error. The sweep stops starting new points once
``--budget`` seconds have passed and saves what it measured.

    python benchmarks/attention_tuning.py [--budget 150]

Writes ``attention_tuning_<device>.json`` and ``.md`` to ``--out``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import save_results  # noqa: E402
from kernel_bench import (  # noqa: E402
    RESULTS_DIR, Shape, bench_mixed, bench_ms, bench_sdpa_prefill, copy_bandwidth_gbs, device_slug, graph_ms,
    make_cache_batch, run_attention,
)

def grid(axes: dict[str, tuple]) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


# The prefill launch shapes timed, the default first: the H200's full grid
# (rows x keys x warps x stages) left 128-key iterations and uncapped eight
# warps at 0.2-0.6x SDPA, and eight warps do nothing for a 64-row tile (it
# runs the narrow warps). What is left: keys per iteration of the prefill
# tile, pipeline depth, eight warps under a register cap that keeps two
# programs per SM (Tiles.mixed_max_registers), and the 128-row tile whole
# rather than as the default's two halves of its rows (Tiles.prefill_halves);
# spills per key-loop iteration of each in kernels_compile_sm90-triton3.6.md.
PREFILL_SHAPES = [
    {}, dict(prefill_halves=1), dict(prefill_block_n=32), dict(prefill_halves=1, prefill_block_n=32),
    dict(wide_warps=8, mixed_max_registers=128, prefill_block_n=32),
    dict(wide_warps=8, mixed_max_registers=128), dict(wide_warps=8, mixed_max_registers=168),
    dict(num_stages=2), dict(num_stages=4), dict(prefill_block_n=32, num_stages=2),
    dict(prefill_block_n=32, num_stages=4),
    dict(wide_warps=8, mixed_max_registers=128, prefill_block_n=32, num_stages=4),
    dict(prefill_rows=64), dict(prefill_rows=64, num_stages=2),
]  # fmt: skip
# fused_merge: the split-K merge inside the launch. Compiled for sm_90 by
# Triton 3.6 (kernels_compile_sm90-triton3.6.md) the decode-only variant
# takes 160 registers, three programs per SM, 168 at five stages and with
# the fused merge, so the register cap (max_registers 168) changes the
# occupancy of one point only, five stages with the fused merge (214
# uncapped, two per SM): the grid runs uncapped, that point both ways. On
# the H200 at 16k keys, neither four units per KV head nor a fourth stage
# beat the best of the other points for any block_n, and 32 keys an
# iteration ran no faster than 64 or 128 (46-47% of copy), so the grid
# keeps 64. Five stages: the first depth at which Triton's pipeliner
# double-buffers the decode key loop's K and V (Tiles.decode_num_stages; at
# 2-4 it keeps one buffer, "tile buffers" in kernels_compile_sm90-triton3.6.md).
DECODE_GRID = dict(block_n=(64,), num_stages=(2, 3, 5), units_scale=(1, 2), max_registers=(None,),
                   fused_merge=(False, True))
# Fewer warps a program (Tiles.narrow_warps), compiled for sm_90 by Triton
# 3.6 (kernels_compile_sm90-triton3.6.md): two hold the 64-key tile in 225
# registers without spilling, four programs per SM against four warps' three;
# one holds a 16-key tile in 196, ten per SM (eight double-buffered), or a
# 32-key tile in 255 (two spill instructions an iteration), eight per SM.
# Keys in flight per SM: 192 by default, 256 at one warp and 32 keys, so
# each program runs half the iterations for a long sequence; a warp alone
# also keeps its row max and sum out of shared memory (two barriers a
# key-loop iteration against nine). Under the register cap they spill, and
# one warp's fused merge spills inside its key loop: uncapped, and one warp
# with the merge kernel only.
DECODE_POINTS = grid(DECODE_GRID) + [
    dict(block_n=64, num_stages=5, units_scale=1, max_registers=168, fused_merge=True),
    *(dict(block_n=64, num_stages=stages, units_scale=1, max_registers=None, fused_merge=fused, narrow_warps=2)
      for stages in (3, 5) for fused in (False, True)),
    *(dict(block_n=block_n, num_stages=stages, units_scale=1, max_registers=None, fused_merge=False, narrow_warps=1)
      for block_n, stages in ((16, 3), (16, 5), (32, 3))),
    # Fewer programs than the SMs hold, each streaming a longer run of keys:
    # on the H200 at 16k keys the floor's reads ran faster the fewer the
    # programs (56% of copy at the default's 50 a KV head, 50% at 100, 47%
    # at 200), so a half and a third of the default are tried too.
    *(dict(block_n=64, num_stages=3, units_scale=scale, max_registers=None, fused_merge=False)
      for scale in (1 / 2, 1 / 3)),
]  # fmt: skip
# The reads of the decode floor: programs per KV head as a multiple of the
# attention's default, keys per iteration, through the block table or not,
# and the cache's bytes taken as [blocks, heads, block_size, head_dim]
# (a block's rows of one head contiguous) instead of the engine's
# [blocks, block_size, heads, head_dim] (each row its own 2*head_dim bytes).
FLOOR_GRID = dict(units_scale=(1 / 3, 1 / 2, 1, 2), block_n=(64, 128), paged=(True, False), head_major=(False, True))
# (prefill chunk, decodes, longest decode context) of the plan comparison.
PLAN_SHAPES = [(c, d, ctx) for c in (512, 2048, 8192) for d in (16, 128) for ctx in (4096, 32768)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384])
    p.add_argument("--budget", type=float, default=150.0, help="seconds after which no new point starts")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    return p.parse_args(argv)


class Sweep:
    """Runs points until the budget is spent; keeps each row as it ends."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.rows: list[dict] = []
        self.skipped = 0

    def point(self, row: dict, measure) -> None:
        if time.monotonic() > self.deadline:
            self.skipped += 1
            return
        try:
            row.update(measure())
        except Exception as exc:  # a shape this GPU cannot run: recorded, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        self.rows.append(row)
        print(json.dumps(row))


def _output(batch: dict, shape: Shape, plan) -> torch.Tensor:
    from fluidserve.kernels import paged_attention as pa

    return pa.paged_attention(batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
                              batch["seq_lens"], batch["query_start_loc"], shape.head_dim**-0.5, work=plan)


def tune_prefill(shape: Shape, lens: list[int], sweep: Sweep) -> None:
    from fluidserve.kernels import paged_attention as pa

    for L in lens:
        batch = make_cache_batch(shape, [L], [L])
        flops = 4 * shape.num_q_heads * shape.head_dim * L * (L + 1) / 2
        sdpa_ms, backend = bench_sdpa_prefill(batch, shape, L)
        reference = _output(batch, shape, pa.plan_for(batch["query"], batch["key_cache"], [L], [L]))
        for cfg in PREFILL_SHAPES:
            def measure(cfg=cfg, batch=batch, reference=reference) -> dict:
                with pa.tiles(**cfg):
                    plan = pa.plan_for(batch["query"], batch["key_cache"], [L], [L])
                    diff = (_output(batch, shape, plan).float() - reference.float()).abs().max().item()
                    ms = bench_ms(partial(run_attention, batch, shape, plan))
                return dict(ms=ms, tflops=flops / ms / 1e9, vs_sdpa=sdpa_ms / ms, max_abs_diff=diff)

            sweep.point(dict(kind="prefill", len=L, sdpa_ms=sdpa_ms, sdpa_backend=backend, **prefill_shape(cfg)),
                        measure)
        del batch, reference
        torch.cuda.empty_cache()


def prefill_shape(changes: dict) -> dict:
    """A prefill point's launch shape in full: what it changes, over the defaults."""
    from fluidserve.kernels.paged_attention import Tiles

    t = Tiles(**changes)
    # A tile of 64 rows or fewer runs the narrow warps (paged_attention._num_warps).
    return dict(changes=", ".join(f"{k}={v}" for k, v in changes.items()) or "default", prefill_rows=t.prefill_rows,
                block_n=t.prefill_step, warps=t.wide_warps if t.prefill_rows > 64 else t.narrow_warps,
                num_stages=t.num_stages, mixed_max_registers=t.mixed_max_registers,
                halves=t.prefill_halves)  # fmt: skip


def scaled_units(default: int, cfg: dict) -> int:
    """Programs per KV head of a point: the default times its ``units_scale``, at least one."""
    return max(1, round(default * cfg["units_scale"]))


def tune_decode(shape: Shape, contexts: list[int], copy_gbs: float, sweep: Sweep) -> None:
    from fluidserve.kernels import paged_attention as pa

    elem = torch.finfo(shape.dtype).bits // 8
    for ctx in contexts:
        batch = make_cache_batch(shape, [1], [ctx])
        nbytes = 2 * ctx * shape.num_kv_heads * shape.head_dim * elem + 2 * shape.num_q_heads * shape.head_dim * elem
        reference = _output(batch, shape, pa.plan_for(batch["query"], batch["key_cache"], [1], [ctx]))
        for cfg in DECODE_POINTS:
            def measure(cfg=cfg, batch=batch, reference=reference) -> dict:
                tiles = {k: v for k, v in cfg.items() if k != "units_scale"}
                with pa.tiles(**tiles):
                    units = scaled_units(pa.default_num_units(batch["query"], batch["key_cache"], False), cfg)
                    plan = pa.plan_for(batch["query"], batch["key_cache"], [1], [ctx], num_units=units)
                    diff = (_output(batch, shape, plan).float() - reference.float()).abs().max().item()
                    ms = graph_ms(partial(run_attention, batch, shape, plan))
                gbs = nbytes / (ms * 1e-3) / 1e9
                return dict(units=units, splits=plan.max_splits, graph_ms=ms, pct_of_copy=100 * gbs / copy_gbs,
                            max_abs_diff=diff)

            sweep.point(dict(kind="decode", batch=1, context=ctx, **cfg), measure)
        del batch, reference
        torch.cuda.empty_cache()


@triton.jit
def _kv_read_kernel(k_ptr, v_ptr, block_table_ptr, out_ptr, seq_len, keys_per_unit, num_heads,
                    stride_kb, stride_ks, stride_kh,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Program (unit, head) sums keys ``[unit * keys_per_unit, ...)`` of one
    sequence's KV head ``head``, K and V, ``BLOCK_N`` keys an iteration:
    the attention's reads without its arithmetic. ``PAGED``: each key's
    block from the block table, as the attention finds it; otherwise
    blocks 0, 1, 2, ... in order (as many bytes, no table)."""
    unit = tl.program_id(0)
    head = tl.program_id(1)
    lo = unit * keys_per_unit
    hi = tl.minimum(lo + keys_per_unit, seq_len)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        if PAGED:
            block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        else:
            block = (pos // BLOCK_SIZE).to(tl.int64)
        rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + head * stride_kh
        tile = rows[:, None] + d[None, :]
        acc += tl.load(k_ptr + tile, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + tile, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + (unit * num_heads + head) * HEAD_DIM + d, tl.sum(acc, axis=0))


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr, 1)


def _caches(batch: dict, head_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's caches indexed [block, slot, head, dim]; ``head_major``:
    their memory read as [blocks, heads, block_size, head_dim] instead."""
    caches = (batch["key_cache"], batch["value_cache"])
    if not head_major:
        return caches
    nb, bs, h, d = caches[0].shape
    return tuple(c.view(nb, h, bs, d).transpose(1, 2) for c in caches)


def kv_read(batch: dict, seq_len: int, units: int, block_n: int, paged: bool,
            head_major: bool = False) -> torch.Tensor:  # fmt: skip
    """Sequence 0's first ``seq_len`` keys and values summed per (unit, KV
    head): [units, Hkv, D] fp32 partial sums (``_kv_read_kernel``)."""
    k, v = _caches(batch, head_major)
    _, block_size, heads, head_dim = k.shape
    out = torch.empty((units, heads, head_dim), dtype=torch.float32, device=k.device)
    _kv_read_kernel[(units, heads)](
        k, v, batch["block_tables"][0], out, seq_len, -(-seq_len // units), heads,
        k.stride(0), k.stride(1), k.stride(2),
        HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_SIZE=block_size, PAGED=paged,
    )  # fmt: skip
    return out


def kv_read_reference(batch: dict, seq_len: int, paged: bool, head_major: bool = False) -> torch.Tensor:
    """[Hkv, D]: what ``kv_read``'s partial sums add up to, in fp32."""
    caches = _caches(batch, head_major)
    _, block_size, heads, head_dim = caches[0].shape
    blocks = -(-seq_len // block_size)
    device = caches[0].device
    ids = batch["block_tables"][0, :blocks].long() if paged else torch.arange(blocks, device=device)
    total = torch.zeros((heads, head_dim), dtype=torch.float32, device=device)
    for cache in caches:
        total += cache[ids].flatten(0, 1)[:seq_len].float().sum(0)
    return total


def tune_floor(shape: Shape, contexts: list[int], copy_gbs: float, sweep: Sweep) -> None:
    from fluidserve.kernels import paged_attention as pa

    elem = torch.finfo(shape.dtype).bits // 8
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sweep.point(dict(kind="floor", read="empty kernel"), lambda: dict(graph_ms=graph_ms(partial(
        _empty_kernel[(1,)], flag))))
    for ctx in contexts:
        batch = make_cache_batch(shape, [1], [ctx])
        nbytes = 2 * ctx * shape.num_kv_heads * shape.head_dim * elem
        default_units = pa.default_num_units(batch["query"], batch["key_cache"], False)
        references = {(paged, major): kv_read_reference(batch, ctx, paged, major)
                      for paged in (True, False) for major in (False, True)}  # fmt: skip
        for cfg in grid(FLOOR_GRID):
            def measure(cfg=cfg, batch=batch, references=references) -> dict:
                units = scaled_units(default_units, cfg)
                run = partial(kv_read, batch, ctx, units, cfg["block_n"], cfg["paged"], cfg["head_major"])
                ref = references[cfg["paged"], cfg["head_major"]]
                err = ((run().sum(0) - ref).abs().max() / ref.abs().max()).item()
                ms, after_reads = graph_ms(run), graph_ms(run, flush="read")
                return dict(units=units, graph_ms=ms, pct_of_copy=100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
                            read_flush_graph_ms=after_reads,
                            read_flush_pct_of_copy=100 * nbytes / (after_reads * 1e-3) / 1e9 / copy_gbs, rel_err=err)

            read = ("through the block table" if cfg["paged"] else "blocks in order") + (
                ", head-major" if cfg["head_major"] else "")
            sweep.point(dict(kind="floor", read=read, context=ctx, **cfg), measure)
        del batch, references
        torch.cuda.empty_cache()


def tune_plans(shape: Shape, sweep: Sweep) -> None:
    for chunk, decodes, longest in PLAN_SHAPES:
        def measure(chunk=chunk, decodes=decodes, longest=longest) -> dict:
            m = bench_mixed(shape, chunk=chunk, decodes=decodes, contexts=(512, longest))
            return {f"{plan}_ms": m[plan]["ms"] for plan in ("packed", "separate", "unpacked", "split_unpacked")}

        sweep.point(dict(kind="plans", chunk=chunk, decodes=decodes, longest_context=longest), measure)
        torch.cuda.empty_cache()


def best(rows: list[dict], kind: str, key: str, by: str, higher: bool) -> dict[int, dict]:
    """The fastest correct row per ``key`` value."""
    out: dict[int, dict] = {}
    for r in rows:
        if r["kind"] != kind or "error" in r or r["max_abs_diff"] > 0.05:
            continue
        cur = out.get(r[key])
        if cur is None or (r[by] > cur[by] if higher else r[by] < cur[by]):
            out[r[key]] = r
    return out


def markdown(report: dict) -> str:
    from fluidserve.kernels.paged_attention import Tiles

    d = Tiles()
    lines = [f"# Attention launch shapes on {report['device']}", "",
             f"Defaults: prefill_rows {d.prefill_rows}, block_n {d.block_n}, warps {d.wide_warps} (wide) / "
             f"{d.narrow_warps} (narrow), num_stages {d.num_stages or 'Triton default'}; device-to-device copy "
             f"{report['copy_gb_s']:.0f} GB/s. {len(report['rows'])} points measured, {report['skipped']} left "
             f"when the {report['budget_s']:.0f} s budget ran out. Max abs difference: against the default "
             "configuration's output (bf16).", "",
             "## Prefill (ratio: torch flash SDPA time / ours)", "",
             "| length | rows | halves | keys per iteration | warps | stages | register cap | ms | TFLOP/s "
             "| vs SDPA | max abs diff |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in sorted((r for r in report["rows"] if r["kind"] == "prefill"), key=lambda r: (r["len"], r.get("ms", 1e9))):
        tail = ([f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['vs_sdpa']:.2f}", f"{r['max_abs_diff']:.3g}"]
                if "error" not in r else [r["error"], "", "", ""])  # fmt: skip
        # Sweeps before the register cap name their warps wide_warps and have no cap.
        cells = [r["len"], r["prefill_rows"], r.get("halves", 1), r["block_n"], r.get("warps", r.get("wide_warps")),
                 r["num_stages"] or "default", r.get("mixed_max_registers") or "–", *tail]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "## Decode, batch 1, in a CUDA graph", "",
              "| context | block_n | warps | stages | register cap | merge | units per KV head | splits | ms "
              "| % of copy | max abs diff |", "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in sorted((r for r in report["rows"] if r["kind"] == "decode"),
                    key=lambda r: (r["context"], r.get("graph_ms", 1e9))):  # fmt: skip
        tail = ([r["units"], r["splits"], f"{r['graph_ms']:.4f}", f"{r['pct_of_copy']:.1f}", f"{r['max_abs_diff']:.3g}"]
                if "error" not in r else ["", "", r["error"], "", ""])  # fmt: skip
        cap = r.get("max_registers") or "–"  # sweeps before the cap lack it
        merge = "in the launch" if r.get("fused_merge") else "merge kernel"
        cells = [r["context"], r["block_n"], decode_warps(r), r["num_stages"], cap, merge, *tail]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    floor = [r for r in report["rows"] if r["kind"] == "floor"]
    if floor:
        lines += ["", "## Decode floor, batch 1: the keys and values read alone, in a CUDA graph", "",
                  "After a read flush: L2 emptied by reads instead of writes before each call (`FLUSHES` in "
                  "kernel_bench.py).", "",
                  "| context | read | keys per iteration | units per KV head | ms | % of copy "
                  "| after a read flush ms | % of copy | rel err |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(floor, key=lambda r: (r.get("context", 0), r.get("graph_ms", 1e9))):
            pct = f"{r['pct_of_copy']:.1f}" if "pct_of_copy" in r else "–"  # the empty kernel reads nothing
            reads = ((f"{r['read_flush_graph_ms']:.4f}", f"{r['read_flush_pct_of_copy']:.1f}")
                     if "read_flush_graph_ms" in r else ("–", "–"))  # sweeps before the read flush lack it
            tail = ([r.get("units", "–"), f"{r['graph_ms']:.4f}", pct, *reads,
                     f"{r['rel_err']:.1e}" if "rel_err" in r else "–"]
                    if "error" not in r else ["", r["error"], "", "", "", ""])  # fmt: skip
            cells = [r.get("context", "–"), r["read"], r.get("block_n", "–"), *tail]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    plans = [r for r in report["rows"] if r["kind"] == "plans"]
    if plans:
        lines += ["", "## Plans of a mixed step (ms; speed-up: unpacked / the faster packed plan)", "",
                  "| prefill chunk | decodes | decode contexts | packed | packed, two launches | unpacked "
                  "| split 2k, unpacked | speed-up |", "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in plans:
            two = r.get("separate_ms")  # sweeps before the two-launch plan lack it
            fastest = min(r["packed_ms"], two or r["packed_ms"]) if "error" not in r else None
            cells = ([f"{r['packed_ms']:.3f}", f"{two:.3f}" if two else "–", f"{r['unpacked_ms']:.3f}",
                      f"{r['split_unpacked_ms']:.3f}", f"{r['unpacked_ms'] / fastest:.2f}x"]
                     if "error" not in r else [r["error"], "", "", "", ""])
            lines.append("| " + " | ".join(map(str, [r["chunk"], r["decodes"], f"512-{r['longest_context']}",
                                                      *cells])) + " |")
    lines += ["", "## Best per shape", ""]
    for L, r in sorted(best(report["rows"], "prefill", "len", "vs_sdpa", True).items()):
        default = next((d for d in report["rows"] if d["kind"] == "prefill" and d["len"] == L
                        and d.get("changes") == "default" and "error" not in d), None)  # fmt: skip
        against = f" ({default['ms'] / r['ms']:.2f}x the default's speed)" if default else ""
        shape = r.get("changes") or (f"rows {r['prefill_rows']}, {r['block_n']} keys, {r['wide_warps']} warps, "
                                     f"stages {r['num_stages']}")  # a sweep before the named changes
        lines.append(f"* prefill {L}: {shape}: {r['vs_sdpa']:.2f}x SDPA{against}")
    for ctx, r in sorted(best(report["rows"], "decode", "context", "pct_of_copy", True).items()):
        lines.append(f"* decode batch 1, {ctx} keys: block_n {r['block_n']}, {decode_warps(r)} warps, "
                     f"stages {r['num_stages']}, register cap "
                     f"{r.get('max_registers') or 'none'}, {'fused' if r.get('fused_merge') else 'separate'} merge, "
                     f"units x{r['units_scale']:.3g}: {r['pct_of_copy']:.1f}% of copy")
    for ctx in sorted({r["context"] for r in floor if "context" in r}):
        reads = [r for r in floor if r.get("context") == ctx and "error" not in r and r["rel_err"] < 1e-3]
        for read in sorted({r["read"] for r in reads}):
            fastest = max((r for r in reads if r["read"] == read), key=lambda r: r["pct_of_copy"], default=None)
            if fastest:
                after_reads = (f"; after a read flush {fastest['read_flush_pct_of_copy']:.1f}%"
                               if "read_flush_pct_of_copy" in fastest else "")
                lines.append(f"* reading {ctx} keys alone, {read}: {fastest['pct_of_copy']:.1f}% of copy "
                             f"({fastest['block_n']} keys per iteration, units x{fastest['units_scale']:.3g})"
                             f"{after_reads}")
    empty = next((r for r in floor if r["read"] == "empty kernel" and "error" not in r), None)
    if empty:
        lines.append(f"* one empty kernel in a graph: {1e3 * empty['graph_ms']:.1f} us")
    return "\n".join(lines) + "\n"


def decode_warps(row: dict) -> int:
    """Warps of a decode point's programs (points before the two-warp ones ran the default)."""
    from fluidserve.kernels import paged_attention as pa

    return row.get("narrow_warps") or pa.Tiles().narrow_warps


def main(argv: list[str] | None = None) -> int:
    from fluidserve.kernels import packing

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention_tuning.py needs a CUDA GPU (none found); nothing measured.", file=sys.stderr)
        return 1
    shape = Shape(num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16)
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs()
    sweep = Sweep(args.budget)
    # The plans first: their two-launch column is what the budget must not cut.
    tune_plans(shape, sweep)
    tune_floor(shape, args.contexts, copy_gbs, sweep)
    tune_decode(shape, args.contexts, copy_gbs, sweep)
    tune_prefill(shape, args.prefill_lens, sweep)
    report = dict(device=name, time=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__,
                  triton=__import__("triton").__version__, copy_gb_s=copy_gbs, budget_s=args.budget,
                  plan_costs=dataclasses.asdict(packing.PLAN_COSTS),  # the costs LPT balanced by
                  lpt_costs=packing.LPT_COSTS,  # how the timed plans were balanced (plan_model.py rebuilds them so)
                  skipped=sweep.skipped, rows=sweep.rows)  # fmt: skip
    stem = args.out / f"attention_tuning_{device_slug(name)}"
    save_results(stem, report, markdown(report))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
