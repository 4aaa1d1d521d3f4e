"""Kernel benchmarks: how close the Triton paged attention gets to the memory
and compute roofs of the GPU it runs on.

Three measurements, all in one process on one device:

* **decode**: one query token per sequence over batch x context; achieved
  bandwidth = bytes of K/V (and Q) read / kernel time, next to the bandwidth of
  a device-to-device copy measured here (the practical roof).
* **prefill**: whole prompts; TFLOP/s of our kernel and of
  ``torch.nn.functional.scaled_dot_product_attention`` (causal, flash backend
  where torch has it, K/V expanded to the query heads) on the same shapes.
  FLOPs count only the causal half: 4 * heads * head_dim * L(L+1)/2.
* **mixed**: one 8k-token prefill chunk + 128 decodes of random contexts,
  with FluidInfer packing (LPT onto persistent units, split-K) in one
  launch, packed in two launches (the decode tiles in the decode-only
  variant), without packing (one program per tile, no split), and split at
  2k keys with one program per piece (the hardware's scheduler balancing
  instead of LPT); and which of the first two the engine's plan picks. The
  target's speed-up is the engine's plan against no packing.

It also reports the compiled variants (how many specialisation keys the
launchers produced over the whole sweep, and how many kernels Triton
compiled: a sweep of varied batches must not add any after warm-up) and the
occupancy read off each variant.

Results go to ``benchmarks/results/kernels_<device>.json`` and ``.md``.
Run: ``python benchmarks/kernel_bench.py`` (``--quick`` for a short sweep).
Needs CUDA; on a machine without it the script says so and exits with
status 1. (Not ``kernels.py``: the benchmarks' folder comes first on the path
of a benchmark run as a script, where a ``kernels`` module would hide PyPI's,
which transformers imports.)

``--batch1-decode`` instead times batch-1 greedy decode of a Llama-3-8B-shaped
dummy model through the engine, eager (``enforce_eager=True``) and with
decode CUDA graphs (``enforce_eager=False``, the default), one engine after the
other in this process, each against the HBM roofline: the bytes one token
must read (every weight but the embedding table, plus its KV) over the copy
bandwidth measured in the same run (``batch1_decode_<device>.json``/``.md``,
rewritten after each mode).

``--compile-only`` needs no GPU: it compiles every attention variant for
sm_90 (H100/H200) with the arguments a real launch passes, reads registers,
shared memory and spills off the cubin, and per key-loop iteration the spill,
tensor-core and barrier instructions off its SASS, and gives the occupancy
the launcher would size the grid with; and the batch-1 GEMV (kernels/gemv.py) at the
engine's launch shape and others ``linear_bandwidth.py`` timed, for
their registers and spills (``kernels_compile_sm90.json``/``.md``). The
GPU machines run Triton 3.6, whose code differs: the same command under it
(any venv with that Triton) with ``--tag=-triton3.6`` writes
``kernels_compile_sm90-triton3.6.*`` beside. It compiles the MoE experts'
kernels (kernels/moe.py) too, at the launches a Qwen3-30B-A3B and a
Mixtral-8x7B layer make at 1 and 4096 tokens, and the weight-only int
linears (kernels/int_linear.py) and float8 ones (kernels/fp8_linear.py) on
a Llama-3-8B o projection.

``--moe`` times ``ops.fused_experts`` on those two layers' shapes (bf16)
over a sweep of token counts: the Triton path launched eagerly and as a
CUDA graph replays it, against the torch reference (the CPU path, one
``F.linear`` pair per expert hit), with the bytes of the experts' weights
the step reads over the graph time (``moe_<device>.json``/``.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import DECODE_MODES, decode_mode, save_results  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Skip decode points whose KV cache would not fit comfortably.
MAX_CACHE_BYTES = 40 * 2**30


@dataclass(frozen=True)
class Shape:
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 16384, 32768])
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128, help="any up to 256 (80, 96 are padded to 128)")
    p.add_argument("--block-size", type=int, default=16, choices=[16, 32])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    p.add_argument("--quick", action="store_true", help="a few points of each sweep")
    p.add_argument("--batch1-decode", action="store_true",
                   help="batch-1 decode of a Llama-3-8B-shaped dummy model against the HBM roofline")
    p.add_argument("--decode-modes", nargs="+", choices=sorted(DECODE_MODES), default=list(DECODE_MODES),
                   help="with --batch1-decode: the engine paths to time, in this order")
    p.add_argument("--moe", action="store_true", help="time the MoE experts (kernels/moe.py) against the torch "
                   "reference")
    p.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: compile every variant for sm_90 and report its resources")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--tag", default="", help="suffix of --compile-only's file name, e.g. -triton3.6 for another "
                   "Triton's compile (the GPU machines run 3.6)")  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.contexts, args.prefill_lens = [1, 64], [2048, 16384], [2048]
        args.moe_tokens = [1, 512]
    return args


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def bench_ms(fn) -> float:
    import triton.testing

    from fluidserve.kernels import paged_attention as pa

    # Median of event-timed runs; do_bench flushes L2 between runs.
    ms = float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    # One more call, untimed, whose specialisation keys are recorded.
    with pa.recording_variants():
        fn()
    return ms


# How graph_ms empties L2 before each call: "write" zeroes 256 MiB, leaving
# up to an L2's worth of dirty lines, which the timed kernel's first reads
# evict and so write back inside its time; "read" sums 256 MiB, leaving L2
# full of clean lines, as a decode step leaves it before attention (the
# kernels before it read weights). At batch 1 the in-graph attention ran
# 14-18 us a call over the copy bandwidth's time at 8k-32k keys, the bare
# read of its cache 12 us, about what writing back 50 MB takes: timing both
# ways tells whether that is the flush's.
FLUSHES = ("write", "read")


def graph_ms(fn, reps: int = 20, runs: int = 5, flush: str = "write") -> float:
    """GPU time of one call of ``fn`` as a CUDA graph replays it, which is
    how the engine runs decode: ``reps`` calls captured in one graph, each
    after an L2 flush (``FLUSHES``), less a graph of the flushes alone;
    median of ``runs`` replays. Launch latency and the host's side of a
    launch are not in it, so a short kernel is timed rather than its
    launcher."""
    import statistics

    if flush not in FLUSHES:
        raise ValueError(f"flush must be one of {FLUSHES}, got {flush!r}")
    words = torch.zeros(64 * 2**20, dtype=torch.float32, device="cuda")  # 256 MiB
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    empty_l2 = words.zero_ if flush == "write" else partial(torch.sum, words, dim=0, out=sink)
    fn()  # compiles, and allocates what a plan keeps, outside the capture
    empty_l2()
    torch.cuda.synchronize()

    def capture(calls: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                empty_l2()
                if calls:
                    fn()
        return graph

    def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
        graph.replay()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    with_calls, flushes_only = capture(True), capture(False)
    return max(0.0, (replay_ms(with_calls) - replay_ms(flushes_only)) / reps)


def copy_bandwidth_gbs(nbytes: int = 2**30) -> float:
    """Device-to-device copy: reads + writes ``nbytes`` each."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_cache_batch(
    shape: Shape, q_lens: list[int], seq_lens: list[int], seed: int = 0, device: str = "cuda"
) -> dict:
    """A paged batch with randomly placed blocks: [num_blocks, bs, Hkv, D] caches."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shape.block_size
    needed = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(needed)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros((len(seq_lens), max(needed)), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(needed):
        tables[i, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    kw = dict(dtype=shape.dtype, device=device)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        query=torch.randn((starts[-1], shape.num_q_heads, shape.head_dim), **kw),
        key_cache=torch.randn(cache_shape, **kw),
        value_cache=torch.randn(cache_shape, **kw),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )


def run_attention(batch: dict, shape: Shape, plan) -> None:
    from fluidserve.kernels import paged_attention as pa

    pa.paged_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens"], batch["query_start_loc"], shape.head_dim**-0.5, work=plan,
    )  # fmt: skip


# A short step's decode splits into pieces of packing.MIN_KV_CHUNK (256) keys
# at least, so at batch 1 and 512 keys two programs per KV head of 33 work.
# A decode graph merges every row anyway, so shorter pieces cost it no
# launch: steps of at most SHORT_STEP_KEYS keys are also timed in a graph
# split at SHORT_SPLIT keys. The plan model fitted to the H100 and H200
# timings (plan_model.py) predicts 17-18 us against 9-10 at 512-2048 keys.
SHORT_SPLIT = 64
SHORT_STEP_KEYS = 8 * 2048
# Decode steps of at most FUSED_MERGE_BATCH rows are also timed with their
# splits merged inside the attention launch (Tiles.fused_merge): the merge
# launch is a fixed cost, which small batches feel.
FUSED_MERGE_BATCH = 8


def bench_decode(shape: Shape, batch_sizes: list[int], contexts: list[int], copy_gbs: float) -> list[dict]:
    from fluidserve.kernels import paged_attention as pa

    elem = torch.finfo(shape.dtype).bits // 8
    rows = []
    for b in batch_sizes:
        for ctx in contexts:
            kv_bytes = 2 * b * ctx * shape.num_kv_heads * shape.head_dim * elem
            if kv_bytes > MAX_CACHE_BYTES:
                rows.append(dict(batch=b, context=ctx, skipped="cache too large"))
                continue
            q_lens, seq_lens = [1] * b, [ctx] * b
            batch = make_cache_batch(shape, q_lens, seq_lens)
            plan = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens)
            ms = bench_ms(partial(run_attention, batch, shape, plan))
            in_graph = graph_ms(partial(run_attention, batch, shape, plan))
            q_bytes = 2 * b * shape.num_q_heads * shape.head_dim * elem  # read Q, write O

            def gb_s(t_ms: float, moved: int = kv_bytes + q_bytes) -> float:
                return moved / (t_ms * 1e-3) / 1e9

            gbs, graph_gbs = gb_s(ms), gb_s(in_graph)
            after_reads = graph_ms(partial(run_attention, batch, shape, plan), flush="read")
            rows.append(dict(batch=b, context=ctx, ms=ms, gb_s=gbs, pct_of_copy=100 * gbs / copy_gbs,
                             graph_ms=in_graph, graph_gb_s=graph_gbs, graph_pct_of_copy=100 * graph_gbs / copy_gbs,
                             read_flush_graph_ms=after_reads,
                             read_flush_graph_pct_of_copy=100 * gb_s(after_reads) / copy_gbs,
                             splits=plan.max_splits, units=plan.num_units))  # fmt: skip
            print(f"decode b={b:4d} ctx={ctx:6d}  {ms:8.3f} ms  {gbs:7.1f} GB/s  ({100 * gbs / copy_gbs:5.1f}% of "
                  f"copy); in a graph {in_graph:8.3f} ms ({100 * graph_gbs / copy_gbs:5.1f}%); after a read "
                  f"flush {after_reads:8.3f} ms ({rows[-1]['read_flush_graph_pct_of_copy']:5.1f}%)")
            # --kv-cache-dtype fp8: the same rows over an e4m3 cache, half the bytes to read.
            fp8 = dict(batch, key_cache=batch["key_cache"].to(torch.float8_e4m3fn),
                       value_cache=batch["value_cache"].to(torch.float8_e4m3fn))
            fp8_plan = pa.plan_for(fp8["query"], fp8["key_cache"], q_lens, seq_lens)  # its variant's occupancy
            fp8_ms = graph_ms(partial(run_attention, fp8, shape, fp8_plan))
            fp8_moved = kv_bytes // elem + q_bytes
            rows[-1].update(fp8_graph_ms=fp8_ms, fp8_graph_pct_of_copy=100 * gb_s(fp8_ms, fp8_moved) / copy_gbs)
            print(f"  over an fp8 cache: in a graph {fp8_ms:8.3f} ms ({rows[-1]['fp8_graph_pct_of_copy']:5.1f}% of "
                  f"copy on its bytes; {in_graph / fp8_ms:.2f}x the speed)")
            del fp8
            if b * ctx <= SHORT_STEP_KEYS:
                short = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens, kv_chunk=SHORT_SPLIT)
                rows[-1].update(short_split_graph_ms=graph_ms(partial(run_attention, batch, shape, short)),
                                short_split_splits=short.max_splits)
                print(f"  split at {SHORT_SPLIT} keys ({short.max_splits} pieces): in a graph "
                      f"{rows[-1]['short_split_graph_ms']:8.3f} ms")
            if b <= FUSED_MERGE_BATCH and plan.max_splits:
                with pa.tiles(fused_merge=True):
                    fused = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens)
                    rows[-1].update(fused_ms=bench_ms(partial(run_attention, batch, shape, fused)),
                                    fused_graph_ms=graph_ms(partial(run_attention, batch, shape, fused)))
                rows[-1]["fused_graph_pct_of_copy"] = 100 * gb_s(rows[-1]["fused_graph_ms"]) / copy_gbs
                print(f"  merged in the attention launch: {rows[-1]['fused_ms']:8.3f} ms; in a graph "
                      f"{rows[-1]['fused_graph_ms']:8.3f} ms")
            del batch
            torch.cuda.empty_cache()
    return rows


# The prefill tile's key loop at 64 keys a step spills 135 local-memory
# instructions an iteration when compiled for sm_90 by Triton 3.6
# (kernels_compile_sm90-triton3.6.md). Each prompt and the mixed batch are
# also timed with the other tiles: PREFILL_ALT_BLOCK_N keys a step (no
# spills, but the accumulator rescaled twice as often; the decode tile keeps
# its own), the tile as two halves of its rows sharing each K/V load (3
# spills, at the same tensor-core instructions a key; the default), and one
# tile of all its rows. Those the engine already runs are left out. By
# result key: the change, and its name in the tables.
PREFILL_ALT_BLOCK_N = 32
PREFILL_ALTERNATIVES = {
    "alt_block_n": (dict(prefill_block_n=PREFILL_ALT_BLOCK_N), f"{PREFILL_ALT_BLOCK_N} keys a step"),
    "halves": (dict(prefill_halves=2), "two halves of rows"),
    "one_tile": (dict(prefill_halves=1), "one tile of rows"),
}


def _prefill_alternatives() -> Iterator[tuple[str, str]]:
    """(result key, name) of each alternative prefill tile the engine does
    not already run, launched with that tile inside the loop's body."""
    from fluidserve.kernels import paged_attention as pa

    for key, (changes, name) in PREFILL_ALTERNATIVES.items():
        if any(getattr(pa.TILES, field) != value for field, value in changes.items()):
            with pa.tiles(**changes):
                yield key, name


