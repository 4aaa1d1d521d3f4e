"""CPU decode attention: a bucket's rows gathered and attended a few at a time
(``kernels/cpu_attention.DECODE_GROUP_ELEMENTS``) against all of them in one
gather and one call, alternating in one process.

* kernel: ``paged_attention`` over decode-only steps of several shapes
  (rows x context x KV heads x group x head dim), fp32 and bf16, one thread,
  thread CPU time, best of rounds;
* engine: the decode steps of ``cpu-deep`` (16 layers, 4 x 64 heads) with 12
  requests at about 1.05k tokens of context, wall time, alternating step by
  step.

    python benchmarks/cpu_decode_groups.py

Writes benchmarks/results/cpu_decode_groups.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from dummy_models import alternating_calls, alternating_steps, build_model_dir, cpu_kernel_record, save_results

from fluidserve.kernels import cpu_attention

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((12, 1056, 4, 1, 64), (32, 1056, 4, 1, 64), (64, 512, 4, 1, 64), (256, 128, 2, 4, 64),
          (1024, 48, 2, 2, 32), (32, 1024, 8, 4, 128), (8, 4096, 8, 4, 128))
WHOLE = 1 << 62  # one call per bucket


def _ways() -> tuple[tuple[str, int], ...]:
    return ("grouped", cpu_attention.DECODE_GROUP_ELEMENTS), ("one call", WHOLE)


def kernel(rows: int, context: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
           rounds: int) -> dict:
    block = 16
    per_row = -(-context // block)
    num_blocks = rows * per_row + 8
    gen = torch.Generator().manual_seed(rows)
    kc = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: rows * per_row].view(rows, per_row)
    rng = random.Random(rows)
    lens = [rng.randint(context * 3 // 4, context) for _ in range(rows)]
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen).to(dtype)
    slots = torch.tensor([int(tables[i, (n - 1) // block]) * block + (n - 1) % block for i, n in enumerate(lens)])
    plan = cpu_attention.build_plan([1] * rows, lens, tables.int(), slots, block, None, kv_heads * head_dim)

    def call(elements: int):
        def run():
            cpu_attention.DECODE_GROUP_ELEMENTS = elements
            return cpu_attention.paged_attention(q, kc, vc, plan, head_dim ** -0.5)
        return run

    ways = _ways()
    try:
        best, outs = alternating_calls({name: call(elements) for name, elements in ways}, rounds)
    finally:
        cpu_attention.DECODE_GROUP_ELEMENTS = ways[0][1]
    diff = (outs["grouped"].float() - outs["one call"].float()).abs().max().item()
    return {"rows": rows, "context": context, "kv_heads": kv_heads, "group": group, "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."), "best_ms": best, "speedup": best["one call"] / best["grouped"],
            "max_abs_diff": diff}


def engine(steps: int) -> dict:
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.engine import next_request_id

    model = build_model_dir("cpu-deep", Path(tempfile.mkdtemp(prefix="fluidserve-decode-")))
    llm = LLM(model=str(model), load_format="dummy", device="cpu", num_kv_blocks=12 * 70 + 64,
              max_num_batched_tokens=1024, enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(12):
        eng.add_request(next_request_id("dec"), [(7 * i + p) % 30000 + 1 for p in range(1024)], params)
    for _ in range(14):  # the twelve prompts, and the first decodes
        eng.step()
    med = alternating_steps(eng, cpu_attention, "DECODE_GROUP_ELEMENTS", dict(_ways()), steps)
    return {"median_step_ms": med, "speedup": med["one call"] / med["grouped"], "steps_each": steps // 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--engine-steps", type=int, default=40)
    args = ap.parse_args(argv)
    record = cpu_kernel_record("cpu_decode_groups", kernel, SHAPES, args.rounds, lambda: engine(args.engine_steps),
                               group_elements=cpu_attention.DECODE_GROUP_ELEMENTS)
    device, load_start, eng, rows = record["device"], record["load_average_start"], record["engine"], record["kernel"]
    lines = [f"# CPU decode attention: rows a few at a time vs one call per bucket — {device}", "",
             f"`{record['command']}`; torch {torch.__version__}, one thread; grouped = at most "
             f"{cpu_attention.DECODE_GROUP_ELEMENTS:,} K elements gathered per call. Load average "
             f"{load_start[0]:.2f} at the start, {record['load_average_end'][0]:.2f} at the end.", "",
             "| rows | context | KV heads x group x head dim | dtype | one call (ms) | grouped (ms) | speedup "
             "| max abs diff |", "|---:|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['context']} | {r['kv_heads']} x {r['group']} x {r['head_dim']} | {r['dtype']} | "
              f"{r['best_ms']['one call']:.2f} | {r['best_ms']['grouped']:.2f} | {r['speedup']:.2f}x | "
              f"{r['max_abs_diff']:.1e} |" for r in rows]
    lines += ["", f"Engine, `cpu-deep` (fp32), 12 requests decoding at ~1.05k tokens of context, steps alternating "
              f"({eng['steps_each']} each): median decode step {eng['median_step_ms']['one call']:.1f} ms one call, "
              f"{eng['median_step_ms']['grouped']:.1f} ms grouped ({eng['speedup']:.2f}x)."]
    save_results(RESULTS / "cpu_decode_groups", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
