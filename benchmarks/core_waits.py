"""What ``--yield-busy-cores`` reads, and what each thread count costs beside
another process (``engine/cpu_share.py``).

A CPU step's OpenMP team stalls whenever one of its threads waits for a
core; the kernel counts that wait per thread (``/proc/self/task/*/schedstat``).
Three measurements, SmolLM2-shaped greedy decode at batch 1 on a second
thread with idle threads spinning 10,000 rounds, as ``fluidserve serve``
steps:

* **fixed teams**: ms per token on all of torch's threads and on one, beside
  each neighbour, with the waits the team's threads counted (cores' worth
  per second) and how busy the neighbour kept the cores;
* **the switch**: the engine with ``yield_busy_cores`` on and off, each in a
  fresh process, decode ms per token and a ``--prompt-tokens`` prefill;
* **a client on the same cores** (``--skip-server`` leaves it out): the
  waits of ``fluidserve serve --no-yield-busy-cores`` while the load
  generator streams chats at each ``--rates``, in 0.2 s windows.

Neighbours: none, one process spinning, and processes that compute for a
few milliseconds and sleep in turn (a service busy with its own requests)::

    python benchmarks/core_waits.py [--model DIR] [--batch N --tag=-batchN]

``--batch N`` decodes N sequences together (a loaded server's steps),
where more of each op is compute. Writes
``benchmarks/results/core_waits{TAG}.{json,md}``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from busy_neighbour import chat_flags, cpu_server, neighbour_command  # noqa: E402

# (label, duty: (ms computing, ms asleep) in turn, or None for a spinner); the first runs nothing beside.
NEIGHBOURS = [
    ("none", None),
    ("spins", None),
    ("0.3 ms busy, 0.5 ms asleep", (0.3, 0.5)),
    ("2 ms busy, 3 ms asleep", (2.0, 3.0)),
    ("5 ms busy, 10 ms asleep", (5.0, 10.0)),
]
ENGINE = {"dtype": "float32", "device": "cpu", "enable_prefix_caching": False}


class Meter:
    """Wall seconds, the team's waits and other processes' load over a stretch."""

    def __init__(self) -> None:
        from fluidserve.engine.cpu_share import ThreadWaits, read_sample

        cpus, waits = frozenset(os.sched_getaffinity(0)), ThreadWaits()
        self._read = lambda: read_sample(cpus, waits)
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        s = end.at - self._start.at
        ours = end.ours_s - self._start.ours_s
        return {"seconds": s, "waiting": (end.waited_s - self._start.waited_s) / s,
                "others_busy": max(0.0, end.busy_s - self._start.busy_s - ours) / s}


def in_process(model: str, job: str, tokens: int, prompt_tokens: int, repeats: int, batch: int = 1) -> list[dict]:
    """One row per neighbour: ``job`` "fixed" (all threads, then one, in
    turns), or "on"/"off" (``yield_busy_cores``)."""
    import torch

    from fluidserve.engine import LLM, SamplingParams

    decode = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long_prompt = list(range(100, 100 + prompt_tokens))
    rows: list[dict] = []

    def run() -> None:
        llm = LLM(model, **ENGINE, yield_busy_cores=job == "on")
        ceiling = torch.get_num_threads()
        llm.generate(["warm up"], decode)
        llm.generate([long_prompt], first)

        def decode_ms() -> tuple[float, dict[str, float]]:
            meter = Meter()
            llm.generate(["Tell me a long story about dragons."] * batch, decode)
            got = meter.stop()
            return got["seconds"] / tokens * 1e3, got

        for label, duty in NEIGHBOURS:
            beside = subprocess.Popen(neighbour_command(duty)) if label != "none" else None
            try:
                time.sleep(1.0)  # at work, and the watch's windows caught up
                row: dict = {"neighbour": label, "duty_ms": duty}
                if job == "fixed":
                    for _ in range(repeats):
                        for threads in (ceiling, 1):
                            torch.set_num_threads(threads)
                            ms, got = decode_ms()
                            row.setdefault(f"decode_ms_{threads}", []).append(ms)
                            row.setdefault(f"waiting_{threads}", []).append(got["waiting"])
                            row.setdefault(f"others_busy_{threads}", []).append(got["others_busy"])
                    torch.set_num_threads(ceiling)
                else:
                    for _ in range(repeats):
                        row.setdefault("decode_ms", []).append(decode_ms()[0])
                        t0 = time.perf_counter()
                        llm.generate([long_prompt], first)
                        row.setdefault("prefill_ms", []).append((time.perf_counter() - t0) * 1e3)
                    stats = llm.engine.stats()
                    row.update(threads_after=stats.cpu_threads, thread_changes=stats.num_cpu_thread_changes,
                               thread_trials=stats.num_cpu_thread_trials)
                rows.append(row)
            finally:
                if beside is not None:
                    beside.kill()
                    beside.wait()
        rows.append({"ceiling": ceiling})

    thread = threading.Thread(target=run)  # the engine built and stepped off the main thread, as the server does
    thread.start()
    thread.join()
    return rows


def run_job(model: str, job: str, args: argparse.Namespace) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",)}
    env.setdefault("GOMP_SPINCOUNT", "10000")  # as serve/cli.py sets it
    spec = json.dumps({"model": model, "job": job})
    out = subprocess.run([sys.executable, __file__, "--job", spec, "--tokens", str(args.tokens),
                          "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats),
                          "--batch", str(args.batch)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def server_waits(model: str, rates: list[float], num_requests: int, real_model: bool) -> list[dict]:
    """The waits of a server on all its threads while the load generator,
    on the same cores, streams chats at each rate."""
    from serve_bench import load, stop_server
    from vs_vllm import wait_quiet

    from fluidserve.engine.cpu_share import WINDOW_S, ThreadWaits

    proc, url = cpu_server(model, "--no-yield-busy-cores")
    server = ThreadWaits(Path("/proc") / str(proc.pid))
    rows = []
    try:
        load(url, chat_flags(8, float("inf"), 1, real_model))  # one-off costs
        for rate in rates:
            wait_quiet()
            windows: list[float] = []
            done = threading.Event()

            def watch() -> None:
                last, at = server.read(), time.monotonic()
                while not done.wait(WINDOW_S):
                    now, t = server.read(), time.monotonic()
                    windows.append(max(0.0, now - last) / (t - at))
                    last, at = now, t

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                rep = load(url, chat_flags(num_requests, rate, 0, real_model))
            finally:
                done.set()
                watcher.join()
            rows.append({"rate": rate, "windows": windows, "tpot_ms_p50": rep["tpot_ms"]["p50"],
                         "completed": rep["completed"]})
            print(f"client at {rate:g} req/s: the server's threads waited {statistics.mean(windows):.2f} cores' "
                  f"worth (windows up to {max(windows):.2f})", flush=True)
    finally:
        stop_server(proc)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model directory (default: the vs_vllm shape, random weights)")
    ap.add_argument("--tokens", type=int, default=48, help="decode: tokens per timed run")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="prefill: the prompt's length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="decode: sequences stepped together (ms per step)")
    ap.add_argument("--tag", default="", help="suffix of the results' file name")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="the client's requests per second")
    ap.add_argument("--num-requests", type=int, default=30)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        job = json.loads(args.job)
        print(json.dumps(in_process(job["model"], job["job"], args.tokens, args.prompt_tokens, args.repeats,
                                    args.batch)))
        return 0
    from dummy_models import save_results
    from vs_vllm import RESULTS, build_model, device_record

    med = statistics.median
    record: dict = {"benchmark": "core waits", "command": " ".join(map(shlex.quote, sys.argv)),
                    "device": device_record()}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "model"))
        record["model"] = Path(args.model).name if args.model else "vs_vllm shape, random weights"
        fixed = run_job(model, "fixed", args)
        ceiling = fixed.pop()["ceiling"]
        for row in fixed:
            print(f"{row['neighbour']:>28}: {med(row[f'decode_ms_{ceiling}']):.1f} ms/token on {ceiling} threads "
                  f"(waiting {med(row[f'waiting_{ceiling}']):.2f}), {med(row['decode_ms_1']):.1f} on one", flush=True)
        switch = {}
        for job in ("on", "off"):
            switch[job] = run_job(model, job, args)[:-1]
            for row in switch[job]:
                print(f"yield {job:>3}, {row['neighbour']:>28}: decode {med(row['decode_ms']):.1f} ms/token, "
                      f"prefill {med(row['prefill_ms']):.0f} ms, {row['threads_after']} threads after", flush=True)
        served = [] if args.skip_server else server_waits(model, args.rates, args.num_requests, bool(args.model))
    record.update(ceiling=ceiling, batch=args.batch, fixed=fixed, switch=switch, server=served)
    lines = ["# Core waits: what `--yield-busy-cores` reads, and what each thread count costs", "",
             f"Command: `{record['command']}`", "",
             f"Model: {record['model']}, fp32, {os.cpu_count()} cores, decode at batch {args.batch} ({args.tokens} "
             "steps; ms per step) "
             f"stepped on a second thread, idle threads spinning 10,000 rounds; medians of {args.repeats}. "
             "Waiting: cores' worth of this process's threads runnable but not running "
             "(`/proc/self/task/*/schedstat`), per second.", "",
             "## Fixed teams", "",
             f"| neighbour | ms/token, {ceiling} threads | waiting, {ceiling} threads | ms/token, 1 thread | "
             f"waiting, 1 thread | neighbour's load (cores), beside {ceiling} / 1 |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in fixed:
        lines.append(f"| {row['neighbour']} | {med(row[f'decode_ms_{ceiling}']):.1f} | "
                     f"{med(row[f'waiting_{ceiling}']):.2f} | {med(row['decode_ms_1']):.1f} | "
                     f"{med(row['waiting_1']):.2f} | {med(row[f'others_busy_{ceiling}']):.2f} / "
                     f"{med(row['others_busy_1']):.2f} |")
    lines += ["", "## The switch (`yield_busy_cores`), each in a fresh process", "",
              "| neighbour | decode ms/token, on / off | "
              f"prefill of {args.prompt_tokens} tokens ms, on / off | threads after (on) | "
              "thread changes (trials), on |",
              "|---|---:|---:|---:|---:|"]
    for on, off in zip(switch["on"], switch["off"]):
        lines.append(f"| {on['neighbour']} | **{med(on['decode_ms']):.1f}** / {med(off['decode_ms']):.1f} | "
                     f"**{med(on['prefill_ms']):.0f}** / {med(off['prefill_ms']):.0f} | {on['threads_after']} | "
                     f"{on['thread_changes']} ({on['thread_trials']}) |")
    if served:
        lines += ["", "## A client streaming chats from the same cores", "",
                  "`fluidserve serve --no-yield-busy-cores`, the load generator on the same cores; the server's "
                  f"threads' waiting in {len(served[0]['windows'])}+ windows of 0.2 s.", "",
                  "| client rate | waiting, mean | median | largest window | median TPOT ms |",
                  "|---:|---:|---:|---:|---:|"]
        for row in served:
            w = row["windows"]
            lines.append(f"| {row['rate']:g} req/s | {statistics.mean(w):.2f} | {med(w):.2f} | {max(w):.2f} | "
                         f"{row['tpot_ms_p50']:.1f} |")
    save_results(RESULTS / f"core_waits{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
