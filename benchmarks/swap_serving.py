"""Two-tier KV on the real engine: the preemption variants of
benchmarks/swapping.py, each a real ``fluidserve serve`` process on the CPU
with a device KV pool far smaller than the load, under the same open-loop
load (serve/bench_client.py: ShareGPT lengths, Poisson arrivals, streamed),
or with ``--workload chat`` closed-loop conversations (the simulator's chat
mix, benchmarks/swapping.py: each turn resends the conversation's opening
context and history, the replies as the server returned them, so the prefix
cache, device and host tiers, serves what it still holds).

    python benchmarks/swap_serving.py                    # ~10 min on 2 cores
    python benchmarks/swap_serving.py --workload chat    # conversations
    python benchmarks/swap_serving.py --num-requests 40  # smoke run
    python benchmarks/swap_serving.py --load 0.9         # 0.9 of what fcfs serves here

Variants: fcfs + recompute (vLLM's behaviour), skip-join + recompute,
skip-join + proactive swap with KV loans off (``--swap-loan-tokens -1``:
FastServe's rule, a request ranked higher may evict any stream), the same
with token deadlines (``--swap-tpot-slack 1.25``, scheduler/token_gap.py),
and the default flags: KV loans (``--swap-loan-tokens 32``,
scheduler/loans.py; the client sends each request's sampled output length
as ``max_tokens``), with skip-join's first-token guard on; and the default
flags with the guard off (``--mlfq-first-token-slack off``); and the default
flags with backfilling off (``--no-swap-backfill``: a request with no token
out waits for the blocks owed to streams on the host even where it would
leave before they could come back). ``--baseline-again`` runs the baseline
once more on each seed, last: near capacity a run's tail turns on which
long prompts happen to queue together, and the baseline against itself shows
how far a figure moves between two runs of one server. The server and the
client share the machine's cores; every variant sees the same request
sequence (same seed). Each run keeps its requests' figures, so the summary
gives the ratios both as medians over seeds and over all seeds' requests
pooled, and splits the TTFT of a ShareGPT load by prompt length. Writes
benchmarks/results/swap_serving.{json,md} (swap_serving_chat.* for the
conversations).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dummy_models import build_model_dir
from serve_bench import bc_free_port, load, start_server, stop_server

# The engine's device pool and the load's lengths (benchmarks/swapping.py
# models the same regime): ShareGPT lengths x0.2, prompts cut to half the
# pool and outputs to a quarter.
NUM_KV_BLOCKS, LENGTH_SCALE = 64, 0.2


def length_limits(num_kv_blocks: int) -> tuple[int, int]:
    """--max-input-len and --max-output-len of the load on a pool of ``num_kv_blocks`` blocks of 16 tokens."""
    return num_kv_blocks * 8, num_kv_blocks * 4


VARIANTS = [
    ("fcfs + recompute", ["--scheduling-policy", "fcfs", "--preemption-mode", "recompute"]),
    ("skip-join + recompute", ["--preemption-mode", "recompute"]),
    ("skip-join + proactive swap, loans off", ["--swap-loan-tokens", "-1"]),
    ("skip-join + proactive swap, slack 1.25", ["--swap-tpot-slack", "1.25", "--swap-loan-tokens", "-1"]),
    ("skip-join + proactive swap, KV loans (max_tokens <= 32; default flags)", []),
    ("default flags but first-token guard off", ["--mlfq-first-token-slack", "off"]),
    ("default flags but backfilling off", ["--no-swap-backfill"]),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--workload", choices=["sharegpt", "chat"], default="sharegpt")
    ap.add_argument("--num-kv-blocks", type=int, default=NUM_KV_BLOCKS, help="device KV pool (blocks of 16 tokens)")
    ap.add_argument("--num-host-blocks", type=int, default=4096)
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--load", type=float, default=None,
                    help="ShareGPT: offer this fraction of what fcfs + recompute serves, measured first on this "
                         "machine (the load's requests all at once, the first seed), instead of --request-rate")
    ap.add_argument("--length-scale", type=float, default=LENGTH_SCALE)
    ap.add_argument("--think-s", type=float, default=8.0, help="chat: mean think time between turns")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0],
                    help="one run of every variant per seed; the summary gives the medians of the paired ratios")
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help="indices into the variants to run (default: all; the first is the baseline)")
    ap.add_argument("--baseline-again", action="store_true",
                    help="run the baseline a second time on every seed, last: its ratios against the first run "
                         "are what the same server's figures move between two runs (the noise floor)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    variants = VARIANTS if args.variants is None else [VARIANTS[i] for i in args.variants]
    if args.baseline_again:
        variants = [*variants, (f"{variants[0][0]}, again", variants[0][1])]
    model_dir = build_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="fluidserve-swap-")))
    engine_flags = ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                    "--num-kv-blocks", str(args.num_kv_blocks), "--num-host-blocks", str(args.num_host_blocks),
                    "--max-model-len", str(args.num_kv_blocks * 16)]
    workload = ["--dataset", "sharegpt"] if args.workload == "sharegpt" else [
        "--dataset", "chat", "--chat-think-s", str(args.think_s)]
    max_input, max_output = length_limits(args.num_kv_blocks)
    lengths = [*workload, "--length-scale", str(args.length_scale), "--max-input-len", str(max_input),
               "--max-output-len", str(max_output), "--num-requests", str(args.num_requests), "--output", "/dev/null"]
    capacity = None
    if args.load is not None:
        if args.workload != "sharegpt":
            ap.error("--load: ShareGPT only (a conversation's turns wait for their replies)")
        capacity = measure_capacity(engine_flags, [*lengths, "--seed", str(args.seeds[0])])
        args.request_rate = round(args.load * capacity, 3)
        print(f"fcfs + recompute serves {capacity:.3f} req/s: offering {args.request_rate} req/s", flush=True)
    load_flags = [*lengths, "--request-rate", str(args.request_rate)]
    rows = []
    for seed, (label, flags) in ((seed, v) for seed in args.seeds for v in variants):
        port = bc_free_port()
        proc = start_server(port, engine_flags + flags)
        try:
            t0 = time.perf_counter()
            rep = load(f"http://127.0.0.1:{port}", [*load_flags, "--seed", str(seed)], per_request=True)
            metrics = _metrics(port)
        finally:
            stop_server(proc)
        row = {"variant": label, "seed": seed, "flags": flags, "wall_s": time.perf_counter() - t0, **metrics,
               **{k: rep[k] for k in ("completed", "failed", "request_throughput", "output_token_throughput")},
               **{k: rep[k] for k in ("ttft_ms", "tpot_ms", "normalized_latency_ms_per_token", "latency_bound_ms",
                                      "per_request")}}
        rows.append(row)
        print(f"seed {seed} {label:44s} norm mean {row['normalized_latency_ms_per_token']['mean']:8.1f} ms/tok  "
              f"TTFT p50 {row['ttft_ms']['p50']:8.1f} p99 {row['ttft_ms']['p99']:8.1f} ms  "
              f"TPOT p99 {row['tpot_ms']['p99']:7.1f} ms  max gap p99 {row['latency_bound_ms']['p99']:8.1f} ms  "
              f"{row['request_throughput']:.2f} req/s  swaps {row['swaps']:.0f} recomputes {row['recomputes']:.0f}",
              flush=True)
    meta = {"command": "python benchmarks/swap_serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "engine_flags": engine_flags, "load_flags": load_flags, "load": args.load, "capacity_rps": capacity,
            "python": platform.python_version(),
            "machine": platform.processor() or platform.machine()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "swap_serving" if args.workload == "sharegpt" else "swap_serving_chat"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "summary": summary(rows), "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(to_markdown(rows, meta))
    print(to_markdown(rows, meta))
    return 0


def measure_capacity(engine_flags: list[str], load_flags: list[str]) -> float:
    """Requests per second fcfs + recompute completes when the load's
    requests all arrive at once: the rate ``--load`` is a fraction of."""
    port = bc_free_port()
    proc = start_server(port, engine_flags + VARIANTS[0][1])
    try:
        rep = load(f"http://127.0.0.1:{port}", [*load_flags, "--request-rate", "inf"])
    finally:
        stop_server(proc)
    if rep["failed"]:
        raise RuntimeError(f"capacity run: {rep['failed']} requests failed")
    return rep["request_throughput"]


def _metrics(port: int) -> dict[str, float]:
    """The server's own swap and preemption counters."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {"swaps": 0.0, "recomputes": 0.0, "swap_stall_s": 0.0, "prompt_tokens": 0.0, "device_hits": 0.0,
           "host_hits": 0.0}
    for fam in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text):
        for s in fam.samples:
            if s.name == "fluidserve_prefix_cache_queries_total" and s.labels.get("tier") == "device":
                out["prompt_tokens"] = s.value  # every prompt token is looked up on the device first
            elif s.name == "fluidserve_prefix_cache_hits_total":
                out[f"{s.labels.get('tier')}_hits"] = s.value
            elif s.name == "fluidserve_swaps_total":
                out["swaps"] = s.value
            elif s.name == "fluidserve_preemptions_by_kind_total" and s.labels.get("kind") == "recompute":
                out["recomputes"] = s.value
            elif s.name == "fluidserve_swap_stall_seconds_total":
                out["swap_stall_s"] = s.value
    return out


