"""Serving on a CPU that another process shares: ``fluidserve serve`` with
``--yield-busy-cores`` (the default: a step computes on the cores other
processes leave free, ``engine/cpu_share.py``) against the same server with
``--no-yield-busy-cores`` (every step on all of torch's threads), both alive
in one run, each under the same Poisson load of streamed chats twice: alone,
and beside ``--neighbours`` processes that spin on a core each (a batch job,
another server's busy loop), or, with ``--duty BUSY_MS SLEEP_MS``, that
compute for BUSY_MS and sleep for SLEEP_MS in turn (a service handling its
own requests: a third of a core, held milliseconds at a time, costs a team
of spinning threads more than its share)::

    python benchmarks/busy_neighbour.py [--model DIR] [--duty 2 3 --tag=-duty]

Each load starts once the cores are quiet (``vs_vllm.wait_quiet``); the two
servers take turns, each round in the opposite order of the last. Writes
``benchmarks/results/busy_neighbour{--tag}.{json,md}``, with how often each load
changed the threads a step computes on (``fluidserve_cpu_thread_changes_total``)
and the trials that decided it (``fluidserve_cpu_thread_trials_total``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dummy_models import save_results  # noqa: E402
from serve_bench import bc_free_port, launch, load, stop_server  # noqa: E402
from vs_vllm import RESULTS, build_model, cpu_threads, device_record, wait_quiet  # noqa: E402


def neighbour_command(duty: tuple[float, float] | None) -> list[str]:
    """A process that spins (``duty`` None) or computes ``duty[0]`` ms and
    sleeps ``duty[1]`` ms in turn."""
    if duty is None:
        return [sys.executable, "-c", "while True: pass"]
    busy, asleep = duty[0] / 1e3, duty[1] / 1e3
    return [sys.executable, "-c", "import time\nwhile True:\n    end = time.perf_counter() + "
            f"{busy}\n    while time.perf_counter() < end: pass\n    time.sleep({asleep})"]


def cpu_server(model: str, *extra: str, name: str = "server") -> tuple[subprocess.Popen, str]:
    """``fluidserve serve`` on the CPU in fp32 with no prefix cache (every
    prompt computed), started and healthy; the process and its URL."""
    port = bc_free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--no-enable-prefix-caching",
           "--log-level", "warning", *extra]
    return launch(cmd, f"{url}/health", timeout=600, name=name), url


def chat_flags(num_requests: int, rate: float, seed: int, real_model: bool, input_len: int = 128,
               output_len: int = 64) -> list[str]:
    """The load generator's flags for streamed chats of about ``input_len``
    words and ``output_len`` tokens."""
    return ["--endpoint", "chat", "--input-len", str(input_len), "--output-len", str(output_len),
            "--length-dist", "uniform", "--length-range", "0.5", "--num-requests", str(num_requests),
            "--request-rate", str(rate), "--seed", str(seed),
            *(["--no-ignore-eos"] if real_model else [])]  # a real model ends its turns


SERVERS = {"yield busy cores (default)": [], "all threads always": ["--no-yield-busy-cores"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the vs_vllm shape, random weights)")
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second")
    ap.add_argument("--num-requests", type=int, default=30)
    ap.add_argument("--neighbours", type=int, default=1, help="busy processes beside the server")
    ap.add_argument("--duty", type=float, nargs=2, metavar=("BUSY_MS", "SLEEP_MS"), default=None,
                    help="each neighbour computes BUSY_MS, then sleeps SLEEP_MS, in turn (default: spins)")
    ap.add_argument("--input-len", type=int, default=128, help="mean prompt words")
    ap.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    ap.add_argument("--repeats", type=int, default=2, help="loads of each server per condition, in turns")
    ap.add_argument("--tag", default="", help="appended to the result files' name")
    args = ap.parse_args(argv)

    def flags(num_requests: int, rate: float, seed: int) -> list[str]:
        return chat_flags(num_requests, rate, seed, real_model=bool(args.model), input_len=args.input_len,
                          output_len=args.output_len)

    record: dict = {"benchmark": "serving beside busy processes", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record(), "rate": args.rate, "num_requests": args.num_requests,
                    "neighbours": args.neighbours, "duty_ms": args.duty, "points": []}
    neighbour = neighbour_command(tuple(args.duty) if args.duty else None)
    kind = ("spinning on a core each" if args.duty is None else
            f"each computing {args.duty[0]:g} ms and sleeping {args.duty[1]:g} ms in turn")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "model"))
        record["model"] = Path(args.model).name if args.model else "vs_vllm shape, random weights"
        procs, urls = {}, {}
        try:
            for name, extra in SERVERS.items():
                procs[name], urls[name] = cpu_server(model, *extra, name=name)
            for name in SERVERS:  # first requests pay one-off costs, not the load's
                load(urls[name], flags(8, float("inf"), 1))
            order = list(SERVERS)
            for beside, round_ in itertools.product((0, args.neighbours), range(args.repeats)):
                for name in order:
                    wait_quiet()
                    spinners = [subprocess.Popen(neighbour) for _ in range(beside)]
                    before = cpu_threads(urls[name])
                    try:
                        time.sleep(1.0)  # the neighbours at work, the servers' watch caught up
                        rep = load(urls[name], flags(args.num_requests, args.rate, 0))
                        after = cpu_threads(urls[name])
                        changes, trials = (after.get(k, 0.0) - before.get(k, 0.0)
                                           for k in ("cpu_thread_changes", "cpu_thread_trials"))
                    finally:
                        for p in spinners:
                            p.kill()
                            p.wait()
                    point = {"server": name, "neighbours": beside, "round": round_, "thread_changes": changes,
                             "thread_trials": trials,
                             **{k: rep[k] for k in ("completed", "failed", "ttft_ms", "tpot_ms",
                                                    "output_token_throughput")}}
                    record["points"].append(point)
                    print(f"{name:>28}, {beside} busy beside: TTFT p50/p99 {rep['ttft_ms']['p50']:.0f} / "
                          f"{rep['ttft_ms']['p99']:.0f} ms, TPOT p50/p99 {rep['tpot_ms']['p50']:.1f} / "
                          f"{rep['tpot_ms']['p99']:.1f} ms, failed {rep['failed']}, thread changes {changes:.0f} "
                          f"(trials {trials:.0f})",
                          flush=True)
                order.reverse()
        finally:
            for proc in procs.values():
                stop_server(proc)
    lines = [f"# Serving beside busy processes ({args.num_requests} streamed chats at {args.rate:g} req/s)", "",
             f"Command: `{record['command']}`", "",
             f"Model: {record['model']}, fp32, {os.cpu_count()} cores. Each server alone, then beside "
             f"{args.neighbours} process(es) {kind}.", "",
             "| server | busy processes beside | round | TTFT p50 / p99 ms | TPOT p50 / p99 ms | out tok/s | failed | "
             "thread changes (trials) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in record["points"]:
        lines.append(f"| {p['server']} | {p['neighbours']} | {p['round'] + 1} | "
                     f"{p['ttft_ms']['p50']:.0f} / {p['ttft_ms']['p99']:.0f} "
                     f"| {p['tpot_ms']['p50']:.1f} / {p['tpot_ms']['p99']:.1f} | "
                     f"{p['output_token_throughput']:.0f} | {p['failed']} | {p['thread_changes']:.0f} "
                     f"({p['thread_trials']:.0f}) |")
    save_results(RESULTS / f"busy_neighbour{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
