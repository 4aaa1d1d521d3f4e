"""A data-parallel replica's CPU step: its engine built on the thread that
steps it (one OpenMP team), against a tree that built it on the actor's
main thread and stepped it on another (two teams: OpenMP then cuts every
idle thread's spin short, and each op pays a wake-up).

One replica actor (``DataParallelEngine``, real Ray, a local cluster) with
``--threads`` torch threads decodes ``--tokens`` greedy tokens of one
request, ``--runs`` times; ms per token, the median after the first run.
The same engine in-process on an ``EngineThread`` (as ``fluidserve serve``
steps it) is the floor. Each system runs in a fresh process, in turns,
``--rounds`` times::

    python benchmarks/replica_team.py --model DIR [--baseline-src OLD_TREE]

Writes ``benchmarks/results/replica_team.{json,md}``.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(model: str, where: str, threads: int, tokens: int, runs: int) -> float:
    import asyncio
    import time

    from transformers import AutoTokenizer

    from fluidserve.engine.async_engine import AsyncEngine, EngineThread
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.data_parallel import DataParallelEngine
    from fluidserve.engine.engine import LLMEngine
    from fluidserve.engine.sampling_params import SamplingParams

    flags = dict(model=model, device="cpu", dtype="float32", enable_prefix_caching=False, yield_busy_cores=False)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = AutoTokenizer.from_pretrained(model).encode("Tell me a long story about dragons.")

    async def decode(front) -> float:
        front.start()
        try:
            ms = []
            for i in range(runs):
                t0 = time.perf_counter()
                async for _ in await front.add_request(f"r{i}", prompt, params):
                    pass
                ms.append((time.perf_counter() - t0) / tokens * 1e3)
            return statistics.median(ms[1:])  # the first run warms the caches
        finally:
            await front.shutdown()

    if where == "in-process":
        import torch

        host = EngineThread()

        def build() -> LLMEngine:
            torch.set_num_threads(threads)
            return LLMEngine(EngineConfig.create(**flags))

        return asyncio.run(decode(AsyncEngine(host.build(build), thread=host)))
    return asyncio.run(decode(DataParallelEngine(EngineConfig.create(**flags, data_parallel_size=1),
                                                 torch_threads=threads)))


def run(model: str, where: str, tree: Path | None, args: argparse.Namespace, tmp: Path) -> float:
    env = {**os.environ, "GOMP_SPINCOUNT": "10000"}  # as serve/cli.py sets it
    if tree is not None:
        from vs_vllm import _baseline_env

        shim = Path(tempfile.mkdtemp(dir=tmp))
        env.update(_baseline_env(tree, shim))
    job = json.dumps({"model": model, "where": where})
    out = subprocess.run([sys.executable, __file__, "--job", job, "--threads", str(args.threads),
                          "--tokens", str(args.tokens), "--runs", str(args.runs)],
                         env=env, check=True, capture_output=True, text=True, timeout=900).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model directory with its tokenizer (required)")
    ap.add_argument("--baseline-src", type=Path, default=None, help="also run the replica from this source tree")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 2))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(measure(job["model"], job["where"], args.threads, args.tokens, args.runs))
        return 0
    if not args.model:
        ap.error("--model is required")
    from dummy_models import save_results
    from vs_vllm import RESULTS, device_record

    systems = [("in-process, EngineThread", "in-process", None), ("replica, this tree", "replica", None)]
    if args.baseline_src:
        systems.append((f"replica, {args.baseline_src.name}", "replica", args.baseline_src))
    ms: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, where, tree in systems if round_ % 2 == 0 else systems[::-1]:
                ms[name].append(run(args.model, where, tree, args, Path(tmp)))
                print(f"{name:>32}: {ms[name][-1]:.1f} ms/token", flush=True)
    record = {"benchmark": "replica team", "command": " ".join(map(shlex.quote, sys.argv)),
              "device": device_record(), "model": Path(args.model).name, "threads": args.threads,
              "tokens": args.tokens, "runs": args.runs, "ms_per_token": ms}
    floor = statistics.median(ms["in-process, EngineThread"])
    lines = ["# A data-parallel replica's decode step, by the thread its engine was built on", "",
             f"Command: `{record['command']}`", "",
             f"Model: {record['model']}, fp32, {args.threads} torch threads, {os.cpu_count()} cores; greedy decode "
             f"of one request, {args.tokens} tokens, median of runs 2-{args.runs}, each system in a fresh process, "
             f"{args.rounds} rounds in turns.", "",
             "| system | ms/token, each round | vs in-process |", "|---|---:|---:|"]
    for name, got in ms.items():
        lines.append(f"| {name} | {' / '.join(f'{x:.1f}' for x in got)} | "
                     f"{statistics.median(got) / floor:.2f}x |")
    save_results(RESULTS / "replica_team", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
