"""Decode attention against the size of its persistent grid: every program
resident at once, or one unit a KV head more, which leaves a few programs
for a second wave; each with the planner's cut of rows into whole waves
(``packing.auto_kv_chunk``) and with rows left whole.

The grid's units a KV head are ``paged_attention.units_per_kv_head``:
SMs x programs per SM // KV heads, rounded down. Rounded up, an H200's 132
SMs x 3 decode programs over 8 heads give 50 units, 400 programs for 396
slots; a program past the slots starts only when one of the first wave
ends, so its unit's work runs after the busiest unit, not beside it.

Each point is timed as a CUDA graph replays it (``kernel_bench.graph_ms``),
as a percentage of the device-to-device copy bandwidth measured in the same
run, counting the K and V bytes read.

    python benchmarks/decode_grid.py [--shapes 64x16384 128x16384 ...]

Writes ``decode_grid_<device>.json`` and ``.md`` to ``--out``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import save_results  # noqa: E402
from kernel_bench import (  # noqa: E402
    RESULTS_DIR, Shape, copy_bandwidth_gbs, device_slug, graph_ms, make_cache_batch, run_attention,
)

SHAPES = ["8x16384", "32x16384", "40x16384", "48x16384", "64x16384", "100x16384", "128x16384", "256x8192"]


@contextmanager
def whole_rows():
    """The planner without the cut into whole waves: decode rows stay whole
    once there are more rows than units."""
    from fluidserve.kernels import packing

    saved = packing.WAVE_SPLITS
    packing.WAVE_SPLITS = np.array([1], dtype=np.int64)
    try:
        yield
    finally:
        packing.WAVE_SPLITS = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="BATCHxCONTEXT")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_grid: needs CUDA", file=sys.stderr)
        return 1
    from fluidserve.kernels import paged_attention as pa

    shape = Shape(num_kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16)
    copy = copy_bandwidth_gbs()
    rows = []
    for text in args.shapes:
        b, ctx = map(int, text.split("x"))
        q, s = [1] * b, [ctx] * b
        batch = make_cache_batch(shape, q, s)
        kv_bytes = 2 * b * ctx * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
        resident = pa.default_num_units(batch["query"], batch["key_cache"], False)
        row = dict(batch=b, context=ctx, resident_units=resident)
        for grid, units in (("resident", resident), ("one_more", resident + 1)):
            for cut in ("waves", "whole"):
                with whole_rows() if cut == "whole" else nullcontext():
                    plan = pa.plan_for(batch["query"], batch["key_cache"], q, s, num_units=units)
                ms = graph_ms(partial(run_attention, batch, shape, plan))
                row[f"{grid}_{cut}"] = dict(ms=ms, pct_of_copy=100 * kv_bytes / (ms * 1e-3) / 1e9 / copy,
                                            splits=plan.max_splits, units=plan.num_units)  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        del batch
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    record = dict(device=name, copy_gb_s=copy, rows=rows)
    save_results(args.out / f"decode_grid_{device_slug(name)}", record, markdown(record))
    return 0


def markdown(r: dict) -> str:
    lines = [f"# Decode attention against its grid, {r['device']}", "",
             "Llama-3-8B attention (8 KV heads, group 4, head 128), bf16, block 16; equal rows, one query each. "
             "% of the copy bandwidth measured in the same run "
             f"({r['copy_gb_s']:.0f} GB/s), counting K and V bytes; timed as a CUDA graph replays each launch. "
             "Resident: the units a KV head whose programs all fit on the SMs at once (the engine's); one more: "
             "a unit a head more, a few programs in a second wave. Waves: the planner's cut of rows into whole "
             "waves; whole: rows left whole.", "",
             "| batch | context | units | resident, waves | resident, whole | one more, waves | one more, whole |",
             "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in r["rows"]:
        cells = [f"{row[k]['pct_of_copy']:.1f}% ({row[k]['splits']} splits)"
                 for k in ("resident_waves", "resident_whole", "one_more_waves", "one_more_whole")]  # fmt: skip
        lines.append(f"| {row['batch']} | {row['context']:,} | {row['resident_units']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
