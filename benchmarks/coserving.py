"""Online/offline co-serving in the simulator (ConServe §6): what a standing
offline backlog does to online latency, and how much of the machine the
backlog gets, for these designs on the same jobs:

* ``online only`` / ``offline only``: each class alone (the references)
* ``naive``: offline jobs enter as online ones (one queue, skip-join orders all)
* ``priority``: online strictly above offline, no budget
* ``priority + budget``: and ConServe's SLO-aware budget (``--online-tpot-slo-ms``)
* ``+ checkpointing``: and incremental checkpointing of offline KV (§4.4)
* ``+ layer-wise preemption (full)``: and an offline-only step paused at
  the next safepoint (every ``--safepoint-layers`` layers) after an online
  arrival, resumed there once online work drains (§4.3)

Online: ShareGPT lengths, Gamma arrivals (CV 4: bursts and idle gaps) at a
fraction of the saturated rate. Offline: a backlog of ShareGPT-length jobs
present at t = 0. Llama-3-8B on one H100 (roofline), full KV pool plus a
64 GiB host pool (swap mode). Offline work is counted over the online window
(until the last online job finishes) as the offline tokens computed in it:
as a share of what the backlog alone computes in the same time, and as a
share of that scaled to the idle capacity (1 - load: the share of the
saturated rate the online load leaves), ConServe's "offline throughput in
the idle capacity".

    python benchmarks/coserving.py        # ~2 min on 2 cores
Writes benchmarks/results/coserving.{json,md} (``--seed N``: coserving-seedN.{json,md}).

``--real-engine``: the real engine on the CPU instead (random weights, preset
``cpu-deep``: 16 thin layers), driven in-process through ``AsyncEngine``, the
bridge the server uses: a standing backlog of long offline prompts from t = 0,
online requests arriving at random (Poisson) while it runs, each request's
TTFT taken from ``add_request`` to its first token and its TPOT from then to
its last. The same designs on the same arrivals (online only, offline only,
naive, priority, priority + budget, full). The budget's SLOs default to
(1 + ``--real-slo-slack``) x the online-only run's P99 TTFT and TPOT: an
operator asking to keep online latency within 10% of an idle machine's. The
offline share is of the offline-only run's throughput in the same window, and
of that scaled to the idle capacity the online-only run leaves (offline
tokens counted as the steps that compute them complete). The full
design checks for interrupts every ``--real-safepoint-layers`` layers (0.5 by
default, before each layer and between its attention and MLP: on this CPU
one layer of a few-hundred-token offline step takes 15-30 ms, a third of the
online prompt's own TTFT; several values run the full design once for each).

    python benchmarks/coserving.py --real-engine   # ~4 min on 2 cores
Writes benchmarks/results/coserving_real.{json,md} (``-designs`` when every
design runs, ``-safepoints`` for several safepoint intervals). ``--real-rounds N`` runs
every design N times, odd rounds in reverse order, and reports medians, each
ratio paired with its own round's online-only run: where the machine's
speed drifts by 10-30% from one minute to the next, one round's ratios move
by as much as the targets allow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

# Before torch loads (the real engine runs in this process): idle OpenMP
# threads sleep at once. Spinning threads on a machine with other load wait
# for each other and make each decode step several times slower, which
# would measure the machine, not the scheduling.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from fluidserve.scheduler.cost_model import default_cost_model
from fluidserve.scheduler.request_state import RequestClass
from fluidserve.scheduler.simulator import SimConfig, estimate_capacity, percentile, simulate
from fluidserve.scheduler.workloads import (
    DEFAULT_WORKLOAD_DIR, SHAREGPT, Job, clamp_lengths, empirical_lengths, gamma_arrivals, load_lengths, synthesize,
)

BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--real-engine", action="store_true", help="run the real engine on the CPU (see above)")
    ap.add_argument("--preset", default="cpu-deep", help="real engine: model shape (benchmarks/dummy_models.py)")
    ap.add_argument("--real-online", type=int, default=20, help="real engine: online requests")
    ap.add_argument("--real-rounds", type=int, default=1,
                    help="real engine: run every design this many times (odd rounds in reverse order) and report "
                         "medians, ratios paired within a round")
    ap.add_argument("--real-designs", nargs="+", default=["naive", "priority", "budget", "full"],
                    choices=["naive", "priority", "budget", "full", "full-loans-off"],
                    help="real engine: the designs run beside the online-only and offline-only references")
    ap.add_argument("--real-gap-s", type=float, default=1.5, help="real engine: mean gap between online arrivals")
    ap.add_argument("--real-offline", type=int, default=96,
                    help="real engine: offline backlog (more than the online window can finish)")
    ap.add_argument("--real-kv-requests", type=int, default=32,
                    help="real engine: device KV holds this many offline requests at once")
    ap.add_argument("--real-offline-prompt", type=int, default=1024)
    ap.add_argument("--real-batched-tokens", type=int, default=1024, help="real engine: token budget of a step")
    ap.add_argument("--real-ttft-slo-ms", type=float, default=None,
                    help="real engine: online TTFT SLO of the budget variants (default: from online only)")
    ap.add_argument("--real-tpot-slo-ms", type=float, default=None,
                    help="real engine: online TPOT SLO of the budget variants (default: from online only)")
    ap.add_argument("--real-threads", type=int, default=1,
                    help="real engine: torch threads (1: the forward on one core, the event loop on the other, "
                         "as vLLM's CPU build keeps its frontend off the compute core)")
    ap.add_argument("--real-safepoint-layers", type=float, nargs="+", default=[0.5],
                    help="real engine, full design: layers between interrupt checks (0.5: also between a "
                         "layer's attention and MLP); several values run the full design once for each")
    ap.add_argument("--real-slo-slack", type=float, default=0.1,
                    help="real engine: default SLOs are (1 + this) x the online-only P99 TTFT and TPOT")
    ap.add_argument("--workload-dir", default=str(DEFAULT_WORKLOAD_DIR))
    ap.add_argument("--online-jobs", type=int, default=400)
    ap.add_argument("--offline-jobs", type=int, default=1500)
    ap.add_argument("--load", type=float, default=0.5, help="online rate as a fraction of the saturated rate")
    ap.add_argument("--seed", type=int, default=0,
                    help="online trace (lengths and arrivals): a P99 over one trace's bursts is decided by a few "
                         "requests, so other seeds show how far a ratio moves")
    ap.add_argument("--tpot-slo-ms", type=float, default=40.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=None,
                    help="online TTFT SLO: caps steps that prefill online work (default: none)")
    ap.add_argument("--safepoint-layers", type=int, default=2, help="layer-wise preemption: layers between checks")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if args.real_engine:
        return real_engine(args, argv)
    cm = default_cost_model()
    pairs = clamp_lengths(load_lengths(Path(args.workload_dir) / SHAREGPT), 8192)
    base = dict(num_kv_blocks=cm.num_kv_blocks(BLOCK), block_size=BLOCK,
                num_host_blocks=64 * 2**30 // (BLOCK * cm.model.kv_bytes_per_token),
                max_swap_blocks_per_step=max(1, int(cm.min_iteration_time()
                                                    / cm.transfer_time(BLOCK * cm.model.kv_bytes_per_token))),
                block_transfer_time=cm.transfer_time(BLOCK * cm.model.kv_bytes_per_token))
    rate = args.load * estimate_capacity(pairs, cm, SimConfig.create(**base), num_jobs=300)
    online = synthesize(args.online_jobs, empirical_lengths(pairs), gamma_arrivals(rate, 4.0), seed=args.seed)
    off_lengths = empirical_lengths(pairs)
    import random

    rng = random.Random(1)
    offline = [Job(f"off{i}", 0.0, *off_lengths(rng), RequestClass.OFFLINE) for i in range(args.offline_jobs)]
    online_ids = {j.request_id for j in online}
    naive = [Job(j.request_id, j.arrival_time, j.prompt_tokens, j.output_tokens) for j in offline]

    plain = {"kv_checkpoint_threshold": None, "preemption_safepoint_layers": 0}
    budget = {"online_tpot_slo_ms": args.tpot_slo_ms, "online_ttft_slo_ms": args.ttft_slo_ms}
    runs = {
        "online only": (online, plain),
        "offline only": (offline, plain),
        "naive (one queue)": (online + naive, plain),
        "priority": (online + offline, plain),
        "priority + budget": (online + offline, {**plain, **budget}),
        "+ checkpointing": (online + offline, {**budget, "preemption_safepoint_layers": 0}),
        "+ layer-wise preemption (full)": (online + offline, {
            **budget, "preemption_safepoint_layers": args.safepoint_layers}),
    }
    offline_ids = {j.request_id for j in offline}  # the naive run's offline work is online-class
    results = {name: simulate(jobs, "skip-join-mlfq", cm, SimConfig.create(**base, **extra), tracked=offline_ids)
               for name, (jobs, extra) in runs.items()}
    end = max(r.finish_time for r in results["online only"].records)
    alone = results["offline only"].work_until(end)[2]
    idle = 1.0 - args.load  # the capacity the online load leaves
    rows = []
    for name, res in results.items():
        on = [r for r in res.records if r.request_id in online_ids]
        row = {"design": name}
        if on:
            row.update(p99_ttft_s=percentile([r.ttft for r in on], 99),
                       p99_tpot_s=percentile([r.tpot for r in on if r.output_tokens > 1], 99),
                       mean_norm_latency_s=sum(r.normalized_latency for r in on) / len(on))
        if name != "online only":
            done = res.work_until(end)[2]
            row["offline_share"] = done / alone if alone else float("nan")
            if name != "offline only":  # the reference runs with the whole device
                row["offline_share_of_idle"] = done / (alone * idle) if alone and idle > 0 else float("nan")
        rows.append(row)
    ref = rows[0]
    out = ["# Co-serving in the simulator (ConServe)", "",
           f"Command: `python benchmarks/coserving.py {' '.join(argv if argv is not None else sys.argv[1:])}`. "
           f"Llama-3-8B on one H100 (roofline), {args.online_jobs} online jobs (ShareGPT lengths, Gamma CV 4, "
           f"trace seed {args.seed}, at "
           f"{args.load:g} of the saturated rate, {rate:.2f} req/s), {args.offline_jobs} offline jobs at t = 0, "
           f"TPOT SLO {args.tpot_slo_ms:g} ms for the budget. Online window: {end:.0f} s; idle "
           f"capacity {idle:.0%} (1 - load).", "",
           "| design | online P99 TTFT (s) | vs online only | online P99 TPOT (ms) | vs online only | "
           "offline tokens in the window (share of offline only) | share of offline only x idle |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        share = (f"{r['offline_share']:.0%} | " + (f"{r['offline_share_of_idle']:.0%}" if "offline_share_of_idle" in r
                                                   else "") if "offline_share" in r else " | ")
        if "p99_ttft_s" in r:
            out.append(f"| {r['design']} | {r['p99_ttft_s']:.3f} | {r['p99_ttft_s'] / ref['p99_ttft_s']:.2f}x | "
                       f"{r['p99_tpot_s'] * 1e3:.1f} | {r['p99_tpot_s'] / ref['p99_tpot_s']:.2f}x | {share} |")
        else:
            out.append(f"| {r['design']} | | | | | {share} |")
    md = "\n".join(out) + "\n"
    dest = Path(args.out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    stem = "coserving" if args.seed == 0 else f"coserving-seed{args.seed}"
    (dest / f"{stem}.json").write_text(json.dumps({"rate_rps": rate, "window_s": end, "seed": args.seed, "rows": rows},
                                                  indent=1))
    (dest / f"{stem}.md").write_text(md)
    print(md)
    return 0


# -- the real engine ---------------------------------------------------------------------


def real_stem(args: argparse.Namespace) -> str:
    """The result file of a real-engine run, named by what it compares, so
    the full design's figures, the comparison of every design and the A/B
    of safepoint intervals each keep their own file."""
    if len(args.real_safepoint_layers) > 1:
        return "coserving_real-safepoints"
    if set(args.real_designs) >= {"naive", "priority", "budget", "full"}:
        return "coserving_real-designs"
    if "full-loans-off" in args.real_designs:
        return "coserving_real-loans"
    return "coserving_real"

# (design, online requests, offline backlog, offline enters as, SLOs on, safepoint layers, checkpointing,
#  --swap-loan-tokens: None for the default)
REAL_VARIANTS = [
    ("online only", True, False, "offline", False, 0, False, None),
    ("offline only", False, True, "offline", False, 0, False, None),
    ("naive (one queue)", True, True, "online", False, 0, False, None),
    ("priority", True, True, "offline", False, 0, False, None),
    ("priority + budget", True, True, "offline", True, 0, False, None),
    ("full (+ layer preemption, checkpointing)", True, True, "offline", True, None, True, None),
    ("full, KV loans off (--swap-loan-tokens -1)", True, True, "offline", True, None, True, -1),
]
# --real-designs names the designs beyond the two references by these keys.
DESIGN_KEYS = {"naive (one queue)": "naive", "priority": "priority", "priority + budget": "budget",
               "full (+ layer preemption, checkpointing)": "full",
               "full, KV loans off (--swap-loan-tokens -1)": "full-loans-off"}


async def _real_variant(model_dir: Path, args, arrivals: list[float], online_on: bool, backlog: bool,
                        offline_klass: str, slos: tuple[float, float] | None, safepoint_layers: float,
                        checkpointing: bool, window_s: float | None = None,
                        loan_tokens: int | None = None) -> dict:
    """One variant on the real engine; the online requests arrive at
    ``arrivals`` (seconds after the backlog was queued); without online
    requests the backlog runs for ``window_s``."""
    import asyncio
    import time

    from fluidserve.engine import SamplingParams
    from fluidserve.engine.async_engine import AsyncEngine
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.engine import LLMEngine
    from fluidserve.engine.heap import frozen_heap

    prompt_len = args.real_offline_prompt
    # Device KV for at most --real-kv-requests offline requests at once: the
    # rest wait (or sit on the host), as a real backlog would.
    blocks = (min(args.real_offline, args.real_kv_requests) * (prompt_len + 64) + args.real_online * 128) // BLOCK + 64
    ttft_slo, tpot_slo = slos if slos else (None, None)
    engine = LLMEngine(EngineConfig.create(
        model=str(model_dir), load_format="dummy", device="cpu", num_kv_blocks=blocks,
        max_num_batched_tokens=args.real_batched_tokens, enable_prefix_caching=False,
        online_tpot_slo_ms=tpot_slo, online_ttft_slo_ms=ttft_slo, preemption_safepoint_layers=safepoint_layers,
        kv_checkpoint_threshold=0.5 if checkpointing else None,
        **({} if loan_tokens is None else {"swap_loan_tokens": loan_tokens})))
    busy = {"s": 0.0}
    step = engine.step

    def timed_step():  # the device's busy time: every step that ran work
        t = time.monotonic()
        out = step()
        busy["s"] += time.monotonic() - t
        return out

    engine.step = timed_step
    ae = AsyncEngine(engine)
    ae.start()
    offline_done = {"tokens": 0, "decodes": 0}
    window = {"start": float("inf"), "end": float("inf")}
    update = engine.scheduler.update_from_output

    def counted(plan, outcome):
        # Offline tokens computed in the online window, step by step (the
        # engine thread): prompt chunks and decodes, an interrupted step's
        # once it completes. Counting prompts only when their first token
        # streams out would credit a 1024-token prompt to whichever design
        # happened to finish it inside the window.
        if not outcome.abandoned and window["start"] <= time.monotonic() <= window["end"]:
            for i in plan.scheduled:
                if i.request_id.startswith("off"):
                    offline_done["tokens"] += i.num_tokens
                    # A decode row reads its whole context on each layer: on
                    # a CPU it costs some 20 prompt tokens, so the mix of the
                    # two in the window is reported beside the sum.
                    if i.num_tokens == 1 and i.samples:
                        offline_done["decodes"] += 1
        update(plan, outcome)

    engine.scheduler.update_from_output = counted

    async def offline(i: int) -> None:
        ids = [(7 * i + p) % 30000 + 1 for p in range(prompt_len)]
        stream = await ae.add_request(f"off{i}", ids, SamplingParams(temperature=0.0, max_tokens=32,
                                                                     ignore_eos=True), klass=offline_klass)
        async for _ in stream:
            pass

    async def online(i: int, at: float, t0: float) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        ids = [(13 * i + p) % 30000 + 1 for p in range(64)]
        start = time.monotonic()
        stream = await ae.add_request(f"on{i}", ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                                    ignore_eos=True), klass="online")
        first = last = None
        n = 0
        async for out in stream:
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                first = time.monotonic()
            last = time.monotonic()
        return first - start, (last - first) / max(1, n - 1)

    with frozen_heap(collect_first=True):  # as `fluidserve serve` runs its engine
        try:
            warm = await ae.add_request("warm-up", list(range(1, 65)), SamplingParams(max_tokens=2), klass="online")
            async for _ in warm:  # the first forward of a fresh process is slow: not an online request's
                pass
            background = [asyncio.create_task(offline(i)) for i in range(args.real_offline if backlog else 0)]
            await asyncio.sleep(0.5)  # the backlog is running before the first online arrival
            busy["s"] = 0.0
            t0 = window["start"] = time.monotonic()
            if online_on:
                results = await asyncio.gather(*(online(i, at, t0) for i, at in enumerate(arrivals)))
            else:
                results = []
                await asyncio.sleep(window_s)
            window["end"] = time.monotonic()
            length = window["end"] - t0
            busy_s = busy["s"]
            stats = engine.stats()
            for task in background:
                task.cancel()
        finally:
            await ae.shutdown()
    row = {"window_s": length, "busy_s": busy_s, "offline_tokens_per_s": offline_done["tokens"] / length,
           "offline_decode_share": offline_done["decodes"] / max(1, offline_done["tokens"]),
           "steps_abandoned": stats.num_steps_abandoned, "abandoned_tokens": stats.abandoned_tokens,
           "steps_resumed": stats.num_steps_resumed,
           "checkpoint_evictions": stats.num_checkpoint_evictions, "steps": stats.num_steps}
    if results:
        ttfts, tpots = [r[0] for r in results], [r[1] for r in results]
        row.update(ttfts_s=ttfts, tpots_s=tpots, p99_ttft_s=percentile(ttfts, 99), p50_ttft_s=percentile(ttfts, 50),
                   p99_tpot_s=percentile(tpots, 99), p50_tpot_s=percentile(tpots, 50))
    return row


def _median_row(runs: list[dict]) -> dict:
    """One design over the rounds: the median of each figure (a ratio: of
    the per-round ratios, each against the same round's online-only run)."""
    row = {"design": runs[0]["design"], "rounds": len(runs)}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(key in r for r in runs):
            row[key] = statistics.median(r[key] for r in runs)
    return row


def real_engine(args, argv: list[str] | None) -> int:
    import asyncio
    import platform
    import random
    import tempfile

    import torch

    torch.set_num_threads(args.real_threads)

    from dummy_models import build_model_dir

    model_dir = build_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="fluidserve-coserve-")))
    rng = random.Random(0)
    arrivals, t = [], 0.0
    for _ in range(args.real_online):
        arrivals.append(t)
        t += rng.expovariate(1.0 / args.real_gap_s)
    load_start = os.getloadavg()
    slos: tuple[float, float] | None = None
    rounds: list[dict[str, dict]] = []
    # The two references always run; of the rest, those asked for, the full
    # design once for each safepoint interval asked for.
    variants = REAL_VARIANTS[:2]
    for v in REAL_VARIANTS[2:]:
        if DESIGN_KEYS[v[0]] not in args.real_designs:
            continue
        if v[5] is not None:
            variants.append(v)
            continue
        for k in args.real_safepoint_layers:
            name = v[0] if len(args.real_safepoint_layers) == 1 else f"{v[0]}, safepoints every {k:g} layers"
            variants.append((name, *v[1:5], k, *v[6:]))
    # The offline-only run lasts as long as the online arrivals (and a second
    # for the last to finish): a rate over about the online window.
    window_s = arrivals[-1] + 1.0
    for rnd in range(args.real_rounds):
        # Offline only first, then online only next to the designs; odd rounds
        # in reverse. On a machine whose speed drifts, each design then sits
        # as near its round's online-only run as the order allows, and ratios
        # pair each design with that run.
        order = [variants[1], variants[0], *variants[2:]]
        order = order if rnd % 2 == 0 else order[::-1]
        results: dict[str, dict] = {}
        for name, online_on, backlog, klass, with_slo, k, ckpt, loans in order:
            if with_slo and slos is None:
                ref = results[REAL_VARIANTS[0][0]]  # online only: the SLOs hold online latency to (1 + slack) of it
                slos = (args.real_ttft_slo_ms or (1 + args.real_slo_slack) * ref["p99_ttft_s"] * 1e3,
                        args.real_tpot_slo_ms or (1 + args.real_slo_slack) * ref["p99_tpot_s"] * 1e3)
            res = asyncio.run(_real_variant(
                model_dir, args, arrivals, online_on, backlog, klass, slos if with_slo else None,
                k, ckpt, window_s=window_s, loan_tokens=loans))
            results[name] = {"design": name, **res}
            print(f"round {rnd + 1}, {name}: "
                  + (f"P99 TTFT {res['p99_ttft_s'] * 1e3:.0f} ms, P99 TPOT {res['p99_tpot_s'] * 1e3:.1f} ms, "
                     if "p99_ttft_s" in res else "")
                  + f"offline {res['offline_tokens_per_s']:.0f} tok/s, busy {res['busy_s']:.1f} of "
                  f"{res['window_s']:.1f} s, {res['steps_abandoned']} steps interrupted, "
                  f"{res['steps_resumed']} resumed", flush=True)
        ref, alone = results[REAL_VARIANTS[0][0]], results[REAL_VARIANTS[1][0]]
        idle = max(0.0, 1.0 - ref["busy_s"] / ref["window_s"])  # the share of the window online work leaves
        for name, r in results.items():
            if "p99_ttft_s" in r:
                r["ttft_ratio"] = r["p99_ttft_s"] / ref["p99_ttft_s"]
                r["tpot_ratio"] = r["p99_tpot_s"] / ref["p99_tpot_s"]
            if name not in (REAL_VARIANTS[0][0], REAL_VARIANTS[1][0]):
                r["offline_share"] = r["offline_tokens_per_s"] / alone["offline_tokens_per_s"]
                r["offline_share_of_idle"] = r["offline_share"] / idle if idle > 0 else float("nan")
            r["idle_share"] = idle
        rounds.append(results)
    rows = [_median_row([rnd[v[0]] for rnd in rounds]) for v in variants]
    ref = rows[0]
    idle = ref["idle_share"]
    load_end = os.getloadavg()
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    out = ["# Co-serving on the real engine (ConServe §4)", "",
           f"Command: `python benchmarks/coserving.py {cmd}`. Preset `{args.preset}` (random weights, fp32) "
           f"on the CPU ({platform.machine()}, {os.cpu_count()} cores, torch on {args.real_threads} thread(s)), "
           f"in-process through AsyncEngine. "
           f"Backlog: {args.real_offline} offline requests of {args.real_offline_prompt} prompt tokens and 32 "
           f"output from t = 0 (device KV for {args.real_kv_requests} of them at once); {args.real_online} online "
           f"requests (64 prompt tokens, 8 output) arriving as a "
           f"Poisson process, mean gap {args.real_gap_s:g} s; step budget {args.real_batched_tokens} tokens. "
           f"SLOs of the budget variants: TTFT {slos[0]:.0f} ms, TPOT {slos[1]:.1f} ms"
           + (f" ({1 + args.real_slo_slack:g}x the online-only P99s)" if not (args.real_ttft_slo_ms
                                                                            or args.real_tpot_slo_ms) else "")
           + f"; cost model: roofline prior, calibrated from the steps run; safepoints every "
           f"{' / '.join(f'{k:g}' for k in args.real_safepoint_layers)} layer(s) in the full design "
           f"(0.5: also between a layer's attention and MLP; an interrupted step pauses there and "
           f"resumes once online work drains). Idle capacity: {idle:.0%} of the window "
           f"(1 - the online-only run's busy time / its window).", "",
           f"Load average (1 min) at the start {load_start[0]:.2f}, at the end {load_end[0]:.2f}; "
           f"{os.cpu_count()} cores.", "",
           "| design | online P99 TTFT (ms) | vs online only | P50 TTFT (ms) | online P99 TPOT (ms) | vs online only "
           "| offline tok/s in the window | share of offline only | share of offline only x idle "
           "| of them decode rows | steps interrupted | of them resumed | tokens computed again |"
           + (" per round: TTFT / TPOT vs online only; share x idle |" if len(rounds) > 1 else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if len(rounds) > 1 else "")]
    for r in rows:
        on = "p99_ttft_s" in r
        cells = ([f"{r['p99_ttft_s'] * 1e3:.0f}", f"{r['ttft_ratio']:.2f}x",
                  f"{r['p50_ttft_s'] * 1e3:.0f}", f"{r['p99_tpot_s'] * 1e3:.1f}",
                  f"{r['tpot_ratio']:.2f}x"] if on else [""] * 5)
        cells += [f"{r['offline_tokens_per_s']:.0f}",
                  f"{r['offline_share']:.0%}" if "offline_share" in r else "",
                  f"{r['offline_share_of_idle']:.0%}" if "offline_share_of_idle" in r else "",
                  f"{r['offline_decode_share']:.1%}" if r.get("offline_tokens_per_s") else "",
                  *(f"{r.get(k, 0):g}" for k in ("steps_abandoned", "steps_resumed", "abandoned_tokens"))]
        if len(rounds) > 1:
            per = [rnd[r["design"]] for rnd in rounds]
            cells.append(", ".join(f"{p['ttft_ratio']:.2f}x / {p['tpot_ratio']:.2f}x" if "ttft_ratio" in p else ""
                                   for p in per).strip(", ")
                         + ("; " if on and "offline_share" in r else "")
                         + (", ".join(f"{p['offline_share_of_idle']:.0%}" for p in per)
                            if "offline_share" in r else ""))
        out.append(f"| {r['design']} | " + " | ".join(cells) + " |")
    md = "\n".join(out) + "\n"
    dest = Path(args.out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    stem = real_stem(args)
    (dest / f"{stem}.json").write_text(json.dumps({"args": vars(args), "arrivals_s": arrivals, "slos_ms": slos,
                                                   "idle_share": idle, "load_start": load_start,
                                                   "load_end": load_end, "rows": rows, "rounds": rounds}, indent=1))
    (dest / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
