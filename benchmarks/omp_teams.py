"""A CPU step, by where the engine was built, how long idle OpenMP threads
spin before they sleep, and whether another process shares the cores.

``fluidserve serve`` steps its engine on a thread of its own. OpenMP gives
every thread that computes a team of its own threads; with two teams (the
engine built on the main thread, stepped on another) it counts more threads
than cores and cuts every idle thread's spin short, so each op pays a
wake-up, as with ``OMP_WAIT_POLICY=PASSIVE``. On one team, the longer idle
threads spin (``GOMP_SPINCOUNT``), the fewer wake-ups a decode step pays;
but where one more busy process shares the cores, a thread that spins holds
a core its teammate needs to finish the op everyone waits for.

Each configuration runs in a fresh process (OpenMP reads its settings once)
on a second thread, as the server does: greedy decode of ``--batches``
requests (ms per step) and the prefill of one ``--prompt-tokens`` prompt
(ms), each the median of ``--repeats`` runs after a warm-up, first alone,
then beside one process that spins on a core (``while True: pass``), as a
peer or any other job on the machine would. The last row steps as
``fluidserve serve`` does (``--yield-busy-cores``, ``engine/cpu_share.py``):
on fewer threads while other processes keep cores busy::

    python benchmarks/omp_teams.py [--model DIR]

Writes ``benchmarks/results/omp_teams.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}
# No prefix cache: every timed prefill computes its prompt.
ENGINE = {"dtype": "float32", "device": "cpu", "enable_prefix_caching": False}


def spin(rounds: int) -> dict[str, str]:
    return {"GOMP_SPINCOUNT": str(rounds)}


# (label, environment, where the engine is built: "main" or "loop", yield_busy_cores)
CONFIGS = [
    ("sleep at once (PASSIVE)", PASSIVE, "main", False),
    ("spin 10,000 rounds", spin(10_000), "main", False),
    ("sleep at once (PASSIVE)", PASSIVE, "loop", False),
    *((f"spin {n:,} rounds", spin(n), "loop", False) for n in (1_000, 10_000, 100_000)),
    ("spin 10,000 rounds, yielding busy cores (`fluidserve serve`)", spin(10_000), "loop", True),
]


def measure(model: str, where: str, yield_busy_cores: bool, batches: list[int], prompt_tokens: int,
            tokens: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """{"alone" | "beside a busy process": {"decode bN" | "prefill": [ms, ...]}}:
    stepped on a second thread as the server does, the engine built there or
    on the main thread."""
    from fluidserve.engine import LLM, SamplingParams

    decode = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine = {**ENGINE, "yield_busy_cores": yield_busy_cores}
    box: list = [LLM(model, **engine)] if where == "main" else []
    out: dict[str, dict[str, list[float]]] = {}

    def runs() -> dict[str, list[float]]:
        llm = box[0]
        long_prompt = list(range(100, 100 + prompt_tokens))
        got: dict[str, list[float]] = {}
        for _ in range(repeats):
            for batch in batches:
                prompts = [f"Tell me a long story about dragon number {i}. " * 4 for i in range(batch)]
                t0 = time.perf_counter()
                llm.generate(prompts, decode)
                got.setdefault(f"decode b{batch}", []).append((time.perf_counter() - t0) / tokens * 1e3)
            t0 = time.perf_counter()
            llm.generate([long_prompt], first)
            got.setdefault("prefill", []).append((time.perf_counter() - t0) * 1e3)
        return got

    def step() -> None:
        if not box:
            box.append(LLM(model, **engine))
        runs()  # warm-up: first runs of every shape
        out["alone"] = runs()
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            out["beside a busy process"] = runs()
        finally:
            busy.kill()
            busy.wait()

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the vs_vllm shape, random weights)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--tokens", type=int, default=48, help="decode: tokens per timed run")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prefill: the prompt's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(measure(job["model"], job["where"], job["yield"], args.batches, args.prompt_tokens,
                                 args.tokens, args.repeats)))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dummy_models import save_results
    from vs_vllm import RESULTS, build_model, device_record

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "model"))
        rows = []
        for label, env, where, yields in CONFIGS:
            clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
            job = json.dumps({"model": model, "where": where, "yield": yields})
            out = subprocess.run([sys.executable, __file__, "--job", job,
                                  "--batches", *map(str, args.batches), "--tokens", str(args.tokens),
                                  "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats)],
                                 env={**clean, **env}, check=True, capture_output=True, text=True).stdout
            runs = json.loads(out.strip().splitlines()[-1])
            median = {cond: {what: statistics.median(ms) for what, ms in got.items()} for cond, got in runs.items()}
            rows.append({"config": label, "env": env, "built_on": where, "yield_busy_cores": yields, "ms": runs,
                         "median_ms": median})
            print(f"{label:>62}, built on the {where} thread: " + "; ".join(
                f"{what} {median['alone'][what]:.1f} / {median['beside a busy process'][what]:.1f} ms"
                for what in median["alone"]), flush=True)
    record = {"benchmark": "CPU step by OpenMP team, spin and a busy neighbour",
              "command": " ".join(map(shlex.quote, sys.argv)), "device": device_record(),
              "model": Path(args.model).name if args.model else "vs_vllm shape, random weights",
              "tokens": args.tokens, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "rows": rows}
    whats = list(rows[0]["median_ms"]["alone"])
    lines = [f"# A CPU step by OpenMP team, idle threads' spin, and a busy process beside it (ms, median of "
             f"{args.repeats} runs)", "", f"Command: `{record['command']}`", "",
             f"Model: {record['model']}, fp32, stepped on a second thread as `fluidserve serve` does; "
             f"{os.cpu_count()} cores, torch's threads. Decode: ms per step over {args.tokens} tokens; prefill: "
             f"one {args.prompt_tokens}-token prompt to its first token. Each cell: alone / beside one process "
             "spinning on a core.", "",
             "| configuration | built on | " + " | ".join(whats) + " |", "|---|---|" + "---:|" * len(whats)]
    for r in rows:
        m = r["median_ms"]
        lines.append(f"| {r['config']} | {r['built_on']} thread | " + " | ".join(
            f"{m['alone'][w]:.1f} / {m['beside a busy process'][w]:.1f}" for w in whats) + " |")
    save_results(RESULTS / "omp_teams", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
