"""Data-parallel routing in the simulator: round-robin vs least-loaded vs
prefix-aware routers (scheduler/router.py) in front of N replicas
(scheduler/cluster.py). Each replica is the Llama-3-8B / H100 preset of the
prefix-cache and swapping benchmarks (roofline cost model, an eighth of the
device KV pool so memory binds, skip-join MLFQ with proactive swapping and KV
loans, the default flags) with
the engine's default 4 GiB host tier (``--host-gib``) and prefix caching on
both tiers.

Workloads:

* ``tenants``: multi-tenant shared system prompts. ``--tenants`` tenants, each
  with a system prompt of ``--prefix-min``..``--prefix-max`` tokens (uniform);
  a request picks its tenant with Zipf(``--zipf``) popularity and adds a user
  turn: a ShareGPT-8k prompt length scaled to a ``--user-turn-mean`` mean
  (vLLM's first-turn ShareGPT sampling is about 200 tokens; ShareGPT-8k's
  prompts are whole conversations, 2340 on average), ShareGPT-8k output.
* ``sharegpt``: ShareGPT-8k lengths as they are, no sharing.

Poisson arrivals at ``load`` x the cluster's capacity: N x one replica's
saturated throughput on the same workload (its prefix cache on; every replica
of a round-robin cluster sees that same mix). The first ``--warmup`` share of
arrivals warms the caches and is left out of the figures. Metrics: mean / P99
TTFT, mean TPOT, prefix hit rate (prompt tokens found cached at admission,
either tier), routed by reason; ratios vs round-robin and vs least-loaded.
Also: prefix-aware's balance threshold swept on the tenants workload (each
replica count, highest load), and the router's decision time per request at
16 replicas with 2k-token prompts.

    python benchmarks/routing.py            # ~4 min on 2 cores
    python benchmarks/routing.py --quick    # smoke run, seconds

Writes benchmarks/results/routing.{json,md} (--quick: routing_quick.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from swapping import BLOCK, sim_config

from fluidserve.scheduler.cluster import Cluster
from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel
from fluidserve.scheduler.router import DEFAULT_BALANCE_THRESHOLD_S, ROUTING_POLICIES, make_router
from fluidserve.scheduler.simulator import SimConfig, simulate
from fluidserve.scheduler.workloads import DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, load_lengths

POLICY = "skip-join-mlfq"
MAX_LEN = 8192
POLICIES = ("round-robin", "least-loaded", "prefix-aware")
assert set(POLICIES) == set(ROUTING_POLICIES)
METRICS = [("mean_ttft_s", "mean TTFT (s)", 1.0), ("p99_ttft_s", "P99 TTFT (s)", 1.0),
           ("mean_tpot_s", "mean TPOT (ms)", 1e3)]


# -- workloads ---------------------------------------------------------------
def tenant_prompts(args) -> list[int]:
    rng = random.Random(args.seed + 1)
    return [rng.randint(args.prefix_min, args.prefix_max) for _ in range(args.tenants)]


def user_turns(pairs: list[tuple[int, int]], mean: int, room: int) -> list[tuple[int, int]]:
    """ShareGPT-8k lengths with every prompt scaled by one factor to ``mean``
    tokens on average, cut to fit ``room`` with the output."""
    scale = mean / (sum(p for p, _ in pairs) / len(pairs))
    return clamp_lengths([(max(1, round(p * scale)), o) for p, o in pairs], room)


def length_mix(args, pairs: list[tuple[int, int]], workload: str) -> list[tuple[int, int]]:
    """(prompt, output) pairs of a workload, for its capacity."""
    if workload == "sharegpt":
        return clamp_lengths(pairs, MAX_LEN)
    rng = random.Random(args.seed + 2)
    prompts = tenant_prompts(args)
    turns = user_turns(pairs, args.user_turn_mean, MAX_LEN - args.prefix_max)
    return [(prompts[rng.randrange(len(prompts))] + p, o) for p, o in turns]


def make_jobs(args, pairs: list[tuple[int, int]], workload: str, n: int, rate: float) -> list[Job]:
    rng = random.Random(args.seed)
    jobs, t = [], 0.0
    if workload == "sharegpt":
        mix = clamp_lengths(pairs, MAX_LEN)
        for i in range(n):
            t += rng.expovariate(rate)
            p, o = mix[rng.randrange(len(mix))]
            jobs.append(Job(f"r{i}", t, p, o))
        return jobs
    prompts = tenant_prompts(args)
    weights = [1 / (g + 1) ** args.zipf for g in range(args.tenants)]
    turns = user_turns(pairs, args.user_turn_mean, MAX_LEN - args.prefix_max)
    for i in range(n):
        t += rng.expovariate(rate)
        p, o = turns[rng.randrange(len(turns))]
        g = rng.choices(range(args.tenants), weights)[0]
        jobs.append(Job(f"r{i}", t, prompts[g] + p, o, shared_prefix=(g, prompts[g])))
    return jobs


# -- runs ----------------------------------------------------------------------
def cluster_config(cm: RooflineCostModel, pool: float, host_gib: float) -> SimConfig:
    host_blocks = int(host_gib * 2**30 // (BLOCK * cm.model.kv_bytes_per_token))
    return sim_config(cm, pool, "swap", True).replace(num_host_blocks=host_blocks)


def _run(task: dict) -> dict:
    cm = RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())
    cfg = cluster_config(cm, task["pool"], task["host_gib"])
    options = {"balance_threshold_s": task["threshold"]} if task["threshold"] is not None else {}
    router = make_router(task["policy"], task["replicas"], block_size=BLOCK, cost_model=cm,
                         index_blocks=cfg.num_kv_blocks + cfg.num_host_blocks, **options)
    t0 = time.perf_counter()
    jobs = task["jobs"]
    res = Cluster(jobs, router, POLICY, cm, cfg).run()
    row = {k: v for k, v in task.items() if k not in ("jobs", "pool", "host_gib", "warmup")}
    row.update(res.summary(warmup_s=jobs[int(task["warmup"] * len(jobs))].arrival_time))
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def decision_time(replicas: int, prompt_tokens: int, num_prompts: int, tenants: int, seed: int,
                  repeats: int = 5) -> dict:
    """Seconds per ``route()`` call at ``replicas`` replicas, ``prompt_tokens``
    token prompts (a tenant's shared first half, its own second half), 64
    requests in flight, the index warm from the earlier routes. The routers
    take turns over ``repeats`` rounds and each keeps its round with the
    lowest mean: the cores are shared with other work, which only adds time.
    The thread's CPU time per call is kept too (wall-clock tails include
    time the process was not running)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(128000) for _ in range(prompt_tokens // 2)] for _ in range(tenants)]
    own = prompt_tokens - prompt_tokens // 2
    prompts = [heads[rng.randrange(tenants)] + [rng.randrange(128000) for _ in range(own)] for _ in range(256)]
    out: dict[str, dict] = {}
    for _ in range(repeats):
        for policy in POLICIES:
            router = make_router(policy, replicas, block_size=BLOCK)
            wall, cpu = [], []
            for i in range(num_prompts):
                prompt = prompts[i % len(prompts)]
                t0, c0 = time.perf_counter(), time.thread_time()
                router.route(f"q{i}", prompt)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                router.finished(f"q{i - 64}")
            wall.sort()
            run = {"mean_us": 1e6 * sum(wall) / len(wall), "p50_us": 1e6 * wall[len(wall) // 2],
                   "p99_us": 1e6 * wall[int(0.99 * len(wall))], "cpu_mean_us": 1e6 * sum(cpu) / len(cpu)}
            if policy not in out or run["mean_us"] < out[policy]["mean_us"]:
                out[policy] = run
    return out


def capacity_of(args, pairs: list[tuple[int, int]], workload: str) -> float:
    """One replica's saturated throughput (requests/s) on a workload, its
    prefix cache on: ``--capacity-jobs`` jobs all present at t = 0, served
    FCFS, the middle 80% of completions timed (as simulator.estimate_capacity
    does for plain lengths)."""
    cm = RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())
    jobs = [replace(j, arrival_time=0.0) for j in make_jobs(args, pairs, workload, args.capacity_jobs, 1.0)]
    res = simulate(jobs, "fcfs", cm, cluster_config(cm, args.pool, args.host_gib))
    ends = sorted(r.finish_time for r in res.records)
    lo, hi = int(0.1 * len(ends)), int(0.9 * len(ends)) - 1
    return (hi - lo) / (ends[hi] - ends[lo])


def num_jobs(args, replicas: int) -> int:
    return max(args.min_jobs, args.jobs_per_replica * replicas)


def build_tasks(args, pairs: list[tuple[int, int]], capacity: dict[str, float]) -> list[dict]:
    tasks, machine = [], {"pool": args.pool, "host_gib": args.host_gib, "warmup": args.warmup}
    for workload in args.workloads:
        for replicas in args.replicas:
            for load in args.loads:
                jobs = make_jobs(args, pairs, workload, num_jobs(args, replicas), load * replicas * capacity[workload])
                for policy in POLICIES:
                    tasks.append({"kind": "grid", "workload": workload, "replicas": replicas, "load": load,
                                  "policy": policy, "threshold": None, "jobs": jobs, **machine})
    load = args.loads[-1]  # where affinity and load pull apart most
    for replicas in args.replicas if args.thresholds else ():
        jobs = make_jobs(args, pairs, "tenants", num_jobs(args, replicas), load * replicas * capacity["tenants"])
        for th in args.thresholds:
            if th == DEFAULT_BALANCE_THRESHOLD_S and "tenants" in args.workloads:
                continue  # the grid's prefix-aware run
            tasks.append({"kind": "sweep", "workload": "tenants", "replicas": replicas, "load": load,
                          "policy": "prefix-aware", "threshold": th, "jobs": jobs, **machine})
    # Longest first, so the pool's workers finish together.
    tasks.sort(key=lambda t: -len(t["jobs"]))
    return tasks


# -- report ------------------------------------------------------------------
def _fmt(x: float, scale: float = 1.0) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * scale:.3g}"