def _cached(r: dict) -> str:
    if not r.get("prompt_tokens"):
        return "-"
    n = r["prompt_tokens"]
    return f"{(r['device_hits'] + r['host_hits']) / n:.0%} ({r['host_hits'] / n:.0%} host)"


def ratios(row: dict, base: dict) -> tuple[float, float, float]:
    """fcfs + recompute / this on mean normalized latency and P99 TTFT (above
    1: better), this / fcfs + recompute on P99 TPOT (below 1: better)."""
    n, t, p = row["normalized_latency_ms_per_token"], row["ttft_ms"], row["tpot_ms"]
    bn, bt, bp = base["normalized_latency_ms_per_token"], base["ttft_ms"], base["tpot_ms"]
    return bn["mean"] / n["mean"], bt["p99"] / t["p99"], p["p99"] / bp["p99"]


def summary(rows: list[dict]) -> list[dict]:
    """Per variant, each seed's three ratios against the first variant on
    the same seed, and their medians."""
    base_of = {r["seed"]: r for r in rows if r["variant"] == rows[0]["variant"]}
    out = []
    for label in dict.fromkeys(r["variant"] for r in rows):
        per_seed = [ratios(r, base_of[r["seed"]]) for r in rows if r["variant"] == label]
        keys = ("mean_norm", "p99_ttft", "p99_tpot")
        out.append({"variant": label, **{k: statistics.median(x) for k, x in zip(keys, zip(*per_seed))},
                    **{f"{k}_seeds": list(x) for k, x in zip(keys, zip(*per_seed))},
                    **pooled(rows, label)})
        again = f"{rows[0]['variant']}, again"
        if label not in (rows[0]["variant"], again) and any(r["variant"] == again for r in rows):
            # Both baseline runs' requests together: a baseline that moves between runs counted once each way.
            both = pooled(rows, label, (rows[0]["variant"], again))
            out[-1].update({k.replace("pooled_", "pooled_both_"): v for k, v in both.items()})
    return out


