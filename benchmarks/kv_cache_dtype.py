"""``--kv-cache-dtype``: what an fp8 KV cache buys and costs, each cache
type side by side in one run.

* **Replies**: greedy chat replies of a real model (SmolLM2-135M-Instruct,
  ``--model DIR`` from ``benchmarks/smollm2.py prepare``) with the cache in
  the model's dtype and in fp8 (e4m3 and e5m2): how many replies are the
  same, and how many tokens each keeps before it parts from the
  full-precision one.
* **Memory pressure**: one burst of requests (prompt lengths from the
  ShareGPT trace, x ``--length-scale``) against a KV budget
  (``--cpu-kv-cache-gb``) that holds only part of them in the model's
  dtype: wall time, output tok/s, the preemptions the budget forced.
  With one byte an element the same budget holds 4x the tokens of a
  float32 model's cache (2x a bf16 one's).
* **Attention cost**: the CPU attention path's decode call (``--rows``
  rows at each ``--contexts`` length) over each cache: an fp8 cache is
  widened to the query's dtype as it is gathered, which the CPU pays for.

    python benchmarks/kv_cache_dtype.py --model /path/to/SmolLM2-135M-Instruct

Writes ``benchmarks/results/kv_cache_dtype{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from dummy_models import device_name, save_results
from smollm2 import PROMPTS as SMOLLM2_PROMPTS

RESULTS = Path(__file__).resolve().parent / "results"
CACHES = ("auto", "fp8", "fp8_e5m2")
MAX_MODEL_LEN = 2048
# The real-model check's prompts (benchmarks/smollm2.py), and six more.
CHAT_PROMPTS = [
    *SMOLLM2_PROMPTS,
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Why is the sky blue? Explain briefly.",
    "Write a short poem about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
    "Give a recipe for a simple tomato soup.",
]


def sharegpt_lengths(n: int, scale: float, seed: int) -> list[tuple[int, int]]:
    """``n`` (prompt, output) token lengths drawn from the ShareGPT trace, x ``scale``."""
    import random

    from fluidserve.scheduler.workloads import DEFAULT_WORKLOAD_DIR, SHAREGPT, clamp_lengths, load_lengths

    rows = load_lengths(DEFAULT_WORKLOAD_DIR / SHAREGPT)
    picked = [(max(4, int(i * scale)), max(4, int(o * scale))) for i, o in random.Random(seed).sample(rows, n)]
    return clamp_lengths(picked, MAX_MODEL_LEN)


def chat_prompts(model: str) -> list[list[int]]:
    """CHAT_PROMPTS through the model's chat template, as token ids."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for p in CHAT_PROMPTS]