def bench_prefill(shape: Shape, lens: list[int]) -> list[dict]:
    from fluidserve.kernels import paged_attention as pa

    rows = []
    for L in lens:
        batch = make_cache_batch(shape, [L], [L])
        plan = pa.plan_for(batch["query"], batch["key_cache"], [L], [L])
        flops = 4 * shape.num_q_heads * shape.head_dim * L * (L + 1) / 2
        ms = bench_ms(partial(run_attention, batch, shape, plan))
        ms_sdpa, backend = bench_sdpa_prefill(batch, shape, L)
        rows.append(dict(len=L, ms=ms, tflops=flops / ms / 1e9, sdpa_ms=ms_sdpa, sdpa_tflops=flops / ms_sdpa / 1e9,
                         sdpa_backend=backend, vs_sdpa=ms_sdpa / ms))  # fmt: skip
        print(f"prefill L={L:6d}  ours {flops / ms / 1e9:6.1f} TFLOP/s  sdpa ({backend}) "
              f"{flops / ms_sdpa / 1e9:6.1f} TFLOP/s  ratio {ms_sdpa / ms:.2f}")
        for key, name in _prefill_alternatives():
            alt = pa.plan_for(batch["query"], batch["key_cache"], [L], [L])
            alt_ms = bench_ms(partial(run_attention, batch, shape, alt))
            rows[-1].update({f"{key}_ms": alt_ms, f"{key}_vs_sdpa": ms_sdpa / alt_ms})
            print(f"  prefill tile, {name}: {flops / alt_ms / 1e9:6.1f} TFLOP/s  ratio {ms_sdpa / alt_ms:.2f}")
        del batch
        torch.cuda.empty_cache()
    return rows


def bench_sdpa_prefill(batch: dict, shape: Shape, length: int) -> tuple[float, str]:
    """Causal SDPA over the prompt of a one-sequence ``batch``: the same K/V,
    contiguous and expanded to the query heads ([1, Hq, L, D])."""
    nb = -(-length // shape.block_size)
    blocks = batch["block_tables"][0, :nb].long()
    k = batch["key_cache"][blocks].reshape(-1, shape.num_kv_heads, shape.head_dim)[:length]
    v = batch["value_cache"][blocks].reshape(-1, shape.num_kv_heads, shape.head_dim)[:length]
    k, v = (t.repeat_interleave(shape.group, dim=1) for t in (k, v))
    q_s, k_s, v_s = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (batch["query"], k, v))
    return bench_sdpa(q_s, k_s, v_s)


