"""Embeddings served side by side with vLLM's: the same checkpoint as an
embedding model (``--runner pooling``), the same inputs, one run.

    python benchmarks/embeddings_vs_vllm.py --model /path/to/SmolLM2-135M-Instruct \\
        --vllm-python /work/vllm-venv/bin/python --tag=-smollm2

Each server is started in turn and takes, through ``/v1/embeddings``:

* the same texts: how close its vectors are to the other's (cosine, and
  the largest difference of one component);
* throughput: ``--docs`` documents of ``--doc-min``..``--doc-max`` tokens
  (random token ids, one input per request), ``--concurrency`` requests
  in flight: documents and tokens a second;
* a mixed burst, the load an embedding service meets when a bulk
  indexing job lands beside live search: ``--burst`` long documents
  (``--doc-max`` tokens) sent at once, and short queries (``--query-len``
  tokens) arriving at ``--query-rate`` a second (Poisson) from the same
  moment until the burst is done: the queries' latency (P50, P99) and when
  the burst's last document came back. Twice: every request alike, then
  the documents marked as background work (``priority: 1``, which both
  servers take: our offline class, vLLM's priority scheduling).

Writes benchmarks/results/embeddings_vs_vllm{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

import serve_bench
from dummy_models import save_results
from vs_vllm import VLLM_ENV, vllm_problem

RESULTS = Path(__file__).resolve().parent / "results"
TEXTS = ["hello world", "The capital of France is Paris.", "def fibonacci(n): return n if n < 2 else fib(n - 1)",
         "Embeddings map text to vectors that keep its meaning.", "A long sentence " * 60,
         "Which year did the first person walk on the moon?"]


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


async def embed(client: httpx.AsyncClient, model: str, given, priority: int = 0) -> float:
    """One request's latency in seconds; raises on a failed one."""
    start = time.perf_counter()
    body = {"model": model, "input": given, **({"priority": priority} if priority else {})}
    r = await client.post("/v1/embeddings", json=body, timeout=600)
    r.raise_for_status()
    assert r.json()["data"], r.text
    return time.perf_counter() - start


async def throughput(base: str, model: str, docs: list[list[int]], concurrency: int) -> dict:
    async with httpx.AsyncClient(base_url=base) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(doc):
            async with gate:
                return await embed(client, model, doc)

        start = time.perf_counter()
        await asyncio.gather(*(one(d) for d in docs))
        took = time.perf_counter() - start
    tokens = sum(map(len, docs))
    return {"seconds": took, "docs_per_s": len(docs) / took, "tokens_per_s": tokens / took}


async def burst(base: str, model: str, long_docs: list[list[int]], queries: list[list[int]], rate: float,
                seed: int, doc_priority: int = 0) -> dict:
    """Long documents at once (vLLM's ``priority`` on each), short queries
    arriving beside them until every document is back (at least one query)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        bulk = asyncio.gather(*(embed(client, model, d, doc_priority) for d in long_docs))
        waits: list[asyncio.Task] = []
        for q in queries:
            waits.append(asyncio.ensure_future(embed(client, model, q)))
            if bulk.done():
                break
            await asyncio.sleep(rng.expovariate(rate))
        latencies = await asyncio.gather(*waits)
        await bulk
        bulk_s = time.perf_counter() - start
    ms = sorted(x * 1000 for x in latencies)
    return {"queries": len(ms), "query_p50_ms": statistics.median(ms),
            "query_p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], "query_max_ms": ms[-1],
            "bulk_done_s": bulk_s}


def pooling_servers(model: str, vllm_python: str, dtype: str, port: int,
                    variants: list[str] | tuple[str, ...] = (), both: list[str] | tuple[str, ...] = (),
                    ) -> dict[str, tuple[list[str], dict]]:
    """Name -> (command, environment) of each server to start in turn:
    ours (and one more per flag variant) and vLLM's, ``model`` as a
    pooling model on ``port``, each also given the flags ``both``."""
    where = ["--host", "127.0.0.1", "--port", str(port)]
    common = ["--dtype", dtype, "--max-model-len", "2048", "--runner", "pooling", *both]
    ours = [sys.executable, "-m", "fluidserve.serve.cli", "serve", model, *where, *common, "--log-level", "warning"]
    return {
        "fluidserve": (ours, {}),
        **{f"fluidserve {flags}": ([*ours, *shlex.split(flags)], {}) for flags in variants},
        # Priority scheduling, so that its requests may carry a priority (lower runs first) as ours do.
        "vLLM": ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *where, *common,
                  "--enforce-eager", "--scheduling-policy", "priority"], VLLM_ENV),
    }


@contextlib.contextmanager
def running(name: str, cmd: list[str], env: dict, base: str, scratch: Path) -> Iterator[str]:
    """The server started and healthy, its model's id; stopped after."""
    # Started outside the repository: its top-level folders would shadow vLLM's imports.
    proc = serve_bench.launch(cmd, f"{base}/health", env, log=scratch / f"{name}.log", timeout=900, name=name,
                              cwd=str(scratch))
    try:
        yield httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    finally:
        serve_bench.stop_server(proc)


