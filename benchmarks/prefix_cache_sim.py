"""Prefix caching across both KV tiers, in the simulator: many tenants (or
agents), each with its own long system prompt, more system prompts than the
device KV pool can keep cached next to the running work.

Three variants on the same jobs (Llama-3-8B on an H100 with a fraction of its
KV pool, skip-join MLFQ with proactive swapping and KV loans, a 64 GiB host
pool):

* ``cache off``             every prompt is computed from its first token
* ``device cache``          prefix caching on the device only: a system prompt
                            whose blocks the device reused is computed again
* ``device + host cache``   freed cached blocks are demoted to the host; a
                            prompt found there comes back by copy

Each job's prompt is one of ``--groups`` system prompts (``--prefix-tokens``
each, picked with Zipf popularity) followed by a ShareGPT prompt of its own;
ShareGPT output lengths. Load = arrival rate / saturated throughput with the
cache off.

    python benchmarks/prefix_cache_sim.py            # ~5 min on 2 cores
    python benchmarks/prefix_cache_sim.py --quick    # smoke run

Writes benchmarks/results/prefix_cache_sim.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

from swapping import BLOCK, sim_config

from fluidserve.scheduler.cost_model import DeviceSpec, ModelShape, RooflineCostModel
from fluidserve.scheduler.simulator import Simulator, estimate_capacity
from fluidserve.scheduler.workloads import (
    DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, empirical_lengths, load_lengths, poisson_arrivals,
)

POLICY = "skip-join-mlfq"
VARIANTS = [  # (label, prefix caching, cache on host)
    ("cache off", False, False),
    ("device cache", True, False),
    ("device + host cache", True, True),
]
METRICS = [("mean_ttft_s", "mean TTFT (s)", 1.0), ("p50_ttft_s", "P50 TTFT (s)", 1.0),
           ("p99_ttft_s", "P99 TTFT (s)", 1.0), ("mean_norm_latency_s", "mean norm (ms/tok)", 1e3),
           ("throughput_rps", "req/s", 1.0)]


def make_jobs(n: int, rate: float, pairs: list[tuple[int, int]], groups: int, prefix_tokens: int,
              max_len: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    sample = empirical_lengths(pairs)
    arrive = poisson_arrivals(rate)
    weights = [1 / (g + 1) for g in range(groups)]  # Zipf(1): a few hot prompts, a long tail
    jobs, t = [], 0.0
    for i in range(n):
        t += arrive(rng)
        own, out = sample(rng)
        own = min(own, max_len - prefix_tokens - out)
        group = rng.choices(range(groups), weights)[0]
        jobs.append(Job(f"j{i}", t, prefix_tokens + max(1, own), out, shared_prefix=(group, prefix_tokens)))
    return jobs


def run_variant(jobs: list[Job], cm: RooflineCostModel, pool: float, caching: bool, on_host: bool) -> dict:
    cfg = sim_config(cm, pool, "swap", True).replace(enable_prefix_caching=caching, cache_on_host=on_host)
    sim = Simulator(jobs, POLICY, cm, cfg)
    t0 = time.perf_counter()
    res = sim.run()
    s = res.summary()
    ttfts = sorted(r.ttft for r in res.records if r.finish_time is not None)
    st = sim.kv.prefix_stats
    q = st.query_tokens or 1
    return {**s, "p50_ttft_s": ttfts[len(ttfts) // 2], "num_kv_blocks": cfg.num_kv_blocks,
            "device_hit_rate": st.hit_tokens / q, "host_hit_rate": st.host_hit_tokens / q,
            "demoted_blocks": st.demoted_blocks, "evicted_blocks": st.evicted_blocks,
            "wall_s": round(time.perf_counter() - t0, 2)}


def to_markdown(rows: list[dict], meta: dict) -> str:
    out = ["# Prefix caching across both KV tiers, in the simulator", "",
           f"{meta['model']} on {meta['device']} with {meta['pool']:g} of its KV pool "
           f"({rows[0]['num_kv_blocks']} blocks of {BLOCK} tokens), 64 GiB host pool, {POLICY} with proactive "
           f"swapping and KV loans (the default flags). {meta['num_jobs']} jobs; each prompt = one of "
           f"{meta['groups']} system prompts of "
           f"{meta['prefix_tokens']} tokens (Zipf popularity) + its own ShareGPT prompt; ShareGPT outputs. "
           f"Load = arrival rate / saturated throughput with the cache off ({meta['capacity_rps']:.2f} req/s).",
           f"Command: `{meta['command']}` ({meta['wall_s']:.0f} s wall).", "",
           "| load | variant | " + " | ".join(m[1] for m in METRICS)
           + " | device hit | host hit | demoted blocks | mean TTFT vs cache off |",
           "|" + "---|" * (len(METRICS) + 6)]
    base = {r["load"]: r["mean_ttft_s"] for r in rows if r["variant"] == VARIANTS[0][0]}
    for r in rows:
        vals = " | ".join(f"{r[k] * s:.3g}" for k, _, s in METRICS)
        out.append(f"| {r['load']:g} | {r['variant']} | {vals} | {100 * r['device_hit_rate']:.1f}% | "
                   f"{100 * r['host_hit_rate']:.1f}% | {r['demoted_blocks']} | "
                   f"{base[r['load']] / r['mean_ttft_s']:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--num-jobs", type=int, default=800)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--pool", type=float, default=1 / 8, help="share of the device KV pool")
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_jobs, args.loads = 200, "0.9"
    loads = [float(x) for x in args.loads.split(",")]
    t0 = time.perf_counter()
    model, device, max_len = ModelShape.llama3_8b(), DeviceSpec.h100(), 8192
    cm = RooflineCostModel(model, device)
    pairs = clamp_lengths(load_lengths(Path(args.workload_dir) / SHAREGPT), max_len - args.prefix_tokens)
    with_prefix = [(p + args.prefix_tokens, o) for p, o in pairs]
    cap = estimate_capacity(with_prefix, cm, sim_config(cm, args.pool, "swap", True), num_jobs=200)
    rows = []
    for load in loads:
        jobs = make_jobs(args.num_jobs, load * cap, pairs, args.groups, args.prefix_tokens, max_len, args.seed)
        for label, caching, on_host in VARIANTS:
            row = {"load": load, "variant": label, **run_variant(jobs, cm, args.pool, caching, on_host)}
            rows.append(row)
            print(f"load {load:g} {label:22s} mean TTFT {row['mean_ttft_s']:.3f}s P99 {row['p99_ttft_s']:.3f}s "
                  f"host hit {100 * row['host_hit_rate']:.1f}% ({row['wall_s']} s)", file=sys.stderr)
    meta = {"model": "Llama-3-8B", "device": "H100 (roofline)", "pool": args.pool, "num_jobs": args.num_jobs,
            "groups": args.groups, "prefix_tokens": args.prefix_tokens, "capacity_rps": cap, "seed": args.seed,
            "command": "python benchmarks/prefix_cache_sim.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "prefix_cache_sim_quick" if args.quick else "prefix_cache_sim"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = to_markdown(rows, meta)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
