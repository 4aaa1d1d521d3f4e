"""CPU attention of short rows (a speculative step's token and its drafts, a
prompt's last few tokens): bucketed like decodes, under a causal mask
(``kernels/cpu_attention.MAX_FOLDED_QUERIES``), against one chunk call set
per row, alternating in one process; the same rows as single-token decodes
beside them, for what a verifying step's attention costs over a plain one.

* kernel: ``paged_attention`` over steps of short rows of several shapes
  (rows x context x queries per row x KV heads x group x head dim), fp32
  and bf16, one thread, thread CPU time, best of rounds;
* engine: a tiny Llama's steps with 12 requests at about 300 tokens of
  context, each verifying 4 drafts (the drafter's offers replaced by
  fixed ones), wall time, the two ways alternating step by step.

    python benchmarks/cpu_short_rows.py

Writes benchmarks/results/cpu_short_rows.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import random
import tempfile
from pathlib import Path

import torch
from dummy_models import alternating_calls, alternating_steps, build_model_dir, cpu_kernel_record, save_results

from fluidserve.kernels import cpu_attention

RESULTS = Path(__file__).resolve().parent / "results"
# rows, context, queries per row, KV heads, group, head dim (SmolLM2-135M's heads: 3 x 3 x 64)
SHAPES = ((1, 300, 5, 3, 3, 64), (4, 300, 5, 3, 3, 64), (12, 300, 2, 3, 3, 64), (12, 300, 5, 3, 3, 64),
          (12, 1000, 5, 3, 3, 64), (32, 300, 5, 3, 3, 64), (12, 300, 9, 3, 3, 64), (12, 300, 16, 3, 3, 64),
          (12, 1000, 32, 3, 3, 64), (8, 1024, 5, 8, 4, 128))
FOLDED = cpu_attention.MAX_FOLDED_QUERIES


def _step(rows: int, context: int, queries: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    block = 16
    per_row = -(-context // block)
    num_blocks = rows * per_row + 8
    tables = torch.randperm(num_blocks, generator=gen)[: rows * per_row].view(rows, per_row)
    rng = random.Random(rows * queries)
    lens = [rng.randint(context * 3 // 4, context) for _ in range(rows)]

    def slots(q: int) -> torch.Tensor:
        return torch.tensor([int(tables[i, p // block]) * block + p % block
                             for i, n in enumerate(lens) for p in range(n - q, n)])

    def plan(q: int, fold: int):
        cpu_attention.MAX_FOLDED_QUERIES = fold
        try:
            return cpu_attention.build_plan([q] * rows, lens, tables.int(), slots(q), block, None, kv_heads * head_dim)
        finally:
            cpu_attention.MAX_FOLDED_QUERIES = FOLDED

    return num_blocks, block, plan


def kernel(rows: int, context: int, queries: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
           rounds: int) -> dict:
    gen = torch.Generator().manual_seed(rows * queries)
    num_blocks, block, plan = _step(rows, context, queries, kv_heads, head_dim, gen)
    kc = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(rows * queries, kv_heads * group, head_dim, generator=gen).to(dtype)
    ways = {"folded": (q, plan(queries, max(FOLDED, queries))), "chunks": (q, plan(queries, 1)),
            "decodes": (q[:rows], plan(1, FOLDED))}
    calls = {name: functools.partial(cpu_attention.paged_attention, query, kc, vc, p, head_dim ** -0.5)
             for name, (query, p) in ways.items()}
    best, outs = alternating_calls(calls, rounds)
    diff = (outs["folded"].float() - outs["chunks"].float()).abs().max().item()
    return {"rows": rows, "context": context, "queries": queries, "kv_heads": kv_heads, "group": group,
            "head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "best_ms": best,
            "speedup": best["chunks"] / best["folded"], "over_decodes": best["folded"] / best["decodes"],
            "max_abs_diff": diff}


class _FixedDrafts:
    """A sequence's drafter that always offers ``k`` tokens: the verifying
    step's shape without depending on what the text repeats."""

    def propose(self, k: int) -> list[int]:
        return [7] * k


def engine(steps: int) -> dict:
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.engine import next_request_id

    model = build_model_dir("cpu-deep", Path(tempfile.mkdtemp(prefix="fluidserve-short-")))
    llm = LLM(model=str(model), load_format="dummy", device="cpu", num_kv_blocks=12 * 40 + 64,
              max_num_batched_tokens=1024, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps * 5 + 16, ignore_eos=True)
    for i in range(12):
        eng.add_request(next_request_id("short"), [(7 * i + p) % 30000 + 1 for p in range(300)], params)
    for seq in eng.seqs.values():
        seq.drafter = _FixedDrafts()
    for _ in range(6):  # the twelve prompts, and the first verifying steps
        eng.step()
    med = alternating_steps(eng, cpu_attention, "MAX_FOLDED_QUERIES", {"folded": FOLDED, "chunks": 1}, steps)
    return {"median_step_ms": med, "speedup": med["chunks"] / med["folded"], "steps_each": steps // 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--engine-steps", type=int, default=40)
    args = ap.parse_args(argv)
    record = cpu_kernel_record("cpu_short_rows", kernel, SHAPES, args.rounds, lambda: engine(args.engine_steps),
                               max_folded_queries=FOLDED)
    device, load_start, eng, rows = record["device"], record["load_average_start"], record["engine"], record["kernel"]
    lines = [f"# CPU attention of short rows: bucketed like decodes vs one chunk each — {device}", "",
             f"`{record['command']}`; torch {torch.__version__}, one thread, best of {args.rounds}; rows of up "
             f"to {FOLDED} queries are bucketed by default (the rows of 32 here are bucketed for the comparison). "
             f"Load average {load_start[0]:.2f} at the start, {record['load_average_end'][0]:.2f} at the end.", "",
             "| rows | context | queries a row | KV heads x group x head dim | dtype | chunks (ms) | bucketed (ms) "
             "| speed-up | the rows as decodes (ms) | bucketed / decodes | max abs diff |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['context']} | {r['queries']} | {r['kv_heads']} x {r['group']} x {r['head_dim']} | "
              f"{r['dtype']} | {r['best_ms']['chunks']:.2f} | {r['best_ms']['folded']:.2f} | {r['speedup']:.2f}x | "
              f"{r['best_ms']['decodes']:.2f} | {r['over_decodes']:.2f}x | {r['max_abs_diff']:.1e} |" for r in rows]
    lines += ["", f"Engine, `cpu-deep` (fp32), 12 requests at ~300 tokens of context each verifying 4 drafts a step, "
              f"steps alternating ({eng['steps_each']} each): median step "
              f"{eng['median_step_ms']['chunks']:.1f} ms as chunks, {eng['median_step_ms']['folded']:.1f} ms "
              f"bucketed ({eng['speedup']:.2f}x)."]
    save_results(RESULTS / "cpu_short_rows", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
