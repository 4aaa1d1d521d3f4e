"""Serving benchmark: an async OpenAI-compatible load generator, plus a
measurement of the frontend's own overhead.

Load test a running server (any OpenAI-compatible one) with ``vllm bench
serve``'s flags; the result JSON carries its keys (``mean_ttft_ms``,
``p99_tpot_ms``, ``output_throughput``, ``request_goodput``, ...) beside ours:

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 \
        --dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json \
        --tokenizer meta-llama/Llama-3.1-8B-Instruct --num-prompts 300 --request-rate 4 \
        --burstiness 0.25 --goodput ttft:500 tpot:50 --percentile-metrics ttft,tpot,itl,e2el \
        --metric-percentiles 50,90,99 --save-result --result-dir benchmarks/results

    (vLLM's datasets: random, sharegpt, burstgpt, custom. Ours, by --dataset: real lengths
     from sharegpt, azure-code [--use-trace-arrivals], arxiv, a CSV path, or synthetic; read
     from --workloads-dir, default benchmarks/workloads)

Frontend overhead (starts its own ``fluidserve serve`` on the built-in tiny model):

    python benchmarks/serve_bench.py --measure-overhead

It reports the requests/s the server sustains with a trivially small model,
and the latency per token a client sees through HTTP/SSE minus what the same
engine takes when called directly in-process. Writes
benchmarks/results/serve_overhead.json (``--output`` to change it). The
client shares the machine's cores with the server, so on a small box the
numbers include the client's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fluidserve.serve import bench_client as bc

REPO_ROOT = Path(__file__).resolve().parents[1]


# -- the engine called directly ---------------------------------------------------


class DirectEngine:
    """``LLMEngine`` driven in-process, the baseline the server is compared to."""

    def __init__(self, config_kwargs: dict) -> None:
        from fluidserve.engine.config import EngineConfig
        from fluidserve.engine.engine import LLMEngine

        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        self.engine = LLMEngine(EngineConfig.create(**config_kwargs))
        self.rounds = 0

    def run(self, prompt_len: int, output_len: int, concurrency: int) -> dict[str, float]:
        """One round of ``concurrency`` requests: mean TPOT, TTFT, tokens/s."""
        from fluidserve.engine.sampling_params import SamplingParams

        engine, self.rounds = self.engine, self.rounds + 1
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        start = time.perf_counter()
        for i in range(concurrency):
            engine.add_request(f"d{self.rounds}-{i}", [100 + (i + j) % 100 for j in range(prompt_len)], params)
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
        elapsed = time.perf_counter() - start
        return {"tpot_ms": statistics.fmean((last[k] - first[k]) / (output_len - 1) for k in first) * 1000,
                "ttft_ms": statistics.fmean(first[k] - start for k in first) * 1000,
                "tokens_per_s": concurrency * output_len / elapsed}


# -- the server ---------------------------------------------------------------------


def launch(cmd: list[str], ready_url: str, env: dict[str, str] | None = None, log: Path | None = None,
           timeout: float = 180.0, name: str = "server", cwd: str | None = None) -> subprocess.Popen:
    """Start a server process in a session of its own (servers fork workers:
    ``stop_server`` signals them all) and return once ``ready_url`` answers 200."""
    import httpx

    out = log.open("a") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if log else subprocess.PIPE,
                            env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            why = f"see {log}" if log else proc.stderr.read().decode()[-2000:]
            raise RuntimeError(f"{name} exited (code {proc.returncode}): {why}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise TimeoutError(f"{name} did not come up in {timeout:.0f} s")


def start_server(port: int, extra: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``fluidserve serve`` on 127.0.0.1:``port`` with ``extra`` flags."""
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *extra]
    return launch(cmd, f"http://127.0.0.1:{port}/health", env)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole session, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def load(base_url: str, flags: list[str], per_request: bool = False) -> dict[str, Any]:
    """The client's report of one load; ``per_request``: with each completed
    request's figures (``per_request``: the prompt length it was sent with;
    TTFT, TPOT, normalized latency in ms), so runs can be pooled before
    percentiles are taken."""
    args = bc.build_parser().parse_args(["--base-url", base_url, "--no-progress", *flags])
    specs = bc.build_workload(args)
    results, elapsed = asyncio.run(bc.run_load(args, specs))
    rep = bc.report(results, elapsed, args)
    if per_request:
        ok = [r for r in results if r.ok]
        rep["per_request"] = {"prompt_len": [r.prompt_len for r in ok], "ttft_ms": [r.ttft * 1e3 for r in ok],
                              "tpot_ms": [r.tpot * 1e3 for r in ok if r.completion_tokens > 1],
                              "norm_ms": [r.e2e / r.completion_tokens * 1e3 for r in ok]}
    return rep


