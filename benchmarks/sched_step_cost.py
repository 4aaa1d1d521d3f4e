"""The scheduler's CPU time per step (schedule + update_from_output) at 256
(``--active``) decoding requests that share a 512-token prefix, cache off and on, for one or
more source trees side by side (say this tree and a git checkout of an older
commit), each in its own process so their packages never mix. With
``--coserving`` the requests are a Batch API job's (offline) under the
co-serving budget ``fluidserve serve --data-dir`` runs by default (a 1.2
slowdown cap, safepoints every layer of Llama-3-8B's 32, an online chat seen):
every step asks the budget for each request's tokens. With ``--queued N``,
N more requests of the same shapes arrive behind them, the device pool holds
about the active ones, and there is a host tier (the server's default
preemption by swap, with KV loans): a burst that memory holds back, whose
waiting requests each step tries to admit.

    git archive REV | tar -x -C /tmp/old
    python benchmarks/sched_step_cost.py . /tmp/old --names new old [--coserving]
    python benchmarks/sched_step_cost.py . /tmp/old --names new old --active 64 --queued 2000

Medians of 200 steps (after 40 warm-up steps), thread CPU time. Writes
benchmarks/results/sched_step_cost.{json,md} (``sched_step_cost-N`` for
another ``--active N``, ``-queued-Q`` with ``--queued Q``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

def shared_prefix_scheduler(cache: bool, active: int = 256, coserving: bool = False, queued: int = 0):
    """A Scheduler holding ``active`` requests whose prompts share a 512-token
    prefix (each its own 50-349-token suffix), none run yet; with
    ``coserving``, offline ones under the default co-serving budget; with
    ``queued``, that many more behind them and a host tier four times the
    device pool. Imports fluidserve when called, so a probe can point it at
    another tree."""
    import random

    from fluidserve.kvcache.manager import KVCacheManager
    from fluidserve.kvcache.prefix_cache import block_keys
    from fluidserve.scheduler.budget import safepoint_attention_share, safepoint_interval_share
    from fluidserve.scheduler.cost_model import default_cost_model
    from fluidserve.scheduler.request_state import RequestClass, SeqState
    from fluidserve.scheduler.scheduler import Scheduler, SchedulerConfig

    bs = 16
    blocks = active * 64 + 64
    kv = KVCacheManager(blocks, bs, 4 * blocks if queued else 0, enable_prefix_caching=cache)
    config = SchedulerConfig(max_num_seqs=active, max_num_batched_tokens=max(2048, 2 * active),
                             online_slowdown_cap=1.2 if coserving else None)
    budget = dict(cost_model=default_cost_model(), safepoint_interval_share=safepoint_interval_share(1, 32),
                  safepoint_attention_share=safepoint_attention_share(1, 32)) if coserving else {}
    s = Scheduler(config, kv, **budget)
    if coserving:
        s.budget.note_online_arrival(200)  # a chat seen: offline-only steps are cut for the next
    klass = RequestClass.OFFLINE if coserving else RequestClass.ONLINE
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(512)]
    for i in range(active + queued):
        prompt = system + [rng.randrange(1000) for _ in range(50 + i % 300)]
        s.add(SeqState(f"r{i}", len(prompt), 10_000, i * 1e-3, klass,
                       block_keys=block_keys(prompt, bs) if cache else []), 0.0)
    return s


_PROBE = r'''
import importlib.util, os, sys, time, types
root, here, active, coserving, queued = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
pkg = types.ModuleType("fluidserve"); pkg.__path__ = []; sys.modules["fluidserve"] = pkg
for name in ("scheduler", "kvcache"):  # pure Python: the two packages are all the scheduler needs
    spec = importlib.util.spec_from_file_location(f"fluidserve.{name}", os.path.join(root, name, "__init__.py"),
                                                  submodule_search_locations=[os.path.join(root, name)])
    mod = importlib.util.module_from_spec(spec); sys.modules[f"fluidserve.{name}"] = mod; spec.loader.exec_module(mod)
sys.path.insert(0, here)
from fluidserve.scheduler.plan import StepOutcome
from sched_step_cost import shared_prefix_scheduler  # this tree's workload, the probed tree's scheduler

def cost(cache, steps=200, warm=40):
    s = shared_prefix_scheduler(cache, active, coserving, queued)
    now, times = 0.0, []
    for k in range(warm + steps):
        t0 = time.thread_time()
        plan = s.schedule(now)
        now += 0.01
        s.update_from_output(plan, StepOutcome(0.01, now, []))
        if k >= warm:
            times.append(time.thread_time() - t0)
    return sorted(times)[len(times) // 2]

print(cost(False), cost(True))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="source trees (the repository root of each)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, interleaved")
    ap.add_argument("--names", nargs="+", help="a label per tree for the table (default: the paths)")
    ap.add_argument("--active", type=int, default=256, help="decoding requests")
    ap.add_argument("--coserving", action="store_true", help="offline requests under the co-serving budget")
    ap.add_argument("--queued", type=int, default=0,
                    help="requests waiting behind the active ones, with a host tier (a burst memory holds back)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    runs: dict[str, list[tuple[float, float]]] = {t: [] for t in args.trees}
    load_start = os.getloadavg()
    for _ in range(args.rounds):
        for tree in args.trees:  # interleaved, so a neighbour's load hits every tree alike
            out = subprocess.run([sys.executable, "-c", _PROBE, str(Path(tree).resolve()),
                                  str(Path(__file__).resolve().parent), str(args.active),
                                  "1" if args.coserving else "0", str(args.queued)], check=True,
                                 capture_output=True, text=True).stdout.split()
            runs[tree].append((float(out[0]), float(out[1])))
    rows = {t: {"cache_off_ms": statistics.median(r[0] for r in rs) * 1e3,
                "cache_on_ms": statistics.median(r[1] for r in rs) * 1e3} for t, rs in runs.items()}
    cmd = "python benchmarks/sched_step_cost.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    what = "offline requests under the co-serving budget" if args.coserving else "decoding requests"
    queue = f", {args.queued} more queued behind them (host tier on)" if args.queued else ""
    md = [f"# Scheduler CPU time per step, {args.active} {what} sharing a 512-token prefix{queue}", "",
          f"Command: `{cmd}`; median of {args.rounds} processes per tree (each the median of 200 steps); "
          f"load average {load_start[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end.", "",
          "| tree | cache off (ms) | cache on (ms) |", "|---|---:|---:|"]
    names = dict(zip(args.trees, args.names or args.trees))
    md += [f"| {names[t]} | {r['cache_off_ms']:.3f} | {r['cache_on_ms']:.3f} |" for t, r in rows.items()]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = ("sched_step_cost" + ("" if args.active == 256 else f"-{args.active}")
            + ("-coserving" if args.coserving else "") + (f"-queued-{args.queued}" if args.queued else ""))
    (out / f"{stem}.json").write_text(json.dumps({"command": cmd, "active": args.active, "coserving": args.coserving,
                                                  "queued": args.queued,
                                                  "rows": rows, "runs": runs},
                                                 indent=1))
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
