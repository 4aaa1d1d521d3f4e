"""LoRA adapters served side by side with vLLM's: the same model, the same
PEFT adapters (random, made here), the same requests.

    python benchmarks/lora_vs_vllm.py --model /path/to/SmolLM2-135M-Instruct \\
        --vllm-python /work/vllm-venv/bin/python --tag=-smollm2

Each server is started in turn in one run with ``--enable-lora --max-loras
K --max-lora-rank R --lora-modules a0=... a{K-1}=...`` and takes:

* greedy completions of a few prompts under the base model and every
  adapter (``--max-tokens`` tokens each, ``ignore_eos``): whether the two
  servers give the same tokens, and how many replies an adapter changed
  from the base model's (an adapter that changed none would prove nothing);
* after a burst of 16 requests over every model (not measured), two
  loads from the same client (``fluidserve bench``, vLLM's random
  dataset at ``--rate`` requests/s): every request to the base model, then
  every request to an adapter drawn at random (``--lora-modules``, vLLM's
  bench flag). Their ratio is what serving adapters costs each server.

Writes benchmarks/results/lora_vs_vllm{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

import serve_bench
from dummy_models import save_results
from vs_vllm import VLLM_ENV, add_peer_load_args, vllm_problem

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["The capital of France is", "Write a haiku about the sea:", "def fibonacci(n):",
           "Three facts about whales:", "Once upon a time, in a small village,", "The best way to learn a language is"]
LOAD_KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
             "p99_tpot_ms", "failed")


def replies(base: str, model: str, max_tokens: int) -> list[list[int] | str]:
    """Greedy completions of PROMPTS under ``model``: token ids where the
    server returns them, else the text."""
    out: list[list[int] | str] = []
    for prompt in PROMPTS:
        r = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append(choice.get("token_ids") or choice["text"])
    return out


def load(base: str, models: list[str], args: argparse.Namespace, warmup: bool = False) -> dict:
    """The client's figures of one load; ``warmup``: 16 requests at once."""
    count, rate = ("16", "inf") if warmup else (str(args.num_requests), str(args.rate))
    rep = serve_bench.load(base, ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                                  "--random-output-len", str(args.output_len), "--num-prompts", count,
                                  "--request-rate", rate, "--seed", str(args.seed), "--ignore-eos",
                                  "--lora-modules", *models])
    return {k: rep.get(k) for k in LOAD_KEYS}


def load_table(servers: dict) -> list[str]:
    """A markdown table of each server's loads (``servers[name]["loads"][kind]``, LOAD_KEYS)."""
    lines = ["| server | load | req/s | output tok/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for name, r in servers.items():
        for kind, m in r["loads"].items():
            lines.append(f"| {name} | {kind} | {m['request_throughput']:.2f} | {m['output_throughput']:.1f} | "
                         f"{m['median_ttft_ms']:.0f} / {m['p99_ttft_ms']:.0f} | "
                         f"{m['median_tpot_ms']:.1f} / {m['p99_tpot_ms']:.1f} | {m['failed']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory both servers can load")
    p.add_argument("--adapters", type=int, default=4, help="random adapters made and served (K)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--scale", type=float, default=0.03, help="the adapters' weights: normal with this deviation")
    add_peer_load_args(p, rate=2.0, num_requests=40, port=8098)
    args = p.parse_args(argv)
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"vLLM cannot run: {problem}")
        return 1
    from fluidserve.engine.tiny_model import build_random_adapter

    scratch = Path(tempfile.mkdtemp(prefix="lora-vs-vllm-"))
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        build_random_adapter(args.model, scratch / name, seed=i, r=args.rank, scale=args.scale)
    lora = ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank),
            "--lora-modules", *(f"{n}={scratch / n}" for n in names)]
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    servers = {
        "fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", args.model, *port, "--dtype",
                        args.dtype, "--max-model-len", "2048", "--log-level", "warning", *lora], {}),
        "vLLM": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, *port,
                  "--dtype", args.dtype, "--max-model-len", "2048", "--enforce-eager", *lora], VLLM_ENV),
    }
    base_url = f"http://127.0.0.1:{args.port}"
    record: dict = {"benchmark": "lora_vs_vllm", "command": " ".join(map(shlex.quote, sys.argv)),
                    "model": Path(args.model).name, "adapters": args.adapters, "rank": args.rank,
                    "scale": args.scale, "dtype": args.dtype, "servers": {}}
    for name, (cmd, env) in servers.items():
        # Started outside the repository: its top-level folders would shadow vLLM's imports.
        proc = serve_bench.launch(cmd, f"{base_url}/health", env, log=scratch / f"{name}.log", timeout=900,
                                  name=name, cwd=str(scratch))
        try:
            base = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            load(base_url, [base, *names], args, warmup=True)  # every model once in a full step, not measured
            got = {"base": replies(base_url, base, args.max_tokens)}
            got.update({n: replies(base_url, n, args.max_tokens) for n in names})
            loads = {"base": load(base_url, [base], args), "adapters": load(base_url, names, args)}
            record["servers"][name] = {"replies": got, "loads": loads}
            print(name, json.dumps(loads))
        finally:
            serve_bench.stop_server(proc)
    ours, theirs = record["servers"]["fluidserve"]["replies"], record["servers"]["vLLM"]["replies"]
    pairs = [(m, i) for m in ours for i in range(len(PROMPTS))]
    same = sum(ours[m][i] == theirs[m][i] for m, i in pairs)
    changed = {s: sum(r["replies"][n][i] != r["replies"]["base"][i] for n in names for i in range(len(PROMPTS)))
               for s, r in record["servers"].items()}
    record["same_replies"], record["replies_compared"], record["changed_by_adapter"] = same, len(pairs), changed
    lines = ["# LoRA adapters beside vLLM", "",
             f"{record['model']} ({args.dtype}), {args.adapters} random PEFT adapters of rank {args.rank} on every "
             f"linear (weights normal, deviation {args.scale}), each server started in turn in one run with "
             "`--enable-lora` and the adapters as `--lora-modules`.", "",
             f"Greedy replies ({args.max_tokens} tokens, {len(PROMPTS)} prompts, the base model and each adapter): "
             f"**{same} of {len(pairs)} the same tokens** on both servers; an adapter changed "
             f"{changed['fluidserve']} (fluidserve) and {changed['vLLM']} (vLLM) of the "
             f"{args.adapters * len(PROMPTS)} adapter replies from the base model's.", "",
             f"Load: {args.num_requests} requests at {args.rate} req/s (Poisson), random prompts of "
             f"{args.input_len} tokens, {args.output_len} out (`ignore_eos`), every request to the base model, "
             "then every request to an adapter drawn at random.", "",
             *load_table(record["servers"]), ""]

    def ratios(a: dict, b: dict) -> str:
        return (f"median TPOT {a['median_tpot_ms'] / b['median_tpot_ms']:.2f}x, "
                f"P99 TTFT {a['p99_ttft_ms'] / b['p99_ttft_ms']:.2f}x, "
                f"output tok/s {a['output_throughput'] / b['output_throughput']:.2f}x")

    for name, r in record["servers"].items():
        lines.append(f"{name}, adapters against the base model: {ratios(r['loads']['adapters'], r['loads']['base'])}.")
    f, v = (record["servers"][s]["loads"]["adapters"] for s in ("fluidserve", "vLLM"))
    lines += ["", f"With adapters, fluidserve against vLLM: {ratios(f, v)}."]
    for r in record["servers"].values():  # the record keeps the comparison, not the replies
        r.pop("replies")
    save_results(RESULTS / f"lora_vs_vllm{args.tag}", record, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
