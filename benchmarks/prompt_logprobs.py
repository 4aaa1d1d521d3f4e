"""What scoring the prompt costs: prefill time of the same requests with and
without ``prompt_logprobs``, side by side in one run (alternating rounds,
medians), on the engine directly.

Each request is a prompt of ``--prompt-len`` tokens and one output token, so
the step time is nearly all prefill; with ``prompt_logprobs=N`` the worker
also projects every prompt position through the LM head (in slices of
``engine/prompt_logprobs.py``'s ROWS_PER_SLICE rows), takes an fp32
log_softmax, the top N and the prompt token's rank, and copies them to the
host. The realistic 32k vocabulary of the ``cpu-small`` shape makes that
head projection cost what it would; there the head (16M weights) outweighs
the 4-layer body (13M), so scoring every prompt position costs several
prefills: the head itself, then fp32 reductions over the vocabulary
(logsumexp, the rank count, top-N) of about the same size again. On a real
model the body dominates and the same work is a small share of a prefill.
The table separates the head (timed alone over the same positions) from
what scoring adds beyond it.

    python benchmarks/prompt_logprobs.py                  # ~1 min on 2 cores
Writes benchmarks/results/prompt_logprobs-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dummy_models import add_model_args, build_model_dir, device_name, model_choice

from fluidserve.engine import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[1]


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if params.prompt_logprobs is not None:  # the work was really done
        assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts))
    return elapsed


def head_only(llm: LLM, positions: int, hidden_size: int) -> float:
    """The LM head over as many rows as the prompts have scored positions, in
    the same slices and nothing else: what any implementation must spend."""
    from fluidserve.engine.prompt_logprobs import ROWS_PER_SLICE

    model = llm.engine.executor.worker.model
    hidden = torch.randn(positions, hidden_size)
    start = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, positions, ROWS_PER_SLICE):
            model.compute_logits(hidden[lo:lo + ROWS_PER_SLICE])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--top-n", type=int, nargs="+", default=[0, 5, 20])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    device, preset, dtype = model_choice(args)
    model_dir = build_model_dir(preset, Path(tempfile.mkdtemp(prefix="fluidserve-plp-")))
    llm = LLM(model=str(model_dir), load_format="dummy", device=device, dtype=dtype,
              max_model_len=args.prompt_len + 16, max_num_batched_tokens=args.max_num_batched_tokens,
              num_kv_blocks=args.num_prompts * (args.prompt_len // 16 + 2))
    prompts = [[(97 + 7 * i + j) % 250 for j in range(args.prompt_len)] for i in range(args.num_prompts)]
    variants = {"none": SamplingParams(max_tokens=1, temperature=0)}
    for n in args.top_n:
        variants[f"prompt_logprobs={n}"] = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=n)
    load_before = os.getloadavg()  # how busy the cores were: the times depend on it
    timed(llm, prompts, variants["none"])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in variants}
    head: list[float] = []
    hidden_size = llm.engine.hf_config.hidden_size
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(timed(llm, prompts, variants[name]))
        head.append(head_only(llm, args.num_prompts * (args.prompt_len - 1), hidden_size))
    base = statistics.median(times["none"])
    head_s = statistics.median(head)
    rows = [{"variant": k, "median_s": statistics.median(v), "prompt_tok_per_s":
             args.num_prompts * args.prompt_len / statistics.median(v), "time_vs_none": statistics.median(v) / base}
            for k, v in times.items()]
    for row in rows[1:]:  # what scoring adds beyond the head projection it cannot avoid
        row["beyond_head_s"] = row["median_s"] - base - head_s
    record = {"benchmark": "prompt_logprobs cost", "command": "python benchmarks/prompt_logprobs.py "
              + " ".join(argv if argv is not None else sys.argv[1:]), "device": device_name(device),
              "preset": preset, "dtype": dtype, "prompt_len": args.prompt_len, "num_prompts": args.num_prompts,
              "max_num_batched_tokens": args.max_num_batched_tokens, "rounds": args.rounds, "rows": rows,
              "lm_head_only_s": head_s, "raw_s": times, "load_average_before": load_before,
              "load_average_after": os.getloadavg()}
    md = [f"# prompt_logprobs cost ({record['device']}, {preset}, {dtype})", "",
          f"`{record['command']}`: {args.num_prompts} prompts of {args.prompt_len} tokens, 1 output token each, "
          f"step budget {args.max_num_batched_tokens} tokens; medians of {args.rounds} alternating rounds; "
          f"load average {load_before[0]:.1f} before, {record['load_average_after'][0]:.1f} after.", "",
          f"The LM head alone over the same {args.num_prompts * (args.prompt_len - 1)} positions: {head_s:.3f} s "
          "(the part no implementation avoids).", "",
          "| variant | time s | prompt tok/s | time vs none | beyond none + head s |", "|---|---:|---:|---:|---:|"]
    md += [f"| {r['variant']} | {r['median_s']:.3f} | {r['prompt_tok_per_s']:.0f} | {r['time_vs_none']:.2f}x | "
           f"{r.get('beyond_head_s', 0.0):.3f} |" for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"prompt_logprobs-{device}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
