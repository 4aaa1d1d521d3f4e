"""Two-tier KV on the real engine: the preemption variants of
benchmarks/swapping.py, each a real ``fluidserve serve`` process on the CPU
with a device KV pool far smaller than the load, under the same open-loop
load (serve/bench_client.py: ShareGPT lengths, Poisson arrivals, streamed).

    python benchmarks/swap_serving.py                    # ~10 min on 2 cores
    python benchmarks/swap_serving.py --num-requests 40  # smoke run

Variants: fcfs + recompute (vLLM's behaviour), skip-join + recompute,
skip-join + proactive swap with KV loans off (``--swap-loan-tokens -1``:
FastServe's rule, a request ranked higher may evict any stream), the same
with token deadlines (``--swap-tpot-slack 1.25``, scheduler/token_gap.py),
and the default flags: KV loans (``--swap-loan-tokens 32``,
scheduler/loans.py; the client sends each request's sampled output length
as ``max_tokens``), with skip-join's first-token guard on; and the default
flags with the guard off (``--mlfq-first-token-slack off``). The server and the
client share the machine's cores; every variant sees the same request
sequence (same seed). Writes benchmarks/results/swap_serving.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from dummy_models import build_model_dir
from serve_bench import bc_free_port, load, start_server, stop_server

VARIANTS = [
    ("fcfs + recompute", ["--scheduling-policy", "fcfs", "--preemption-mode", "recompute"]),
    ("skip-join + recompute", ["--preemption-mode", "recompute"]),
    ("skip-join + proactive swap, loans off", ["--swap-loan-tokens", "-1"]),
    ("skip-join + proactive swap, slack 1.25", ["--swap-tpot-slack", "1.25", "--swap-loan-tokens", "-1"]),
    ("skip-join + proactive swap, KV loans (max_tokens <= 32; default flags)", []),
    ("default flags but first-token guard off", ["--mlfq-first-token-slack", "off"]),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--num-kv-blocks", type=int, default=64, help="device KV pool (blocks of 16 tokens)")
    ap.add_argument("--num-host-blocks", type=int, default=4096)
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--request-rate", type=float, default=4.0)
    ap.add_argument("--length-scale", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help="indices into the variants to run (default: all; the first is the baseline)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    variants = VARIANTS if args.variants is None else [VARIANTS[i] for i in args.variants]
    model_dir = build_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="fluidserve-swap-")))
    engine_flags = ["--model", str(model_dir), "--load-format", "dummy", "--device", "cpu",
                    "--num-kv-blocks", str(args.num_kv_blocks), "--num-host-blocks", str(args.num_host_blocks),
                    "--max-model-len", str(args.num_kv_blocks * 16)]
    load_flags = ["--dataset", "sharegpt", "--length-scale", str(args.length_scale),
                  "--max-input-len", str(args.num_kv_blocks * 8), "--max-output-len", str(args.num_kv_blocks * 4),
                  "--num-requests", str(args.num_requests), "--request-rate", str(args.request_rate),
                  "--seed", str(args.seed), "--output", "/dev/null"]
    rows = []
    for label, flags in variants:
        port = bc_free_port()
        proc = start_server(port, engine_flags + flags)
        try:
            t0 = time.perf_counter()
            rep = load(f"http://127.0.0.1:{port}", load_flags)
            metrics = _metrics(port)
        finally:
            stop_server(proc)
        row = {"variant": label, "flags": flags, "wall_s": time.perf_counter() - t0, **metrics,
               **{k: rep[k] for k in ("completed", "failed", "request_throughput", "output_token_throughput")},
               **{k: rep[k] for k in ("ttft_ms", "tpot_ms", "normalized_latency_ms_per_token", "latency_bound_ms")}}
        rows.append(row)
        print(f"{label:44s} norm mean {row['normalized_latency_ms_per_token']['mean']:8.1f} ms/tok  "
              f"TTFT p50 {row['ttft_ms']['p50']:8.1f} p99 {row['ttft_ms']['p99']:8.1f} ms  "
              f"TPOT p99 {row['tpot_ms']['p99']:7.1f} ms  max gap p99 {row['latency_bound_ms']['p99']:8.1f} ms  "
              f"{row['request_throughput']:.2f} req/s  swaps {row['swaps']:.0f} recomputes {row['recomputes']:.0f}",
              flush=True)
    meta = {"command": "python benchmarks/swap_serving.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "engine_flags": engine_flags, "load_flags": load_flags, "python": platform.python_version(),
            "machine": platform.processor() or platform.machine()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "swap_serving.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "swap_serving.md").write_text(to_markdown(rows, meta))
    print(to_markdown(rows, meta))
    return 0


def _metrics(port: int) -> dict[str, float]:
    """The server's own swap and preemption counters."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {"swaps": 0.0, "recomputes": 0.0, "swap_stall_s": 0.0}
    for fam in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{port}/metrics").text):
        for s in fam.samples:
            if s.name == "fluidserve_swaps_total":
                out["swaps"] = s.value
            elif s.name == "fluidserve_preemptions_by_kind_total" and s.labels.get("kind") == "recompute":
                out["recomputes"] = s.value
            elif s.name == "fluidserve_swap_stall_seconds_total":
                out["swap_stall_s"] = s.value
    return out


def to_markdown(rows: list[dict], meta: dict) -> str:
    b = rows[0]
    out = ["# Two-tier KV on the real engine (CPU)", "",
           f"Command: `{meta['command']}`. Server flags: `{' '.join(meta['engine_flags'])}`; load: "
           f"`{' '.join(meta['load_flags'])}`. Server and client share the machine ({meta['machine']}).", "",
           "| variant | mean norm (ms/tok) | P99 norm | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p99 (ms) "
           "| max token gap p99 (ms) | req/s | swaps | recomputes | swap stall (s) "
           "| fcfs+recompute / this: mean norm | P99 TTFT | this / fcfs+recompute: P99 TPOT |", "|" + "---|" * 14]
    bn, bt, bp = b["normalized_latency_ms_per_token"], b["ttft_ms"], b["tpot_ms"]
    for r in rows:
        n, t, p = r["normalized_latency_ms_per_token"], r["ttft_ms"], r["tpot_ms"]
        gap = r.get("latency_bound_ms", {}).get("p99", float("nan"))
        out.append(f"| {r['variant']} | {n['mean']:.1f} | {n['p99']:.1f} | {t['p50']:.0f} | {t['p99']:.0f} | "
                   f"{p['p99']:.1f} | {gap:.0f} | {r['request_throughput']:.2f} | {r['swaps']:.0f} | "
                   f"{r['recomputes']:.0f} | {r['swap_stall_s']:.2f} | {bn['mean'] / n['mean']:.2f}x | "
                   f"{bt['p99'] / t['p99']:.2f}x | {p['p99'] / bp['p99']:.2f}x |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