def replies(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from fluidserve.engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [list(o.outputs[0].token_ids) for o in outs]


# Run by vLLM's Python (``--vllm-python``) in a scratch folder: the same
# chat prompts' greedy replies from vLLM's own engine over one cache type.
VLLM_SCRIPT = """
import json, sys


def main():
    from vllm import LLM, SamplingParams

    model, prompts, cache, tokens = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3], int(sys.argv[4])
    llm = LLM(model=model, dtype=sys.argv[5], kv_cache_dtype=cache, enforce_eager=True, max_model_len=2048,
              enable_prefix_caching=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=tokens))
    print("REPLIES " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":
    main()
"""


def vllm_replies(python: str, model: str, prompts: list[list[int]], cache: str, tokens: int, dtype: str) -> list:
    """vLLM's greedy replies to ``prompts`` over a ``cache`` KV cache (its CPU
    build, 1 GiB of KV)."""
    import json
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script, data = Path(tmp) / "replies.py", Path(tmp) / "prompts.json"
        script.write_text(VLLM_SCRIPT)
        data.write_text(json.dumps(prompts))
        done = subprocess.run([python, str(script), model, str(data), cache, str(tokens), dtype], cwd=tmp,
                              capture_output=True, text=True, timeout=1200,
                              env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((x for x in done.stdout.splitlines() if x.startswith("REPLIES ")), None)
    if line is None:
        raise RuntimeError(f"vLLM gave no replies ({cache}):\n{done.stderr[-3000:]}")
    return json.loads(line.removeprefix("REPLIES "))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(replies: list[list[int]], reference: list[list[int]]) -> dict:
    """How many replies equal the reference's, and how many tokens each keeps before it parts."""
    return dict(same=sum(a == b for a, b in zip(replies, reference)), of=len(reference),
                tokens_before_parting=[common_prefix(a, b) for a, b in zip(replies, reference)],
                reply_tokens=[len(b) for b in reference])


def pressure_run(llm, lengths: list[tuple[int, int]], vocab: int, seed: int) -> dict:
    from fluidserve.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, vocab, (i,), generator=g).tolist() for i, _ in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    before = llm.engine.stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    after = llm.engine.stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(wall_s=wall, output_tokens=out_tokens, output_tok_s=out_tokens / wall,
                preemptions=after.num_preemptions - before.num_preemptions,
                recomputes=after.num_recomputes - before.num_recomputes,
                swaps=after.num_swaps - before.num_swaps, kv_blocks=after.kv_blocks_total)


def attention_cost(contexts: list[int], rows: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    """Median ms of one CPU decode attention call (rows x context) over each cache."""
    from fluidserve.kernels import cpu_attention
    from fluidserve.kernels.cache_dtype import cache_dtype, round_to_cache

    out = []
    kv_heads, group, head_dim, bs = 8, 4, 128, 16
    for length in contexts:
        blocks = -(-length // bs)
        g = torch.Generator().manual_seed(length)
        query = torch.randn(rows, kv_heads * group, head_dim, generator=g).to(dtype)
        tables = torch.arange(rows * blocks, dtype=torch.int32).view(rows, blocks)
        slots = torch.tensor([int(tables[r, (length - 1) // bs]) * bs + (length - 1) % bs for r in range(rows)])
        plan = cpu_attention.build_plan([1] * rows, [length] * rows, tables, slots, bs, None, kv_heads * head_dim)
        full = [torch.randn(rows * blocks, bs, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
        row = dict(context=length, rows=rows)
        times: dict[str, list[float]] = {}
        caches = {name: [round_to_cache(c, cache_dtype(name, dtype)) for c in full] for name in CACHES}
        for r in range(rounds):
            for name in CACHES if r % 2 == 0 else reversed(CACHES):
                t0 = time.perf_counter()
                cpu_attention.paged_attention(query, *caches[name], plan, head_dim**-0.5)
                times.setdefault(name, []).append(time.perf_counter() - t0)
        for name in CACHES:
            row[f"{name}_ms"] = statistics.median(times[name]) * 1e3
            row[f"{name}_mb"] = sum(c.nbytes for c in caches[name]) / 1e6
        out.append(row)
        print(row, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from fluidserve.engine import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a real model's directory (benchmarks/smollm2.py prepare)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=48, help="the memory-pressure burst")
    p.add_argument("--length-scale", type=float, default=0.5, help="ShareGPT lengths x this")
    p.add_argument("--cpu-kv-cache-gb", type=float, default=0.1, help="the pressure runs' KV budget")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM: its replies over each cache too")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = sharegpt_lengths(args.requests, args.length_scale, args.seed)
    record = dict(benchmark="kv_cache_dtype", command=" ".join(["benchmarks/kv_cache_dtype.py", *sys.argv[1:]]),
                  device=device_name("cpu"), model=Path(args.model).name, dtype=args.dtype,
                  cpu_kv_cache_gb=args.cpu_kv_cache_gb, requests=args.requests, length_scale=args.length_scale,
                  prompt_tokens=sum(i for i, _ in lengths), output_tokens=sum(o for _, o in lengths),
                  torch_threads=torch.get_num_threads(), replies={}, pressure={})
    answers, chats = {}, chat_prompts(args.model)
    for name in CACHES:
        llm = LLM(model=args.model, device="cpu", dtype=args.dtype, kv_cache_dtype=name,
                  cpu_kv_cache_gb=args.cpu_kv_cache_gb, max_model_len=MAX_MODEL_LEN, seed=args.seed)
        answers[name] = replies(llm, chats, args.reply_tokens)
        record["pressure"][name] = pressure_run(llm, lengths, llm.engine.vocab_size, args.seed)
        print(name, record["pressure"][name], flush=True)
        del llm
        gc.collect()
    for name in CACHES[1:]:
        record["replies"][name] = agreement(answers[name], answers["auto"])
    if args.vllm_python:
        theirs = {name: vllm_replies(args.vllm_python, args.model, chats, name, args.reply_tokens, args.dtype)
                  for name in CACHES}
        record["vllm"] = {name: dict(agreement(theirs[name], theirs["auto"]) if name != "auto" else {},
                                     same_as_ours=agreement(theirs[name], answers[name])) for name in CACHES}
    record["attention"] = attention_cost(args.contexts, args.rows, getattr(torch, args.dtype), args.rounds)
    save_results(RESULTS / f"kv_cache_dtype{args.tag}", record, to_markdown(record))
    print(to_markdown(record))
    return 0


def _kept(rep: dict) -> str:
    return ", ".join(f"{k}/{n}" for k, n in zip(rep["tokens_before_parting"], rep["reply_tokens"]))


def to_markdown(r: dict) -> str:
    auto = r["pressure"]["auto"]
    lines = [f"# The KV cache's dtype: {r['model']} ({r['dtype']})", "",
             f"Command: `{r['command']}`; {r['device']}, {r['torch_threads']} torch threads. Each cache type in "
             "turn in one process, the same model, prompts and budget.", "",
             f"## Greedy chat replies ({len(CHAT_PROMPTS)} prompts) against the cache in the model's dtype", "",
             "| cache | same replies | tokens kept before parting (each reply) |", "|---|---:|---|"]
    for name, rep in r["replies"].items():
        lines.append(f"| {name} | {rep['same']} of {rep['of']} | {_kept(rep)} |")
    if "vllm" in r:
        v = r["vllm"]
        lines += ["", "vLLM's CPU build over the same caches (the same prompt tokens, greedy): its own fp8 replies "
                  "against its own model-dtype ones, and each cache's replies against ours over that cache.", "",
                  "| cache | vLLM: same replies as its auto | tokens kept before parting | vLLM = ours (replies) "
                  "| tokens kept before parting |", "|---|---:|---|---:|---|"]
        for name, rep in v.items():
            own = (f"{rep['same']} of {rep['of']}", _kept(rep)) if "same" in rep else ("–", "–")
            ours = rep["same_as_ours"]
            lines.append(f"| {name} | {own[0]} | {own[1]} | {ours['same']} of {ours['of']} | {_kept(ours)} |")
    lines += ["", f"## A burst against a {r['cpu_kv_cache_gb']} GiB KV budget", "",
              f"{r['requests']} requests at once, ShareGPT lengths x {r['length_scale']} ({r['prompt_tokens']} "
              f"prompt and {r['output_tokens']} output tokens), random prompt tokens, greedy, `ignore_eos`.", "",
              "| cache | KV blocks | wall s | output tok/s | vs auto | preemptions (recomputes) | swaps |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, run in r["pressure"].items():
        lines.append(f"| {name} | {run['kv_blocks']} | {run['wall_s']:.1f} | {run['output_tok_s']:.1f} | "
                     f"{run['output_tok_s'] / auto['output_tok_s']:.2f}x | {run['preemptions']} "
                     f"({run['recomputes']}) | {run['swaps']} |")
    lines += ["", "## CPU decode attention, one call (Llama-3-8B heads: 8 KV heads, group 4, head 128)", "",
              "Median ms of `cpu_attention.paged_attention` over rows of one context each; an fp8 cache is "
              "widened to the query's dtype as it is gathered.", "",
              "| context | rows | auto ms | fp8 ms | fp8_e5m2 ms | fp8 / auto | cache MB (auto / fp8) |",
              "|---:|---:|---:|---:|---:|---:|---|"]
    for a in r["attention"]:
        lines.append(f"| {a['context']} | {a['rows']} | {a['auto_ms']:.2f} | {a['fp8_ms']:.2f} | "
                     f"{a['fp8_e5m2_ms']:.2f} | {a['fp8_ms'] / a['auto_ms']:.2f}x | "
                     f"{a['auto_mb']:.0f} / {a['fp8_mb']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
