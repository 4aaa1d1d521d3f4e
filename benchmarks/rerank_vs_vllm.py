"""Score and rerank served side by side with vLLM's: the same checkpoint as
an embedding model (``--runner pooling``) or, given a sequence classifier
of one label, as a cross-encoder; the same requests, one run.

    python benchmarks/rerank_vs_vllm.py --model /path/to/SmolLM2-135M-Instruct \\
        --vllm-python /work/vllm-venv/bin/python --tag=-smollm2
    python benchmarks/smollm2.py classifier /path/to/SmolLM2-135M-Instruct /path/to/smollm2-reranker
    python benchmarks/rerank_vs_vllm.py --model /path/to/smollm2-reranker \\
        --vllm-python /work/vllm-venv/bin/python --tag=-smollm2-cross-encoder

A causal LM served as a reranker the way vLLM serves Qwen3-Reranker (its LM
head's "yes" row less its "no" row, each pair rendered by a score template)::

    python benchmarks/rerank_vs_vllm.py --model /path/to/SmolLM2-135M-Instruct \\
        --vllm-python /work/vllm-venv/bin/python --tag=-smollm2-yes-no \\
        --hf-overrides '{"architectures": ["LlamaForSequenceClassification"], \\
            "classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}' \\
        --chat-template benchmarks/templates/score_yes_no.jinja

Each server is started in turn and takes:

* agreement: ``/score`` of one query against a handful of documents, the
  ranking ``/rerank`` returns for it, and ``/v1/embeddings`` (``/classify``
  on a classifier) of chat conversations (the ``messages`` form): the
  largest difference of a score or an output component between the
  servers, and whether the rankings match;
* throughput: ``--requests`` rerank requests (a query and ``--docs-per``
  documents of ``--doc-words`` random words each), ``--concurrency`` in
  flight: requests and documents a second, and the latency P50 / P99;
* reranking beside bulk indexing: ``--burst`` long documents (``--long``
  tokens) sent to ``/v1/embeddings`` (``/classify``) at once as background work
  (``priority: 1``: our offline class, vLLM's priority scheduling), and
  rerank requests arriving at ``--rate`` a second (Poisson) until the
  burst is done: the rerank latency P50 / P99, and when the burst came back.

Writes benchmarks/results/rerank_vs_vllm{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from dummy_models import save_results
from embeddings_vs_vllm import ids, pooling_servers, running
from vs_vllm import vllm_problem

RESULTS = Path(__file__).resolve().parent / "results"
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "The Eiffel Tower stands in Paris.",
             "Berlin is the capital of Germany.", "Photosynthesis turns light into chemical energy.",
             "France is a country in Western Europe.", "The stock market closed lower on Friday."]
CONVERSATIONS = [[{"role": "user", "content": "How do I sort a list in Python?"}],
                 [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]]
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community "
         "name president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def rerank(client: httpx.AsyncClient, model: str, query: str, documents: list[str]) -> float:
    """One rerank request's latency in seconds; raises on a failed one."""
    start = time.perf_counter()
    r = await client.post("/rerank", json={"model": model, "query": query, "documents": documents}, timeout=600)
    r.raise_for_status()
    assert len(r.json()["results"]) == len(documents), r.text
    return time.perf_counter() - start


