"""Online/offline co-serving in the simulator (ConServe §6): what a standing
offline backlog does to online latency, and how much of the machine the
backlog gets, for four designs on the same jobs:

* ``online only`` / ``offline only``: each class alone (the references)
* ``naive``: offline jobs enter as online ones (one queue, skip-join orders all)
* ``priority``: online strictly above offline, no budget
* ``priority + budget``: and ConServe's SLO-aware budget (``--online-tpot-slo-ms``)

Online: ShareGPT lengths, Gamma arrivals (CV 4: bursts and idle gaps) at a
fraction of the saturated rate. Offline: a backlog of ShareGPT-length jobs
present at t = 0. Llama-3-8B on one H100 (roofline), full KV pool plus a
64 GiB host pool (swap mode). Offline throughput is counted over the online
window (until the last online job finishes), as a fraction of what the
backlog alone completes in the same time.

    python benchmarks/coserving.py        # ~2 min on 2 cores
Writes benchmarks/results/coserving.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fluidserve.scheduler.cost_model import default_cost_model
from fluidserve.scheduler.request_state import RequestClass
from fluidserve.scheduler.simulator import SimConfig, estimate_capacity, percentile, simulate
from fluidserve.scheduler.workloads import (
    DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, empirical_lengths, gamma_arrivals, load_lengths, synthesize,
)

BLOCK = 16


def _window_tokens(res, ids: set[str], until: float) -> int:
    """Tokens (prompt + output) of the jobs in ``ids`` finished by ``until``."""
    return sum(r.prompt_tokens + r.output_tokens for r in res.records
               if r.request_id in ids and r.finish_time is not None and r.finish_time <= until)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--online-jobs", type=int, default=400)
    ap.add_argument("--offline-jobs", type=int, default=1500)
    ap.add_argument("--load", type=float, default=0.5, help="online rate as a fraction of the saturated rate")
    ap.add_argument("--tpot-slo-ms", type=float, default=40.0)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    cm = default_cost_model()
    pairs = clamp_lengths(load_lengths(Path(args.workload_dir) / SHAREGPT), 8192)
    base = dict(num_kv_blocks=cm.num_kv_blocks(BLOCK), block_size=BLOCK,
                num_host_blocks=64 * 2**30 // (BLOCK * cm.model.kv_bytes_per_token),
                max_swap_blocks_per_step=max(1, int(cm.min_iteration_time()
                                                    / cm.transfer_time(BLOCK * cm.model.kv_bytes_per_token))),
                block_transfer_time=cm.transfer_time(BLOCK * cm.model.kv_bytes_per_token))
    rate = args.load * estimate_capacity(pairs, cm, SimConfig(**base), num_jobs=300)
    online = synthesize(args.online_jobs, empirical_lengths(pairs), gamma_arrivals(rate, 4.0), seed=0)
    off_lengths = empirical_lengths(pairs)
    import random

    rng = random.Random(1)
    offline = [Job(f"off{i}", 0.0, *off_lengths(rng), RequestClass.OFFLINE) for i in range(args.offline_jobs)]
    online_ids, offline_ids = {j.request_id for j in online}, {j.request_id for j in offline}
    naive = [Job(j.request_id, j.arrival_time, j.prompt_tokens, j.output_tokens) for j in offline]

    runs = {
        "online only": (online, {}),
        "offline only": (offline, {}),
        "naive (one queue)": (online + naive, {}),
        "priority": (online + offline, {}),
        "priority + budget": (online + offline, {"online_tpot_slo_ms": args.tpot_slo_ms}),
    }
    results = {name: simulate(jobs, "skip-join-mlfq", cm, SimConfig(**base, **extra))
               for name, (jobs, extra) in runs.items()}
    end = max(r.finish_time for r in results["online only"].records)
    alone = _window_tokens(results["offline only"], offline_ids, end)
    rows = []
    for name, res in results.items():
        on = [r for r in res.records if r.request_id in online_ids]
        row = {"design": name}
        if on:
            row.update(p99_ttft_s=percentile([r.ttft for r in on], 99),
                       p99_tpot_s=percentile([r.tpot for r in on if r.output_tokens > 1], 99),
                       mean_norm_latency_s=sum(r.normalized_latency for r in on) / len(on))
        if name != "online only":
            row["offline_share"] = _window_tokens(res, offline_ids, end) / alone if alone else float("nan")
        rows.append(row)
    ref = rows[0]
    out = ["# Co-serving in the simulator (ConServe)", "",
           f"Command: `python benchmarks/coserving.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
           f"Llama-3-8B on one H100 (roofline), {args.online_jobs} online jobs (ShareGPT lengths, Gamma CV 4 at "
           f"{args.load:g} of the saturated rate, {rate:.2f} req/s), {args.offline_jobs} offline jobs at t = 0, "
           f"TPOT SLO {args.tpot_slo_ms:g} ms for the budget. Online window: {end:.0f} s.", "",
           "| design | online P99 TTFT (s) | vs online only | online P99 TPOT (ms) | vs online only | "
           "offline work in the window (share of offline only) |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "p99_ttft_s" in r:
            out.append(f"| {r['design']} | {r['p99_ttft_s']:.3f} | {r['p99_ttft_s'] / ref['p99_ttft_s']:.2f}x | "
                       f"{r['p99_tpot_s'] * 1e3:.1f} | {r['p99_tpot_s'] / ref['p99_tpot_s']:.2f}x | "
                       f"{r.get('offline_share', float('nan')):.0%} |")
        else:
            out.append(f"| {r['design']} | | | | | {r['offline_share']:.0%} |")
    md = "\n".join(out) + "\n"
    dest = Path(args.out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "coserving.json").write_text(json.dumps({"rate_rps": rate, "window_s": end, "rows": rows}, indent=1))
    (dest / "coserving.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