def vectors(base: str, model: str) -> np.ndarray:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": model, "input": TEXTS}, timeout=300)
    r.raise_for_status()
    return np.array([d["embedding"] for d in r.json()["data"]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory both servers can load")
    p.add_argument("--vllm-python", help="a Python with vLLM installed")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--docs", type=int, default=96)
    p.add_argument("--doc-min", type=int, default=64)
    p.add_argument("--doc-max", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--burst", type=int, default=16, help="long documents sent at once in the mixed burst")
    p.add_argument("--query-len", type=int, default=16)
    p.add_argument("--query-rate", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8097)
    p.add_argument("--tag", default="")
    p.add_argument("--fluidserve-variant", action="append", default=[], metavar="FLAGS",
                   help="also run fluidserve with these flags (a row of its own; repeatable)")
    p.add_argument("--from-json", metavar="PATH", help="only write the markdown again from a run's saved JSON")
    args = p.parse_args(argv)
    if args.from_json:
        import json as _json

        record = _json.loads(Path(args.from_json).read_text())
        record.setdefault("texts", len(TEXTS))
        save_results(RESULTS / f"embeddings_vs_vllm{args.tag}", record, markdown(record))
        return 0
    if not args.model or not args.vllm_python:
        p.error("--model and --vllm-python are needed for a run")
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"vLLM cannot run: {problem}")
        return 1
    import json as _json

    vocab = _json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    # Every phase has inputs of its own: none is a prefix-cache hit of an earlier one.
    warmup = [ids(rng, rng.randint(args.doc_min, args.doc_max), vocab) for _ in range(8)]
    docs = [ids(rng, rng.randint(args.doc_min, args.doc_max), vocab) for _ in range(args.docs)]
    long_docs = [[ids(rng, args.doc_max, vocab) for _ in range(args.burst)] for _ in range(2)]
    queries = [[ids(rng, args.query_len, vocab) for _ in range(2000)] for _ in range(2)]
    scratch = Path(tempfile.mkdtemp(prefix="embeddings-vs-vllm-"))
    servers = pooling_servers(args.model, args.vllm_python, args.dtype, args.port, args.fluidserve_variant)
    base = f"http://127.0.0.1:{args.port}"
    record: dict = {"benchmark": "embeddings_vs_vllm", "command": " ".join(map(shlex.quote, sys.argv)),
                    "model": Path(args.model).name, "dtype": args.dtype, "docs": args.docs,
                    "doc_tokens": [args.doc_min, args.doc_max], "concurrency": args.concurrency,
                    "burst": args.burst, "query_len": args.query_len, "query_rate": args.query_rate, "servers": {}}
    got: dict[str, np.ndarray] = {}
    for name, (cmd, env) in servers.items():
        with running(name, cmd, env, base, scratch) as model:
            asyncio.run(throughput(base, model, warmup, 8))  # not measured
            got[name] = vectors(base, model)
            record["servers"][name] = {
                "throughput": asyncio.run(throughput(base, model, docs, args.concurrency)),
                "burst": asyncio.run(burst(base, model, long_docs[0], queries[0], args.query_rate, args.seed)),
                "burst_bulk_priority_1": asyncio.run(burst(base, model, long_docs[1], queries[1], args.query_rate,
                                                           args.seed, doc_priority=1)),
            }
            print(name, _json.dumps(record["servers"][name]))
    a, b = got["fluidserve"], got["vLLM"]
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    record["min_cosine"], record["max_abs_diff"] = float(cos.min()), float(np.abs(a - b).max())
    record["texts"] = len(TEXTS)
    text = markdown(record)
    save_results(RESULTS / f"embeddings_vs_vllm{args.tag}", record, text)
    return 0


def markdown(record: dict) -> str:
    """The results file's text, from the run's record."""
    f, v = record["servers"]["fluidserve"], record["servers"]["vLLM"]
    lo, hi = record["doc_tokens"]
    lines = ["# Embeddings beside vLLM", "",
             f"{record['model']} ({record['dtype']}) as an embedding model (`--runner pooling`: last token, "
             "normalized), each server started in turn in one run.", "",
             f"The same {record['texts']} texts: smallest cosine between the servers' vectors "
             f"**{record['min_cosine']:.6f}**, largest difference of a component {record['max_abs_diff']:.1e}.", "",
             f"Throughput: {record['docs']} documents of {lo}-{hi} random tokens, one per request, "
             f"{record['concurrency']} in flight. Mixed burst: {record['burst']} documents of {hi} tokens at once, "
             f"and queries of {record['query_len']} tokens at {record['query_rate']}/s (Poisson) until the burst "
             "is done.", "",
             "The burst runs twice: every request at priority 0, then the documents at `priority: 1` (a "
             "background job: our offline class; vLLM runs with `--scheduling-policy priority`). Each phase "
             "sends inputs of its own (no prefix-cache hit of an earlier one).", "",
             "| server | docs/s | tokens/s | burst | queries | query P50 / P99 ms | burst done s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in record["servers"].items():
        t = r["throughput"]
        for kind, label in (("burst", "all priority 0"), ("burst_bulk_priority_1", "documents priority 1")):
            m = r[kind]
            lines.append(f"| {name} | {t['docs_per_s']:.2f} | {t['tokens_per_s']:.0f} | {label} | {m['queries']} | "
                         f"{m['query_p50_ms']:.0f} / {m['query_p99_ms']:.0f} | {m['bulk_done_s']:.1f} |")
    speed = f["throughput"]["tokens_per_s"] / v["throughput"]["tokens_per_s"]
    lines += ["", f"fluidserve against vLLM: throughput {speed:.2f}x."]
    for name, r in record["servers"].items():
        if name == "vLLM":
            continue
        for kind, label in (("burst", "every request at priority 0"),
                            ("burst_bulk_priority_1", "documents at priority 1")):
            a, b = r[kind], v[kind]
            lines.append(f"{name}, burst, {label}: query latency P50 {b['query_p50_ms'] / a['query_p50_ms']:.1f}x "
                         f"lower than vLLM's, P99 {b['query_p99_ms'] / a['query_p99_ms']:.1f}x lower; the documents "
                         f"done in {a['bulk_done_s'] / b['bulk_done_s']:.2f}x vLLM's time.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