def pooled(rows: list[dict], label: str, base_labels: tuple[str, ...] | None = None) -> dict:
    """The same three ratios with every seed's requests pooled before the
    mean and the percentiles are taken (a seed's P99 of 120 requests is its
    second-worst request; pooled, it is a percentile of them all), against
    the rows of ``base_labels`` (the first variant's by default). Empty
    where a row lacks its requests' figures."""
    mine = [r for r in rows if r["variant"] == label]
    base_labels = base_labels or (rows[0]["variant"],)
    base = [r for r in rows if r["variant"] in base_labels and r["seed"] in {m["seed"] for m in mine}]
    if not all("per_request" in r for r in mine + base):
        return {}

    def fig(rs: list[dict], key: str, stat: str) -> float:
        xs = [x for r in rs for x in r["per_request"][key]]
        return float(np.mean(xs)) if stat == "mean" else float(np.percentile(xs, 99))

    return {"pooled_requests": sum(len(r["per_request"]["ttft_ms"]) for r in mine),
            "pooled_mean_norm": fig(base, "norm_ms", "mean") / fig(mine, "norm_ms", "mean"),
            "pooled_p99_ttft": fig(base, "ttft_ms", "p99") / fig(mine, "ttft_ms", "p99"),
            "pooled_p99_tpot": fig(mine, "tpot_ms", "p99") / fig(base, "tpot_ms", "p99")}


def ttft_by_prompt(rows: list[dict], load_flags: list[str]) -> list[dict]:
    """Per variant, TTFT over every seed's requests split by prompt length:
    prompts cut to ``--max-input-len`` and the shorter rest. Empty for
    conversations (a turn's prompt is its history) or rows without their
    requests' figures."""
    if "sharegpt" not in load_flags or not all("prompt_len" in r.get("per_request", {}) for r in rows):
        return []
    cap = int(load_flags[load_flags.index("--max-input-len") + 1])
    out = []
    for label in dict.fromkeys(r["variant"] for r in rows):
        split: dict[bool, list[float]] = {True: [], False: []}
        for r in (r for r in rows if r["variant"] == label):
            for ttft, n in zip(r["per_request"]["ttft_ms"], r["per_request"]["prompt_len"], strict=True):
                split[n >= cap].append(ttft)
        out.append({"variant": label, "cap": cap, **{
            f"{key}_{stat}": (len(xs) if stat == "n" else float(np.mean(xs)) if stat == "mean"
                              else float(np.percentile(xs, 99))) if xs else float("nan")
            for key, xs in (("capped", split[True]), ("shorter", split[False])) for stat in ("n", "mean", "p99")}})
    return out


