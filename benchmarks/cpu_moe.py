"""A MoE layer's experts on the CPU, three ways side by side in one run: the
torch reference (``reference.fused_experts``: two ``F.linear`` per expert a
step reaches, over the stacked weights), every expert through oneDNN's
linear over its reordered weights (``kernels/cpu_moe.py`` with
``native_rows=0``), and the serving path (``kernels/cpu_moe.py``: experts of
few rows through ``cpu_moe.c`` in one call a layer, the others through
oneDNN).

The shape is benchmarks/models_vs_vllm.py's Qwen3-MoE (hidden 512, 64
experts of 192 features, 8 a token) unless flags say otherwise; routing is
each token's top-k of random logits. Rounds run both ways in turn (the
order swapped each round) and the median of each is reported, with the
bytes of the experts a step reaches over the time.

    python benchmarks/cpu_moe.py
    python benchmarks/cpu_moe.py --tokens 1 8 32 128 --threads 1
    python benchmarks/cpu_moe.py --dtype bfloat16
    python benchmarks/cpu_moe.py --tokens 128 512 2048 --native-rows 16 64 100000   # where oneDNN takes over
    python benchmarks/cpu_moe.py --layers 4 --vllm-python VLLM_VENV/bin/python   # beside vLLM's kernel

``--vllm-python`` also times vLLM's CPU build's fused MoE kernel over the
same operands, in a process of its own: the kernel its unquantized CPU
experts call (one C++ call a layer, the experts split among the threads).

Writes JSON + markdown to ``benchmarks/results/cpu_moe{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--layers", type=int, default=1,
                   help="layers of weights (each its own), all timed in turn: more than the cache holds makes "
                        "every layer read its experts from memory, as serving does")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--vllm-python", help="a Python with vLLM's CPU build: its fused MoE kernel over the same operands")
    p.add_argument("--native-rows", type=int, nargs="*", default=[],
                   help="also time the experts of at most N rows through cpu_moe.c, the others through oneDNN")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_moe.native_library() is None:
        raise SystemExit("cpu_moe.c did not build here (see the warning above): nothing to compare")
    dtype = getattr(torch, args.dtype)
    native_rows = cpu_moe.NATIVE_ROWS[dtype]
    serving = "every expert" if native_rows == math.inf else f"the experts of at most {native_rows} rows"
    # way -> fused_experts's native_rows
    ways = {"reference": None, "onednn": 0, "serving": native_rows, **{f"rows<={n}": n for n in args.native_rows}}
    rows, for_vllm = [], {}
    for t in args.tokens:
        # x and the weights in the dtype, the routing weights in float32 (as Mixtral's; vLLM's kernel takes those)
        layers = [tuple(a.to(dtype) if i < 3 else a for i, a in
                        enumerate(operands(t, args.experts, args.top_k, args.hidden, args.inter, seed=layer)))
                  for layer in range(args.layers)]  # fmt: skip
        # serving's layout (experts past native_rows take the model's own weights), and oneDNN's copies
        packs = [cpu_moe.pack(w13, w2) for _, w13, w2, _, _ in layers]
        copies = [cpu_moe.pack(w13, w2, onednn=True) for _, w13, w2, _, _ in layers]

        def run(way: str) -> None:
            for (x, w13, w2, ids, weights), packed, copied in zip(layers, packs, copies):
                if way == "reference":
                    reference.fused_experts(x, w13, w2, ids, weights)
                else:
                    cpu_moe.fused_experts(x, copied if way == "onednn" else packed, ids, weights, ways[way])

        x, w13, w2, ids, weights = layers[0]
        expected = reference.fused_experts(x, w13, w2, ids, weights).float()
        ours = cpu_moe.fused_experts(x, packs[0], ids, weights)
        diffs = {"onednn": (cpu_moe.fused_experts(x, copies[0], ids, weights, 0).float() - expected).abs().max().item(),
                 "serving": (ours.float() - expected).abs().max().item()}
        for_vllm[t] = (layers, ours)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                start = time.perf_counter()
                run(name)
                times[name].append((time.perf_counter() - start) / args.layers)
        reached = int(ids.unique().numel())
        weight_mb = reached * 3 * args.hidden * args.inter * dtype.itemsize / 1e6
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        rows.append(dict(tokens=t, experts_reached=reached, weight_mb=weight_mb, reference_ms=ms["reference"],
                         onednn_ms=ms["onednn"], serving_ms=ms["serving"], serving_gb_s=weight_mb / ms["serving"],
                         onednn_max_abs_diff=diffs["onednn"], serving_max_abs_diff=diffs["serving"],
                         sweep_ms={n: ms[f"rows<={n}"] for n in args.native_rows}))
        print(rows[-1], flush=True)
    if args.vllm_python:
        theirs = vllm_times(args.vllm_python, for_vllm, args.rounds, torch.get_num_threads())
        for row in rows:
            v = theirs[row["tokens"]]
            row.update(vllm_ms=v["ms"], vllm_gb_s=row["weight_mb"] / v["ms"], vllm_max_abs_diff=v["max_abs_diff"])
            print(row, flush=True)
    record = dict(benchmark="cpu_moe", command=" ".join(["benchmarks/cpu_moe.py", *sys.argv[1:]]),
                  device=device_name("cpu"), experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                  inter=args.inter, dtype=args.dtype, rounds=args.rounds, layers=args.layers,
                  threads=torch.get_num_threads(), native_rows=None if native_rows == math.inf else native_rows,
                  rows=rows)
    vllm = bool(args.vllm_python)
    lines = ["# A MoE layer's experts on the CPU", "",
             f"Command: `{record['command']}`; {record['device']}; {args.experts} experts of {args.inter} features, "
             f"{args.top_k} a token, hidden {args.hidden}, {args.dtype}; {args.layers} layer(s) of weights timed in "
             f"turn (per layer below); median of {args.rounds} rounds, the three ways in each. **oneDNN**: every "
             f"expert through oneDNN's linear over its reordered weights; **serving**: {serving} through "
             "`cpu_moe.c` in one call a layer, any others through oneDNN's linear over the stacked weights"
             + ("; **vLLM**: its CPU build's fused MoE kernel (`cpu_fused_moe`, its unquantized CPU experts' path) "
                "over the same operands in a process of its own, after ours, with as many threads." if vllm else "."),
             "", "| tokens | experts reached | their weights MB | reference ms | oneDNN ms | serving ms "
             "| oneDNN / serving | serving GB/s | max abs diff |" + (" vLLM ms | vLLM GB/s | serving / vLLM speed |"
                                                                     " vLLM diff |" if vllm else ""),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|---:|" if vllm else "")]
    for r in rows:
        line = (f"| {r['tokens']} | {r['experts_reached']} | {r['weight_mb']:.1f} | {r['reference_ms']:.2f} | "
                f"{r['onednn_ms']:.2f} | {r['serving_ms']:.2f} | {r['onednn_ms'] / r['serving_ms']:.2f}x | "
                f"{r['serving_gb_s']:.1f} | {r['serving_max_abs_diff']:.1e} |")
        if vllm:
            line += (f" {r['vllm_ms']:.2f} | {r['vllm_gb_s']:.1f} | {r['vllm_ms'] / r['serving_ms']:.2f}x | "
                     f"{r['vllm_max_abs_diff']:.1e} |")
        lines.append(line)
    if args.native_rows:
        lines += ["", "The experts of at most N rows through `cpu_moe.c`, the others through oneDNN's linear over the "
                  "stacked weights (ms a layer):", "",
                  "| tokens | oneDNN | " + " | ".join(f"N = {n}" for n in args.native_rows) + " |",
                  "|---:|---:|" + "---:|" * len(args.native_rows)]
        lines += [f"| {r['tokens']} | {r['onednn_ms']:.2f} | " + " | ".join(f"{r['sweep_ms'][n]:.2f}"
                                                                        for n in args.native_rows) + " |"
                  for r in rows]
    save_results(RESULTS / f"cpu_moe{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
