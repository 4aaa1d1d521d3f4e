"""What the online slowdown cap costs offline work when no online work runs
beside it: the same offline-only load through an engine without the cap and
with ``fluidserve serve``'s default (1.2), in turn, in one process.

    python benchmarks/slowdown_cap_offline.py --model /path/to/SmolLM2-135M-Instruct --tag=-smollm2

The load is an embedding job (``--runner pooling``): ``--docs`` documents of
``--doc-len`` random tokens, all at priority 1 (offline), added at once; each
round draws documents of its own (no prefix-cache hit across rounds), and
the configurations take turns. Figures: seconds and steps per round.

Writes benchmarks/results/slowdown_cap_offline{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {"no cap": None, "cap 1.2 (the server's default)": 1.2}


def one_round(engine, docs: list[list[int]]) -> tuple[float, int]:
    from fluidserve.engine import PoolingParams, SamplingParams

    start = time.perf_counter()
    for i, doc in enumerate(docs):
        engine.add_request(f"d{i}-{start}", doc, SamplingParams(pooling=PoolingParams()), klass="offline")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return time.perf_counter() - start, steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    import json

    from fluidserve.engine import LLM

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    engines = {name: LLM(model=args.model, device="cpu", runner="pooling", max_model_len=2048,
                         online_slowdown_cap=cap).engine for name, cap in CONFIGS.items()}
    rng = random.Random(0)
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            docs = [[rng.randrange(100, vocab) for _ in range(args.doc_len)] for _ in range(args.docs)]
            seconds, steps = one_round(engine, docs)
            runs[name].append({"seconds": seconds, "steps": steps})
            print(f"{name}: {seconds:.1f} s, {steps} steps", flush=True)
    record = {"benchmark": "slowdown_cap_offline", "command": " ".join(map(shlex.quote, sys.argv)),
              "model": Path(args.model).name, "docs": args.docs, "doc_len": args.doc_len, "runs": runs}
    base = statistics.median(r["seconds"] for r in runs["no cap"])
    lines = ["# The online slowdown cap on offline-only work", "",
             f"{record['model']} as an embedding model, {args.docs} documents of {args.doc_len} random tokens at "
             f"priority 1 (offline), nothing online; {args.rounds} rounds, the configurations in turn, each round "
             "with documents of its own.", "",
             "| configuration | seconds a round | steps | median against no cap |", "|---|---|---|---|"]
    for name, rows in runs.items():
        med = statistics.median(r["seconds"] for r in rows)
        seconds = ", ".join(f"{r['seconds']:.1f}" for r in rows)
        steps = ", ".join(str(r["steps"]) for r in rows)
        lines.append(f"| {name} | {seconds} | {steps} | {med / base:.2f}x |")
    save_results(RESULTS / f"slowdown_cap_offline{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
