"""Latency of small requests on a kept-alive connection, as the OpenAI
client sends them (one ``httpx.Client`` whose connection is reused), against
a fresh connection per request, for several servers started one after the
other in one run: this tree's ``fluidserve serve``, optionally the same
server from another source tree (``--baseline-src``, a checkout before a
change) and vLLM (``--vllm-python``).

    python benchmarks/keepalive_latency.py --model DIR --dtype float32 \\
        --baseline-src /tmp/old --vllm-python /path/to/vllm-venv/bin/python

A server whose sockets leave Nagle's algorithm on answers a kept-alive
connection's request ~40 ms late: the response's body waits behind its
headers for the client's delayed ACK, which a fresh connection sends at once
(Linux acknowledges a connection's first segments immediately). Per server
and request: the median of ``--rounds`` requests, one at a time. Writes
benchmarks/results/keepalive_latency{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import serve_bench
from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"


def requests(model: str) -> dict[str, tuple[str, str, dict | None]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "ignore_eos": True}
    return {"GET /v1/models": ("GET", "/v1/models", None),
            "chat, 1 token": ("POST", "/v1/chat/completions", {**chat, "max_tokens": 1}),
            "chat, 8 tokens": ("POST", "/v1/chat/completions", {**chat, "max_tokens": 8})}


def measure(base: str, rounds: int) -> dict[str, dict[str, float]]:
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    out: dict[str, dict[str, float]] = {}
    kept = httpx.Client(base_url=base, timeout=120)
    for name, (method, path, body) in requests(model).items():
        times: dict[str, list[float]] = {"kept alive": [], "fresh": []}
        for how in times:  # back to back, as a client sends its requests
            for i in range(rounds + 2):  # the first two warm up
                client = kept if how == "kept alive" else httpx.Client(base_url=base, timeout=120)
                start = time.perf_counter()
                client.request(method, path, json=body).raise_for_status()
                elapsed = time.perf_counter() - start
                if how == "fresh":
                    client.close()
                if i >= 2:
                    times[how].append(elapsed)
        out[name] = {how: statistics.median(t) * 1e3 for how, t in times.items()}
        print(base, name, json.dumps(out[name]), flush=True)
    kept.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory every server can load")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--baseline-src", type=Path, default=None, help="another source tree of fluidserve")
    p.add_argument("--baseline-label", default="baseline tree", help="what the baseline tree is (its commit)")
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM installed")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--port", type=int, default=8094)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    fluid = [sys.executable, "-m", "fluidserve.serve.cli", "serve", args.model, "--dtype", args.dtype,
             "--host", "127.0.0.1", "--port", str(args.port), "--log-level", "warning"]
    servers: dict[str, tuple[list[str], dict]] = {"fluidserve": (fluid, {})}
    scratch = Path(tempfile.mkdtemp(prefix="keepalive-"))
    if args.baseline_src:
        root = scratch / "baseline_path"
        root.mkdir()
        (root / "fluidserve").symlink_to(args.baseline_src.resolve(), target_is_directory=True)
        servers[f"fluidserve ({args.baseline_label})"] = (fluid, {"PYTHONPATH": str(root)})
    if args.vllm_python:
        servers["vLLM"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                            "--host", "127.0.0.1", "--port", str(args.port), "--dtype", args.dtype,
                            "--max-model-len", "4096", "--enforce-eager"], {"VLLM_CPU_KVCACHE_SPACE": "2"})
    base = f"http://127.0.0.1:{args.port}"
    results = {}
    for name, (cmd, env) in servers.items():
        # Started outside the repository: its top-level folders would shadow vLLM's imports.
        proc = serve_bench.launch(cmd, f"{base}/health", env, log=scratch / f"{name.split()[0]}.log", timeout=600,
                                  name=name, cwd=str(scratch))
        try:
            results[name] = measure(base, args.rounds)
        finally:
            serve_bench.stop_server(proc)
    record = {"model": Path(args.model).name, "dtype": args.dtype, "rounds": args.rounds, "results": results}
    lines = ["# Small requests on a kept-alive connection", "",
             f"{record['model']} ({args.dtype}); each server started in turn in one run; medians of "
             f"{args.rounds} requests, one at a time, kept alive (one `httpx.Client`, as the OpenAI client) "
             "and on a fresh connection each.", "",
             "| server | request | kept alive ms | fresh connection ms | kept alive / fresh |", "|---|---|---|---|---|"]
    for name, per in results.items():
        for req, t in per.items():
            lines.append(f"| {name} | {req} | {t['kept alive']:.1f} | {t['fresh']:.1f} | "
                         f"{t['kept alive'] / t['fresh']:.2f}x |")
    save_results(RESULTS / f"keepalive_latency{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
