"""Data-parallel replicas on the real engine, through the server: what
``--data-parallel-size 2`` buys against one engine, side by side in one run.

Both servers serve the same dummy-weight model (``--preset``, default
``cpu-small``) and get the same load from ``fluidserve bench``; each figure
is a ratio of the two in this run, after a warm-up load on each server that
is not measured:

* saturation: every request at once; output tokens/s (2 replicas of one torch
  thread each against one engine of one torch thread: the replicas' gain is
  what a second engine adds, not more threads for one);
* shared prefix: requests sharing a long prefix, all at once; the prefix
  cache hit rate summed over the replicas (``vllm:prefix_cache_*`` of every
  ``engine``) against the single engine's, and the router's prefix share;
* light load: requests one at a time at a low rate; mean TTFT (what the extra
  hop from the front end to a replica's actor costs, with the rest of the
  server around it);
* the hop alone, in this process: one-token requests on the built-in tiny
  model, one at a time, and the gaps between streamed outputs, through an
  in-process ``AsyncEngine`` and through 2 replicas, over the replica
  channel and over Ray calls.

    python benchmarks/data_parallel.py [--preset cpu-small] [--rounds 2]
    python benchmarks/data_parallel.py --hop-only

Writes benchmarks/results/data_parallel-<device>.{json,md} (data_parallel-hop.* with --hop-only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from dummy_models import PRESETS, build_model_dir, device_slug, save_results

ROOT = Path(__file__).resolve().parents[1]
SERVE_ARGS = ["--load-format", "dummy", "--device", "cpu", "--max-model-len", "2048", "--swap-space", "0",
              "--max-num-seqs", "64"]
WORKLOADS = {
    "saturation": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
                   "--num-requests", "96", "--request-rate", "inf"],
    "shared-prefix": ["--dataset-name", "random", "--random-prefix-len", "512", "--random-input-len", "64",
                      "--random-output-len", "16", "--num-requests", "64", "--request-rate", "inf"],
    "light-load": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16",
                   "--num-requests", "16", "--request-rate", "0.5"],
}
# Run first on every server and not measured: a cold server's first steps
# (allocator growth, thread pools, each replica actor's first calls) would
# otherwise land in whichever workload runs first.
WARM_UP = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "16",
           "--num-requests", "32", "--request-rate", "inf"]
SETUPS = {"one engine": [], "2 replicas": ["--data-parallel-size", "2"]}


def start(model_dir: Path, extra: list[str], port: int, log: Path) -> subprocess.Popen:
    # One torch thread per engine: the single engine's own, and (split by
    # the server among the replicas) each replica's on two cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if not extra else dict(os.environ)
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", str(model_dir), *SERVE_ARGS, *extra,
           "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not become healthy")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def metrics(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def total(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def bench(port: int, model_dir: Path, workload: str, out: Path, seed: int) -> dict:
    load = WARM_UP if workload == "warm-up" else WORKLOADS[workload]
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
           "--tokenizer", str(model_dir), *load, "--ignore-eos", "--seed", str(seed),
           "--output", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_setup(name: str, model_dir: Path, tmp: Path, port: int, seed: int) -> dict:
    proc = start(model_dir, SETUPS[name], port, tmp / f"{name}.log")
    try:
        row: dict = {}
        bench(port, model_dir, "warm-up", tmp / f"{name}-warm-up.json", 10_000 + seed)
        for k, workload in enumerate(WORKLOADS):
            before = metrics(port)
            # Each workload its own random prompts: none hits what an earlier one cached.
            r = bench(port, model_dir, workload, tmp / f"{name}-{workload}.json", seed * len(WORKLOADS) + k)
            after = metrics(port)
            row[workload] = {
                "output_throughput": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
                "p99_ttft_ms": r["p99_ttft_ms"], "completed": r["completed"],
                "prefix_hit_rate": (total(after, "vllm:prefix_cache_hits_total")
                                    - total(before, "vllm:prefix_cache_hits_total"))
                / max(1.0, total(after, "vllm:prefix_cache_queries_total")
                      - total(before, "vllm:prefix_cache_queries_total")),
                "routed_prefix": sum(v - before.get(k, 0.0) for k, v in after.items()
                                     if k.startswith("fluidserve_router_requests_total") and 'reason="prefix"' in k),
            }
            print(f"{name:>10} {workload:>13}: {row[workload]}", flush=True)
        return row
    finally:
        stop(proc)


def hop_latency(requests: int = 60, streams: int = 10) -> dict[str, dict[str, float]]:
    """Through an in-process ``AsyncEngine``, and through 2 replicas whose
    requests and outputs take the replica channel (Unix sockets) or Ray
    calls: the median ms from add to the finished output of a one-token
    request, one at a time, and the gaps between the streamed outputs of
    16-token requests (median and P90: outputs that wait for a poll come
    bunched, a gap near zero after a long one)."""
    import asyncio

    import numpy as np

    from fluidserve.engine.async_engine import AsyncEngine
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.data_parallel import DataParallelEngine
    from fluidserve.engine.engine import LLMEngine
    from fluidserve.engine.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sixteen = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    flags = dict(device="cpu", num_kv_blocks=64, max_model_len=128, swap_space=0)

    async def measure(front) -> dict[str, float]:
        front.start()
        await asyncio.sleep(0.5)  # the replicas' channels open
        hops, gaps = [], []
        for i in range(requests):
            start = time.perf_counter()
            async for _ in await front.add_request(f"hop-{i}", [1, 2, 3, 4 + i % 50] * 8, one):
                pass
            hops.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.02)
        for i in range(streams):
            last = None
            async for _ in await front.add_request(f"stream-{i}", [5, 6, 7, 8 + i % 50] * 8, sixteen):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now - last) * 1e3)
                last = now
            await asyncio.sleep(0.02)
        await front.shutdown()
        return {"hop_ms": statistics.median(hops[5:]),  # the first few warm the caches
                "gap_median_ms": float(np.median(gaps)), "gap_p90_ms": float(np.percentile(gaps, 90))}

    import ray
    import torch

    torch.set_num_threads(1)
    figures = {"in-process": asyncio.run(measure(AsyncEngine(LLMEngine(EngineConfig.create(**flags)))))}
    for name, transport in (("2 replicas, sockets", "auto"), ("2 replicas, Ray calls", "ray-calls")):
        config = EngineConfig.create(**flags, data_parallel_size=2, ray_transport=transport)
        figures[name] = asyncio.run(measure(DataParallelEngine(config, torch_threads=1)))
        ray.shutdown()
    return figures


def hop_table(hop: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| path | one-token request ms | streamed gap median ms | streamed gap P90 ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {f['hop_ms']:.2f} | {f['gap_median_ms']:.2f} | {f['gap_p90_ms']:.2f} |"
              for name, f in hop.items()]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu-small")
    ap.add_argument("--rounds", type=int, default=2, help="each round runs both setups, alternating their order")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "data_parallel-cpu")
    ap.add_argument("--hop-only", action="store_true",
                    help="only the hop, in this process: writes data_parallel-hop.{json,md}")
    args = ap.parse_args()
    hop = hop_latency()
    print("\n".join(hop_table(hop)), flush=True)
    if args.hop_only:
        lines = ["# The hop to a data-parallel replica, in one process", "",
                 "One-token requests one at a time (median of 55), and the gaps between the streamed outputs of "
                 "ten 16-token requests, on the built-in tiny model (one torch thread an engine): an in-process "
                 "`AsyncEngine` against 2 replicas whose requests and outputs take the replica channel "
                 "(`--ray-transport auto`, Unix sockets, outputs pushed) or Ray calls (`--ray-transport "
                 "ray-calls`, outputs by long polling).", "", *hop_table(hop), "",
                 f"`python benchmarks/data_parallel.py --hop-only` on {os.cpu_count()} cores."]
        save_results(args.output.parent / "data_parallel-hop", {"cores": os.cpu_count(), "hop": hop},
                     "\n".join(lines) + "\n")
        return 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = build_model_dir(args.preset, tmp / "model")
        rounds = []
        for i in range(args.rounds):
            order = list(SETUPS) if i % 2 == 0 else list(SETUPS)[::-1]
            rounds.append({name: run_setup(name, model_dir, tmp, args.port, seed=i) for name in order})
    one, two = "one engine", "2 replicas"

    def med(workload: str, key: str, setup: str) -> float:
        return statistics.median(r[setup][workload][key] for r in rounds)

    figures = {
        "throughput_ratio": med("saturation", "output_throughput", two) / med("saturation", "output_throughput", one),
        "prefix_hit_rate": {one: med("shared-prefix", "prefix_hit_rate", one),
                            two: med("shared-prefix", "prefix_hit_rate", two)},
        "light_load_ttft_ratio": med("light-load", "mean_ttft_ms", two) / med("light-load", "mean_ttft_ms", one),
        "hop_ms": hop,
    }
    lines = [f"# Data-parallel replicas against one engine ({args.preset}, {len(rounds)} rounds, medians)", "",
             "| workload | figure | one engine | 2 replicas | 2 replicas / one |", "|---|---|---|---|---|"]
    for workload, key, unit in (("saturation", "output_throughput", "output tok/s"),
                                ("shared-prefix", "prefix_hit_rate", "prefix hit rate"),
                                ("shared-prefix", "mean_ttft_ms", "mean TTFT ms"),
                                ("light-load", "mean_ttft_ms", "mean TTFT ms"),
                                ("light-load", "p99_ttft_ms", "P99 TTFT ms")):
        a, b = med(workload, key, one), med(workload, key, two)
        lines.append(f"| {workload} | {unit} | {a:.3g} | {b:.3g} | {b / a if a else float('nan'):.2f}x |")
    lines += ["", f"Saturation throughput: {figures['throughput_ratio']:.2f}x one engine (target >= 1.7x). "
              f"Shared-prefix hit rate: {figures['prefix_hit_rate'][two]:.1%} against "
              f"{figures['prefix_hit_rate'][one]:.1%} (target: within 10%). Light-load TTFT: "
              f"{figures['light_load_ttft_ratio']:.2f}x (target: within 1.05x). The hop alone, in one process "
              "(tiny model; one-token requests one at a time, medians; gaps between streamed outputs):", "",
              *hop_table(hop), "",
              "The servers' replicas take the replica channel (`--ray-transport auto`).",
              "", "Each engine computes on one torch thread; `python benchmarks/data_parallel.py` "
              f"on {os.cpu_count()} cores."]
    record = {"preset": args.preset, "device": device_slug("cpu"), "cores": os.cpu_count(), "rounds": rounds,
              "figures": figures, "workloads": WORKLOADS}
    save_results(args.output, record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
