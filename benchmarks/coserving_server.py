"""Co-serving through the server, as a user runs it: ``fluidserve serve MODEL
--data-dir DIR``, a streamed chat service at a fixed rate and, beside it, a
Batch API job, both through the official ``openai`` client over HTTP.

Each configuration starts its own server (a subprocess) and runs:

* online only: ``--online-requests`` streamed chats at ``--rate`` req/s
  (Poisson), ``--online-tokens`` output tokens each;
* batch alone: the batch job (``--batch-lines`` completions of about
  ``--batch-prompt`` tokens, ``--batch-tokens`` output tokens each), counted
  over a window as long as the online run;
* both, with the server flags under test.

It reports, per configuration, the online P99 TTFT and P99 TPOT (a
request's mean gap between tokens) against online only, and the tokens the
engine generated for the batch in the window against the batch alone (and
the lines done, which move a wave of in-flight lines at a time), for
``--rounds`` paired rounds
(medians of the ratios, each paired with its own round's references).

    python benchmarks/coserving_server.py         # defaults (--data-dir: a 1.2 slowdown cap), the cap off, 1.5
    python benchmarks/coserving_server.py --configs "" "--online-tpot-slo-ms 30"
    python benchmarks/coserving_server.py --configs "" slo:1.2
    python benchmarks/coserving_server.py --flags="--swap-loan-tokens 32" --tag=-kv-loans

A configuration ``slo:X`` sets ``--online-ttft-slo-ms`` and
``--online-tpot-slo-ms`` to X times the round's online-only P99s, and the
report says whether each SLO held.

Writes benchmarks/results/coserving_server{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import build_model_dir, save_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``fluidserve serve`` in a subprocess, on a free loopback port."""

    def __init__(self, model_dir: Path, data_dir: Path, flags: list[str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", str(model_dir), "--load-format", "dummy",
               "--data-dir", str(data_dir), "--port", str(self.port), "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited at start: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        raise RuntimeError("server did not start in 180 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def online_run(base: str, model: str, arrivals: list[float], tokens: int) -> list[dict]:
    """Streamed chats at the given arrival times: TTFT and token gaps each."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    start = time.monotonic()

    async def one(i: int, at: float) -> dict:
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        stamps = []
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Question {i}: tell me about the weather."}],
            max_tokens=tokens, temperature=0, stream=True, logprobs=True, extra_body={"ignore_eos": True})
        # Each token's chunk carries its logprob: dummy weights sample ids
        # the byte tokenizer has no text for, so content alone would not
        # show every token.
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                stamps.append(time.monotonic())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"ttft": stamps[0] - sent if stamps else float("nan"), "tpot": statistics.mean(gaps) if gaps else 0.0,
                "max_gap": max(gaps, default=0.0), "tokens": len(stamps)}

    out = await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    await client.close()
    return out


def start_batch(base: str, model: str, lines: int, prompt_tokens: int, tokens: int, work: Path) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="x")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    path = work / "batch.jsonl"
    with open(path, "w") as f:
        for i in range(lines):
            prompt = " ".join(rng.choice(words) for _ in range(prompt_tokens // 6))  # ~6 bytes a word, byte tokens
            f.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": model, "prompt": prompt, "max_tokens": tokens,
                                         "ignore_eos": True}}) + "\n")
    file = client.files.create(file=open(path, "rb"), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                                 completion_window="24h").id


def offline_tokens(base: str) -> float:
    """Tokens the engine has generated for offline requests (every replica)."""
    name = "fluidserve_offline_engine_generation_tokens_total"
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def lines_done(base: str, batch_id: str) -> int:
    b = httpx.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()
    return int(b["request_counts"]["completed"])


def p99(values: list[float]) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))]


def run_config(args, model_dir: Path, flags: list[str], online: bool, batch: bool, arrivals: list[float],
               window: float | None, work: Path, name: str) -> dict:
    data = Path(tempfile.mkdtemp(dir=work))
    server = Server(model_dir, data, [*shlex.split(args.flags), *flags], work / f"{name}.log")
    model = httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"][0]["id"]
    try:
        # Warm the server (first steps compile nothing on CPU, but allocate).
        asyncio.run(online_run(server.base, model, [0.0, 0.0], 4))
        batch_id = start_batch(server.base, model, args.batch_lines, args.batch_prompt, args.batch_tokens, work) \
            if batch else None
        t0 = time.monotonic()
        tokens0 = offline_tokens(server.base)
        rows = asyncio.run(online_run(server.base, model, arrivals, args.online_tokens)) if online else []
        elapsed = time.monotonic() - t0
        if batch and not online:
            time.sleep(max(0.0, (window or elapsed) - elapsed))
            elapsed = window or elapsed
        done = lines_done(server.base, batch_id) if batch_id else 0
        generated = offline_tokens(server.base) - tokens0
    finally:
        server.stop()
    res = {"window_s": elapsed, "lines_done": done, "offline_tokens": generated}
    if rows:
        res.update(p99_ttft_ms=1e3 * p99([r["ttft"] for r in rows]), p99_tpot_ms=1e3 * p99([r["tpot"] for r in rows]),
                   max_gap_ms=1e3 * max(r["max_gap"] for r in rows), requests=len(rows),
                   tokens=sum(r["tokens"] for r in rows))
    return res


def _flags_of(config: str, alone: dict) -> tuple[list[str], tuple[float, float] | None]:
    """Server flags of a configuration, and the SLOs (TTFT, TPOT ms) where
    it is ``slo:X``: X times this round's online-only P99s."""
    if not config.startswith("slo:"):
        return shlex.split(config), None
    x = float(config[len("slo:"):])
    ttft, tpot = x * alone["p99_ttft_ms"], x * alone["p99_tpot_ms"]
    return ["--online-ttft-slo-ms", f"{ttft:.1f}", "--online-tpot-slo-ms", f"{tpot:.1f}"], (ttft, tpot)


def _held(res: dict) -> str:
    """Whether a round kept its SLOs: P99 TTFT and P99 TPOT against them."""
    def mark(p99: float, slo: float) -> str:
        return f"{p99:.1f}/{slo:.1f} ms {'yes' if p99 <= slo else 'no'}"
    return f"{mark(res['p99_ttft_ms'], res['slo_ttft_ms'])}; {mark(res['p99_tpot_ms'], res['slo_tpot_ms'])}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small", help="benchmarks/dummy_models.py preset")
    ap.add_argument("--rate", type=float, default=1.0, help="online requests per second")
    ap.add_argument("--online-requests", type=int, default=40)
    ap.add_argument("--online-tokens", type=int, default=24)
    ap.add_argument("--batch-lines", type=int, default=400)
    ap.add_argument("--batch-prompt", type=int, default=500)
    ap.add_argument("--batch-tokens", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=["", "--online-slowdown-cap 0", "--online-slowdown-cap 1.5"],
                    help="server flags of each co-served configuration ('' = defaults)")
    ap.add_argument("--flags", default="", help="server flags added to every server, the references' too")
    ap.add_argument("--tag", default="", help="suffix of the results files' names")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="coserving-server-"))
    model_dir = work / "model"
    build_model_dir(args.preset, model_dir)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.online_requests):
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    rounds = []
    for r in range(args.rounds):
        alone = run_config(args, model_dir, [], True, False, arrivals, None, work, f"r{r}-online")
        batch = run_config(args, model_dir, [], False, True, arrivals, alone["window_s"], work, f"r{r}-batch")
        both = {}
        for i, flags in enumerate(args.configs):
            argv_i, slos = _flags_of(flags, alone)
            res = run_config(args, model_dir, argv_i, True, True, arrivals, None, work, f"r{r}-c{i}")
            if slos:
                res.update(slo_ttft_ms=slos[0], slo_tpot_ms=slos[1], slo_flags=" ".join(argv_i))
            alone_rate = batch["offline_tokens"] / batch["window_s"]
            lines_rate = batch["lines_done"] / batch["window_s"]
            nan = float("nan")
            res.update(ttft_x=res["p99_ttft_ms"] / alone["p99_ttft_ms"],
                       tpot_x=res["p99_tpot_ms"] / alone["p99_tpot_ms"],
                       batch_share=(res["offline_tokens"] / res["window_s"]) / alone_rate if alone_rate else nan,
                       lines_share=(res["lines_done"] / res["window_s"]) / lines_rate if lines_rate else nan)
            both[flags or "defaults"] = res
        if batch["lines_done"] >= args.batch_lines:
            print(f"warning: the batch alone finished inside the window: its speed is understated; "
                  f"raise --batch-lines above {args.batch_lines}", file=sys.stderr)
        rounds.append({"online_only": alone, "batch_alone": batch, "coserved": both})
        print(json.dumps(rounds[-1], indent=1), flush=True)

    lines = ["# Co-serving through the server", "",
             f"`fluidserve serve` ({args.preset} dummy weights, CPU) with `--data-dir`; online: {args.online_requests} "
             f"streamed chats at {args.rate} req/s (Poisson), {args.online_tokens} tokens each; batch: "
             f"{args.batch_lines} completions of ~{args.batch_prompt} tokens, {args.batch_tokens} out; "
             f"{args.rounds} round(s), medians of the ratios paired within a round. Command: "
             f"`python benchmarks/coserving_server.py {' '.join(shlex.quote(a) for a in (argv or sys.argv[1:]))}`",
             "", *([f"Every server, the references' too, runs with `{args.flags}`.", ""] if args.flags else []),
             "Harvest: the tokens the engine generated for the batch in the window against the batch alone "
             "(lines finish in waves of `--batch-max-in-flight`, so lines done, also shown, moves a wave at a time).",
             "", "| server flags | online P99 TTFT vs online only | online P99 TPOT vs online only | "
             "batch tokens vs the batch alone | batch lines done vs alone | SLOs held (TTFT, TPOT), per round |",
             "|---|---:|---:|---:|---:|---|"]
    for flags in [c or "defaults" for c in args.configs]:
        per = [rd["coserved"][flags] for rd in rounds]
        med = {k: statistics.median(p[k] for p in per) for k in ("ttft_x", "tpot_x", "batch_share", "lines_share")}
        ref = rounds[0]["online_only"]
        held = ", ".join(_held(p) for p in per) if "slo_ttft_ms" in per[0] else ""
        lines.append(f"| `{flags}` | {med['ttft_x']:.2f}x ({ref['p99_ttft_ms']:.0f} -> "
                     f"{per[0]['p99_ttft_ms']:.0f} ms) | {med['tpot_x']:.2f}x ({ref['p99_tpot_ms']:.1f} -> "
                     f"{per[0]['p99_tpot_ms']:.1f} ms) | {med['batch_share']:.0%} | {med['lines_share']:.0%} | "
                     f"{held} |")
    text = "\n".join(lines) + "\n"
    save_results(args.out_dir / f"coserving_server{args.tag}", {"benchmark": "coserving_server", "args": vars(args) | {
        "out_dir": str(args.out_dir)}, "rounds": rounds}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