def measure_overhead(opts: argparse.Namespace) -> dict[str, Any]:
    engine_flags = ["--device", "cpu", "--num-kv-blocks", "4096", "--max-model-len", "512",
                    "--max-num-seqs", "256"]
    config = dict(model=None, device="cpu", num_kv_blocks=4096, max_model_len=512, max_num_seqs=256)
    L, P = opts.output_len, opts.prompt_len
    result: dict[str, Any] = {"cpu_count": os.cpu_count(), "prompt_len": P, "output_len": L,
                              "model": "built-in tiny random-weight llama (2 layers, hidden 64)",
                              "load_average_before": os.getloadavg()}
    # Torch's intra-op threads: with as many as cores, the engine's OpenMP
    # workers spin against the event loop and the client on a small box.
    threads = str(opts.torch_threads)
    os.environ["OMP_NUM_THREADS"] = threads
    result["torch_threads"] = opts.torch_threads
    port = bc_free_port()
    proc = start_server(port, engine_flags, {"OMP_NUM_THREADS": threads})
    base = f"http://127.0.0.1:{port}"
    try:
        load(base, ["--num-requests", "20", "--input-len", str(P), "--output-len", "4"])  # warm-up
        print("server: request capacity ...", flush=True)
        result["capacity"] = {}
        for out_len in (1, 16):
            rep = load(base, ["--num-requests", str(opts.capacity_requests), "--input-len", str(P),
                              "--output-len", str(out_len), "--max-concurrency", "64"])
            result["capacity"][f"output_len_{out_len}"] = _brief(rep)
        print("per-token latency, direct and through the server, alternating ...", flush=True)
        direct = DirectEngine(config)
        direct.run(P, 4, 1)  # warm-up
        rounds: dict[int, dict[str, list]] = {c: {"direct": [], "server": []} for c in opts.concurrency}
        for _ in range(opts.rounds):
            for c in opts.concurrency:
                rounds[c]["direct"].append(direct.run(P, L, c))
                rep = load(base, ["--num-requests", str(c), "--input-len", str(P), "--output-len", str(L),
                                  "--max-concurrency", str(c)])
                rounds[c]["server"].append(_brief(rep))
    finally:
        stop_server(proc)
    result["direct"] = {c: _median(r["direct"]) for c, r in rounds.items()}
    result["server"] = {c: _median(r["server"]) for c, r in rounds.items()}
    # TPOT (from exact token counts) rather than chunk gaps: a byte-level
    # token that ends inside a UTF-8 character sends no chunk of its own.
    result["added_ms_per_token"] = {c: result["server"][c]["tpot_ms_mean"] - result["direct"][c]["tpot_ms"]
                                    for c in opts.concurrency}
    result["load_average_after"] = os.getloadavg()
    return result


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-field median over rounds (robust to a noisy neighbour)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _brief(rep: dict[str, Any]) -> dict[str, float]:
    return {"completed": rep["completed"], "failed": rep["failed"], "req_per_s": rep["request_throughput"],
            "out_tok_per_s": rep["output_token_throughput"], "ttft_ms_mean": rep["ttft_ms"]["mean"],
            "tpot_ms_mean": rep["tpot_ms"]["mean"], "itl_ms_mean": rep["itl_ms"]["mean"],
            "itl_ms_p99": rep["itl_ms"]["p99"],
            "e2e_ms_mean": rep["e2e_ms"]["mean"]}


def bc_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def print_overhead(res: dict[str, Any]) -> None:
    print(f"\nfrontend overhead on {res['cpu_count']} CPU cores, {res['model']}, "
          f"torch threads {res['torch_threads']}")
    for name, cap in res["capacity"].items():
        print(f"  capacity ({name}, 64 concurrent): {cap['req_per_s']:.1f} req/s "
              f"({cap['completed']} ok, {cap['failed']} failed)")
    for c in res["direct"]:
        d, s = res["direct"][c], res["server"][c]
        print(f"  concurrency {c:3d}: per-token direct {d['tpot_ms']:.2f} ms, via HTTP/SSE {s['tpot_ms_mean']:.2f} ms "
              f"-> added {res['added_ms_per_token'][c]:+.2f} ms/token; tokens/s direct {d['tokens_per_s']:.0f}, "
              f"server {s['out_tok_per_s']:.0f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--measure-overhead" not in argv:
        return bc.main(argv)
    p = argparse.ArgumentParser(description="measure the frontend's overhead")
    p.add_argument("--measure-overhead", action="store_true")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--capacity-requests", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5, help="alternating direct/server rounds (medians)")
    p.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of the engine, both sides")
    p.add_argument("--output", default=None)
    opts = p.parse_args(argv)
    res = measure_overhead(opts)
    print_overhead(res)
    res["command"] = "python benchmarks/serve_bench.py " + " ".join(argv)
    print("wrote", bc.write_json(res, opts.output or REPO_ROOT / "benchmarks" / "results" / "serve_overhead.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
