"""Load generator for any OpenAI-compatible server (``fluidserve bench``,
``benchmarks/serve_bench.py``).

Owns the open-loop client: arrivals (Poisson, Gamma with a given CV, or a
trace's own times), request lengths (fixed / uniform / a CSV of real lengths
scaled and clipped), exact output lengths through ``ignore_eos``, and the
report: throughput, TTFT / TPOT / ITL / E2E (mean, P50, P99), normalized
latency (E2E per output token), latency bound (the largest gap between two
tokens of a request) and goodput under SLOs. Results go to JSON.

Prompts are sent as token ids on /v1/completions, so input lengths are exact
whatever the tokenizer; the chat endpoint uses text instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from fluidserve.scheduler.simulator import percentile  # one percentile definition for every benchmark
from fluidserve.scheduler.workloads import ARXIV, AZURE_CODE, DEFAULT_WORKLOAD_DIR, SHAREGPT, gamma_arrivals, read_rows

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS = {"sharegpt": SHAREGPT, "azure-code": AZURE_CODE, "arxiv": ARXIV}


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    output_len: int
    arrival_s: float  # offset from the start of the run


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    token_times: list[float] = field(default_factory=list)  # offsets from start
    completion_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float:
        n = self.completion_tokens
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else math.nan


# -- workload -------------------------------------------------------------------


def load_lengths(path: Path) -> list[tuple[int, int, float | None]]:
    """(prompt_tokens, output_tokens, arrival_s or None) rows of a CSV."""
    rows = []
    for row in read_rows(path):
        arrival = float(row["arrival_s"]) if row.get("arrival_s") not in (None, "") else None
        rows.append((int(row["prompt_tokens"]), int(row["output_tokens"]), arrival))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def arrival_gaps(n: int, rate: float, cv: float, rng: random.Random) -> list[float]:
    """Inter-arrival gaps: Poisson (cv 1) or Gamma with the given CV; rate inf
    sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    gap = gamma_arrivals(rate, cv)
    return [gap(rng) for _ in range(n)]


def build_workload(args: argparse.Namespace) -> list[RequestSpec]:
    rng = random.Random(args.seed)
    lengths = _sample_lengths(args, rng)
    if args.use_trace_arrivals:
        t0 = lengths[0][2] or 0.0
        times = [(a - t0) / args.time_scale for _, _, a in lengths]
    else:
        times = _cumulative(arrival_gaps(len(lengths), args.request_rate, args.cv, rng))
    specs = [RequestSpec(p, o, t) for (p, o, _), t in zip(lengths, times)]
    if args.duration is not None:
        specs = [s for s in specs if s.arrival_s < args.duration]
    return specs


def _cumulative(gaps: list[float]) -> list[float]:
    out, t = [], 0.0
    for i, g in enumerate(gaps):
        t += g if i else 0.0
        out.append(t)
    return out


def _clip(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


def _sample_lengths(args: argparse.Namespace, rng: random.Random) -> list[tuple[int, int, float | None]]:
    n = args.num_requests
    if args.duration is not None and not math.isinf(args.request_rate):
        n = int(args.request_rate * args.duration * 1.5) + 10  # enough arrivals; cut at the duration later
    if args.dataset == "synthetic":
        def draw(mean: int) -> float:
            if args.length_dist == "fixed":
                return mean
            if args.length_dist == "uniform":
                return rng.uniform(mean * (1 - args.length_range), mean * (1 + args.length_range))
            sigma = args.length_range  # lognormal with the given mean
            return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        rows = [(draw(args.input_len), draw(args.output_len), None) for _ in range(n)]
    else:
        path = Path(args.dataset) if args.dataset not in DATASETS else Path(args.workloads_dir) / DATASETS[args.dataset]
        table = load_lengths(path)
        if args.use_trace_arrivals:
            if table[0][2] is None:
                raise ValueError(f"{path} has no arrival_s column")
            rows = table[: n]
        else:
            rows = [rng.choice(table) for _ in range(n)]
    s = args.length_scale
    return [(_clip(p * s, 1, args.max_input_len), _clip(o * s, 1, args.max_output_len), a) for p, o, a in rows]


# -- client ---------------------------------------------------------------------


def _payload(args: argparse.Namespace, model: str, spec: RequestSpec, rng: random.Random) -> tuple[str, dict]:
    body: dict[str, Any] = {
        "model": model, "max_tokens": spec.output_len, "stream": True, "ignore_eos": args.ignore_eos,
        "stream_options": {"include_usage": True}, "temperature": args.temperature,
    }
    if args.endpoint == "chat":
        words = " ".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(spec.prompt_len))
        body["messages"] = [{"role": "user", "content": words}]
        return "/v1/chat/completions", body
    lo, hi = args.prompt_token_range
    body["prompt"] = [rng.randrange(lo, hi) for _ in range(spec.prompt_len)]
    return "/v1/completions", body


async def send_one(client: Any, url: str, body: dict, result: RequestResult, headers: dict) -> None:
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                _on_event(line[6:], result)
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        result.error = f"{type(exc).__name__}: {exc}"
        return
    result.e2e = time.perf_counter() - result.start
    result.ok = not result.error and result.completion_tokens > 0


def _on_event(data: str, result: RequestResult) -> None:
    now = time.perf_counter() - result.start
    if data == "[DONE]":
        return
    if '"error"' in data[:12]:
        result.error = data[:300]
    elif '"choices":[]' in data:  # the usage chunk
        usage = json.loads(data)["usage"]
        result.completion_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
    elif '"role":"assistant","content":""' in data:
        return  # chat's opening chunk carries no token
    else:
        if not result.token_times:
            result.ttft = now
        result.token_times.append(now)