def bench_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, str]:
    """Causal SDPA on the flash backend where this torch has it, else the
    default choice; returns (ms, backend)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(q, k, v, is_causal=True)
            return bench_ms(lambda: sdpa(q, k, v, is_causal=True)), "flash"
    except (ImportError, RuntimeError):
        return bench_ms(lambda: sdpa(q, k, v, is_causal=True)), "default"


def bench_mixed(
    shape: Shape, chunk: int = 8192, decodes: int = 128, contexts: tuple[int, int] = (512, 32768), seed: int = 0,
    split_keys: int = 2048,
) -> dict:
    from fluidserve.kernels import paged_attention as pa

    rng = random.Random(seed)
    q_lens = [chunk] + [1] * decodes
    seq_lens = [chunk] + [rng.randint(*contexts) for _ in range(decodes)]
    batch = make_cache_batch(shape, q_lens, seq_lens)
    result = {}
    plans = (("packed", dict(separate=False)), ("separate", dict(separate=True)), ("unpacked", dict(pack=False)),
             ("split_unpacked", dict(pack=False, kv_chunk=split_keys)))  # fmt: skip
    for name, options in plans:
        plan = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens, **options)
        ms = bench_ms(partial(run_attention, batch, shape, plan))
        result[name] = dict(ms=ms, items=plan.num_items, units=plan.num_units, max_splits=plan.max_splits)
        if plan.decode_part is not None:
            result[name]["decode_units"] = plan.decode_part.num_units
        print(f"mixed {name:14s} {ms:8.3f} ms  items={plan.num_items} units={plan.num_units}")
    chosen = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens)
    result["default"] = "separate" if chosen.decode_part is not None else "packed"
    result["speedup"] = result["unpacked"]["ms"] / result[result["default"]]["ms"]
    # The mixed variant with an alternative prefill tile also spills less in its decode tile's loop.
    for key, alt_name in _prefill_alternatives():
        for name, options in plans[:2]:  # the packed plans: every launch with prefill tiles
            plan = pa.plan_for(batch["query"], batch["key_cache"], q_lens, seq_lens, **options)
            ms = bench_ms(partial(run_attention, batch, shape, plan))
            result[name][f"{key}_ms"] = ms
            print(f"mixed {name:14s} {ms:8.3f} ms  with the prefill tile: {alt_name}")
    return result


def markdown(report: dict) -> str:
    lines = [f"# Kernel benchmarks on {report['device']}", "", f"Config: `{report['config']}`", "",
             f"Device-to-device copy: **{report['copy_gb_s']:.0f} GB/s**", "", "## Decode attention", "",
             "Launched: event-timed launches from Python, one at a time, as eager steps run them. In a graph: "
             "the kernels' GPU time as a CUDA graph replays them, as decode steps run by default (`graph_ms`).",
             "", "| batch | context | launched ms | GB/s | % of copy | in a graph ms | GB/s | % of copy |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['context']} | – | {r['skipped']} | – | – | – | – |")
        else:
            graph = ((f"{r['graph_ms']:.3f}", f"{r['graph_gb_s']:.0f}", f"{r['graph_pct_of_copy']:.1f}")
                     if "graph_ms" in r else ("–",) * 3)  # fmt: skip
            cells = (r["batch"], r["context"], f"{r['ms']:.3f}", f"{r['gb_s']:.0f}", f"{r['pct_of_copy']:.1f}", *graph)
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    after_reads = [r for r in report["decode"] if "read_flush_graph_ms" in r]
    if after_reads:
        lines += ["", "In a graph with L2 emptied by reads instead of writes before each call (`graph_ms(flush="
                  "\"read\")`): no dirty lines for the kernel to write back, as in a decode step, where the kernels "
                  "before attention read weights:", "",
                  "| batch | context | after a write flush ms | after a read flush ms | % of copy | write / read |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['context']} | {r['graph_ms']:.4f} | {r['read_flush_graph_ms']:.4f} | "
                  f"{r['read_flush_graph_pct_of_copy']:.1f} | {r['graph_ms'] / r['read_flush_graph_ms']:.2f}x |"
                  for r in after_reads]
    fp8 = [r for r in report["decode"] if "fp8_graph_ms" in r]
    if fp8:
        lines += ["", "Over an fp8 (e4m3) cache (`--kv-cache-dtype fp8`), in a graph: % of copy on the bytes it "
                  "reads (half the K/V bytes), and its speed against the model-dtype cache's:", "",
                  "| batch | context | ms | % of copy | vs the model dtype's cache |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['context']} | {r['fp8_graph_ms']:.4f} | {r['fp8_graph_pct_of_copy']:.1f} | "
                  f"{r['graph_ms'] / r['fp8_graph_ms']:.2f}x |" for r in fp8]
    short = [r for r in report["decode"] if "short_split_graph_ms" in r]
    if short:
        from fluidserve.kernels import packing

        lines += ["", f"Short steps, in a graph, as planned (pieces of {packing.MIN_KV_CHUNK} keys at least) and "
                  f"split at {SHORT_SPLIT} keys:", "",
                  "| batch | context | pieces | ms | pieces | ms | planned / shorter |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in short:
            cells = (r["batch"], r["context"], max(r["splits"], 1), f"{r['graph_ms']:.4f}",  # 0 splits: one piece
                     max(r["short_split_splits"], 1), f"{r['short_split_graph_ms']:.4f}",
                     f"{r['graph_ms'] / r['short_split_graph_ms']:.2f}x")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    fused = [r for r in report["decode"] if "fused_graph_ms" in r]
    if fused:
        lines += ["", "Split-K pieces merged by the merge kernel (the default) and inside the attention launch "
                  "(`Tiles.fused_merge`), ms:", "",
                  "| batch | context | pieces | launched | fused, launched | in a graph | fused, in a graph "
                  "| graph: merge kernel / fused |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in fused:
            ratio = r["graph_ms"] / r["fused_graph_ms"]
            cells = (r["batch"], r["context"], r["splits"], f"{r['ms']:.4f}", f"{r['fused_ms']:.4f}",
                     f"{r['graph_ms']:.4f}", f"{r['fused_graph_ms']:.4f}", f"{ratio:.2f}x")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    alts = [(key, name) for key, (_, name) in PREFILL_ALTERNATIVES.items()
            if any(f"{key}_ms" in r for r in report["prefill"])]  # a run saves the alternatives it timed
    lines += ["", "## Prefill attention (causal FLOPs)", "",
              "Beside the default tile, the other prefill tiles (their spills per key-loop iteration compiled "
              "for sm_90 in kernels_compile_sm90-triton3.6.md): "
              + ", ".join(name for _, name in alts or [("", "none")]) + ".",
              "", "| length | ours ms | ours TFLOP/s | SDPA ms | SDPA TFLOP/s | vs SDPA"
              + "".join(f" | {name}: ms | vs SDPA" for _, name in alts) + " |",
              "|---:|---:|---:|---:|---:|---:" + "|---:|---:" * len(alts) + "|"]  # fmt: skip
    for r in report["prefill"]:
        alt = [cell for key, _ in alts for cell in ((f"{r[f'{key}_ms']:.3f}", f"{r[f'{key}_vs_sdpa']:.2f}x")
                                                    if f"{key}_ms" in r else ("–", "–"))]  # fmt: skip
        cells = (r["len"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}", f"{r['sdpa_ms']:.3f}", f"{r['sdpa_tflops']:.1f}",
                 f"{r['vs_sdpa']:.2f}x", *alt)  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    m = report["mixed"]
    lines += ["", "## Mixed batch: one 8k prefill chunk + 128 decodes (contexts 512–32k)", "",
              "| plan | ms | items | units" + "".join(f" | ms, prefill tile: {name}" for _, name in alts) + " |",
              "|---|---:|---:|---:" + "|---:" * len(alts) + "|"]
    names = {"packed": "packed (LPT + split-K), one launch",
             "separate": "packed, decode tiles in a launch of their own",
             "unpacked": "unpacked", "split_unpacked": "split-K, one program per piece"}  # fmt: skip
    for key, label in names.items():
        if key in m:  # runs before the two-launch plan have fewer rows
            r = m[key]
            units = f"{r['units']} + {r['decode_units']}" if "decode_units" in r else r["units"]
            alt = "".join(f" | {r[f'{key}_ms']:.3f}" if f"{key}_ms" in r else " | –" for key, _ in alts)
            lines.append(f"| {label} | {r['ms']:.3f} | {r['items']} | {units}{alt} |")
    default = m.get("default", "packed")
    lines += ["", f"The engine's plan ({names[default]}) against no packing: **{m['speedup']:.2f}x**", ""]
    v = report["variants"]
    lines += ["## Compiled variants", "",
              f"Start-up compile (decode-only, mixed, merge): {v['warmup_s']:.1f} s. Specialisation keys after "
              f"warm-up: {v['keys_after_warmup']}; with the alternatives timed beside the engine's variants "
              f"compiled too: {v.get('keys_with_alternatives', '–')}; after the whole sweep: "
              f"{v['keys_after_sweep']}. Kernels Triton compiled after warm-up: {v['triton_after_warmup']}; with "
              f"the alternatives: {v.get('triton_with_alternatives', '–')}; after the sweep: "
              f"{v['triton_after_sweep']}.", "",
              "| variant | programs per SM | units per KV head |", "|---|---:|---:|"]  # fmt: skip
    for o in v["occupancy"]:
        kind = "mixed (decode + prefill tiles)" if o["has_prefill"] else "decode-only"
        lines.append(f"| {kind}, head_dim {o['head_dim']}, group {o['group']} | {o['programs_per_sm']} | "
                     f"{o['units_per_kv_head']} |")  # fmt: skip
    t = report["targets"]
    lines += ["", "## Against the targets", "",
              f"* decode at the longest context measured, largest batch: {t['decode_pct_of_copy']:.1f}% of copy "
              "bandwidth (target >= 85%)",
              f"* decode at the longest context measured, batch 1: {t['decode_batch1_pct_of_copy']:.1f}% of copy "
              "bandwidth launched, " + _pct(t.get("decode_batch1_graph_pct_of_copy")) + " in a graph (target >= 70%)",
              *([f"* decode at 16k context, batch 1: {_pct(t['decode_batch1_16k_pct_of_copy'])} launched, "
                 f"{_pct(t['decode_batch1_16k_graph_pct_of_copy'])} in a graph (target >= 70%)"
                 + (f"; with the split-K merge in the attention launch (`Tiles.fused_merge`): "
                    f"{_pct(t['decode_batch1_16k_fused_graph_pct_of_copy'])} in a graph"
                    if t.get("decode_batch1_16k_fused_graph_pct_of_copy") is not None else "")
                 + (f"; in a graph after a read flush: {_pct(t['decode_batch1_16k_read_flush_graph_pct_of_copy'])}"
                    if t.get("decode_batch1_16k_read_flush_graph_pct_of_copy") is not None else "")]
                if "decode_batch1_16k_pct_of_copy" in t else []),
              f"* prefill at the longest length: {t['prefill_vs_sdpa']:.2f}x SDPA's speed (target >= 1.0x)"
              + "".join(f"; prefill tile, {name}: {ratio:.2f}x"
                        for name, ratio in t.get("prefill_alternatives_vs_sdpa", {}).items()),
              f"* mixed batch: the engine's plan {m['speedup']:.2f}x faster than no packing (target >= 1.1x, or "
              "packing chosen per step only where it wins)", ""]  # fmt: skip
    return "\n".join(lines)


def warm_alternatives(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Compile, as a warm-up would, the variants the sweep times beside the
    engine's (the alternative prefill tiles, the
    decode-only variant with its merge fused, and over an fp8 cache), so that a variant the sweep
    adds beyond these is a recompile while serving."""
    from fluidserve.kernels import paged_attention as pa

    with pa.recording_variants():
        for _ in _prefill_alternatives():
            pa.warmup(query, key_cache, variants=(True,))
        with pa.tiles(fused_merge=True):
            pa.warmup(query, key_cache, variants=(False,))
        pa.warmup(query, torch.empty_like(key_cache, dtype=torch.float8_e4m3fn), variants=(False,))


def variants_report(shape: Shape, warmup_s: float, keys_warm: int, triton_warm: int | None, keys_alt: int,
                    triton_alt: int | None) -> dict:  # fmt: skip
    from fluidserve.kernels import paged_attention as pa

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    occupancy = [dict(o, units_per_kv_head=pa.units_per_kv_head(sms, o["programs_per_sm"], shape.num_kv_heads))
                 for o in pa.occupancies()]  # fmt: skip
    return dict(warmup_s=warmup_s, keys_after_warmup=keys_warm, keys_with_alternatives=keys_alt,
                keys_after_sweep=pa.num_variants(), triton_after_warmup=triton_warm,
                triton_with_alternatives=triton_alt, triton_after_sweep=pa.triton_compiled_count(),
                occupancy=occupancy)  # fmt: skip


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}%"


def targets(report: dict) -> dict:
    decode = [r for r in report["decode"] if "skipped" not in r]
    longest = max(r["context"] for r in decode)
    at_longest = [r for r in decode if r["context"] == longest]
    batch1 = min(at_longest, key=lambda r: r["batch"])
    longest_prefill = max(report["prefill"], key=lambda r: r["len"])
    out = dict(
        decode_pct_of_copy=max(at_longest, key=lambda r: r["batch"])["pct_of_copy"],
        decode_batch1_pct_of_copy=batch1["pct_of_copy"],
        decode_batch1_graph_pct_of_copy=batch1.get("graph_pct_of_copy"),
        prefill_vs_sdpa=longest_prefill["vs_sdpa"],
        prefill_alternatives_vs_sdpa={name: longest_prefill[f"{key}_vs_sdpa"]
                                      for key, (_, name) in PREFILL_ALTERNATIVES.items()
                                      if f"{key}_vs_sdpa" in longest_prefill},
    )
    at_16k = [r for r in decode if r["context"] == 16384 and r["batch"] == 1]
    if at_16k:  # the context the target names
        out.update(decode_batch1_16k_pct_of_copy=at_16k[0]["pct_of_copy"],
                   decode_batch1_16k_graph_pct_of_copy=at_16k[0].get("graph_pct_of_copy"),
                   decode_batch1_16k_fused_graph_pct_of_copy=at_16k[0].get("fused_graph_pct_of_copy"),
                   decode_batch1_16k_read_flush_graph_pct_of_copy=at_16k[0].get("read_flush_graph_pct_of_copy"))
    return out


