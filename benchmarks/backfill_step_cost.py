"""What backfilling (``--swap-backfill``, scheduler.py ``_backfills``) costs
the scheduler per step where it has the most to read: ``--resident``
streams on the device, those it parked on the host owed their blocks, and
``--waiting`` requests each refused by those owed blocks every step. The
same scheduler with backfilling on and off, side by side in one process
(interleaved rounds), so the ratio is what the rule adds.

    python benchmarks/backfill_step_cost.py

Median thread CPU time of ``schedule`` + ``update_from_output`` over
``--steps`` steps, median over rounds. Writes
benchmarks/results/backfill_step_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK = 16


def loaded_scheduler(backfill: bool, resident: int, waiting: int) -> tuple[Scheduler, float]:
    """``resident`` streams of 48-token prompts and 400 tokens to stream
    each, on a pool of 4 blocks apiece and a few more: growing, some are
    parked on the host. Then ``waiting`` requests of 100-400-token prompts
    arrive, none of them a borrower (``max_tokens`` 40-300 > 32)."""
    kv = KVCacheManager(resident * 4 + 40, BLOCK, num_host_blocks=20 * resident)
    s = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, swap_backfill=backfill), kv)
    now = 0.0
    for i in range(resident):
        s.add(SeqState(f"r{i}", 48, 400, now), now)
    for _ in range(3):
        plan = s.schedule(now)
        now += 0.01
        s.update_from_output(plan, StepOutcome(0.01, now, []))
    rng = random.Random(0)
    for i in range(waiting):
        s.add(SeqState(f"w{i}", rng.randrange(100, 400), rng.randrange(40, 300), now), now)
    return s, now


def step_cost(backfill: bool, resident: int, waiting: int, steps: int) -> tuple[float, dict]:
    s, now = loaded_scheduler(backfill, resident, waiting)
    times = []
    for _ in range(steps):
        t0 = time.thread_time()
        plan = s.schedule(now)
        now += 0.01
        s.update_from_output(plan, StepOutcome(0.01, now, []))
        times.append(time.thread_time() - t0)
    c = s.counters
    return statistics.median(times), {"parked": s.kv.num_swapped, "swap_outs": c.num_swap_outs,
                                      "backfills": c.num_backfills}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resident", type=int, default=200)
    ap.add_argument("--waiting", type=int, default=500)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    runs: dict[str, list[float]] = {"on": [], "off": []}
    state = {}
    for _ in range(args.rounds):
        for label in runs:  # interleaved: a neighbour's load hits both alike
            t, state[label] = step_cost(label == "on", args.resident, args.waiting, args.steps)
            runs[label].append(t)
    ms = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
    cmd = " ".join(["python benchmarks/backfill_step_cost.py", *(argv if argv is not None else sys.argv[1:])])
    md = [f"# Scheduler CPU time per step with backfilling on and off: {args.resident} streams, "
          f"{args.waiting} requests refused by owed blocks", "",
          f"Command: `{cmd}`; median of {args.rounds} interleaved rounds, each the median of {args.steps} "
          "steps (thread CPU time of schedule + update_from_output).", "",
          "| backfilling | ms per step | streams parked at the end | swap-outs | backfills |",
          "|---|---:|---:|---:|---:|"]
    md += [f"| {k} | {ms[k]:.3f} | {state[k]['parked']} | {state[k]['swap_outs']} | {state[k]['backfills']} |"
           for k in runs]
    md += ["", f"On / off: {ms['on'] / ms['off']:.2f}x."]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backfill_step_cost.json").write_text(json.dumps(
        {"command": cmd, "resident": args.resident, "waiting": args.waiting, "steps": args.steps,
         "rounds": args.rounds, "ms_per_step": ms, "runs_s": runs, "state": state}, indent=1))
    (out / "backfill_step_cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
