"""FastServe §6.3 design-choice experiment, in the simulator.

fcfs vs mlfq vs fixed-priority vs skip-join-mlfq (plus skip-join with a long
starve limit), on a Llama-3-8B-shaped model on one H100 (analytic roofline,
or ``--profile profile.json``), sweeping load (fraction of the saturated FCFS
throughput of the same length mix) and the input/output length ratio.
Workloads are read from ``benchmarks/workloads`` (or ``--workload-dir``):

* ShareGPT-8k lengths with Poisson arrivals, and with Gamma arrivals (CV 2, 4)
* ShareGPT-8k with FastServe's input/output ratio scaling, Poisson, fixed load
* the Azure code trace replayed at 1x / 2x / 4x speed

Metrics per run: mean and P95 normalized latency (E2E / output tokens), mean
TTFT, P99 TPOT, P99 latency bound (max gap between two tokens of a request).
Also the scheduler's own CPU time per step at 256 and 1024 active requests.

    python benchmarks/scheduling.py                 # default sweep, ~3-5 min on 2 cores
    python benchmarks/scheduling.py --quick         # smoke run

Writes benchmarks/results/scheduling.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.cost_model import CostModel, default_cost_model, load_profile
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.policies import make_policy
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig
from fluidserve.scheduler.simulator import SimConfig, estimate_capacity, simulate
from fluidserve.scheduler.workloads import (
    AZURE_CODE, DEFAULT_WORKLOAD_DIR, SHAREGPT, clamp_lengths, empirical_lengths, gamma_arrivals,
    load_lengths, load_trace, poisson_arrivals, replay_trace, scale_ratio, synthesize,
)

MAX_MODEL_LEN = 8192
# (label, policy, options)
POLICIES = [
    ("fcfs", "fcfs", {}),
    ("fixed-priority", "fixed-priority", {}),
    ("mlfq", "mlfq", {}),
    ("skip-join-mlfq", "skip-join-mlfq", {}),
    ("skip-join-mlfq α=3s", "skip-join-mlfq", {"starve_limit_ms": 3000.0}),
]
METRICS = [("mean_norm_latency_s", "mean norm (ms/tok)", 1e3), ("p95_norm_latency_s", "P95 norm (ms/tok)", 1e3),
           ("mean_ttft_s", "mean TTFT (s)", 1.0), ("p99_tpot_s", "P99 TPOT (ms)", 1e3),
           ("p99_latency_bound_s", "P99 lat. bound (s)", 1.0)]


def _cost_model(profile: str | None) -> CostModel:
    if profile:
        return load_profile(profile)
    return default_cost_model()


def _run(task: dict) -> dict:
    cm = _cost_model(task["profile"])
    cfg = SimConfig.create(**task["sim"])
    t0 = time.perf_counter()
    res = simulate(task["jobs"], task["policy"], cm, cfg, task["options"])
    row = {k: v for k, v in task.items() if k not in ("jobs", "sim", "profile")}
    row.update(res.summary())
    row["policy"] = task["label"]
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def build_tasks(args, cm: CostModel, sim: dict) -> tuple[list[dict], dict]:
    wdir = Path(args.workload_dir)
    base_pairs = clamp_lengths(load_lengths(wdir / SHAREGPT), MAX_MODEL_LEN)
    cfg = SimConfig.create(**sim)
    capacity: dict[str, float] = {}
    tasks: list[dict] = []

    def cap_of(key: str, pairs) -> float:
        if key not in capacity:
            capacity[key] = estimate_capacity(pairs, cm, cfg, num_jobs=args.capacity_jobs)
        return capacity[key]

    def add(experiment: str, x: float, jobs, **extra) -> None:
        for label, policy, options in POLICIES:
            tasks.append({"experiment": experiment, "x": x, "label": label, "policy": policy,
                          "options": options, "jobs": jobs, "sim": sim, "profile": args.profile, **extra})

    # 1. load sweeps, original ShareGPT lengths
    arrivals = {"sharegpt-poisson": None, "sharegpt-gamma-cv2": 2.0, "sharegpt-gamma-cv4": 4.0}
    cap = cap_of("sharegpt", base_pairs)
    for name, cv in arrivals.items():
        for load in args.loads:
            rate = load * cap
            gaps = poisson_arrivals(rate) if cv is None else gamma_arrivals(rate, cv)
            add(name, load, synthesize(args.num_jobs, empirical_lengths(base_pairs), gaps, seed=args.seed),
                rate_rps=rate)
    # 1b. the same with a binding request cap: FastServe schedules a fixed
    # MaxBatchSize, so jobs queue for batch slots even when KV has room —
    # the head-of-line blocking its MLFQ removes.
    if args.batch_cap:
        capped = {**sim, "max_num_seqs": args.batch_cap}
        cap_capped = estimate_capacity(base_pairs, cm, SimConfig.create(**capped), num_jobs=args.capacity_jobs)
        capacity[f"sharegpt, cap {args.batch_cap}"] = cap_capped
        for load in args.loads:
            rate = load * cap_capped
            jobs = synthesize(args.num_jobs, empirical_lengths(base_pairs), poisson_arrivals(rate), seed=args.seed)
            before = len(tasks)
            add(f"sharegpt-poisson-cap{args.batch_cap}", load, jobs, rate_rps=rate)
            for t in tasks[before:]:
                t["sim"] = capped
    # 2. input/output ratio sweep at fixed load (FastServe Fig. 14)
    for ratio in args.ratios:
        pairs = clamp_lengths(scale_ratio(base_pairs, ratio), MAX_MODEL_LEN)
        rate = args.ratio_load * cap_of(f"ratio-{ratio}", pairs)
        add("sharegpt-ratio", ratio, synthesize(args.num_jobs, empirical_lengths(pairs), poisson_arrivals(rate),
                                                seed=args.seed), rate_rps=rate)
    # 3. Azure code trace, replayed faster
    rows = load_trace(wdir / AZURE_CODE)
    for speed in args.speeds:
        jobs = replay_trace(rows, speed=speed, limit=args.trace_jobs, max_model_len=MAX_MODEL_LEN)
        add("azure-code-trace", speed, jobs, rate_rps=len(jobs) / max(jobs[-1].arrival_time, 1e-9))
    return tasks, capacity


def scheduler_overhead(cm: CostModel, policy: str, active: int, steps: int = 200) -> float:
    """CPU seconds per schedule() + update_from_output() with ``active`` decoding requests."""
    kv = KVCacheManager(active * 64 + 64, 16)
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048, scheduling_policy=policy), kv,
                  make_policy(policy, cost_model=cm))
    for i in range(active):
        seq = SeqState(f"r{i}", 200 + (i * 37) % 600, 10_000, i * 1e-3)
        s.add(seq, 0.0)
    return time_steps(s, warm_steps=3, steps=steps)


def time_steps(s: Scheduler, warm_steps: int, steps: int) -> float:
    """CPU seconds per schedule() + update_from_output(), after
    ``warm_steps`` untimed steps (admission and prefill)."""
    now = 1.0
    for _ in range(warm_steps):
        s.update_from_output(s.schedule(now), StepOutcome(0.01, now))
    t0 = time.process_time()
    for _ in range(steps):
        s.update_from_output(s.schedule(now), StepOutcome(0.01, now))
        now += 0.01
    return (time.process_time() - t0) / steps


def to_markdown(rows: list[dict], capacity: dict, overhead: dict, meta: dict) -> str:
    out = ["# Scheduling policies in the simulator (FastServe §6.3)", "",
           f"Model/device: {meta['cost_model']}. KV pool {meta['sim']['num_kv_blocks']} blocks x "
           f"{meta['sim']['block_size']} tokens, token budget {meta['sim']['max_num_batched_tokens']}, "
           f"request cap {meta['sim']['max_num_seqs']} (except the -cap experiment). "
           f"{meta['num_jobs']} jobs per run (trace: first "
           f"{meta['trace_jobs']}), seed {meta['seed']}. ShareGPT-8k lengths (Llama-2 tokenizer, prompts "
           f"and outputs clamped to {MAX_MODEL_LEN} tokens in all). Load = arrival rate / saturated FCFS "
           "throughput of the same length mix: " +
           ", ".join(f"{k} {v:.2f} req/s" for k, v in capacity.items()) + ".",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s wall).", ""]
    experiments = []
    for r in rows:
        if r["experiment"] not in experiments:
            experiments.append(r["experiment"])
    xname = {"sharegpt-ratio": "in/out ratio", "azure-code-trace": "speed"}
    for exp in experiments:
        sub = [r for r in rows if r["experiment"] == exp]
        out += [f"## {exp}", "", f"| {xname.get(exp, 'load')} | policy | " + " | ".join(m[1] for m in METRICS)
                + " | vs fcfs (mean norm) |", "|" + "---|" * (len(METRICS) + 3)]
        fcfs = {r["x"]: r["mean_norm_latency_s"] for r in sub if r["policy"] == "fcfs"}
        for r in sub:
            vals = " | ".join(f"{r[k] * s:.3g}" for k, _, s in METRICS)
            gain = fcfs[r["x"]] / r["mean_norm_latency_s"]
            out.append(f"| {r['x']:g} | {r['policy']} | {vals} | {gain:.2f}x |")
        out.append("")
    out += ["## Scheduler CPU time per step (schedule + update_from_output, decoding requests)", "",
            "| policy | " + " | ".join(f"{n} active (ms)" for n in sorted(next(iter(overhead.values())))) + " |",
            "|---|" + "---|" * len(next(iter(overhead.values())))]
    for pol, d in overhead.items():
        out.append(f"| {pol} | " + " | ".join(f"{d[n] * 1e3:.3f}" for n in sorted(d)) + " |")
    out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for r in rows:  # every experiment, in the order it ran
        if r["experiment"] not in panels:
            panels.append(r["experiment"])
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for j, exp in enumerate(panels):
        for i, (metric, label, scale) in enumerate(METRICS[:2]):
            ax = axes[i][j]
            for pol, *_ in POLICIES:
                pts = sorted((r["x"], r[metric] * scale) for r in rows if r["experiment"] == exp and r["policy"] == pol)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=pol)
            ax.set_title(exp, fontsize=9)
            ax.set_xlabel({"sharegpt-ratio": "input/output length ratio",
                           "azure-code-trace": "replay speed"}.get(exp, "load (fraction of capacity)"))
            ax.set_ylabel(label)
            ax.set_yscale("log")
            if exp in ("sharegpt-ratio", "azure-code-trace"):
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--profile", default=None, help="measured profile.json (default: Llama-3-8B/H100 roofline)")
    ap.add_argument("--num-jobs", type=int, default=800)
    ap.add_argument("--trace-jobs", type=int, default=2000, help="replay the first N requests of the trace")
    ap.add_argument("--capacity-jobs", type=int, default=400)
    ap.add_argument("--loads", default="0.5,0.7,0.8,0.9,0.95")
    ap.add_argument("--ratios", default="1,4,16,32")
    ap.add_argument("--ratio-load", type=float, default=0.9)
    ap.add_argument("--speeds", default="1,2,4")
    ap.add_argument("--batch-cap", type=int, default=16,
                    help="also sweep load with this request cap (FastServe's MaxBatchSize); 0 = skip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_jobs, args.trace_jobs, args.capacity_jobs = 120, 300, 120
        args.loads, args.ratios, args.speeds = "0.5,0.9", "1,16", "1,4"
    args.loads = [float(x) for x in args.loads.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",")]
    args.speeds = [float(x) for x in args.speeds.split(",")]
    t0 = time.perf_counter()
    cm = _cost_model(args.profile)
    blocks = cm.num_kv_blocks(16) if hasattr(cm, "num_kv_blocks") else default_cost_model().num_kv_blocks(16)
    sim = {"num_kv_blocks": blocks, "block_size": 16, "max_num_batched_tokens": 2048, "max_num_seqs": 256}
    tasks, capacity = build_tasks(args, cm, sim)
    print(f"{len(tasks)} simulations on {args.workers} workers ...", file=sys.stderr)
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_run, tasks, chunksize=1))
    overhead = {pol: {n: scheduler_overhead(cm, pol, n) for n in (256, 1024)}
                for pol in ("fcfs", "skip-join-mlfq")}
    meta = {"cost_model": getattr(cm, "describe", lambda: {"kind": "profile"})(), "sim": sim,
            "num_jobs": args.num_jobs, "trace_jobs": args.trace_jobs, "seed": args.seed,
            "command": "python benchmarks/scheduling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version()}
    if isinstance(meta["cost_model"], dict) and meta["cost_model"].get("kind") == "roofline":
        meta["cost_model"] = f"roofline {meta['cost_model']['model']['name']} on {meta['cost_model']['device']['name']}"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "scheduling_quick" if args.quick else "scheduling"
    (out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "capacity_rps": capacity, "scheduler_cpu_s_per_step": overhead, "rows": rows},
        indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o)))
    md = to_markdown(rows, capacity, overhead, meta)
    (out / f"{stem}.md").write_text(md)
    plot(rows, out / f"{stem}.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