def split_table(split: list[dict]) -> tuple[list[str], list[list]]:
    """``ttft_by_prompt``'s figures as a table's header and rows."""
    cap = split[0]["cap"]
    heads = ["variant", f"at {cap}: requests", "mean TTFT (ms)", "P99 TTFT (ms)", "shorter: requests",
             "mean TTFT (ms)", "P99 TTFT (ms)"]
    return heads, [[d["variant"], *(d[f"{k}_{stat}"] for k in ("capped", "shorter") for stat in ("n", "mean", "p99"))]
                   for d in split]


def to_markdown(rows: list[dict], meta: dict) -> str:
    seeds = sorted({r["seed"] for r in rows})
    out = ["# Two-tier KV on the real engine (CPU)", "",
           f"Command: `{meta['command']}`. Server flags: `{' '.join(meta['engine_flags'])}`; load: "
           f"`{' '.join(meta['load_flags'])}` (seeds {', '.join(map(str, seeds))}). Server and client share the "
           f"machine ({meta['machine']}).", ""]
    if meta.get("load") is not None:
        out[-2] += (f" The rate is {meta['load']:g} of the {meta['capacity_rps']:.3f} req/s fcfs + recompute "
                    "completed with the same requests all sent at once, measured first.")
    base_of = {r["seed"]: r for r in rows if r["variant"] == rows[0]["variant"]}
    if len(seeds) > 1:
        out += [f"Medians over seeds of each seed's ratio against {rows[0]['variant']} (the seeds' own in brackets); "
                "pooled: the ratios of the figures over every seed's requests together.",
                "", "| variant | mean norm (fcfs / this) | P99 TTFT (fcfs / this) | P99 TPOT (this / fcfs) "
                "| pooled: mean norm / P99 TTFT / P99 TPOT |", "|---|---|---|---|---|"]
        summed = summary(rows)
        for s in summed:
            cells = [f"{s[k]:.2f}x [{' / '.join(f'{v:.2f}' for v in s[k + '_seeds'])}]"
                     for k in ("mean_norm", "p99_ttft", "p99_tpot")]
            cells.append(" / ".join(f"{s[k]:.2f}x" for k in ("pooled_mean_norm", "pooled_p99_ttft", "pooled_p99_tpot"))
                         + f" ({s['pooled_requests']} requests)" if "pooled_requests" in s else "-")
            out.append(f"| {s['variant']} | {' | '.join(cells)} |")
        out.append("")
        both = [s for s in summed if "pooled_both_requests" in s]
        if both:
            out += [f"Against both runs of {rows[0]['variant']} pooled (every seed's requests of each):", "",
                    "| variant | mean norm | P99 TTFT | P99 TPOT |", "|---|---|---|---|"]
            out += [f"| {s['variant']} | " + " | ".join(f"{s['pooled_both_' + k]:.2f}x" for k in
                                                        ("mean_norm", "p99_ttft", "p99_tpot")) + " |" for s in both]
            out.append("")
    split = ttft_by_prompt(rows, meta["load_flags"])
    if split:
        heads, cells = split_table(split)
        out += [f"TTFT by prompt length, every seed's requests together: prompts cut to {split[0]['cap']} tokens "
                "(`--max-input-len`) and the shorter rest.", "",
                "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        out += ["| " + " | ".join(c if isinstance(c, str) else f"{c:.0f}" for c in row) + " |" for row in cells]
        out.append("")
    out += ["| seed | variant | mean norm (ms/tok) | P99 norm | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p99 (ms) "
           "| max token gap p99 (ms) | req/s | swaps | recomputes | swap stall (s) | prompt tokens cached "
           "| fcfs+recompute / this: mean norm | P99 TTFT | this / fcfs+recompute: P99 TPOT |", "|" + "---|" * 16]
    for r in rows:
        n, t, p = r["normalized_latency_ms_per_token"], r["ttft_ms"], r["tpot_ms"]
        gap = r.get("latency_bound_ms", {}).get("p99", float("nan"))
        rn, rt, rp = ratios(r, base_of[r["seed"]])
        out.append(f"| {r['seed']} | {r['variant']} | {n['mean']:.1f} | {n['p99']:.1f} | {t['p50']:.0f} | "
                   f"{t['p99']:.0f} | "
                   f"{p['p99']:.1f} | {gap:.0f} | {r['request_throughput']:.2f} | {r['swaps']:.0f} | "
                   f"{r['recomputes']:.0f} | {r['swap_stall_s']:.2f} | {_cached(r)} | {rn:.2f}x | "
                   f"{rt:.2f}x | {rp:.2f}x |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