def _percentiles(seconds: list[float]) -> dict:
    ms = sorted(x * 1000 for x in seconds)
    return {"p50_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]}


async def throughput(base: str, model: str, work: list[tuple[str, list[str]]], concurrency: int) -> dict:
    async with httpx.AsyncClient(base_url=base) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(query: str, docs: list[str]) -> float:
            async with gate:
                return await rerank(client, model, query, docs)

        start = time.perf_counter()
        latencies = await asyncio.gather(*(one(q, d) for q, d in work))
        took = time.perf_counter() - start
    return {"seconds": took, "requests_per_s": len(work) / took,
            "docs_per_s": sum(len(d) for _, d in work) / took, **_percentiles(latencies)}


async def pool(client: httpx.AsyncClient, route: str, model: str, doc: list[int]) -> None:
    """One long document through the model's own route, at priority 1."""
    r = await client.post(route, json={"model": model, "input": doc, "priority": 1}, timeout=600)
    r.raise_for_status()


async def beside_bulk(base: str, route: str, model: str, long_docs: list[list[int]],
                      work: list[tuple[str, list[str]]], rate: float, seed: int) -> dict:
    """Long documents at once at priority 1, rerank requests arriving beside
    them until every document is back (at least one request)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        bulk = asyncio.gather(*(pool(client, route, model, d) for d in long_docs))
        waits: list[asyncio.Task] = []
        for q, d in work:
            waits.append(asyncio.ensure_future(rerank(client, model, q, d)))
            if bulk.done():
                break
            await asyncio.sleep(rng.expovariate(rate))
        latencies = await asyncio.gather(*waits)
        await bulk
        bulk_s = time.perf_counter() - start
    return {"reranks": len(latencies), **_percentiles(latencies), "bulk_done_s": bulk_s}


def agreement(base: str, route: str, model: str, chats: bool = True) -> dict:
    """The scores, the ranking and (``chats``: not where the chat template
    is a score template) the chat-form outputs a server gives."""
    score = httpx.post(f"{base}/score", json={"model": model, "queries": QUERY, "documents": DOCUMENTS}, timeout=300)
    ranked = httpx.post(f"{base}/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS}, timeout=300)
    # One conversation a request: vLLM's /classify takes no list of them.
    chats = [httpx.post(f"{base}{route}", json={"model": model, "messages": c}, timeout=300)
             for c in (CONVERSATIONS if chats else ())]
    for r in (score, ranked, *chats):
        r.raise_for_status()
    return {"scores": [d["score"] for d in score.json()["data"]],
            "order": [x["index"] for x in ranked.json()["results"]],
            "rerank_scores": [x["relevance_score"] for x in ranked.json()["results"]],
            "chat_outputs": [d.get("embedding", d.get("probs")) for r in chats for d in r.json()["data"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory both servers can load")
    p.add_argument("--vllm-python", help="a Python with vLLM installed")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--docs-per", type=int, default=8)
    p.add_argument("--doc-words", type=int, nargs=2, default=(16, 96))
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--burst", type=int, default=8, help="long documents sent at once beside the reranks")
    p.add_argument("--long", type=int, default=1024, help="tokens of each long document")
    p.add_argument("--rate", type=float, default=0.5, help="rerank requests a second beside the burst")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8098)
    p.add_argument("--tag", default="")
    p.add_argument("--hf-overrides", metavar="JSON", help="both servers: vLLM's config overrides (a causal LM "
                   "trained as a reranker: classifier_from_token)")
    p.add_argument("--chat-template", metavar="FILE", help="both servers: the cross-encoder's score template")
    p.add_argument("--from-json", metavar="PATH", help="only write the markdown again from a run's saved JSON")
    args = p.parse_args(argv)
    if args.from_json:
        record = json.loads(Path(args.from_json).read_text())
        save_results(RESULTS / f"rerank_vs_vllm{args.tag}", record, markdown(record))
        return 0
    if not args.model or not args.vllm_python:
        p.error("--model and --vllm-python are needed for a run")
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"vLLM cannot run: {problem}")
        return 1
    config = json.loads((Path(args.model) / "config.json").read_text())
    vocab = config["vocab_size"]
    overrides = json.loads(args.hf_overrides) if args.hf_overrides else {}
    archs = overrides.get("architectures") or config.get("architectures") or ["-"]
    cross = all(a.endswith("ForSequenceClassification") for a in archs)
    route = "/classify" if cross else "/v1/embeddings"
    rng = random.Random(args.seed)
    lo, hi = args.doc_words

    def requests(n: int) -> list[tuple[str, list[str]]]:
        return [(words(rng, 8), [words(rng, rng.randint(lo, hi)) for _ in range(args.docs_per)]) for _ in range(n)]

    # Every phase has inputs of its own: none is a prefix-cache hit of an earlier one.
    warmup, work, beside = requests(4), requests(args.requests), requests(200)
    long_docs = [ids(rng, args.long, vocab) for _ in range(args.burst)]
    scratch = Path(tempfile.mkdtemp(prefix="rerank-vs-vllm-"))
    both = [*(["--hf-overrides", args.hf_overrides] if args.hf_overrides else []),
            *(["--chat-template", str(Path(args.chat_template).resolve())] if args.chat_template else [])]
    servers = pooling_servers(args.model, args.vllm_python, args.dtype, args.port, both=both)
    base = f"http://127.0.0.1:{args.port}"
    record: dict = {"benchmark": "rerank_vs_vllm", "command": " ".join(map(shlex.quote, sys.argv)),
                    "model": Path(args.model).name, "dtype": args.dtype, "requests": args.requests,
                    "docs_per": args.docs_per, "doc_words": [lo, hi], "concurrency": args.concurrency,
                    "burst": args.burst, "long": args.long, "rate": args.rate, "cross_encoder": cross,
                    "hf_overrides": overrides or None, "score_template": bool(args.chat_template),
                    "servers": {}}
    got: dict[str, dict] = {}
    for name, (cmd, env) in servers.items():
        with running(name, cmd, env, base, scratch) as model:
            asyncio.run(throughput(base, model, warmup, 4))  # not measured
            got[name] = agreement(base, route, model, chats=not args.chat_template)
            record["servers"][name] = {
                "throughput": asyncio.run(throughput(base, model, work, args.concurrency)),
                "beside_bulk": asyncio.run(beside_bulk(base, route, model, long_docs, beside, args.rate, args.seed)),
            }
            print(name, json.dumps(record["servers"][name]))
    a, b = got["fluidserve"], got["vLLM"]
    record["agreement"] = {
        "max_score_diff": float(np.abs(np.array(a["scores"]) - np.array(b["scores"])).max()),
        "same_order": a["order"] == b["order"], "order": a["order"],
        "max_rerank_score_diff": float(np.abs(np.array(a["rerank_scores"]) - np.array(b["rerank_scores"])).max()),
        "max_chat_output_diff": (float(np.abs(np.array(a["chat_outputs"]) - np.array(b["chat_outputs"])).max())
                                 if a["chat_outputs"] else None),
    }
    save_results(RESULTS / f"rerank_vs_vllm{args.tag}", record, markdown(record))
    return 0


def markdown(record: dict) -> str:
    """The results file's text, from the run's record."""
    f, v = record["servers"]["fluidserve"], record["servers"]["vLLM"]
    agree, (lo, hi) = record["agreement"], record["doc_words"]
    cross = record.get("cross_encoder", False)
    route = "/classify" if cross else "/v1/embeddings"
    recipe = record.get("hf_overrides")
    kind = ((f"as a cross-encoder built from its LM head (`--hf-overrides '{json.dumps(recipe)}'`"
             + (", `--chat-template` as the score template" if record.get("score_template") else "")
             + "): each pair one prompt, its score the classifier's output") if recipe else
            "as a cross-encoder (a sequence classifier of one label): each pair one prompt, its score the "
            "classifier's output" if cross else "as an embedding model (`--runner pooling`): a score is the cosine "
            "of the two texts' vectors (vLLM's bi-encoder scoring)")
    lines = ["# Score and rerank beside vLLM", "",
             f"{record['model']} ({record['dtype']}) {kind}; each server started in turn in one run.", "",
             f"Agreement on one query and {len(DOCUMENTS)} documents: largest score difference "
             f"{agree['max_score_diff']:.1e} (`/score`), {agree['max_rerank_score_diff']:.1e} (`/rerank`); the "
             f"same ranking: {'yes' if agree['same_order'] else 'no'}."
             + ("" if agree["max_chat_output_diff"] is None else
                f" The chat form through `{route}` (`messages`, {len(CONVERSATIONS)} conversations): largest "
                f"component difference {agree['max_chat_output_diff']:.1e}."), "",
             f"Throughput: {record['requests']} rerank requests, each a query and {record['docs_per']} documents "
             f"of {lo}-{hi} random words, {record['concurrency']} in flight. Beside bulk indexing: "
             f"{record['burst']} documents of {record['long']} tokens sent to `{route}` at once at "
             f"`priority: 1` (our offline class; vLLM runs with `--scheduling-policy priority`), and rerank "
             f"requests at {record['rate']}/s (Poisson) until the documents are back.", "",
             "| server | reranks/s | docs/s | P50 / P99 ms | beside bulk: reranks | P50 / P99 ms | bulk done s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in record["servers"].items():
        t, m = r["throughput"], r["beside_bulk"]
        lines.append(f"| {name} | {t['requests_per_s']:.2f} | {t['docs_per_s']:.1f} | {t['p50_ms']:.0f} / "
                     f"{t['p99_ms']:.0f} | {m['reranks']} | {m['p50_ms']:.0f} / {m['p99_ms']:.0f} | "
                     f"{m['bulk_done_s']:.1f} |")
    ft, vt, fm, vm = f["throughput"], v["throughput"], f["beside_bulk"], v["beside_bulk"]
    lines += ["", f"fluidserve against vLLM: rerank throughput {ft['requests_per_s'] / vt['requests_per_s']:.2f}x; "
              f"beside bulk indexing, rerank latency P50 {vm['p50_ms'] / fm['p50_ms']:.1f}x lower, P99 "
              f"{vm['p99_ms'] / fm['p99_ms']:.1f}x lower, the bulk done in "
              f"{fm['bulk_done_s'] / vm['bulk_done_s']:.2f}x vLLM's time."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
