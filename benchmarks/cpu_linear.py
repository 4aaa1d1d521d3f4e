"""The linear layers of one decoder layer on the CPU, each way torch can run
them, side by side in one run: what ``engine/parallel.py`` should call.

One layer of the vs_vllm model (hidden 512, 8 query heads and 2 KV heads of
64, MLP 1536) has four matrix products per token batch: q/k/v, o, gate/up,
down. Ways timed, each over the same inputs:

* ``separate``: ``F.linear`` per checkpoint weight (q, k, v and gate, up
  apart), as the model ran before the projections were fused;
* ``fused``: ``F.linear`` over one stacked q/k/v weight and one stacked
  gate/up weight;
* ``fused+onednn``: the fused weights reordered once into oneDNN's blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``) and run by
  ``torch.ops.mkldnn._linear_pointwise``;
* ``fused+mkl`` (fp32 only): the fused weights packed once for MKL's
  ``sgemm_compute`` (``torch.ops.mkl._mkl_reorder_linear_weight``).

Rounds run every way once in turn (the order rotated each round) and the
median per way is reported, so load from other processes hits all alike.
With one thread (the default) the time is the thread's CPU time, which other
processes disturb far less than wall time; ``--threads 2`` times
wall clock.

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --tokens 64 256 2048 --rounds 30

``--engine`` adds the end-to-end check: one engine (the vs_vllm model, one
thread) generates the same batch with its linears packed and with the packed
copies dropped (``F.linear`` on the same fused weights), alternating in one
process after a warm-up run; output tokens per CPU-second.

Writes JSON + markdown to ``benchmarks/results/cpu_linear.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch.nn import functional as F

from fluidserve.engine.parallel import can_prepack

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 512, 8, 2, 64, 1536


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * 0.05).to(dtype)

    return {"q": w(HEADS * HEAD_DIM, HIDDEN), "k": w(KV_HEADS * HEAD_DIM, HIDDEN),
            "v": w(KV_HEADS * HEAD_DIM, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
            "gate": w(INTER, HIDDEN), "up": w(INTER, HIDDEN), "down": w(HIDDEN, INTER)}


def _layer_ways(w: dict[str, torch.Tensor], tokens: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way runs the layer's four products over x [T, hidden] and returns the MLP output."""
    qkv = torch.cat([w["q"], w["k"], w["v"]])
    gate_up = torch.cat([w["gate"], w["up"]])

    def separate(x):
        q, k, v = F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"])
        a = F.linear(q, w["o"]) + k.sum() + v.sum()
        return F.linear(F.silu(F.linear(a, w["gate"])) * F.linear(a, w["up"]), w["down"])

    def fused_with(lin: Callable, packs: dict):
        def run(x):
            q, k, v = lin(x, "qkv", packs).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            a = lin(q, "o", packs) + k.sum() + v.sum()
            g, u = lin(a, "gate_up", packs).chunk(2, -1)
            return lin(F.silu(g) * u, "down", packs)
        return run

    plain = {"qkv": qkv, "o": w["o"], "gate_up": gate_up, "down": w["down"]}
    ways = {"separate": separate,
            "fused": fused_with(lambda x, n, p: F.linear(x, p[n]), plain)}
    if can_prepack(qkv):  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT
        onednn = {n: torch.ops.mkldnn._reorder_linear_weight(t, tokens) for n, t in plain.items()}
        ways["fused+onednn"] = fused_with(
            lambda x, n, p: torch.ops.mkldnn._linear_pointwise(x, p[n], None, "none", [], ""), onednn)
    if qkv.dtype == torch.float32:
        mkl = {n: (torch.ops.mkl._mkl_reorder_linear_weight(t, tokens), t) for n, t in plain.items()}
        ways["fused+mkl"] = fused_with(
            lambda x, n, p: torch.ops.mkl._mkl_linear(x, p[n][0], p[n][1], None, tokens), mkl)
    return ways


