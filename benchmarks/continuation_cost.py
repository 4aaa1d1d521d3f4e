"""What async scheduling's blind plan costs the host per step, against the
plan it replaces: ``Scheduler.schedule`` and ``Scheduler.continue_decodes``
on the same state, every request decoding, in one process.

    python benchmarks/continuation_cost.py [--requests 64 256] [--steps 200]

Medians over ``--steps`` pairs of steps (skip-join MLFQ, the default cost
model, blocks of 16, prompts of 100 tokens). Writes
``continuation_cost.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from fluidserve.kvcache.config import CacheConfig
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.cost_model import default_cost_model
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import save_results  # noqa: E402


def measure(num_requests: int, steps: int) -> dict:
    sched = Scheduler.create(SchedulerConfig(max_num_seqs=num_requests), CacheConfig(block_size=16),
                             64 * num_requests, cost_model=default_cost_model())
    for i in range(num_requests):
        sched.add(SeqState(f"r{i}", 100, 10**6, 0.0), 0.0)
    now = 0.0
    while any(s.num_computed_tokens < 100 for s in sched.seqs.values()):  # the prompts
        plan = sched.schedule(now)
        now += 0.01
        sched.update_from_output(plan, StepOutcome(0.01, now))
    schedule_s, continue_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule(now)
        t1 = time.perf_counter()
        keep = [item.request_id for item in plan.scheduled]
        t2 = time.perf_counter()
        nxt = sched.continue_decodes(plan, keep)
        t3 = time.perf_counter()
        if nxt is None or len(nxt.scheduled) != num_requests:
            raise RuntimeError("the continuation was refused: the benchmark's state is not all-decoding")
        schedule_s.append(t1 - t0)
        continue_s.append(t3 - t2)
        for p in (plan, nxt):
            now += 0.01
            sched.update_from_output(p, StepOutcome(0.01, now))
    s, c = statistics.median(schedule_s), statistics.median(continue_s)
    return dict(requests=num_requests, schedule_ms=s * 1e3, continue_decodes_ms=c * 1e3, ratio=c / s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    rows = [measure(n, args.steps) for n in args.requests]
    lines = ["# Async scheduling's blind plan against the scheduler's, per step", "",
             f"`python benchmarks/continuation_cost.py`; wall time of the planning call, medians "
             f"over {args.steps} steps, every request decoding (skip-join MLFQ).", "",
             "| requests | schedule ms | continue_decodes ms | continue / schedule |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['requests']} | {r['schedule_ms']:.3f} | {r['continue_decodes_ms']:.3f} | {r['ratio']:.2f}x |"
              for r in rows]
    save_results(args.out / "continuation_cost", dict(steps=args.steps, rows=rows), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
