"""When decode rows that share a cached prefix should get an attention bucket
of their own on CPU (``kernels/cpu_attention.py``, ``MIN_SHARED_SAVING``).

Reading a shared prefix once for all its rows saves copying it per row, but
each such bucket costs a fixed price per layer (two attention calls and a
merge). Two parts, both side by side in one process:

* kernel: one step's plan plus 4 layers of decode attention over 256 rows in
  families of F rows that share S blocks, under three rules: every family
  apart (the rule before ``MIN_SHARED_SAVING``), none apart, and the rule;
* engine: ``LLM.generate`` (tiny preset by default) of 1024 requests where every prompt is sent by 4
  requests (what ``n=4`` or a retried prompt gives the prefix cache), median
  decode-step time under the rule, every family apart, and the cache off.

    python benchmarks/shared_prefix_decode.py

Writes benchmarks/results/shared_prefix_decode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dummy_models import build_model_dir, device_name

from fluidserve.kernels import cpu_attention

RULES = {"rule": None, "every family apart": 0, "none apart": 1 << 62}


def _set_rule(value: int | None, default: int) -> None:
    cpu_attention.MIN_SHARED_SAVING = default if value is None else value


def kernel_case(rows: int, family: int, shared: int, kv_heads: int, head_dim: int, layers: int,
                repeats: int) -> dict:
    """Best of ``repeats`` for plan + ``layers`` decode attentions, per rule."""
    bs, own = 16, 2
    gen = torch.Generator().manual_seed(0)
    nb = shared + own
    num_blocks = (rows // family) * shared + rows * own + 1
    key_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=gen)
    tables = torch.zeros(rows, nb, dtype=torch.int32)
    lens: list[int] = []
    nxt = 1
    for f in range(rows // family):
        prefix = torch.arange(nxt, nxt + shared)
        nxt += shared
        for r in range(family):
            tables[f * family + r, :shared] = prefix
            tables[f * family + r, shared:] = torch.arange(nxt, nxt + own)
            nxt += own
            lens.append(shared * bs + 1 + (r * 7) % (own * bs - 1))
    query = torch.randn(rows, kv_heads * 4, head_dim, generator=gen)
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    default = cpu_attention.MIN_SHARED_SAVING
    out = {"rows": rows, "family": family, "shared_blocks": shared,
           "saved_tokens": (family - 1) * shared * bs}
    try:
        for name, value in RULES.items():
            _set_rule(value, default)
            best, buckets = float("inf"), 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                plan = cpu_attention.build_plan([1] * rows, lens, tables, slots, bs, None, kv_heads * head_dim)
                for _ in range(layers):
                    cpu_attention.paged_attention(query, key_cache, value_cache, plan, head_dim ** -0.5)
                best, buckets = min(best, time.perf_counter() - t0), len(plan.decodes)
            out[name] = {"ms": best * 1e3, "buckets": buckets}
    finally:
        _set_rule(None, default)
    return out


def engine_case(preset: str, num_requests: int, family: int, prompt_len: int, output_len: int) -> dict:
    """Median decode-step time of LLM.generate per rule, and with the cache off."""
    from fluidserve.engine import LLM, SamplingParams

    model = build_model_dir(preset, Path(tempfile.mkdtemp()))
    # A prompt's copies a quarter of the requests apart: they reach the cache
    # in later steps than the first, so they share its blocks (copies
    # prefilled in the same step would each compute their own).
    prompts = [[(k * 7 + j) % 250 + 3 for j in range(prompt_len)]
               for _ in range(family) for k in range(num_requests // family)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    blocks = num_requests * ((prompt_len + output_len) // 16 + 2) + 16
    default = cpu_attention.MIN_SHARED_SAVING
    results = {}
    for name, caching, value in (("rule", True, None), ("every family apart", True, 0), ("cache off", False, None)):
        llm = LLM(model=str(model), load_format="dummy", device="cpu", num_kv_blocks=blocks,
                  max_model_len=prompt_len + output_len + 16,
                  max_num_seqs=num_requests, enable_prefix_caching=caching)
        times: list[float] = []
        execute = llm.engine.executor.execute

        def timed(inp, *args, **kwargs):
            t0 = time.perf_counter()
            result = execute(inp, *args, **kwargs)
            if inp.num_tokens == num_requests:  # every request decoding
                times.append(time.perf_counter() - t0)
            return result

        llm.engine.executor.execute = timed
        _set_rule(value, default)
        try:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
        finally:
            _set_rule(None, default)
        results[name] = {"decode_step_ms": statistics.median(times) * 1e3 if times else None,
                         "decode_steps": len(times), "tok_per_s": num_requests * output_len / wall}
        del llm
    return {"preset": preset, "requests": num_requests, "family": family, "prompt_len": prompt_len,
            "output_len": output_len,
            **results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--engine-preset", default="tiny",
                    help="model of the engine part (tiny: a step is nearly all attention and overhead; "
                         "cpu-small: its 32k-vocab LM head over 1024 rows outweighs attention)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    kernel = [kernel_case(args.rows, f, s, 2, 64, 4, args.repeats) for f in (2, 4, 16, 64) for s in (2, 8, 32)]
    lines = ["| rows sharing | shared blocks | saved tokens | every family apart | none apart | rule |",
             "|---|---|---|---|---|---|"]
    for k in kernel:
        cells = [f"{k[r]['ms']:.1f} ms ({k[r]['buckets']} buckets)" for r in RULES if r != "rule"]
        lines.append(f"| {k['family']} | {k['shared_blocks']} | {k['saved_tokens']} | " + " | ".join(cells)
                     + f" | {k['rule']['ms']:.1f} ms ({k['rule']['buckets']} buckets) |")
    eng = engine_case(args.engine_preset, args.requests, 4, 32, 64)
    lines += ["", f"LLM.generate, {eng['preset']} preset, {eng['requests']} requests, "
                  f"each prompt ({eng['prompt_len']} tokens) "
              f"sent by {eng['family']}, {eng['output_len']} output tokens:", "",
              "| | median decode step | decode steps | output tok/s |", "|---|---|---|---|"]
    for name in ("rule", "every family apart", "cache off"):
        r = eng[name]
        lines.append(f"| {name} | {r['decode_step_ms']:.1f} ms | {r['decode_steps']} | {r['tok_per_s']:.0f} |")
    device = device_name("cpu")
    text = "\n".join([f"# Shared-prefix decode buckets on {device}", "",
                      f"Kernel: plan + 4 layers of decode attention, {args.rows} rows, 2 KV heads x 64, fp32, "
                      f"best of {args.repeats}.", ""] + lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shared_prefix_decode.json").write_text(json.dumps({"device": device, "kernel": kernel, "engine": eng},
                                                              indent=2))
    (out / "shared_prefix_decode.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