def targets(rows: list[dict]) -> list[dict]:
    """The targets, per grid point: prefix-aware >= 2x lower mean
    TTFT than round-robin on tenants with P99 TTFT no worse; within 5% of
    least-loaded on sharegpt."""
    out = []
    grid = [r for r in rows if r["kind"] == "grid"]
    for r in grid:
        if r["policy"] != "prefix-aware":
            continue
        peers = {p["policy"]: p for p in grid if (p["workload"], p["replicas"], p["load"])
                 == (r["workload"], r["replicas"], r["load"])}
        rr, ll = peers["round-robin"], peers["least-loaded"]
        t = {"workload": r["workload"], "replicas": r["replicas"], "load": r["load"],
             "mean_ttft_vs_rr": rr["mean_ttft_s"] / r["mean_ttft_s"],
             "p99_ttft_vs_rr": rr["p99_ttft_s"] / r["p99_ttft_s"],
             "mean_ttft_vs_ll": ll["mean_ttft_s"] / r["mean_ttft_s"],
             "p99_ttft_vs_ll": ll["p99_ttft_s"] / r["p99_ttft_s"]}
        if r["workload"] == "tenants":
            t["target"] = ">= 2x lower mean TTFT than round-robin, P99 TTFT no worse"
            t["met"] = t["mean_ttft_vs_rr"] >= 2.0 and r["p99_ttft_s"] <= rr["p99_ttft_s"]
        else:
            t["target"] = "mean TTFT within 5% of least-loaded"
            t["met"] = r["mean_ttft_s"] <= 1.05 * ll["mean_ttft_s"]
        out.append(t)
    return out


