"""Two-tier KV in the simulator (FastServe §4.2, §6.3): what swapping to host
memory buys the scheduler when device KV is what binds.

Four variants on the same jobs, same model, same device:

* ``fcfs + recompute``       vLLM's behaviour: arrival order, a preempted job
                             loses its KV and prefills again
* ``skip-join + recompute``  FastServe's MLFQ without a host tier
* ``skip-join + reactive``   swaps to host on demand only (evict / bring back
                             when the scheduler needs it this step)
* ``skip-join + proactive``  also prefetches swapped KV ahead of its turn and
                             keeps a reserve of free blocks for arrivals

Presets are memory-bound on purpose: OPT-13B on a 40 GB A100 (FastServe's
setting), Llama-3-8B on an H100 with an eighth of its KV pool, Llama-3-8B with
arXiv-summarization (long prompt) lengths and a quarter of the pool, and the
Azure code trace on the small pool. The host link moves one block in
``block bytes / PCIe bandwidth`` (DeviceSpec), copies overlap compute, and a
step stalls only on swap-ins it reads (see scheduler/simulator.py). Per-step
swap traffic is bounded as the engine bounds it: the blocks that move in one
minimum iteration. Load = arrival rate / saturated throughput of fcfs +
recompute on the same lengths.

    python benchmarks/swapping.py            # ~10 min on 2 cores
    python benchmarks/swapping.py --quick    # smoke run

Writes benchmarks/results/swapping.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel
from fluidserve.scheduler.simulator import SimConfig, estimate_capacity, simulate
from fluidserve.scheduler.workloads import (
    ARXIV, AZURE_CODE, DEFAULT_WORKLOAD_DIR, SHAREGPT, clamp_lengths, empirical_lengths, load_lengths,
    load_trace, poisson_arrivals, replay_trace, synthesize,
)

BLOCK = 16
HOST_GIB = 64  # FastServe's host memory for swapped KV
SKIP_JOIN = "skip-join-mlfq"
VARIANTS = [  # (label, policy, preemption mode, proactive)
    ("fcfs + recompute", "fcfs", "recompute", False),
    ("skip-join + recompute", SKIP_JOIN, "recompute", False),
    ("skip-join + reactive swap", SKIP_JOIN, "swap", False),
    ("skip-join + proactive swap", SKIP_JOIN, "swap", True),
]
METRICS = [("mean_norm_latency_s", "mean norm (ms/tok)", 1e3), ("p95_norm_latency_s", "P95 norm (ms/tok)", 1e3),
           ("mean_ttft_s", "mean TTFT (s)", 1.0), ("p99_ttft_s", "P99 TTFT (s)", 1.0),
           ("p99_tpot_s", "P99 TPOT (ms)", 1e3)]


def opt_13b() -> ModelShape:
    return ModelShape.from_hf_config({"num_hidden_layers": 40, "hidden_size": 5120, "ffn_dim": 20480,
                                      "num_attention_heads": 40, "vocab_size": 50272, "_name_or_path": "opt-13b"})


def presets(wdir: Path) -> dict[str, dict]:
    """name -> model, device, pool fraction, lengths or trace, max length."""
    sharegpt = load_lengths(wdir / SHAREGPT)
    return {
        "opt-13b/a100-40g sharegpt": dict(model=opt_13b(), device=DeviceSpec.a100_40g(), pool=1.0,
                                          pairs=clamp_lengths(sharegpt, 2048)),
        "llama-3-8b/h100 pool/8 sharegpt": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1 / 8,
                                                pairs=clamp_lengths(sharegpt, 8192)),
        "llama-3-8b/h100 pool/4 arxiv": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(), pool=1 / 4,
                                             pairs=clamp_lengths(load_lengths(wdir / ARXIV), 8192)),
        "llama-3-8b/h100 pool/8 azure-code": dict(model=ModelShape.llama3_8b(), device=DeviceSpec.h100(),
                                                  pool=1 / 8, trace=load_trace(wdir / AZURE_CODE)),
    }


def sim_config(cm: RooflineCostModel, pool: float, mode: str, proactive: bool) -> SimConfig:
    block_bytes = BLOCK * cm.model.kv_bytes_per_token
    per_block = cm.transfer_time(block_bytes)
    swap = mode == "swap"
    return SimConfig.create(
        num_kv_blocks=max(1, int(cm.num_kv_blocks(BLOCK) * pool)), block_size=BLOCK,
        max_num_batched_tokens=2048, max_num_seqs=256,
        num_host_blocks=HOST_GIB * 2**30 // block_bytes if swap else 0,
        preemption_mode=mode, proactive_swap=proactive, block_transfer_time=per_block,
        max_swap_blocks_per_step=max(1, int(cm.min_iteration_time() / per_block)),
    )


def _run(task: dict) -> dict:
    cm = RooflineCostModel(task["model"], task["device"])
    cfg = sim_config(cm, task["pool"], task["mode"], task["proactive"])
    t0 = time.perf_counter()
    res = simulate(task["jobs"], task["policy"], cm, cfg)
    s = res.summary()
    row = {"preset": task["preset"], "x": task["x"], "variant": task["label"], "num_kv_blocks": cfg.num_kv_blocks,
           "num_host_blocks": cfg.num_host_blocks, "max_swap_blocks_per_step": cfg.max_swap_blocks_per_step, **s}
    row["swap_gib"] = s["swap_blocks"] * BLOCK * cm.model.kv_bytes_per_token / 2**30
    row["stall_share"] = s["swap_stall_s"] / res.makespan if res.makespan else 0.0
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def build_tasks(args) -> tuple[list[dict], dict]:
    tasks, capacity = [], {}
    for name, p in presets(Path(args.workload_dir)).items():
        cm = RooflineCostModel(p["model"], p["device"])
        if "trace" in p:
            points = [(speed, replay_trace(p["trace"], speed=speed, limit=args.trace_jobs, max_model_len=8192))
                      for speed in args.speeds]
        else:
            base = sim_config(cm, p["pool"], "recompute", False)
            cap = estimate_capacity(p["pairs"], cm, base, num_jobs=args.capacity_jobs)
            capacity[name] = cap
            points = [(load, synthesize(args.num_jobs, empirical_lengths(p["pairs"]), poisson_arrivals(load * cap),
                                        seed=args.seed)) for load in args.loads]
        for x, jobs in points:
            for label, policy, mode, proactive in VARIANTS:
                tasks.append({"preset": name, "x": x, "label": label, "policy": policy, "mode": mode,
                              "proactive": proactive, "jobs": jobs, "model": p["model"], "device": p["device"],
                              "pool": p["pool"]})
    return tasks, capacity


def to_markdown(rows: list[dict], capacity: dict, meta: dict) -> str:
    out = ["# Two-tier KV in the simulator: recompute vs reactive vs proactive swapping", "",
           f"Roofline cost model; block {BLOCK} tokens; host pool {HOST_GIB} GiB; token budget 2048, request cap 256; "
           f"{meta['num_jobs']} jobs per synthetic run (trace: first {meta['trace_jobs']}), seed {meta['seed']}. "
           "Load = arrival rate / saturated fcfs + recompute throughput: "
           + ", ".join(f"{k} {v:.2f} req/s" for k, v in capacity.items()) + ".",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s wall).", ""]
    for preset in dict.fromkeys(r["preset"] for r in rows):
        sub = [r for r in rows if r["preset"] == preset]
        xname = "speed" if "azure" in preset else "load"
        out += [f"## {preset} ({sub[0]['num_kv_blocks']} device blocks)", "",
                f"| {xname} | variant | " + " | ".join(m[1] for m in METRICS)
                + " | recomputes | swap-outs | swapped GiB | stall / makespan | vs fcfs+recompute (mean norm) |",
                "|" + "---|" * (len(METRICS) + 7)]
        base = {r["x"]: r["mean_norm_latency_s"] for r in sub if r["variant"] == VARIANTS[0][0]}
        for r in sub:
            vals = " | ".join(f"{r[k] * s:.3g}" for k, _, s in METRICS)
            out.append(f"| {r['x']:g} | {r['variant']} | {vals} | {r['num_recomputes']} | {r['num_swap_outs']} | "
                       f"{r['swap_gib']:.1f} | {100 * r['stall_share']:.2f}% | "
                       f"{base[r['x']] / r['mean_norm_latency_s']:.2f}x |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--num-jobs", type=int, default=600)
    ap.add_argument("--trace-jobs", type=int, default=1500)
    ap.add_argument("--capacity-jobs", type=int, default=300)
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--speeds", default="1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_jobs, args.trace_jobs, args.capacity_jobs, args.loads, args.speeds = 150, 300, 120, "0.9", "1"
    args.loads = [float(x) for x in args.loads.split(",")]
    args.speeds = [float(x) for x in args.speeds.split(",")]
    t0 = time.perf_counter()
    tasks, capacity = build_tasks(args)
    print(f"{len(tasks)} simulations on {args.workers} workers ...", file=sys.stderr)
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_run, tasks, chunksize=1))
    meta = {"num_jobs": args.num_jobs, "trace_jobs": args.trace_jobs, "seed": args.seed,
            "command": "python benchmarks/swapping.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "swapping_quick" if args.quick else "swapping"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "capacity_rps": capacity, "rows": rows}, indent=1))
    md = to_markdown(rows, capacity, meta)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