def decode_bytes_per_token(cfg: dict, context: int, elem: int = 2) -> int:
    """Bytes one decode token must read: every weight but the embedding table
    (one row of it is read), and the KV of ``context`` positions."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_layer = h * (hq * d) * 2 + h * (hkv * d) * 2 + 3 * h * inter + 2 * h  # q,o; k,v; gate,up,down; norms
    from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE

    lm_head = cfg.get("vocab_size", BYTE_VOCAB_SIZE) * h
    kv = 2 * layers * context * hkv * d
    return elem * (layers * per_layer + lm_head + h + kv)




def _graph_replays(llm, kind: str = "replays") -> int | None:
    """Decode steps the engine ran as graph replays (``kind``
    ``direct_replays``: of those, over the direct plans; None: it holds no
    graphs). Read through engine internals, so tolerant of their changing:
    the figure only confirms the graphs path really ran."""
    graphs = getattr(getattr(getattr(llm.engine, "executor", None), "worker", None), "graphs", None)
    replays = getattr(graphs, kind, None)
    return None if replays is None else int(sum(replays.values()))


def bench_batch1_decode_mode(model_dir: Path, settings: dict, prompt_len: int, output_len: int) -> dict:
    """Greedy batch-1 decode through one engine: time per token from two runs
    (1 and ``output_len`` new tokens) so prefill and start-up cancel."""
    import gc

    from fluidserve.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    # swap_space=0: no pinned host pool to allocate; one sequence never swaps.
    llm = LLM(model=str(model_dir), load_format="dummy", device="cuda", dtype="bfloat16", max_num_seqs=1,
              max_model_len=prompt_len + output_len + 16, num_kv_blocks=64, swap_space=0,
              **settings)  # fmt: skip
    startup_s = time.perf_counter() - t0
    prompt = [[5 + (37 * i) % 250 for i in range(prompt_len)]]  # byte-token ids: any vocabulary holds them

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    try:
        run(8)  # warm-up: compiles, allocator
        t_one = min(run(1) for _ in range(3))
        t_many = min(run(output_len) for _ in range(2))
        replays, direct = _graph_replays(llm), _graph_replays(llm, "direct_replays")
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
        # Engines sit in reference cycles: without a collection the first
        # one's 16 GB of weights outlive it while the second loads.
        llm = None  # the run closure holds the engine too
        gc.collect()
        torch.cuda.empty_cache()
    out = dict(**settings, ms_per_token=(t_many - t_one) / (output_len - 1) * 1e3,
               t_one_s=t_one, t_many_s=t_many, startup_s=startup_s, graph_replays=replays,
               direct_replays=direct, steps_launched_ahead=stats.num_steps_launched_ahead)  # fmt: skip
    if "speculative_config" in settings:  # over every run of the mode, warm-up included
        out.update(draft_tokens=stats.spec_num_draft_tokens, drafts_stood=stats.spec_num_accepted_tokens,
                   drafts_withheld=stats.spec_num_withheld_tokens)
    return out


def bench_batch1_decode(
    preset: str = "llama3-8b",
    prompt_len: int = 128,
    output_len: int = 128,
    modes: tuple[str, ...] = tuple(DECODE_MODES),
    on_mode=None,
) -> dict:
    """Batch-1 decode of a ``preset``-shaped dummy model in each of ``modes``
    (eager, then decode CUDA graphs), one engine at a time in this process,
    against the HBM roofline: the bytes one token must read over the copy
    bandwidth measured in the same run. A mode that fails is recorded with
    its error and the others still run; ``on_mode(result)`` is called after
    each mode, so a caller can save what is done before the next one starts."""
    import gc
    import tempfile

    from dummy_models import PRESETS, build_model_dir

    cfg = PRESETS[preset]
    copy_gbs = copy_bandwidth_gbs()
    nbytes = decode_bytes_per_token(cfg, prompt_len + output_len // 2)
    roofline_ms = nbytes / (copy_gbs * 1e9) * 1e3
    torch.cuda.empty_cache()  # the copy's 2 GiB
    result = dict(preset=preset, prompt_len=prompt_len, output_len=output_len, bytes_per_token=nbytes,
                  copy_gb_s=copy_gbs, roofline_ms=roofline_ms, modes={})  # fmt: skip
    print(f"batch-1 decode {preset}: roofline {roofline_ms:.2f} ms/token "
          f"({nbytes / 1e9:.2f} GB at {copy_gbs:.0f} GB/s)")
    with tempfile.TemporaryDirectory() as root:
        build_model_dir(preset, Path(root))
        for mode in modes:
            try:
                with decode_mode(mode) as settings:
                    r = bench_batch1_decode_mode(Path(root), settings, prompt_len, output_len)
                r["vs_roofline"] = r["ms_per_token"] / roofline_ms
                print(f"  {mode:6s}: {r['ms_per_token']:.2f} ms/token, {r['vs_roofline']:.2f}x roofline "
                      f"(target <= 1.3x); start-up {r['startup_s']:.1f} s; graph replays {r['graph_replays']} "
                      f"(direct {r['direct_replays']})")
            except Exception as exc:  # the other mode's figure is still worth having
                r = dict(**DECODE_MODES[mode], error=f"{type(exc).__name__}: {exc}"[:500])
                print(f"  {mode:6s}: {r['error']}")
            if "error" in r:  # what a failed start-up allocated is garbage only now
                gc.collect()
                torch.cuda.empty_cache()
            result["modes"][mode] = r
            ms = {m: v.get("ms_per_token") for m, v in result["modes"].items()}
            if ms.get("eager") and ms.get("graphs"):
                result["eager_over_graphs"] = ms["eager"] / ms["graphs"]
                print(f"  eager / graphs: {result['eager_over_graphs']:.2f}x")
            if on_mode is not None:
                on_mode(result)
    return result


def batch1_markdown(result: dict) -> str:
    lines = [f"# Batch-1 decode on {result['device']}", "",
             f"{result['preset']}-shaped dummy model, bf16, prompt {result['prompt_len']}, {result['output_len']} "
             f"new tokens, greedy; ms/token = (time for {result['output_len']} tokens - time for 1) / "
             f"{result['output_len'] - 1}. HBM roofline {result['roofline_ms']:.2f} ms/token: "
             f"{result['bytes_per_token'] / 1e9:.2f} GB per token at the measured copy bandwidth "
             f"{result['copy_gb_s']:.0f} GB/s (target <= 1.3x).", "",
             "| mode | ms/token | x roofline | engine start-up s | graph replays (direct) |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    names = {"eager": "eager, synchronous (--enforce-eager --no-async-scheduling)",
             "eager-cublas": "eager, synchronous, without the batch-1 row kernels (cuBLAS, separate norms)",
             "eager-no-relaunch": "eager, synchronous, every launch through Triton's JIT path",
             "graphs": "decode CUDA graphs, synchronous (--no-async-scheduling)",
             "graphs-async": "decode CUDA graphs, async scheduling (the default on CUDA)",
             "graphs-fused-merge": "decode CUDA graphs, synchronous, split-K merged in the attention launch",
             "graphs-async-always-merge": "decode CUDA graphs, async scheduling, without the direct graphs "
                                          "(every step merges)",
             "graphs-async-pdl": "decode CUDA graphs, async scheduling, GEMVs as dependent launches "
                                 "(FLUIDSERVE_GEMV_PDL=1)",
             "graphs-async-pdl-l2": "decode CUDA graphs, async scheduling, GEMVs as dependent launches, each "
                                    "program first fetching 64 KiB of its rows into L2 (FLUIDSERVE_GEMV_PDL=l2)",
             "graphs-async-pdl-l2-attention": "as the row above, and the attention lets the o projection start "
                                              "as it begins (Tiles.launch_dependents)",
             "eager-pdl": "eager, synchronous, GEMVs as dependent launches (FLUIDSERVE_GEMV_PDL=1)",
             "graphs-drafts": "decode CUDA graphs, synchronous, n-gram drafts (verifying steps eager)",
             "graphs-async-drafts": "decode CUDA graphs, async scheduling, n-gram drafts (steps without drafts "
                                    "go ahead)",
             "graphs-async-drafts-piecewise": "as the row above, verifying steps as piecewise graphs"}
    for mode, r in result["modes"].items():
        if "error" in r:
            lines.append(f"| {names.get(mode, mode)} | error: {r['error'][:120]} | | | |")
        else:
            replays = "-" if r["graph_replays"] is None else f"{r['graph_replays']} ({r.get('direct_replays', '-')})"
            lines.append(f"| {names.get(mode, mode)} | {r['ms_per_token']:.2f} | {r['vs_roofline']:.2f} | "
                         f"{r['startup_s']:.1f} | {replays} |")
    if "eager_over_graphs" in result:
        lines += ["", f"Eager / graphs: **{result['eager_over_graphs']:.2f}x**."]
    drafted = {m: r for m, r in result["modes"].items() if "draft_tokens" in r}
    if drafted:
        lines += ["", "Drafts over every run of a mode (warm-up included): "
                  + "; ".join(f"{names.get(m, m)}: {r['drafts_stood']} of {r['draft_tokens']} stood, "
                              f"{r['drafts_withheld']} withheld, {r['steps_launched_ahead']} steps went ahead"
                              for m, r in drafted.items()) + "."]
    return "\n".join(lines) + "\n"


# -- MoE experts -------------------------------------------------------------------------

# (model, experts, experts a token, hidden, intermediate) of one MoE layer's routed experts.
MOE_SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768), ("mixtral-8x7b", 8, 2, 4096, 14336)]


def moe_operands(experts: int, top_k: int, hidden: int, inter: int, tokens: int, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """x, w13 [E, 2N, H], w2 [E, H, N], and a router's routing of random
    logits (top-k of the softmax, renormalised, fp32)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn((tokens, experts), generator=gen, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return x, w13, w2, ids, weights / weights.sum(dim=-1, keepdim=True)


def bench_moe(tokens: list[int], device: str = "cuda") -> list[dict]:
    from fluidserve.kernels import moe, reference

    rows = []
    for name, experts, top_k, hidden, inter in MOE_SHAPES:
        for t in tokens:
            args = moe_operands(experts, top_k, hidden, inter, t, device)
            hit = int(args[3].unique().numel())
            weight_bytes = hit * 3 * inter * hidden * args[1].element_size()
            triton, torch_reference = partial(moe.fused_experts, *args), partial(reference.fused_experts, *args)
            triton_ms, in_graph_ms, reference_ms = bench_ms(triton), graph_ms(triton), bench_ms(torch_reference)
            diff = (triton().float() - torch_reference().float()).abs().max()
            rows.append(dict(model=name, experts=experts, top_k=top_k, hidden=hidden, inter=inter, tokens=t,
                             experts_hit=hit, block_m=moe.block_m(t * top_k, experts), triton_ms=triton_ms,
                             graph_ms=in_graph_ms, reference_ms=reference_ms,
                             weight_gb_s=weight_bytes / (in_graph_ms * 1e-3) / 1e9 if in_graph_ms else None,
                             max_abs_diff=float(diff)))  # fmt: skip
            print(f"moe {name} tokens={t}: triton {triton_ms:.3f} ms (graph {in_graph_ms:.3f}), "
                  f"reference {reference_ms:.3f} ms, max |diff| {float(diff):.2e}")
    return rows


# The stored formats ``bench_moe_packed`` times: (label, bits; 0 is e4m3 float8), groups and blocks 128 wide.
MOE_PACKED_FORMATS = [("int4, groups of 128", 4), ("e4m3, blocks of 128", 0)]


def packed_experts_like(w: torch.Tensor, bits: int, seed: int = 1):
    """Random ``reference.PackedExperts`` at dense ``w``'s shape [E, N, K]:
    ``bits``-bit codes (0: e4m3) with a scale a row per 128 features
    (zero points at mid-range), weights of ``w``'s scale, about K^-1/2."""
    from fluidserve.kernels.reference import PackedExperts

    e, n, k = w.shape
    gen = torch.Generator(device=w.device).manual_seed(seed)
    groups, step = k // 128, k**-0.5
    g_idx = (torch.arange(k, device=w.device, dtype=torch.int32) // 128).expand(e, k).contiguous()
    if not bits:
        codes = torch.randn((e, n, k), generator=gen, device=w.device).to(torch.float8_e4m3fn)
        return PackedExperts(codes, torch.full((e, n, groups), step, device=w.device), None, g_idx, 8, 128)
    words = torch.randint(-2**31, 2**31 - 1, (e, n, k * bits // 32), generator=gen, device=w.device,
                          dtype=torch.int64).to(torch.int32)  # fmt: skip
    zeros = torch.full((e, n, groups), 1 << (bits - 1), dtype=torch.uint8, device=w.device)
    return PackedExperts(words, torch.full((e, n, groups), step / (1 << (bits - 1)), device=w.device), zeros, g_idx,
                         bits, 128)  # fmt: skip


def bench_moe_packed(tokens: list[int], device: str = "cuda") -> list[dict]:
    """The experts held as a quantized checkpoint stores them
    (``PackedExperts``) against the same routing over dense bf16 stacks,
    each as a CUDA graph replays it: the stored bytes of the experts hit
    over the time, and dense time / packed time."""
    from fluidserve.kernels import moe, reference

    rows = []
    for name, experts, top_k, hidden, inter in MOE_SHAPES:
        for t in tokens:
            x, w13, w2, ids, weights = moe_operands(experts, top_k, hidden, inter, t, device)
            hit = int(ids.unique().numel())
            dense_ms = graph_ms(partial(moe.fused_experts, x, w13, w2, ids, weights))
            for label, bits in MOE_PACKED_FORMATS:
                p13, p2 = packed_experts_like(w13, bits), packed_experts_like(w2, bits, seed=2)
                packed = partial(moe.fused_experts, x, p13, p2, ids, weights)
                ms = graph_ms(packed)
                stored = sum(w.codes.numel() * w.codes.element_size() + w.scales.numel() * 4 for w in (p13, p2))
                diff = (packed().float() - reference.fused_experts(x, p13, p2, ids, weights).float()).abs().max()
                rows.append(dict(model=name, tokens=t, experts_hit=hit, format=label, dense_graph_ms=dense_ms,
                                 packed_graph_ms=ms, speedup=dense_ms / ms if ms else None,
                                 stored_gb_s=stored * hit / experts / (ms * 1e-3) / 1e9 if ms else None,
                                 max_abs_diff=float(diff)))  # fmt: skip
                print(f"moe packed {name} {label} tokens={t}: {ms:.3f} ms in a graph against {dense_ms:.3f} dense "
                      f"bf16, max |diff| vs reference {float(diff):.2e}")
            del w13, w2
            torch.cuda.empty_cache()
    return rows


def moe_markdown(report: dict) -> str:
    lines = [f"# MoE experts on {report['device']}", "",
             "`ops.fused_experts`, bf16: the Triton path (kernels/moe.py) launched from Python and as a CUDA "
             "graph replays it (`graph_ms`), against the torch reference (reference.fused_experts, the CPU "
             "path: one host sync, then two `F.linear` per expert hit). Weight GB/s: the bytes of the experts "
             f"hit over the graph time (copy: {report['copy_gb_s']:.0f} GB/s). Routing: top-k of a softmax of "
             "random logits.", "",
             "| model | tokens | experts hit | BLOCK_M | Triton ms | in a graph ms | weight GB/s | reference ms "
             "| reference / Triton | max abs diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["moe"]:
        gbs = f"{r['weight_gb_s']:.0f}" if r["weight_gb_s"] else "–"
        lines.append(f"| {r['model']} | {r['tokens']} | {r['experts_hit']} | {r['block_m']} | {r['triton_ms']:.3f} "
                     f"| {r['graph_ms']:.3f} | {gbs} | {r['reference_ms']:.3f} "
                     f"| {r['reference_ms'] / r['triton_ms']:.2f}x | {r['max_abs_diff']:.2e} |")
    if report.get("packed"):
        lines += ["", "## Experts held as stored (`reference.PackedExperts`) against dense bf16", "",
                  "The same routing and activations; random codes (int4 with a scale and zero a row per 128 "
                  "features, or e4m3 with a scale a row per 128-wide block), each side as a CUDA graph replays "
                  "it. Stored GB/s: the codes and scales of the experts hit over the packed time. Max abs diff: "
                  "against the torch reference over the same codes.", "",
                  "| model | tokens | experts hit | format | packed ms | dense bf16 ms | dense / packed | stored GB/s "
                  "| max abs diff |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in report["packed"]:
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "–"
            gbs = f"{r['stored_gb_s']:.0f}" if r["stored_gb_s"] else "–"
            lines.append(f"| {r['model']} | {r['tokens']} | {r['experts_hit']} | {r['format']} "
                         f"| {r['packed_graph_ms']:.3f} | {r['dense_graph_ms']:.3f} | {speed} | {gbs} "
                         f"| {r['max_abs_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def moe_main(args: argparse.Namespace) -> int:
    name = torch.cuda.get_device_name()
    report = dict(device=name, time=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__,
                  copy_gb_s=copy_bandwidth_gbs(), moe=bench_moe(args.moe_tokens))  # fmt: skip
    save_results(args.out / f"moe_{device_slug(name)}", report, moe_markdown(report))  # kept if the packed rows fail
    report["packed"] = bench_moe_packed(args.moe_tokens)
    save_results(args.out / f"moe_{device_slug(name)}", report, moe_markdown(report))
    return 0


def moe_compile_report() -> list[dict]:
    """The MoE experts' launches (the gated GEMM, the down GEMM, the sum
    over slots) at a decode token and a 4096-token prefill of each
    ``MOE_SHAPES`` layer, compiled for sm_90 with the arguments the
    wrapper passes."""
    from fluidserve.kernels import moe

    rows, bf16 = [], torch.bfloat16
    for name, experts, top_k, hidden, inter in MOE_SHAPES:
        for tokens in (1, 4096):
            ids = torch.randint(0, experts, (tokens, top_k))  # the launches are recorded, not run: any routing
            args = (torch.empty((tokens, hidden), dtype=bf16), torch.empty((experts, 2 * inter, hidden), dtype=bf16),
                    torch.empty((experts, hidden, inter), dtype=bf16), ids, torch.rand(tokens, top_k))  # fmt: skip
            for fn, kernel_args, constexprs, options in _launches_of(lambda: moe.fused_experts(*args)):
                res = _compile_offline(fn, kernel_args, constexprs, (), options)
                what = ("gate/up + SiLU-mul" if constexprs.get("GATED") else "down, weighted"
                        if "GATED" in constexprs else "sum over slots")  # fmt: skip
                tile = "x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in constexprs)
                res.update(kernel="moe", variant=f"{name}, {tokens} tokens: {what}" + (f", {tile}" if tile else ""))
                rows.append(res)
                print(f"moe {res['variant']:50s} warps={res['num_warps']} regs={res['registers']} "
                      f"stack={res['stack_bytes']} local={res['local_bytes']} shared={res['shared_bytes']}")
    return rows


# Shapes the offline compile covers: (head_dim, group) of Llama-3-8B, an MHA
# model, a wide GQA group, OPT-2.7B's 80 and a padded 96.
COMPILE_SHAPES = [(128, 4), (128, 1), (64, 8), (80, 1), (96, 4)]


def _compile_offline(fn, args: dict, constexprs: dict, dynamic: tuple[str, ...], options: dict[str, int]) -> dict:
    """Compile one kernel for sm_90 with the signature and divisibility a
    real launch of these arguments gets, and its launch ``options`` (warps,
    and any pipeline depth or register cap), and read its resources."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    elem = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
            torch.int64: "i64", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + elem[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif isinstance(v, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            aligned = name not in dynamic and v % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    t0 = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(options))
    seconds = time.perf_counter() - t0
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{usage}")
    regs, stack, local = map(int, found.groups())
    return dict(registers=regs, stack_bytes=stack, local_bytes=local, shared_bytes=compiled.metadata.shared,
                grid_dependency="griddepcontrol.wait" in compiled.asm["ptx"],
                l2_prefetches=compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2"),
                num_warps=options["num_warps"], compile_s=seconds, tile_buffers=tile_buffers(compiled.asm["ttgir"]),
                wide_accesses=len(re.findall(r"\b(?:LDG|STG)\.E\.128\b", sass)),
                **{f"loop_{kind}": counts for kind, counts in loop_counts(sass).items()})  # fmt: skip


def tile_buffers(ttgir: str) -> int:
    """The most copies of one 2-D tile the software pipeline keeps in
    shared memory (the leading dimension of its tile buffers in Triton's GPU
    IR); 0, a kernel without such buffers. In the attention's key loops, 1
    means each tile is waited for before the next one's load is issued, so
    no load overlaps the loop's arithmetic."""
    return max(map(int, re.findall(r"memdesc<(\d+)x\d+x\d+x[A-Za-z0-9]+, [^>]*mutable>", ttgir)), default=0)


# SASS opcodes counted per key-loop iteration: spill stores and reloads,
# tensor-core products (HGMMA: Hopper's warpgroup MMA; HMMA: the warp-level
# one), and barriers.
LOOP_OPCODES = {"spills": ("LDL", "STL"), "tensor_ops": ("HGMMA", "HMMA"), "barriers": ("BAR",)}


def loop_counts(sass: str) -> dict[str, list[int]]:
    """Instructions of each ``LOOP_OPCODES`` kind in each innermost loop of
    a kernel's SASS, in address order: a loop is the span from a backward
    branch's target to the branch, innermost when it holds no other. For the
    attention kernel those are its key loops (the prefill tile's two,
    without and with the causal test, and the decode tile's), where each
    counts on every iteration; outside them, once per work item."""
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                                                     sass)]  # fmt: skip
    loops = []
    for addr, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?(0x[0-9a-f]+)", sass):
        lo, hi = int(text, 16), int(addr, 16)
        if lo < hi:
            loops.append((lo, hi))
    inner = sorted((lo, hi) for lo, hi in loops
                   if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops))
    counts = {}
    for kind, opcodes in LOOP_OPCODES.items():
        found = [a for a, op in code if op.split(".")[0] in opcodes]
        counts[kind] = [sum(1 for a in found if lo <= a <= hi) for lo, hi in inner]
    return counts


def compile_report(num_kv_heads: int, block_size: int) -> list[dict]:
    """Every attention variant the engine launches, at its default tiles;
    then the mixed variant of a Llama-3-8B head (bf16, 128 wide, group 4) at
    the launch shapes ``attention_tuning.py`` sweeps."""
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim, group in COMPILE_SHAPES:
            for has_prefill in (False, True):
                rows.append(_compile_attention(num_kv_heads, block_size, dtype, head_dim, group, has_prefill))
    for changes in DECODE_SHAPES:
        rows.append(_compile_attention(num_kv_heads, block_size, torch.bfloat16, 128, 4, False, **changes))
    for changes in MIXED_SHAPES:
        rows.append(_compile_attention(num_kv_heads, block_size, torch.bfloat16, 128, 4, True, **changes))
    for cache in (torch.float8_e4m3fn, torch.float8_e5m2):  # --kv-cache-dtype fp8 / fp8_e5m2: K/V widened in the loop
        for has_prefill in (False, True):
            row = _compile_attention(num_kv_heads, block_size, torch.bfloat16, 128, 4, has_prefill, cache_dtype=cache)
            row.update(tuned=True, changes=f"{row['cache_dtype']} cache")
            rows.append(row)
    return rows


# Launch shapes compiled beside the defaults: of the decode-only variant, the
# register cap, the merge inside the launch (alone and under the cap), a
# pipeline deep enough to double-buffer its key loop (alone, with the merge,
# and both under the cap), two warps a program
# (alone, under the cap and double-buffered) and one (16 and 32 keys an
# iteration), and letting the next launch start as it begins; of the mixed variant, keys per step, warps and the prefill
# tile whole or in halves (the tuning sweep's axes).
DECODE_SHAPES = [dict(max_registers=168), dict(fused_merge=True), dict(max_registers=168, fused_merge=True),
                 dict(decode_num_stages=5), dict(decode_num_stages=5, fused_merge=True),
                 dict(decode_num_stages=5, max_registers=168, fused_merge=True), dict(narrow_warps=2),
                 dict(narrow_warps=2, max_registers=168), dict(narrow_warps=2, decode_num_stages=5),
                 dict(narrow_warps=1, block_n=16), dict(narrow_warps=1, block_n=16, decode_num_stages=5),
                 dict(narrow_warps=1, block_n=32), dict(launch_dependents=True)]
MIXED_SHAPES = [dict(prefill_block_n=32), dict(block_n=32), dict(block_n=128), dict(wide_warps=8),
                dict(block_n=128, wide_warps=8), dict(wide_warps=8, mixed_max_registers=128),
                dict(wide_warps=8, mixed_max_registers=168),
                dict(wide_warps=8, mixed_max_registers=128, prefill_block_n=32), dict(prefill_halves=1),
                dict(prefill_halves=1, prefill_block_n=32)]


def _compile_attention(num_kv_heads: int, block_size: int, dtype: torch.dtype, head_dim: int, group: int,
                       has_prefill: bool, cache_dtype: torch.dtype | None = None, **changes: int) -> dict:
    from fluidserve.kernels import paged_attention as pa

    query = torch.empty((1, num_kv_heads * group, head_dim), dtype=dtype)
    cache = torch.empty((4, block_size, num_kv_heads, head_dim), dtype=cache_dtype or dtype)
    tables = torch.zeros((1, 1), dtype=torch.int32)
    with pa.tiles(**changes) as shape:
        plan = pa._empty_plan(query.device, group, has_prefill, None)
        launch = pa._prepare(query[:0], cache, cache, tables, 1.0, plan)
    res = _compile_offline(pa._paged_attention_kernel, launch.args, launch.constexprs, pa._ATTENTION_DYNAMIC,
                           launch.options)
    res.update(kernel="attention", dtype=str(dtype).removeprefix("torch."), head_dim=head_dim, group=group,
               cache_dtype=str(cache.dtype).removeprefix("torch."),
               variant="mixed" if has_prefill else "decode-only", block_n=shape.block_n,
               prefill_block_n=shape.prefill_step, tuned=bool(changes),
               changes=", ".join(f"{k}={v}" for k, v in changes.items()),
               programs_per_sm=pa.occupancy(res["registers"], res["num_warps"], res["shared_bytes"], pa.SmLimits()))
    print(f"{res['dtype']} head_dim={head_dim} group={group} {res['variant']:11s} block_n={shape.block_n} "
          f"prefill_block_n={res['prefill_block_n']} warps={res['num_warps']} regs={res['registers']} "
          f"stack={res['stack_bytes']} shared={res['shared_bytes']} key-loop spills={res['loop_spills']} "
          f"-> {res['programs_per_sm']}/SM ({res['compile_s']:.1f} s)")  # fmt: skip
    return res


# (BLOCK_N, BLOCK_K, warps, gated, norm) of the GEMV compiled offline: the
# engine's, shapes linear_bandwidth.py timed on an H100 (32x512 with two warps
# ran at 8-10% of copy there), the gate/up launch with SiLU-mul fused, at the
# engine's shape (BLOCK_N / 2 rows of each half) and a full BLOCK_N, and the
# batch-1 layer's launches with the RMSNorm in the prologue (qkv, gate/up).
GEMV_SHAPES = [(16, 512, 4, False, False), (4, 512, 4, False, False), (8, 512, 4, False, False),
               (32, 512, 4, False, False), (16, 256, 4, False, False), (32, 512, 2, False, False),
               (16, 512, 2, False, False), (8, 512, 4, True, False), (16, 512, 4, True, False),
               (16, 512, 4, False, True), (8, 512, 4, True, True)]  # fmt: skip


def gemv_compile_report() -> list[dict]:
    """Every ``GEMV_SHAPES`` launch, then the engine's four again launched
    as programmatic dependents in each mode (kernels/gemv.py: the first
    weight step loaded before the wait for the kernel before; "l2", after
    a bulk prefetch of more of the program's rows into L2)."""
    from fluidserve.kernels import gemv

    rows = []
    x, y = torch.empty((1, 4096), dtype=torch.bfloat16), torch.empty((1, 4096), dtype=torch.bfloat16)
    engine = [s for s in GEMV_SHAPES if _engine_gemv(gemv, *s)]
    for shape, mode in [(s, "off") for s in GEMV_SHAPES] + [(s, m) for m in ("on", "l2") for s in engine]:
        block_n, block_k, warps, gated, norm = shape
        w = torch.empty((2 * 4096 if gated else 4096, 4096), dtype=torch.bfloat16)
        args = dict(x_ptr=x, w_ptr=w, bias_ptr=y, residual_ptr=y, norm_ptr=y, y_ptr=y, N=4096, K=4096,
                    stride_wn=4096, eps=1e-5)  # fmt: skip
        chained = gemv.chain_options(mode, False, 4096, block_n * (2 if gated else 1), w)
        options = dict(num_warps=warps, **{k: v for k, v in chained.items() if k == "launch_pdl"})
        constexprs = dict(HAS_BIAS=False, HAS_RESIDUAL=not (gated or norm), ROUND_BEFORE_RESIDUAL=False,
                          GATED=gated, NORM=norm, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_D=4096 if norm else 1,
                          PREFETCH=False, GDC=False, L2_K=0, L2_PART_BYTES=0)  # fmt: skip
        constexprs.update({k: v for k, v in chained.items() if k in constexprs})
        res = _compile_offline(gemv._gemv_kernel, args, constexprs, (), options)
        suffix = {"on": ", dependent launch", "l2": ", dependent launch, L2 prefetch"}.get(
            mode, " (the engine's)" if shape in engine else "")
        res.update(kernel="gemv", dependent=mode != "off", mode=mode,
                   variant=f"{block_n}x{block_k}/{warps}" + (", RMSNorm prologue" if norm else "")
                   + (", gate/up + SiLU-mul" if gated else "") + suffix)  # fmt: skip
        rows.append(res)
        print(f"gemv {res['variant']:24s} regs={res['registers']} stack={res['stack_bytes']} "
              f"local={res['local_bytes']} grid dependency={res['grid_dependency']} ({res['compile_s']:.1f} s)")
    return rows


# Llama-3-8B's batch-1 row launches: (name, weight rows, K, gated, normed,
# residual) of the qkv (RMSNorm in the prologue), o (plus the residual into
# a fresh output), gate/up (normed, SiLU-mul) and down (the residual in
# place) projections, and the packed formats their GEMVs are compiled in,
# every ``gemv.PACKED_BLOCK_K`` entry among them: (label, bits, group_size,
# float8), group_size 0 being one group of all K (a scale a row).
GEMV_PACKED_SHAPES = [("qkv", 6144, 4096, False, True, False), ("o", 4096, 4096, False, False, True),
                      ("gate/up", 2 * 14336, 4096, True, True, False), ("down", 4096, 14336, False, False, True)]
GEMV_PACKED_FORMATS = [("int4, plain groups of 128", 4, 128, False), ("int4, act-order", 4, None, False),
                       ("int8, plain groups of 128", 8, 128, False), ("int8, act-order", 8, None, False),
                       ("e4m3, blocks of 128", 8, 128, True), ("e4m3, gathered", 8, None, True),
                       ("e4m3, a scale a row", 8, 0, True)]


def gemv_packed_compile_report(formats: list[tuple[str, int, int | None, bool]] | None = None,
                               k_steps: tuple[int | None, ...] = (None,)) -> list[dict]:  # fmt: skip
    """The batch-1 GEMV over packed weights (kernels/gemv.py,
    ``reference.PackedLinear``) at each ``GEMV_PACKED_SHAPES`` launch in
    each of ``formats`` (default ``GEMV_PACKED_FORMATS``), bf16, as
    ``gemv.launch`` launches them, compiled for sm_90: at the engine's K
    step (None) or each of ``k_steps`` (the sweep ``gemv.PACKED_BLOCK_K``
    was chosen from)."""
    from fluidserve.kernels import gemv
    from fluidserve.kernels.launch import cdiv
    from fluidserve.kernels.reference import PackedLinear

    rows, bf16 = [], torch.bfloat16
    for label, bits, size, fp8 in formats or GEMV_PACKED_FORMATS:
        for name, n, k, gated, normed, residual in GEMV_PACKED_SHAPES:
            group_size = k if size == 0 else size
            groups = cdiv(k, group_size or 128)  # the launches are recorded, not run: empty tensors of the real shapes
            codes = (torch.empty((n, k), dtype=torch.float8_e4m3fn) if fp8
                     else torch.empty((n, k * bits // 32), dtype=torch.int32))  # fmt: skip
            zeros = None if fp8 else torch.empty((n, groups), dtype=torch.uint8)
            w = PackedLinear(codes, torch.empty((n, groups)), zeros, torch.empty(k, dtype=torch.int32), bits,
                             group_size)  # fmt: skip
            x = torch.empty((1, k), dtype=bf16)
            into = torch.empty((1, n), dtype=bf16) if residual else None
            norm = (torch.empty(k, dtype=bf16), 1e-5) if normed else None
            for step in k_steps:
                call = partial(gemv.launch, x, w, None, into, out=None if name != "o" else torch.empty_like(into),
                               k_step=step, gated=gated, norm=norm, round_before_residual=name == "o")  # fmt: skip
                (fn, kernel_args, constexprs, options), = _launches_of(call)
                res = _compile_offline(fn, kernel_args, constexprs, (), options)
                tile = f"{constexprs['BLOCK_N']}x{constexprs['BLOCK_K']}"
                res.update(kernel="gemv_packed", format=label, shape=name, block_k=constexprs["BLOCK_K"],
                           engine=step is None, variant=f"{label}, {name} {n}x{k}, {tile}")  # fmt: skip
                rows.append(res)
                print(f"gemv_packed {res['variant']:52s} warps={res['num_warps']} regs={res['registers']} "
                      f"stack={res['stack_bytes']} local={res['local_bytes']} ({res['compile_s']:.1f} s)")
    return rows


def int_linear_compile_report() -> list[dict]:
    """kernels/int_linear.py's launches on a Llama-3-8B o projection (4096 x
    4096, groups of 128, bf16): the fused kernel at 1, 16 and 32 rows and
    the dequantizing one, 4 and 8 bits, plain groups (scales per word) and
    act-order ones (gathered per code), as the wrappers launch them."""
    from fluidserve.kernels import int_linear

    rows, n, k, groups = [], 4096, 4096, 32
    scales, zeros = torch.empty((n, groups)), torch.empty((n, groups), dtype=torch.uint8)
    g_idx = torch.empty(k, dtype=torch.int32)
    for bits in int_linear.BITS:
        codes = torch.empty((n, k * bits // 32), dtype=torch.int32)
        for group_size in (128, None):
            _compile_weight_launches(rows, int_linear.int_linear, int_linear.dequantize, (codes, scales, zeros, g_idx,
                                     bits), k, group_size, f"int{bits}",
                                     "plain groups" if group_size else "act-order")  # fmt: skip
    return rows


def fp8_linear_compile_report() -> list[dict]:
    """kernels/fp8_linear.py's launches on a Llama-3-8B o projection (4096 x
    4096, bf16), e4m3 and e5m2: the fused kernel at 1, 16 and 32 rows and
    the dequantizing one, with 128-wide blocks' scales read per run
    (``group_size=128``), one scale a row (G = 1) and scales gathered
    through ``g_idx``, as the wrappers launch them."""
    from fluidserve.kernels import fp8_linear

    rows, n, k = [], 4096, 4096
    g_idx = torch.empty(k, dtype=torch.int32)
    for dtype in fp8_linear.FP8_DTYPES:
        weight = torch.empty((n, k), dtype=dtype)
        for groups, group_size, label in ((32, 128, "blocks of 128"), (1, k, "a scale a row"),
                                          (32, None, "gathered")):  # fmt: skip
            _compile_weight_launches(rows, fp8_linear.fp8_linear, fp8_linear.dequantize,
                                     (weight, torch.empty((n, groups)), g_idx), k, group_size,
                                     str(dtype).removeprefix("torch.float8_"), label)  # fmt: skip
    return rows


def _compile_weight_launches(rows: list[dict], fused, dequantize, args: tuple, k: int, group_size: int | None,
                             kind: str, label: str) -> None:  # fmt: skip
    """A stored-weight linear's launches (the fused kernel at 1, 16 and 32
    rows, and the dequantizing one) compiled for sm_90, into ``rows``."""
    xs = {f"{m} row{'s' * (m > 1)}": torch.empty((m, k), dtype=torch.bfloat16) for m in (1, 16, 32)}
    calls = [(what, partial(fused, x, *args, group_size=group_size)) for what, x in xs.items()]
    calls.append(("dequantize", partial(dequantize, *args, torch.bfloat16, group_size=group_size)))
    for what, call in calls:
        (fn, kernel_args, constexprs, options), = _launches_of(call)
        res = _compile_offline(fn, kernel_args, constexprs, (), options)
        tile = "x".join(str(constexprs[c]) for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "RUN") if c in constexprs)
        res.update(kernel=fused.__name__, variant=f"{kind}, {what}, {label}, {tile}")
        rows.append(res)
        print(f"{res['kernel']} {res['variant']:48s} warps={res['num_warps']} regs={res['registers']} "
              f"stack={res['stack_bytes']} local={res['local_bytes']} ({res['compile_s']:.1f} s)")


def moe_packed_compile_report() -> list[dict]:
    """The MoE experts' GEMMs over ``reference.PackedExperts`` (kernels/moe.py:
    the gated gate/up GEMM and the weighted down GEMM) at a Qwen3-30B-A3B
    layer's shape (128 experts, 8 a token, hidden 2048, intermediate 768,
    bf16), at a decode token and a 4096-token prefill: int4 with 128-wide
    groups (scales read per word) and act-order (gathered per code), int8
    with 128-wide groups, e4m3 in 128-wide blocks (scales read per run and
    gathered), as the wrapper launches them, compiled for sm_90."""
    from fluidserve.kernels import moe
    from fluidserve.kernels.reference import PackedExperts

    name, experts, top_k, hidden, inter = MOE_SHAPES[0]
    rows, bf16 = [], torch.bfloat16

    def packed(n: int, k: int, bits: int, group_size: int | None, fp8: bool) -> PackedExperts:
        groups = k // 128
        if fp8:  # the launches are recorded, not run: empty tensors of the real shapes
            return PackedExperts(torch.empty((experts, n, k), dtype=torch.float8_e4m3fn),
                                 torch.empty((experts, n, groups)), None,
                                 torch.empty((experts, k), dtype=torch.int32), 8, group_size)  # fmt: skip
        return PackedExperts(torch.empty((experts, n, k * bits // 32), dtype=torch.int32),
                             torch.empty((experts, n, groups)), torch.empty((experts, n, groups), dtype=torch.uint8),
                             torch.empty((experts, k), dtype=torch.int32), bits, group_size)  # fmt: skip

    formats = [("int4, plain groups", 4, 128, False), ("int4, act-order", 4, None, False),
               ("int8, plain groups", 8, 128, False), ("e4m3, blocks of 128", 8, 128, True),
               ("e4m3, gathered", 8, None, True)]  # fmt: skip
    for label, bits, group_size, fp8 in formats:
        w13 = packed(2 * inter, hidden, bits, group_size, fp8)
        w2 = packed(hidden, inter, bits, group_size, fp8)
        for tokens in (1, 4096):
            ids = torch.randint(0, experts, (tokens, top_k))  # any routing: the launches' shapes follow the sizes
            x = torch.empty((tokens, hidden), dtype=bf16)
            call = partial(moe.fused_experts, x, w13, w2, ids, torch.rand(tokens, top_k))
            for fn, kernel_args, constexprs, options in _launches_of(call):
                if fn is not moe._expert_gemm_kernel:
                    continue
                res = _compile_offline(fn, kernel_args, constexprs, (), options)
                what = "gate/up + SiLU-mul" if constexprs["GATED"] else "down, weighted"
                tile = "x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
                res.update(kernel="moe", format=label, tokens=tokens, gated=constexprs["GATED"],
                           variant=f"{name}, {label}, {tokens} tokens: {what}, {tile}")  # fmt: skip
                rows.append(res)
                print(f"moe {res['variant']:72s} warps={res['num_warps']} regs={res['registers']} "
                      f"stack={res['stack_bytes']} local={res['local_bytes']} ({res['compile_s']:.1f} s)")
    return rows


def _engine_gemv(gemv, block_n: int, block_k: int, warps: int, gated: bool, norm: bool) -> bool:
    """Whether this is the launch shape the engine gives a Llama-3-8B GEMV."""
    return (block_n, block_k, warps) == (gemv.BLOCK_N // 2 if gated else gemv.BLOCK_N, gemv.MAX_BLOCK_K,
                                         gemv.NUM_WARPS)  # fmt: skip


def _launches_of(call: Callable[[], Any]) -> list[tuple[Any, dict, dict, dict]]:
    """The Triton launches ``call`` makes through ``Relaunch``, recorded
    instead of run (CPU tensors, no GPU): each as (kernel, runtime arguments
    by name, constexprs with their defaults filled in, launch options), the
    arguments the wrapper computes for a real launch, at a GPU's launch
    shapes (off CUDA the wrappers give the interpreter bigger tiles)."""
    from fluidserve.kernels import gemv, launch
    from fluidserve.kernels.launch import Relaunch

    seen = []

    def record(self: Relaunch, grid: Any, args: tuple, kwargs: dict) -> None:
        params = self.fn.params
        runtime = [p.name for p in params if not p.is_constexpr]
        constexprs = {p.name: kwargs.get(p.name, p.default) for p in params if p.is_constexpr}
        options = {"num_warps": 4, **{k: v for k, v in kwargs.items() if k not in constexprs}}  # Triton's default
        seen.append((self.fn, dict(zip(runtime, args, strict=True)), constexprs, options))

    shapes = launch.INTERPRETER_ROWS, gemv.INTERPRETER_BLOCK_N
    real, Relaunch.launch = Relaunch.launch, record
    launch.INTERPRETER_ROWS, gemv.INTERPRETER_BLOCK_N = 1, None
    try:
        call()
    finally:
        Relaunch.launch = real
        launch.INTERPRETER_ROWS, gemv.INTERPRETER_BLOCK_N = shapes
    return seen


def row_compile_report() -> list[dict]:
    """The eager layer's other Triton kernels (RMSNorm with and without the
    residual add, SiLU-mul, rope with the KV write, the cache write, the
    swap's block copies, the split-K merge), compiled for sm_90 with the arguments their
    wrappers pass at a Llama-3-8B decode token (bf16, 32 query and 8 KV
    heads of 128, hidden 4096, intermediate 14336, 16-token blocks). None
    of them needs a GPU to compile, so a kernel that will not build under a
    Triton is caught here, before a GPU run."""
    from fluidserve.kernels import activation, cache_ops, fused_norm, rope_cache

    bf16 = torch.bfloat16
    x, residual = torch.empty((1, 4096), dtype=bf16), torch.empty((1, 4096), dtype=bf16)
    weight = torch.empty(4096, dtype=bf16)
    qkv = torch.empty((1, 6144), dtype=bf16)  # the fused QKV projection's output, split by views as the layer does
    q, k, v = qkv[:, :4096].view(1, 32, 128), qkv[:, 4096:5120].view(1, 8, 128), qkv[:, 5120:].view(1, 8, 128)
    cos, sin = torch.empty((1, 128), dtype=bf16), torch.empty((1, 128), dtype=bf16)
    key_cache, value_cache = (torch.empty((64, 16, 8, 128), dtype=bf16) for _ in range(2))
    fp8_caches = [torch.empty((64, 16, 8, 128), dtype=torch.float8_e4m3fn) for _ in range(2)]
    e5m2_caches = [torch.empty((64, 16, 8, 128), dtype=torch.float8_e5m2) for _ in range(2)]
    slots, ids = torch.zeros(1, dtype=torch.int64), torch.arange(4, dtype=torch.int64)
    cases = [
        ("rms_norm", "residual add + RMSNorm", lambda: fused_norm.rms_norm(x, weight, 1e-5, residual)),
        ("rms_norm", "RMSNorm", lambda: fused_norm.rms_norm(x, weight, 1e-5)),
        ("silu_and_mul", "[1, 2 x 14336]", lambda: activation.silu_and_mul(torch.empty((1, 28672), dtype=bf16))),
        ("rope_and_cache", "q, k rotated, k and v cached",
         lambda: rope_cache.rope_and_cache(q, k, v, cos, sin, key_cache, value_cache, slots)),
        ("rope_and_cache", "q, k normed per head (Qwen3), rotated",
         lambda: rope_cache.rope_and_cache(q, k, v, cos, sin, key_cache, value_cache, slots,
                                           (weight[:128], weight[128:256], 1e-6))),
        ("reshape_and_cache", "k and v cached",
         lambda: cache_ops.reshape_and_cache(k, v, key_cache, value_cache, slots)),
        ("rope_and_cache", "q, k rotated, k and v cached in fp8 (e4m3)",
         lambda: rope_cache.rope_and_cache(q, k, v, cos, sin, *fp8_caches, slots)),
        ("reshape_and_cache", "k and v cached in fp8 (e5m2)",
         lambda: cache_ops.reshape_and_cache(k, v, *e5m2_caches, slots)),
        ("copy_blocks", "gather (swap out)", lambda: cache_ops.gather_blocks(key_cache, ids)),
        ("copy_blocks", "scatter (swap in)",
         lambda: cache_ops.scatter_blocks(torch.empty((4, 16, 8, 128), dtype=bf16), key_cache, ids)),
    ]
    rows = []
    for kernel, variant, call in cases:
        (fn, args, constexprs, options), = _launches_of(call)
        res = _compile_offline(fn, args, constexprs, (), options)
        res.update(kernel=kernel, variant=variant)
        rows.append(res)
    rows.append(_compile_merge(8, 16, bf16, 128, 4))
    rows.append(_compile_merge(8, 16, bf16, 128, 4, launch_dependents=True))
    for res in rows:
        print(f"{res['kernel']} {res['variant']:30s} warps={res['num_warps']} regs={res['registers']} "
              f"stack={res['stack_bytes']} local={res['local_bytes']} ({res['compile_s']:.1f} s)")
    return rows


def _compile_merge(num_kv_heads: int, block_size: int, dtype: torch.dtype, head_dim: int, group: int,
                   launch_dependents: bool = False) -> dict:  # fmt: skip
    """The split-K merge kernel (a decode step with split rows runs it),
    with the arguments the attention's launcher passes it."""
    from fluidserve.kernels import paged_attention as pa

    query = torch.empty((1, num_kv_heads * group, head_dim), dtype=dtype)
    cache = torch.empty((4, block_size, num_kv_heads, head_dim), dtype=dtype)
    plan = pa._empty_plan(query.device, group, False, None)
    with pa.tiles(launch_dependents=launch_dependents):
        launch = pa._prepare(query[:0], cache, cache, torch.zeros((1, 1), dtype=torch.int32), 1.0, plan)
    launch = launch.with_tensors(launch.args, torch.empty_like(query))
    res = _compile_offline(pa._merge_kernel, pa._merge_args(launch, plan), pa._merge_constexprs(launch),
                           pa._MERGE_DYNAMIC, dict(num_warps=pa.MERGE_WARPS))
    res.update(kernel="merge", variant=f"split-K merge, head {head_dim}"
               + (", lets the next launch start" if launch_dependents else ""))  # fmt: skip
    return res


# The per-key-loop columns of the compile report (``loop_counts``, saved as
# ``loop_<kind>``), each a list over the kernel's key loops; reports saved
# before a column existed show –.
LOOP_COLUMNS = {f"loop_{kind}": name for kind, name in zip(LOOP_OPCODES, ("spills", "tensor-core", "barriers"),
                                                             strict=True)}
LOOP_HEADER = " | ".join(f"{name} per key-loop iteration" for name in LOOP_COLUMNS.values()) + " | tile buffers"


def loop_cells(r: dict) -> list[str]:
    """A compiled variant's per-key-loop counts, one cell a kind (``a / b /
    c``), then its deepest tile buffer."""
    return [*(" / ".join(map(str, r[key])) if key in r else "–" for key in LOOP_COLUMNS), r.get("tile_buffers", "–")]


# The compile report's sections after the attention's: (the rows' ``kernel``,
# None for every kernel no other section takes; title; what the rows are;
# the columns before the resources, header -> row key).
_LAUNCH = {"launch": "variant", "warps": "num_warps"}
RESOURCE_SECTIONS = [
    ("gemv", "Batch-1 GEMV (kernels/gemv.py), bf16, with what it fuses (residual, RMSNorm, SiLU-mul)",
     "BLOCK_N x BLOCK_K / warps (gated: BLOCK_N rows of the gate half and as many of the up half). Stack and "
     "local bytes are spills: a shape that spills reads its accumulator back from memory on every step. "
     "Dependent launches (`FLUIDSERVE_GEMV_PDL`): the grid-dependency wait in the code, and the bulk L2 "
     "prefetch instructions in it (one per weight half).",
     {"launch shape": "variant", "wait": "grid_dependency", "L2 prefetches": "l2_prefetches"}),
    ("gemv_packed",
     "Batch-1 GEMV over packed weights (kernels/gemv.py, `PackedLinear`), bf16, Llama-3-8B's row launches",
     "The qkv (RMSNorm prologue), o (residual into a fresh output), gate/up (RMSNorm, SiLU-mul) and down "
     "(residual in place) launches over int and float8 codes, BLOCK_N x BLOCK_K as `gemv.launch` picks them "
     "(the K step: `gemv.PACKED_BLOCK_K`). Plain groups, blocks and a scale a row read scales per word or "
     "run; act-order and gathered ones per code, through g_idx.", _LAUNCH),
    (None, "The layer's other kernels, at a Llama-3-8B decode token (bf16)",
     "Each compiled with the arguments its wrapper passes (kernels/fused_norm.py, activation.py, "
     "rope_cache.py, cache_ops.py, and paged_attention.py's split-K merge).",
     {"kernel": "kernel", **_LAUNCH}),
    ("int_linear", "Weight-only int linears (kernels/int_linear.py), bf16, 4096 x 4096",
     "The fused kernel at 1 row (a multiply-and-sum per lane) and at 16 and 32 (tl.dot), and the dequantizing "
     "kernel; BLOCK_M x BLOCK_N x BLOCK_K. Plain groups of 128 read scales per word, act-order ones gather "
     "them per code.", _LAUNCH),
    ("fp8_linear", "Float8 linears (kernels/fp8_linear.py), bf16, 4096 x 4096",
     "The fused kernel at 1 row (a multiply-and-sum per lane) and at 16 and 32 (tl.dot), and the dequantizing "
     "kernel; BLOCK_M x BLOCK_N x BLOCK_K x RUN (features a scale covers in a tile). Blocks of 128 and a "
     "scale a row read a scale per row and run; gathered scales are read per weight through g_idx.", _LAUNCH),
    ("moe", "MoE experts (kernels/moe.py), bf16",
     "The three launches of `ops.fused_experts` on the Triton lane, BLOCK_M x BLOCK_N x BLOCK_K as the "
     "wrapper picks them for the shape (gate/up: BLOCK_N columns of the gate half and as many of the up "
     "half).", _LAUNCH),
]
# The kernels whose rows have a section of their own (attention's, above the table's).
_SECTION_KERNELS = {None, "attention", *(kernel for kernel, *_ in RESOURCE_SECTIONS if kernel is not None)}


def compile_markdown(rows: list[dict], triton_version: str) -> str:
    lines = ["# Triton kernels compiled for sm_90, no GPU", "",
             f"Triton {triton_version}; registers, stack and local memory from the cubin (cuobjdump), occupancy "
             "from paged_attention.occupancy with an H100 SM's limits (64K registers, 2048 threads, 228 KiB "
             "shared). Stack bytes are registers spilled to memory. Spills per key-loop iteration: the "
             "local-memory instructions (spill stores and reloads) a thread runs in each key loop, where a "
             "spill costs its traffic on every iteration (the mixed variant's loops: the prefill tile's without "
             "and with the causal test, then the decode tile's; the decode-only variant has the last). In the "
             "same loops, per thread: tensor-core instructions (HGMMA, Hopper's warpgroup products, or HMMA, "
             "the warp-level ones; none would mean the loop lost the tensor cores) and barriers (BAR: every "
             "warp of the program waits at each; programs sharing an SM never wait for one another). Tile buffers: "
             "the most copies of one K/V tile the software pipeline keeps in shared memory; at 1 every load is "
             "waited for before the next is issued, and none overlaps the arithmetic.",
             "", "| dtype | head_dim | group | variant | warps | registers | stack B | shared B | local B "
             f"| programs/SM | {LOOP_HEADER} |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    attention = [r for r in rows if r.get("kernel", "attention") == "attention"]

    def cells(r: dict, *first: object) -> str:
        return "| " + " | ".join(map(str, (*first, r["num_warps"], r["registers"], r.get("stack_bytes", "–"),
                                           r["shared_bytes"], r["local_bytes"], r["programs_per_sm"],
                                           *loop_cells(r)))) + " |"

    lines += [cells(r, r["dtype"], r["head_dim"], r["group"], r["variant"]) for r in attention if not r.get("tuned")]
    tuned = [r for r in attention if r.get("tuned") or (r["dtype"] == "bfloat16"
                                                        and (r["head_dim"], r["group"]) == (128, 4))]
    tuned.sort(key=lambda r: (r["variant"] == "mixed", bool(r.get("tuned"))))  # each variant's default first
    if len(tuned) > 2:
        lines += ["", "## Other launch shapes (bf16, head_dim 128, group 4)", "",
                  "| variant | launch shape | keys per step (decode / prefill tile) | warps | registers | stack B "
                  f"| shared B | local B | programs/SM | {LOOP_HEADER} |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [cells(r, r["variant"], r.get("changes") or "default",
                        f"{r.get('block_n', '–')} / {r.get('prefill_block_n', r.get('block_n', '–'))}")
                  for r in tuned]
    for kernel, title, intro, named in RESOURCE_SECTIONS:
        picked = [r for r in rows if (r.get("kernel") == kernel if kernel is not None
                                      else r.get("kernel") not in _SECTION_KERNELS)]  # fmt: skip
        if picked:
            lines += _resource_section(title, intro, named, picked)
    return "\n".join(lines) + "\n"


def _resource_section(title: str, intro: str, named: dict[str, str], rows: list[dict]) -> list[str]:
    """A markdown section: the ``named`` columns (header -> row key), then
    each kernel's registers, shared memory and spills."""
    columns = {**named, "registers": "registers", "shared B": "shared_bytes", "stack B": "stack_bytes",
               "local B": "local_bytes"}
    align = ["---" if key in ("kernel", "variant") else "---:" for key in columns.values()]
    return ["", f"## {title}", "", intro, "", "| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(str(r.get(key, "–")) for key in columns.values()) + " |" for r in rows)]


def compile_main(args: argparse.Namespace) -> int:
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("--compile-only compiles; unset TRITON_INTERPRET", file=sys.stderr)
        return 1
    import triton

    rows = (compile_report(args.num_kv_heads, args.block_size) + gemv_compile_report() + gemv_packed_compile_report()
            + row_compile_report() + moe_compile_report() + moe_packed_compile_report() + int_linear_compile_report()
            + fp8_linear_compile_report())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernels_compile_sm90{args.tag}"  # the tag may hold a dot: no with_suffix
    Path(f"{stem}.json").write_text(json.dumps(dict(triton=triton.__version__, variants=rows), indent=2))
    Path(f"{stem}.md").write_text(compile_markdown(rows, triton.__version__))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def batch1_main(args: argparse.Namespace) -> int:
    name = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"batch1_decode_{device_slug(name)}"
    head = dict(device=name, time=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__)

    def save(result: dict) -> None:  # after each mode: a run cut off later keeps it
        record = {**head, **result}
        stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
        stem.with_suffix(".md").write_text(batch1_markdown(record))

    result = bench_batch1_decode(modes=tuple(args.decode_modes), on_mode=save)
    print(f"wrote {stem}.json and {stem}.md")
    return 1 if any("error" in r for r in result["modes"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_main(args)
    if not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py needs a CUDA GPU (none found); nothing measured.", file=sys.stderr)
        return 1
    if args.batch1_decode:
        return batch1_main(args)
    if args.moe:
        return moe_main(args)
    from fluidserve.kernels import packing
    from fluidserve.kernels import paged_attention as pa

    shape = Shape(args.num_kv_heads, args.group, args.head_dim, args.block_size, getattr(torch, args.dtype))
    name = torch.cuda.get_device_name()
    print(f"device: {name}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s")
    # Start-up: compile the fixed variant set once, as the engine's first step does.
    probe = make_cache_batch(shape, [1], [shape.block_size])
    t0 = time.perf_counter()
    with pa.recording_variants():
        pa.warmup(probe["query"], probe["key_cache"])
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    keys_warm, triton_warm = pa.num_variants(), pa.triton_compiled_count()
    print(f"warm-up: {warmup_s:.1f} s, {keys_warm} variants; occupancy {pa.occupancies()}")
    warm_alternatives(probe["query"], probe["key_cache"])
    keys_alt, triton_alt = pa.num_variants(), pa.triton_compiled_count()
    report = dict(
        device=name,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        torch=torch.__version__,
        config={**asdict(shape), "dtype": args.dtype},
        copy_gb_s=copy_gbs,
        plan_costs=dataclasses.asdict(packing.PLAN_COSTS),  # the costs LPT balanced by
        lpt_costs=packing.LPT_COSTS,  # how the timed plans were balanced (plan_model.py rebuilds them so)
        decode=bench_decode(shape, args.batch_sizes, args.contexts, copy_gbs),
        prefill=bench_prefill(shape, args.prefill_lens),
        mixed=bench_mixed(shape),
    )
    report["variants"] = variants_report(shape, warmup_s, keys_warm, triton_warm, keys_alt, triton_alt)
    report["targets"] = targets(report)
    print(f"variants: {report['variants']}")
    print(f"targets: {report['targets']}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kernels_{device_slug(name)}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