def to_markdown(rows: list[dict], checks: list[dict], decisions: dict, meta: dict) -> str:
    out = ["# Data-parallel routing in the simulator", "",
           f"Llama-3-8B on H100 per replica (roofline), {meta['pool']:g} of its KV pool "
           f"({meta['num_kv_blocks']} blocks of {BLOCK} tokens) and a {meta['host_gib']:g} GiB host tier, prefix "
           f"caching on both, {POLICY} with proactive swapping and KV loans (the default flags); replicas "
           f"report their load every 100 ms. "
           f"{meta['jobs_per_replica']} jobs per replica (at least {meta['min_jobs']}) per run, Poisson arrivals, "
           f"seed {meta['seed']}; the first "
           f"{100 * meta['warmup']:.0f}% of arrivals warm the caches and are not counted. "
           f"*tenants*: {meta['tenants']} system prompts of {meta['prefix_min']}-{meta['prefix_max']} tokens, "
           f"Zipf({meta['zipf']:g}) popularity, user turns = ShareGPT-8k prompts scaled to a "
           f"{meta['user_turn_mean']}-token mean, ShareGPT-8k outputs. *sharegpt*: ShareGPT-8k lengths, no sharing. "
           "Load = arrival rate / (N x one replica's saturated throughput on the workload, prefix cache on: "
           + ", ".join(f"{k} {v:.2f} req/s" for k, v in meta["capacity_rps"].items()) + "). "
           "Prefix hit = prompt tokens found cached at admission (either tier); host share = tokens copied "
           "back from the host tier, whole run.",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s wall).", "",
           "| workload | replicas | load | router | " + " | ".join(m[1] for m in METRICS)
           + " | prefix hit | host share | routed (prefix/load/least-loaded) | mean TTFT vs RR | vs LL |",
           "|" + "---|" * (len(METRICS) + 9)]
    grid = [r for r in rows if r["kind"] == "grid"]
    for r in grid:
        peers = {p["policy"]: p for p in grid if (p["workload"], p["replicas"], p["load"])
                 == (r["workload"], r["replicas"], r["load"])}
        vals = " | ".join(_fmt(r[k], s) for k, _, s in METRICS)
        routed = r["routed"]
        how = (f"{routed.get('prefix', 0)}/{routed.get('load', 0)}/{routed.get('least-loaded', 0)}"
               if r["policy"] == "prefix-aware" else "")
        out.append(f"| {r['workload']} | {r['replicas']} | {r['load']:g} | {r['policy']} | {vals} | "
                   f"{100 * r['prefix_hit_rate']:.1f}% | {100 * r['host_hit_share']:.1f}% | {how} | "
                   f"{peers['round-robin']['mean_ttft_s'] / r['mean_ttft_s']:.2f}x | "
                   f"{peers['least-loaded']['mean_ttft_s'] / r['mean_ttft_s']:.2f}x |")
    out += ["", "## Targets", "",
            "| workload | replicas | load | target | mean TTFT: RR / PA | P99 TTFT: RR / PA "
            "| mean TTFT: LL / PA | met |",
            "|---|---|---|---|---|---|---|---|"]
    for t in checks:
        out.append(f"| {t['workload']} | {t['replicas']} | {t['load']:g} | {t['target']} | "
                   f"{t['mean_ttft_vs_rr']:.2f}x | {t['p99_ttft_vs_rr']:.2f}x | {t['mean_ttft_vs_ll']:.2f}x | "
                   f"{'yes' if t['met'] else 'no'} |")
    sweep = [r for r in rows if r["kind"] == "sweep"]
    for replicas in dict.fromkeys(r["replicas"] for r in sweep):
        load = sweep[0]["load"]
        points = [r for r in sweep if r["replicas"] == replicas]
        points += [{**r, "threshold": meta["default_threshold_s"]} for r in grid
                   if r["policy"] == "prefix-aware" and r["workload"] == "tenants"
                   and (r["replicas"], r["load"]) == (replicas, load)]
        out += ["", f"## Prefix-aware balance threshold (tenants, {replicas} replicas, load {load:g})", "",
                "| threshold (s) | " + " | ".join(m[1] for m in METRICS) + " | prefix hit | spilled (load) |",
                "|" + "---|" * (len(METRICS) + 3)]
        for r in sorted(points, key=lambda r: r["threshold"]):
            vals = " | ".join(_fmt(r[k], s) for k, _, s in METRICS)
            default = " (default)" if r["threshold"] == meta["default_threshold_s"] else ""
            out.append(f"| {r['threshold']:g}{default} | {vals} | {100 * r['prefix_hit_rate']:.1f}% | "
                       f"{r['routed'].get('load', 0)} |")
    out += ["", f"## Decision time per request ({meta['decision_replicas']} replicas, "
            f"{meta['decision_prompt_tokens']}-token prompts)", "",
            "| router | mean (µs) | P50 (µs) | P99 (µs) | CPU mean (µs) |", "|---|---|---|---|---|"]
    for policy, d in decisions.items():
        out.append(f"| {policy} | {d['mean_us']:.1f} | {d['p50_us']:.1f} | {d['p99_us']:.1f} | "
                   f"{d['cpu_mean_us']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--replicas", default="4,16")
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--workloads", default="tenants,sharegpt")
    ap.add_argument("--jobs-per-replica", type=int, default=100)
    ap.add_argument("--min-jobs", type=int, default=800, help="jobs per run at least")
    ap.add_argument("--warmup", type=float, default=0.25,
                    help="share of each run's first arrivals left out of the latency and hit figures")
    ap.add_argument("--capacity-jobs", type=int, default=300)
    ap.add_argument("--tenants", type=int, default=128)
    ap.add_argument("--prefix-min", type=int, default=500)
    ap.add_argument("--prefix-max", type=int, default=2000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--user-turn-mean", type=int, default=200)
    ap.add_argument("--pool", type=float, default=1 / 8, help="share of the device KV pool")
    ap.add_argument("--host-gib", type=float, default=4.0, help="host KV tier per replica (the engine's default)")
    ap.add_argument("--thresholds", default="0,0.25,1,inf",
                    help="prefix-aware balance thresholds to sweep (s); empty: no sweep")
    ap.add_argument("--decision-replicas", type=int, default=16)
    ap.add_argument("--decision-prompt-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.loads, args.min_jobs, args.capacity_jobs = "2", "0.9", 80, 80
        args.tenants, args.thresholds = 16, ""
    args.replicas = [int(x) for x in args.replicas.split(",")]
    args.loads = [float(x) for x in args.loads.split(",")]
    args.workloads = args.workloads.split(",")
    args.thresholds = [float(x) for x in args.thresholds.split(",") if x]
    t0 = time.perf_counter()
    pairs = load_lengths(Path(args.workload_dir) / SHAREGPT)
    needed = set(args.workloads) | ({"tenants"} if args.thresholds else set())
    capacity = {w: capacity_of(args, pairs, w) for w in sorted(needed)}
    tasks = build_tasks(args, pairs, capacity)
    print(f"{len(tasks)} cluster simulations on {args.workers} workers ...", file=sys.stderr)
    rows = []
    with ProcessPoolExecutor(args.workers) as pool:
        for row in pool.map(_run, tasks, chunksize=1):
            rows.append(row)
            print(f"{row['workload']:8s} x{row['replicas']:<2d} load {row['load']:g} {row['policy']:12s}"
                  f"{'' if row['threshold'] is None else ' threshold %g' % row['threshold']}: "
                  f"mean TTFT {row['mean_ttft_s']:.3f}s P99 {row['p99_ttft_s']:.3f}s "
                  f"hit {100 * row['prefix_hit_rate']:.1f}% ({row['wall_s']} s)", file=sys.stderr)
    order = {(w, n, x, p): i for i, (w, n, x, p) in enumerate(
        (w, n, x, p) for w in args.workloads for n in args.replicas for x in args.loads for p in POLICIES)}
    rows.sort(key=lambda r: (r["kind"], order.get((r["workload"], r["replicas"], r["load"], r["policy"]), 0),
                             r["threshold"] or 0))
    decisions = decision_time(args.decision_replicas, args.decision_prompt_tokens,
                              300 if args.quick else 3000, 64, args.seed)
    for policy, d in decisions.items():
        print(f"decision time {policy}: mean {d['mean_us']:.1f} us, P50 {d['p50_us']:.1f} us, "
              f"P99 {d['p99_us']:.1f} us, CPU mean {d['cpu_mean_us']:.1f} us "
              f"({args.decision_replicas} replicas, {args.decision_prompt_tokens}-token prompts)", file=sys.stderr)
    checks = targets(rows)
    cm = RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())
    meta = {"model": "Llama-3-8B", "device": "H100 (roofline)", "pool": args.pool,
            "num_kv_blocks": cluster_config(cm, args.pool, args.host_gib).num_kv_blocks,
            "host_gib": args.host_gib, "jobs_per_replica": args.jobs_per_replica, "min_jobs": args.min_jobs,
            "warmup": args.warmup, "default_threshold_s": DEFAULT_BALANCE_THRESHOLD_S,
            "tenants": args.tenants, "prefix_min": args.prefix_min, "prefix_max": args.prefix_max,
            "zipf": args.zipf, "user_turn_mean": args.user_turn_mean, "capacity_rps": capacity, "seed": args.seed,
            "decision_replicas": args.decision_replicas, "decision_prompt_tokens": args.decision_prompt_tokens,
            "command": " ".join(["python benchmarks/routing.py", *(argv if argv is not None else sys.argv[1:])]),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "routing_quick" if args.quick else "routing"
    rows_json = [{**r, "threshold": "inf" if r["threshold"] == math.inf else r["threshold"]} for r in rows]
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows_json, "targets": checks,
                                                  "decision_time": decisions}, indent=1))
    md = to_markdown(rows, checks, decisions, meta)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