async def run_load(args: argparse.Namespace, specs: list[RequestSpec]) -> tuple[list[RequestResult], float]:
    import httpx

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the bench extra
        tqdm = None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 100_000, max_keepalive_connections=1024)
    rng = random.Random(args.seed + 1)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model or await _first_model(client, headers)
        bar = tqdm(total=len(specs), desc="requests", unit="req", disable=args.no_progress) if tqdm else None
        results = [RequestResult(s.prompt_len, s.output_len) for s in specs]
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        t0 = time.perf_counter()

        async def launch(spec: RequestSpec, result: RequestResult) -> None:
            delay = spec.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            url, body = _payload(args, model, spec, rng)
            if gate is None:
                await send_one(client, url, body, result, headers)
            else:
                async with gate:
                    await send_one(client, url, body, result, headers)
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(launch(s, r) for s, r in zip(specs, results)))
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return results, elapsed


async def _first_model(client: Any, headers: dict) -> str:
    resp = await client.get("/v1/models", headers=headers)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# -- report ---------------------------------------------------------------------


def summarize(xs: list[float], scale: float = 1000.0) -> dict[str, float]:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return {"mean": statistics.fmean(xs) * scale, "p50": percentile(xs, 50) * scale, "p99": percentile(xs, 99) * scale}


def report(results: list[RequestResult], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    meets = [r for r in ok if _meets_slo(r, args)]
    itls = [x for r in ok for x in r.itls]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": summarize([r.ttft for r in ok]),
        "tpot_ms": summarize([r.tpot for r in ok]),
        "itl_ms": summarize(itls),
        "e2e_ms": summarize([r.e2e for r in ok]),
        "normalized_latency_ms_per_token": summarize([r.e2e / r.completion_tokens for r in ok]),
        "latency_bound_ms": summarize([max(r.itls, default=r.ttft) for r in ok]),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "e2e_ms": args.slo_e2e_ms},
        "slo_attainment": len(meets) / len(results) if results else math.nan,
        "goodput_req_s": len(meets) / elapsed,
        "goodput_tok_s": sum(r.completion_tokens for r in meets) / elapsed,
    }


def _meets_slo(r: RequestResult, args: argparse.Namespace) -> bool:
    checks = ((args.slo_ttft_ms, r.ttft), (args.slo_tpot_ms, r.tpot), (args.slo_e2e_ms, r.e2e))
    return all(limit is None or math.isnan(value) or value * 1000 <= limit for limit, value in checks)


def print_report(rep: dict[str, Any]) -> None:
    print(f"completed {rep['completed']}  failed {rep['failed']}  in {rep['duration_s']:.2f} s")
    print(f"throughput  {rep['request_throughput']:.2f} req/s  {rep['output_token_throughput']:.1f} out tok/s  "
          f"{rep['total_token_throughput']:.1f} total tok/s")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "normalized_latency_ms_per_token", "latency_bound_ms"):
        s = rep[key]
        print(f"{key:34s} mean {s['mean']:9.2f}  p50 {s['p50']:9.2f}  p99 {s['p99']:9.2f}")
    print(f"goodput  {rep['goodput_req_s']:.2f} req/s  {rep['goodput_tok_s']:.1f} tok/s  "
          f"(SLO attainment {rep['slo_attainment']:.1%})")
    for err in rep["errors"]:
        print("error:", err)


# -- entry point ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fluidserve bench",
                                description="Open-loop load generator for an OpenAI-compatible server.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=200)
    w.add_argument("--duration", type=float, default=None, help="seconds of arrivals (instead of a count)")
    w.add_argument("--request-rate", type=float, default=float("inf"), help="req/s; inf = all at once")
    w.add_argument("--arrival", choices=["poisson", "gamma"], default="poisson")
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gaps (gamma)")
    w.add_argument("--dataset", default="synthetic",
                   help=f"synthetic, one of {sorted(DATASETS)} (from --workloads-dir), or a CSV path")
    w.add_argument("--workloads-dir", default=str(DEFAULT_WORKLOAD_DIR))
    w.add_argument("--use-trace-arrivals", action="store_true", help="use the CSV's arrival_s column")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals sped up by this factor")
    w.add_argument("--input-len", type=int, default=32)
    w.add_argument("--output-len", type=int, default=32)
    w.add_argument("--length-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    w.add_argument("--length-range", type=float, default=0.5, help="uniform ±fraction, or lognormal sigma")
    w.add_argument("--length-scale", type=float, default=1.0, help="multiply dataset lengths (other tokenizers)")
    w.add_argument("--max-input-len", type=int, default=100_000)
    w.add_argument("--max-output-len", type=int, default=100_000)
    w.add_argument("--prompt-token-range", type=int, nargs=2, default=[100, 200], metavar=("LO", "HI"))
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--max-concurrency", type=int, default=None)
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLOs (goodput)")
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-tpot-ms", type=float, default=None)
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    o = p.add_argument_group("output")
    o.add_argument("--output", default=None, help="JSON path (default benchmarks/results/serve_bench_<time>.json)")
    o.add_argument("--label", default="")
    o.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.arrival == "poisson":
        args.cv = 1.0
    specs = build_workload(args)
    results, elapsed = asyncio.run(run_load(args, specs))
    rep = report(results, elapsed, args)
    rep["args"] = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
    return rep


def write_json(rep: dict[str, Any], path: str | None, stem: str = "serve_bench") -> Path:
    out = Path(path) if path else REPO_ROOT / "benchmarks" / "results" / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2, default=_json_default))
    return out


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return str(x)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rep = run(args)
    print_report(rep)
    print("wrote", write_json(rep, args.output))
    return 0 if rep["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
