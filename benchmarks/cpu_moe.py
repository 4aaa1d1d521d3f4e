"""A MoE layer's experts on the CPU, two ways side by side in one run: the
torch reference (``reference.fused_experts``: two ``F.linear`` per expert a
step reaches, over the stacked weights) and the serving path
(``kernels/cpu_moe.py``: the same products over each expert's weights packed
for oneDNN, the pairs gathered once).

The shape is benchmarks/models_vs_vllm.py's Qwen3-MoE (hidden 512, 64
experts of 192 features, 8 a token) unless flags say otherwise; routing is
each token's top-k of random logits. Rounds run both ways in turn (the
order swapped each round) and the median of each is reported, with the
bytes of the experts a step reaches over the time.

    python benchmarks/cpu_moe.py
    python benchmarks/cpu_moe.py --tokens 1 8 32 128 --threads 1
    python benchmarks/cpu_moe.py --layers 4 --vllm-python VLLM_VENV/bin/python   # beside vLLM's kernel

``--vllm-python`` also times vLLM's CPU build's fused MoE kernel over the
same operands, in a process of its own: the kernel its unquantized CPU
experts call (one C++ call a layer, the experts split among the threads).

Writes JSON + markdown to ``benchmarks/results/cpu_moe{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dummy_models import device_name, save_results

RESULTS = Path(__file__).resolve().parent / "results"


def operands(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, ids, weights / weights.sum(-1, keepdim=True)


# Run by vLLM's Python (``--vllm-python``): its CPU build's fused MoE kernel
# (the one its unquantized CPU experts call) over the operands saved for it.
VLLM_SCRIPT = """
import json, statistics, sys, time
import torch
import vllm._custom_ops as ops

data, rounds, threads = torch.load(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
out = {}
for t, (layers, ours) in data.items():
    calls = []
    for x, w13, w2, ids, weights in layers:
        w13p, w2p = ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec")
        y, ids32 = torch.empty_like(x), ids.to(torch.int32)
        calls.append((y, lambda y=y, x=x, a=w13p, b=w2p, w=weights, i=ids32:
                      ops.cpu_fused_moe(y, x, a, b, None, None, w, i, "silu", "vec")))
    for y, call in calls:
        call()
    diff = (calls[0][0] - ours).abs().max().item()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _, call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    out[t] = dict(ms=statistics.median(times) * 1e3, max_abs_diff=diff)
print("RESULT " + json.dumps(out))
"""


def vllm_times(python: str, data: dict, rounds: int, threads: int) -> dict:
    """vLLM's fused MoE over ``data`` (tokens -> (layers' operands, our
    output of the first)), in a process of its own: tokens -> ms, diff."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(data, Path(tmp) / "operands.pt")
        (Path(tmp) / "moe.py").write_text(VLLM_SCRIPT)
        done = subprocess.run([python, "moe.py", "operands.pt", str(rounds), str(threads)], cwd=tmp,
                              capture_output=True, text=True, timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM's kernel gave no result:\n{done.stderr[-3000:]}")
    return {int(t): v for t, v in json.loads(line.removeprefix("RESULT ")).items()}


def main(argv: list[str] | None = None) -> int:
    from fluidserve.kernels import cpu_moe, reference

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=1,
                   help="layers of weights (each its own), all timed in turn: more than the cache holds makes "
                        "every layer read its experts from memory, as serving does")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--vllm-python", help="a Python with vLLM's CPU build: its fused MoE kernel over the same operands")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, for_vllm = [], {}
    for t in args.tokens:
        layers = [operands(t, args.experts, args.top_k, args.hidden, args.inter, seed=layer)
                  for layer in range(args.layers)]
        packs = [(cpu_moe.pack(w13), cpu_moe.pack(w2)) for _, w13, w2, _, _ in layers]

        def reference_way():
            for x, w13, w2, ids, weights in layers:
                reference.fused_experts(x, w13, w2, ids, weights)

        def packed_way():
            for (x, _, _, ids, weights), packed in zip(layers, packs):
                cpu_moe.fused_experts(x, *packed, ids, weights)

        x, w13, w2, ids, weights = layers[0]
        ours = cpu_moe.fused_experts(x, *packs[0], ids, weights)
        diff = (reference.fused_experts(x, w13, w2, ids, weights) - ours).abs().max().item()
        for_vllm[t] = (layers, ours)
        ways = {"reference": reference_way, "packed": packed_way}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                start = time.perf_counter()
                ways[name]()
                times[name].append((time.perf_counter() - start) / args.layers)
        reached = int(ids.unique().numel())
        weight_mb = reached * 3 * args.hidden * args.inter * 4 / 1e6
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        rows.append(dict(tokens=t, experts_reached=reached, weight_mb=weight_mb, reference_ms=ms["reference"],
                         packed_ms=ms["packed"], packed_gb_s=weight_mb / ms["packed"], max_abs_diff=diff))
        print(rows[-1], flush=True)
    if args.vllm_python:
        theirs = vllm_times(args.vllm_python, for_vllm, args.rounds, torch.get_num_threads())
        for row in rows:
            v = theirs[row["tokens"]]
            row.update(vllm_ms=v["ms"], vllm_gb_s=row["weight_mb"] / v["ms"], vllm_max_abs_diff=v["max_abs_diff"])
            print(row, flush=True)
    record = dict(benchmark="cpu_moe", command=" ".join(["benchmarks/cpu_moe.py", *sys.argv[1:]]),
                  device=device_name("cpu"), experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                  inter=args.inter, rounds=args.rounds, layers=args.layers, threads=torch.get_num_threads(),
                  rows=rows)
    vllm = bool(args.vllm_python)
    lines = ["# A MoE layer's experts on the CPU", "",
             f"Command: `{record['command']}`; {record['device']}; {args.experts} experts of {args.inter} features, "
             f"{args.top_k} a token, hidden {args.hidden}, fp32; {args.layers} layer(s) of weights timed in turn "
             f"(per layer below); median of {args.rounds} rounds, both ways in each"
             + ("; vLLM's CPU build's fused MoE kernel (`cpu_fused_moe`, its unquantized CPU experts' path) over "
                "the same operands in a process of its own, after ours, with as many threads." if vllm else "."),
             "", "| tokens | experts reached | their weights MB | reference ms | packed ms | reference / packed "
             "| packed GB/s | max abs diff |" + (" vLLM ms | vLLM GB/s | packed / vLLM speed | vLLM diff |"
                                                if vllm else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if vllm else "")]
    for r in rows:
        line = (f"| {r['tokens']} | {r['experts_reached']} | {r['weight_mb']:.1f} | {r['reference_ms']:.2f} | "
                f"{r['packed_ms']:.2f} | {r['reference_ms'] / r['packed_ms']:.2f}x | {r['packed_gb_s']:.1f} | "
                f"{r['max_abs_diff']:.1e} |")
        if vllm:
            line += (f" {r['vllm_ms']:.2f} | {r['vllm_gb_s']:.1f} | {r['vllm_ms'] / r['packed_ms']:.2f}x | "
                     f"{r['vllm_max_abs_diff']:.1e} |")
        lines.append(line)
    save_results(RESULTS / f"cpu_moe{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
