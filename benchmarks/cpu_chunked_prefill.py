"""CPU attention of a prompt chunk over a cached prefix: the prefix and the
chunk's own keys in two unmasked flash calls merged by log-sum-exp
(``kernels/cpu_attention.py``) against one call over the whole gathered
context with an explicit [chunk, context] mask (the way before, kept here as
the baseline), alternating in one process.

* kernel: one layer's attention for chunk x prefix shapes, fp32 and bf16,
  one thread, thread CPU time, best of rounds;
* engine: ``cpu-deep`` prefilling 1024-token prompts in one step and in
  352-token chunks (the size the co-serving budget holds offline steps to on
  this CPU), wall time per prompt, the two attention paths alternating
  prompt by prompt.

    python benchmarks/cpu_chunked_prefill.py

Writes benchmarks/results/cpu_chunked_prefill.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from dummy_models import build_model_dir, cpu_kernel_record, save_results

from fluidserve.kernels import cpu_attention

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((352, 352), (352, 672), (320, 704), (64, 960), (512, 2048))  # (chunk, prefix)
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 4, 1, 64, 16  # cpu-deep's attention


def masked_prefill(out, query, key_cache, value_cache, item, scale, key, value, softcap=None) -> None:
    """The baseline: one call over the gathered context with a [chunk,
    context] mask wherever a prefix is cached (no soft cap: the models here
    have none)."""
    q = query[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)
    q_len = item.q_hi - item.q_lo
    if q_len == item.seq_len and key is not None:  # a whole prompt: its own K/V are all it reads
        k = key[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)
        v = value[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        k = cpu_attention._gathered(key_cache, item.block_ids, item.seq_len, q.dtype)
        v = cpu_attention._gathered(value_cache, item.block_ids, item.seq_len, q.dtype)
        mask = item.mask
        if mask is None:
            q_pos = torch.arange(item.seq_len - q_len, item.seq_len).unsqueeze(1)
            mask = torch.arange(item.seq_len).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[item.q_lo:item.q_hi] = o[0].transpose(0, 1)


SPLIT = cpu_attention._prefill
WAYS = (("two calls", SPLIT), ("one masked call", masked_prefill))


def kernel(chunk: int, prefix: int, dtype: torch.dtype, rounds: int) -> dict:
    seq_len = chunk + prefix
    nb = -(-seq_len // BLOCK)
    gen = torch.Generator().manual_seed(seq_len)
    kc = torch.randn(nb + 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    vc = torch.randn(nb + 4, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    table = torch.randperm(nb + 4, generator=gen)[:nb].view(1, nb).int()
    slots = torch.tensor([int(table[0, p // BLOCK]) * BLOCK + p % BLOCK for p in range(prefix, seq_len)])
    plan = cpu_attention.build_plan([chunk], [seq_len], table, slots, BLOCK, None, KV_HEADS * HEAD_DIM)
    q = torch.randn(chunk, KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    key, value = kc.view(-1, KV_HEADS, HEAD_DIM)[slots], vc.view(-1, KV_HEADS, HEAD_DIM)[slots]
    ms: dict[str, list[float]] = {name: [] for name, _ in WAYS}
    outs = {}
    for r in range(rounds):
        for name, fn in (WAYS if r % 2 == 0 else WAYS[::-1]):
            cpu_attention._prefill = fn
            c0 = time.thread_time()
            outs[name] = cpu_attention.paged_attention(q, kc, vc, plan, HEAD_DIM ** -0.5, key, value)
            ms[name].append((time.thread_time() - c0) * 1e3)
    cpu_attention._prefill = SPLIT
    diff = (outs["two calls"].float() - outs["one masked call"].float()).abs().max().item()
    best = {name: min(v) for name, v in ms.items()}
    return {"chunk": chunk, "prefix": prefix, "dtype": str(dtype).removeprefix("torch."), "best_ms": best,
            "speedup": best["one masked call"] / best["two calls"], "max_abs_diff": diff}


def engine(prompts: int) -> dict:
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.engine import next_request_id

    model = build_model_dir("cpu-deep", Path(tempfile.mkdtemp(prefix="fluidserve-chunks-")))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out: dict[str, dict[str, float]] = {}
    for chunk in (1024, 352):
        llm = LLM(model=str(model), load_format="dummy", device="cpu", num_kv_blocks=256,
                  max_num_batched_tokens=chunk, enable_prefix_caching=False)
        eng = llm.engine
        ms: dict[str, list[float]] = {name: [] for name, _ in WAYS}
        for i in range(2 * prompts + 2):
            name, fn = WAYS[i % 2]
            cpu_attention._prefill = fn
            eng.add_request(next_request_id("p"), [(7 * i + p) % 30000 + 1 for p in range(1024)], params)
            t0 = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            if i >= 2:  # the first of each way warms up
                ms[name].append((time.perf_counter() - t0) * 1e3)
        cpu_attention._prefill = SPLIT
        out[str(chunk)] = {name: statistics.median(v) for name, v in ms.items()}
    return {"prompts_each": prompts, "median_prompt_ms": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--engine-prompts", type=int, default=6, help="prompts per attention path and chunk size")
    args = ap.parse_args(argv)
    record = cpu_kernel_record("cpu_chunked_prefill", kernel, SHAPES, args.rounds,
                               lambda: engine(args.engine_prompts))
    device, load_start, eng, rows = record["device"], record["load_average_start"], record["engine"], record["kernel"]
    lines = [f"# CPU attention of a chunk over a cached prefix: two calls vs one masked call — {device}", "",
             f"`{record['command']}`; torch {torch.__version__}, one thread; {KV_HEADS} KV heads x group {GROUP} "
             f"x head dim {HEAD_DIM}, blocks of {BLOCK}. Load average {load_start[0]:.2f} at the start, "
             f"{record['load_average_end'][0]:.2f} at the end.", "",
             "| chunk | prefix | dtype | one masked call (ms) | two calls (ms) | speedup | max abs diff |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['chunk']} | {r['prefix']} | {r['dtype']} | {r['best_ms']['one masked call']:.2f} | "
              f"{r['best_ms']['two calls']:.2f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |" for r in rows]
    med = eng["median_prompt_ms"]
    lines += ["", f"Engine, `cpu-deep` (fp32), 1024-token prompts, the paths alternating prompt by prompt "
              f"({eng['prompts_each']} each), median prefill per prompt:", "",
              "| step budget | two calls (ms) | one masked call (ms) | chunked / whole, two calls | "
              "chunked / whole, one masked call |", "|---:|---:|---:|---:|---:|",
              f"| 1024 (whole) | {med['1024']['two calls']:.0f} | {med['1024']['one masked call']:.0f} | | |",
              f"| 352 (3 chunks) | {med['352']['two calls']:.0f} | {med['352']['one masked call']:.0f} | "
              f"{med['352']['two calls'] / med['1024']['two calls']:.2f}x | "
              f"{med['352']['one masked call'] / med['1024']['one masked call']:.2f}x |"]
    save_results(RESULTS / "cpu_chunked_prefill", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
