"""A CPU decode step, by where the engine was built and how idle OpenMP
threads wait.

``fluidserve serve`` steps its engine on a thread of its own. OpenMP gives
every thread that computes a team of its own threads; with two teams (the
engine built on the main thread, stepped on another) it counts more threads
than cores and cuts every idle thread's spin short, so each op pays a
wake-up, as with ``OMP_WAIT_POLICY=PASSIVE``. Each configuration runs in a
fresh process (OpenMP reads its settings once), greedy batch-1 and batch-4
decode of ``--model`` (default: the vs_vllm shape, random weights), the best
of ``--repeats`` timed runs of ``--tokens`` tokens, after a warm-up::

    python benchmarks/omp_teams.py [--model DIR]

Writes ``benchmarks/results/omp_teams.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# (label, environment, where the engine is built: "main" or "loop")
CONFIGS = [
    ("sleep at once (PASSIVE), built on the main thread", {"OMP_WAIT_POLICY": "PASSIVE"}, "main"),
    ("spin 10,000 rounds, built on the main thread", {"GOMP_SPINCOUNT": "10000"}, "main"),
    ("spin 10,000 rounds, built on the stepping thread", {"GOMP_SPINCOUNT": "10000"}, "loop"),
]


def measure(model: str, where: str, batch: int, tokens: int, repeats: int) -> list[float]:
    """ms per decode step, one per timed run: stepped on a second thread as
    the server does, the engine built there or on the main thread."""
    from fluidserve.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"Tell me a long story about dragon number {i}. " * 4 for i in range(batch)]
    box: list = [LLM(model, dtype="float32", device="cpu")] if where == "main" else []
    times: list[float] = []

    def step() -> None:
        if not box:
            box.append(LLM(model, dtype="float32", device="cpu"))
        box[0].generate(prompts, params)
        for _ in range(repeats):
            t0 = time.perf_counter()
            box[0].generate(prompts, params)
            times.append((time.perf_counter() - t0) / tokens * 1e3)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the vs_vllm shape, random weights)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(measure(job["model"], job["where"], job["batch"], args.tokens, args.repeats)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_vllm import RESULTS, build_model, device_record

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "model"))
        rows = []
        for label, env, where in CONFIGS:
            clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            for batch in args.batches:
                job = json.dumps({"model": model, "where": where, "batch": batch})
                out = subprocess.run([sys.executable, __file__, "--job", job, "--tokens", str(args.tokens),
                                      "--repeats", str(args.repeats)], env={**clean, **env}, check=True,
                                     capture_output=True, text=True).stdout
                ms = json.loads(out.strip().splitlines()[-1])
                rows.append({"config": label, "env": env, "built_on": where, "batch": batch, "ms_per_step": ms,
                             "best_ms": min(ms)})
                print(f"{label:>52}  batch {batch}: {min(ms):.1f} ms/step ({', '.join(f'{x:.1f}' for x in ms)})",
                      flush=True)
    record = {"benchmark": "decode step by OpenMP team and wait policy",
              "command": " ".join(map(shlex.quote, sys.argv)), "device": device_record(),
              "model": Path(args.model).name if args.model else "vs_vllm shape, random weights",
              "tokens": args.tokens, "repeats": args.repeats, "rows": rows}
    base = {r["batch"]: r["best_ms"] for r in rows if r["config"] == CONFIGS[0][0]}
    lines = ["# A CPU decode step by OpenMP team and wait policy (ms per step, best of "
             f"{args.repeats} runs of {args.tokens} tokens)", "", f"Command: `{record['command']}`", "",
             f"Model: {record['model']}, fp32, stepped on a second thread as `fluidserve serve` does; "
             f"{os.cpu_count()} cores, torch's threads.", "",
             "| configuration | batch | ms / step | runs | vs the first row |", "|---|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['batch']} | {r['best_ms']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['ms_per_step'])} | {base[r['batch']] / r['best_ms']:.2f}x |")
    (RESULTS / "omp_teams.json").write_text(json.dumps(record, indent=2) + "\n")
    (RESULTS / "omp_teams.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