def measure(dtype: torch.dtype, tokens: int, rounds: int) -> dict:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    w = _weights(dtype)
    ways = _layer_ways(w, tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = ways["separate"](x).float()
    err = {n: (f(x).float() - ref).abs().max().item() for n, f in ways.items()}
    samples: dict[str, list[float]] = {n: [] for n in ways}
    names = list(ways)
    for r in range(rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t0 = clock()
            ways[n](x)
            samples[n].append(clock() - t0)
    ms = {n: statistics.median(s[2:]) * 1e3 for n, s in samples.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "ms": ms,
            "max_abs_diff_vs_separate": err}


def engine_ab(dtype: str, requests: int, output_len: int, rounds: int) -> dict:
    """Output tokens per CPU-second of one engine with packed linears and with
    F.linear, alternating (see the module docstring)."""
    import tempfile

    from vs_vllm import build_model, sample_prompts

    from torch import nn

    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.parallel import _PrepackedLinear

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=str(build_model(Path(tmp) / "model")), device="cpu", dtype=dtype, max_model_len=1024,
                  enable_prefix_caching=False, num_kv_blocks=requests * 40 + 16)
        model = llm.engine.executor.worker.model
        prompts = sample_prompts(requests, 0.05, 512, 0)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # A packed linear gave up its dense weight: F.linear gets it back,
        # read from the packed copy, and each way sets the copy it runs on.
        linears = [(m, m._packed) for m in model.modules() if isinstance(m, _PrepackedLinear)]
        for m, _ in linears:
            m.weight = nn.Parameter(m.dense_weight(), requires_grad=False)
        llm.generate(prompts, params)  # every shape once
        out: dict[str, list[float]] = {"packed": [], "F.linear": []}
        for r in range(rounds):
            for way in ("packed", "F.linear") if r % 2 == 0 else ("F.linear", "packed"):
                for m, packed in linears:
                    m._packed = packed if way == "packed" else None
                c0 = time.process_time()
                llm.generate(prompts, params)
                out[way].append(requests * output_len / (time.process_time() - c0))
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"dtype": dtype, "requests": requests, "output_len": output_len, "tokens_per_cpu_s": out,
            "median": med, "packed_over_f_linear": med["packed"] / med["F.linear"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 2048])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1, help="1: thread CPU time; more: wall time")
    ap.add_argument("--engine", action="store_true", help="also the end-to-end check (a few minutes)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    rows = []
    with torch.inference_mode():
        for dt in args.dtypes:
            for t in args.tokens:
                row = measure(getattr(torch, dt), t, args.rounds)
                rows.append(row)
                print(row["dtype"], t, {n: round(v, 3) for n, v in row["ms"].items()}, flush=True)
    record = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "command": "python benchmarks/cpu_linear.py " + " ".join(argv or []),
              "load_average_start": load_start, "rows": rows}
    if args.engine:
        record["engine"] = [engine_ab(dt, 64, 32, 4) for dt in args.dtypes]
    record["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_linear.json").write_text(json.dumps(record, indent=2))
    ways = list(rows[0]["ms"])
    lines = ["# Linear layers of one decoder layer on the CPU (ms per layer, median of rounds)", "",
             f"torch {torch.__version__}, {record['threads']} thread(s), "
             f"{'thread CPU time' if record['threads'] == 1 else 'wall time'}; load average at start "
             f"{load_start[0]:.2f}, at end {record['load_average_end'][0]:.2f} ({os.cpu_count()} cores).",
             "", "| dtype | tokens | " + " | ".join(ways) + " | best vs separate |",
             "|---|---:|" + "---:|" * (len(ways) + 1)]
    for row in rows:
        cells = [f"{row['ms'].get(n, float('nan')):.3f}" for n in ways]
        best = min(row["ms"].values())
        lines.append(f"| {row['dtype']} | {row['tokens']} | " + " | ".join(cells)
                     + f" | {row['ms']['separate'] / best:.2f}x |")
    if args.engine:
        lines += ["", "End to end: one engine (vs_vllm model, one thread, 64 requests x 32 tokens), packed linears "
                  "vs F.linear alternating in one process; output tokens per CPU-second, median of 4:", "",
                  "| dtype | packed | F.linear | packed / F.linear |", "|---|---:|---:|---:|"]
        lines += [f"| {e['dtype']} | {e['median']['packed']:.0f} | {e['median']['F.linear']:.0f} | "
                  f"{e['packed_over_f_linear']:.2f}x |" for e in record["engine"]]
    (RESULTS / "cpu_linear.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
