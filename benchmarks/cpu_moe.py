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

Writes JSON + markdown to ``benchmarks/results/cpu_moe{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def main(argv: list[str] | None = None) -> int:
    from fluidserve.kernels import cpu_moe, reference

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=192)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for t in args.tokens:
        x, w13, w2, ids, weights = operands(t, args.experts, args.top_k, args.hidden, args.inter)
        packed = cpu_moe.pack(w13), cpu_moe.pack(w2)
        ways = {"reference": lambda: reference.fused_experts(x, w13, w2, ids, weights),
                "packed": lambda: cpu_moe.fused_experts(x, *packed, ids, weights)}
        diff = (ways["reference"]() - ways["packed"]()).abs().max().item()
        times: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                start = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - start)
        reached = int(ids.unique().numel())
        weight_mb = reached * 3 * args.hidden * args.inter * 4 / 1e6
        ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        rows.append(dict(tokens=t, experts_reached=reached, weight_mb=weight_mb, reference_ms=ms["reference"],
                         packed_ms=ms["packed"], packed_gb_s=weight_mb / ms["packed"], max_abs_diff=diff))
        print(rows[-1], flush=True)
    record = dict(benchmark="cpu_moe", command=" ".join(["benchmarks/cpu_moe.py", *sys.argv[1:]]),
                  device=device_name("cpu"), experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                  inter=args.inter, rounds=args.rounds, rows=rows)
    lines = ["# A MoE layer's experts on the CPU", "",
             f"Command: `{record['command']}`; {record['device']}; {args.experts} experts of {args.inter} features, "
             f"{args.top_k} a token, hidden {args.hidden}, fp32; median of {args.rounds} rounds, both ways in each.",
             "", "| tokens | experts reached | their weights MB | reference ms | packed ms | reference / packed "
             "| packed GB/s | max abs diff |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['experts_reached']} | {r['weight_mb']:.1f} | {r['reference_ms']:.2f} | "
                     f"{r['packed_ms']:.2f} | {r['reference_ms'] / r['packed_ms']:.2f}x | {r['packed_gb_s']:.1f} | "
                     f"{r['max_abs_diff']:.1e} |")
    save_results(RESULTS / f"cpu_moe{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
