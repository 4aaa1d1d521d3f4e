"""How the two-tier comparison (benchmarks/swapping.py) depends on the step's
token budget, ``--max-num-batched-tokens``: the one engine flag both sides
of that comparison share and neither tunes.

On every preset of swapping.py, the same arrivals (load 0.9 of what fcfs +
recompute serves at the 2048-token budget swapping.py runs) are served by
fcfs + recompute (vLLM's behaviour) and by skip-join + proactive swap with
the default flags, at each budget. Per preset and budget, medians over the
seeds of each seed's ratios:

* fcfs + recompute at the budget against itself at 2048: what the budget
  alone does to vLLM's behaviour;
* the default flags against fcfs + recompute at 2048 (swapping.py's figure
  when the budget is 2048);
* the default flags against fcfs + recompute at the same budget: what the
  ranking and the host tier add once both sides share the budget.

Mean normalized latency and P99 TTFT as the baseline's over this (higher is
better), P99 TPOT as this over the baseline's (lower is better), as in
swapping.py. Each preset's ``knee`` is the chunk, in tokens, whose matmul
time equals one read of the weights on the preset's device
(cost_model.RooflineCostModel): a step carrying fewer prefill tokens than
that beside its decodes costs them little more than the decodes alone, a
step carrying more slows every decode in it in proportion.

    python benchmarks/token_budget.py                      # every preset, seeds 0-6
    python benchmarks/token_budget.py --quick --presets cpu-small

Writes benchmarks/results/token_budget.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dummy_models import save_results
from swapping import LOAN_TOKENS, SKIP_JOIN, figure_ratios, preset_capacity, preset_jobs, presets, sim_config

from fluidserve.scheduler.cost_model import RooflineCostModel
from fluidserve.scheduler.simulator import simulate
from fluidserve.scheduler.workloads import DEFAULT_WORKLOAD_DIR, replay_trace

BASE_BUDGET = 2048  # swapping.py's, and the engine's default
LOAD = 0.9
FCFS = "fcfs + recompute"
DEFAULT = "skip-join + proactive swap (default flags)"
FIGURES = ("mean_norm_latency_s", "p99_ttft_s", "p99_tpot_s", "mean_ttft_s", "throughput_rps", "num_steps",
           "num_recomputes", "num_swap_outs")


def knee_tokens(cm: RooflineCostModel) -> int:
    """Prefill tokens whose matmuls take as long as one read of the weights."""
    read = cm.model.weight_bytes / (cm.device.hbm_bandwidth * cm.device.memory_efficiency)
    flops = 2 * cm.model.num_layers * cm.model.active_layer_params
    per_token = flops / (cm.device.peak_flops * cm.device.flops_efficiency)
    return round(read / per_token)


def _run(task: dict) -> dict:
    cm = RooflineCostModel(task["model"], task["device"])
    if task["variant"] == FCFS:
        cfg, policy = sim_config(cm, task["pool"], "recompute", False, loan_tokens=None), "fcfs"
    else:
        cfg, policy = sim_config(cm, task["pool"], "swap", True, loan_tokens=LOAN_TOKENS), SKIP_JOIN
    s = simulate(task["jobs"], policy, cm, cfg.replace(max_num_batched_tokens=task["budget"])).summary()
    return {"preset": task["preset"], "seed": task["seed"], "budget": task["budget"], "variant": task["variant"],
            **{k: s[k] for k in FIGURES}}


def build_tasks(args) -> tuple[list[dict], dict]:
    tasks, meta = [], {}
    for name, p in presets(Path(args.workload_dir)).items():
        if args.presets and not any(s in name for s in args.presets):
            continue
        cm = RooflineCostModel(p["model"], p["device"])
        if "trace" in p:  # a trace replays its jobs: one run whatever the seed
            runs = [(args.seeds[0], replay_trace(p["trace"], speed=1, limit=args.trace_jobs, max_model_len=8192))]
            meta[name] = {"knee_tokens": knee_tokens(cm)}
        else:
            cap = preset_capacity(p, cm, args.capacity_jobs)
            runs = [(seed, preset_jobs(p, args.num_jobs, LOAD * cap, seed)) for seed in args.seeds]
            meta[name] = {"knee_tokens": knee_tokens(cm), "capacity_rps": cap, "rate_rps": LOAD * cap}
        for seed, jobs in runs:
            for budget in args.budgets:
                for variant in (FCFS, DEFAULT):
                    tasks.append({"preset": name, "seed": seed, "budget": budget, "variant": variant, "jobs": jobs,
                                  "model": p["model"], "device": p["device"], "pool": p["pool"]})
    return tasks, meta


def summarize(rows: list[dict]) -> list[dict]:
    """Per preset and budget, the medians over seeds of the three comparisons."""
    by = {(r["preset"], r["seed"], r["budget"], r["variant"]): r for r in rows}
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        seeds = sorted({r["seed"] for r in rows if r["preset"] == preset})
        for budget in sorted({r["budget"] for r in rows if r["preset"] == preset}):
            comparisons = {
                "fcfs_vs_fcfs_base": [(by[preset, s, budget, FCFS], by[preset, s, BASE_BUDGET, FCFS]) for s in seeds],
                "default_vs_fcfs_base": [(by[preset, s, budget, DEFAULT], by[preset, s, BASE_BUDGET, FCFS])
                                         for s in seeds],
                "default_vs_fcfs_same": [(by[preset, s, budget, DEFAULT], by[preset, s, budget, FCFS])
                                         for s in seeds],
            }
            row = {"preset": preset, "budget": budget, "seeds": seeds}
            for key, pairs in comparisons.items():
                ratios = [figure_ratios(base, r) for r, base in pairs]
                row[key] = [statistics.median(x[i] for x in ratios) for i in range(3)]
            for variant, tag in ((FCFS, "fcfs"), (DEFAULT, "default")):
                row[f"{tag}_throughput_rps"] = statistics.median(by[preset, s, budget, variant]["throughput_rps"]
                                                                 for s in seeds)
            out.append(row)
    return out


def to_markdown(summary: list[dict], meta: dict, run: dict) -> str:
    def three(x: list[float]) -> str:
        return " / ".join(f"{v:.2f}x" for v in x)

    lines = ["# The token budget: fcfs + recompute and skip-join + proactive swap at each budget", "",
             f"Command: `{run['command']}` ({run['wall_s']:.0f} s wall). Same arrivals at every budget: load {LOAD} "
             f"of fcfs + recompute's capacity at {BASE_BUDGET} tokens (a trace replays its own); medians over seeds "
             f"{', '.join(map(str, run['seeds']))} (a trace: one run) of each seed's ratios. Each cell: mean "
             "normalized latency / P99 TTFT (baseline over this: higher is better) / P99 TPOT (this over "
             "baseline: lower is better).", "",
             "| preset | knee (tokens) | budget | fcfs + recompute vs itself at 2048 | default flags vs fcfs + "
             "recompute at 2048 | default flags vs fcfs + recompute at the same budget | throughput fcfs / "
             "default (req/s) |", "|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['preset']} | {meta[r['preset']]['knee_tokens']} | {r['budget']} | "
                     f"{three(r['fcfs_vs_fcfs_base'])} | {three(r['default_vs_fcfs_base'])} | "
                     f"{three(r['default_vs_fcfs_same'])} | {r['fcfs_throughput_rps']:.2f} / "
                     f"{r['default_throughput_rps']:.2f} |")
    return "\n".join(lines + ["", " ".join(FINDINGS.split()), ""])


FINDINGS = """A budget near the knee lets the decodes of a step run at
nearly their own pace while prompts still fill the step's compute; a larger
one stretches every step that carries a prompt chunk, and with it every
stream's gap between tokens and the time its blocks stay held. Where memory
binds, blocks held longer are arrivals waiting longer: the budget moves the
mean and both tails of fcfs + recompute itself. The ranking and the host
tier act on top of whichever budget both sides run; their gain at 2048
(swapping.py) is not the gain at every budget."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--budgets", default="256,512,1024,2048,4096",
                    help=f"token budgets to run ({BASE_BUDGET} is always run: the baseline)")
    ap.add_argument("--presets", nargs="*", default=[], help="substrings of the preset names to run (default all)")
    ap.add_argument("--num-jobs", type=int, default=600)
    ap.add_argument("--trace-jobs", type=int, default=1500)
    ap.add_argument("--capacity-jobs", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quick", action="store_true", help="150 jobs, one seed: a smoke run")
    args = ap.parse_args(argv)
    args.budgets = sorted({int(x) for x in args.budgets.split(",") if x} | {BASE_BUDGET})
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    if args.quick:
        args.num_jobs, args.trace_jobs, args.capacity_jobs, args.seeds = 150, 300, 120, args.seeds[:1]
    t0 = time.perf_counter()
    tasks, meta = build_tasks(args)
    print(f"{len(tasks)} simulations on {args.workers} workers ...", file=sys.stderr)
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_run, tasks, chunksize=1))
    summary = summarize(rows)
    run = {"command": "python benchmarks/token_budget.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "wall_s": time.perf_counter() - t0, "seeds": args.seeds, "num_jobs": args.num_jobs,
           "trace_jobs": args.trace_jobs, "load": LOAD, "python": platform.python_version()}
    stem = Path(args.out_dir) / ("token_budget_quick" if args.quick else "token_budget")
    record = {"meta": run, "presets": meta, "summary": summary, "rows": rows}
    save_results(stem, record, to_markdown(summary, meta, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
