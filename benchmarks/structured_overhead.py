"""What grammar-constrained decoding costs in decode throughput.

64 concurrent JSON-mode requests (``structured_outputs=json_object``, what
``response_format: {"type": "json_object"}`` becomes) against the same 64
requests unconstrained, in one run on one engine, rounds alternating so a
busy machine hurts both alike. Figure: decode tokens/s of each, and their
ratio.

Both sides must decode the same number of tokens at the same batch size, or
the comparison measures request lengths, not the grammar. A random model in
JSON mode may close its object after two tokens, so both sides carry the
same ``logit_bias`` of -100 on ``}`` (and the unconstrained side
``ignore_eos``): the JSON-mode requests then never finish their object, stay
under the grammar for all ``--tokens`` steps (strings, numbers, nesting),
and every step of both sides is a decode of all 64 rows. The grammar work is
the real per-step cost: matchers taking last step's tokens, the bitmask
fill, the mask on the logits.

    python3 benchmarks/structured_overhead.py              # tiny model on CPU
    python3 benchmarks/structured_overhead.py --rounds 5 --tokens 64

Writes benchmarks/results/structured_overhead-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.sampling_params import StructuredOutputs
from fluidserve.engine.tiny_model import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
# Models built for the run: the tests' tiny llama, and a wider, deeper one
# whose decode step costs more, so the grammar's fixed per-row cost weighs less.
SIZES: dict[str, dict] = {
    "tiny": {},
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}


def decode_rate(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """Run ``prompts`` to the end; decode tokens/s over the steps after every
    request has its first token (the prefill steps are left out)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
    started = set()
    t_decode = cpu_decode = None
    grammar_before = GRAMMAR_SECONDS[0]
    decode_tokens = 0
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        new = sum(len(co.new_token_ids) for o in outs for co in o.outputs)
        if t_decode is not None:
            decode_tokens += new
            steps += 1
        for o in outs:
            started.add(o.request_id)
        if t_decode is None and len(started) == len(prompts):
            t_decode, cpu_decode = now, time.process_time()  # every request has its first token: decode from here
            grammar_before = GRAMMAR_SECONDS[0]
    elapsed = time.perf_counter() - t_decode
    cpu = time.process_time() - cpu_decode
    grammar = GRAMMAR_SECONDS[0] - grammar_before
    return {"decode_tokens": decode_tokens, "decode_steps": steps, "seconds": elapsed, "cpu_seconds": cpu,
            "grammar_seconds": grammar, "tokens_per_s": decode_tokens / elapsed,
            "tokens_per_cpu_s": decode_tokens / cpu}


# Wall time spent in the grammar's share of each step (matchers taking last
# step's tokens and the batch bitmask fill, the mask on the logits), summed.
GRAMMAR_SECONDS = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            GRAMMAR_SECONDS[0] += time.perf_counter() - t0
    return wrapper


def instrument(llm: LLM) -> None:
    """Time the grammar's calls on the sampling worker (in-process executor)."""
    from fluidserve.engine import structured

    decoder = llm.engine.executor.worker.structured
    decoder.fill = _timed(decoder.fill)
    structured.TokenMask.apply = _timed(structured.TokenMask.apply)


def _describe(overrides: dict) -> str:
    return (f"hidden {overrides.get('hidden_size', 64)}, {overrides.get('num_hidden_layers', 2)} layers")


def _rates(runs: list[dict]) -> str:
    return ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a random llama built in a temp dir)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES),
                    help="the built model: tiny (the test model) or small (a wider, deeper one, same vocabulary)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=48, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one core per side of the comparison; CPU time then tracks work done

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.TemporaryDirectory()
        model = str(build_tiny_model(Path(tmp.name) / args.size, "llama", seed=0, **SIZES[args.size]))
    llm = LLM(model=model, device=args.device, max_num_seqs=args.concurrency,
              max_num_batched_tokens=max(2048, args.concurrency * 32))
    close_brace = llm.engine.tokenizer.convert_tokens_to_ids("}")
    bias = {close_brace: -100.0}
    prompts = [f"Reply in JSON, request {i}: describe item {i * 7 % 13}." for i in range(args.concurrency)]
    sides = {
        "unconstrained": SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True,
                                        logit_bias=bias),
        "json_mode": SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, logit_bias=bias,
                                    structured_outputs=StructuredOutputs(json_object=True)),
    }
    instrument(llm)
    decode_rate(llm, prompts[:4], sides["json_mode"])  # warm-up: kernels, grammar compile, tokenizer info
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name in (sides if r % 2 == 0 else reversed(list(sides))):
            run = decode_rate(llm, prompts, sides[name])
            assert run["decode_tokens"] == args.concurrency * (args.tokens - 1), run  # same work both sides
            runs[name].append(run)
            print(f"round {r} {name}: {run['tokens_per_s']:.1f} decode tok/s, {run['tokens_per_cpu_s']:.1f} per "
                  f"CPU-s, grammar {run['grammar_seconds']:.3f} s of {run['seconds']:.2f} s", flush=True)
    median = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    median_cpu = {name: statistics.median(r["tokens_per_cpu_s"] for r in rs) for name, rs in runs.items()}
    ratio = median["json_mode"] / median["unconstrained"]
    ratio_cpu = median_cpu["json_mode"] / median_cpu["unconstrained"]
    grammar_share = statistics.median(r["grammar_seconds"] / r["seconds"] for r in runs["json_mode"])
    # Each round's two runs ran back to back: their ratio sees the same machine load.
    paired = statistics.median(j["tokens_per_cpu_s"] / u["tokens_per_cpu_s"]
                               for j, u in zip(runs["json_mode"], runs["unconstrained"]))
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0).replace(" ", "_")
    meta = {
        "device": device, "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "model": (f"random llama '{args.size}' ({_describe(SIZES[args.size])}, byte vocabulary 261)"
                  if args.model is None else args.model),
        "concurrency": args.concurrency, "tokens_per_request": args.tokens, "rounds": args.rounds,
        "command": "python3 benchmarks/structured_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    result = {"meta": meta, "runs": runs, "median_tokens_per_s": median, "median_tokens_per_cpu_s": median_cpu,
              "json_over_unconstrained_wall": round(ratio, 4), "json_over_unconstrained_cpu": round(ratio_cpu, 4),
              "json_over_unconstrained_cpu_paired": round(paired, 4),
              "grammar_share_of_json_decode_wall": round(grammar_share, 4)}
    suffix = "" if args.model is not None or args.size == "tiny" else f"-{args.size}"
    out = Path(args.out) if args.out else RESULTS / f"structured_overhead-{device}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    md = "\n".join([
        "# Constrained decoding cost (JSON mode vs unconstrained)",
        "",
        f"{args.concurrency} concurrent requests, {args.tokens} tokens each, {meta['model']} on {device} "
        f"({meta['cpus']} CPUs); {args.rounds} alternating rounds per side, medians.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| side | decode tok/s (median) | per round | decode tok per CPU-s (median) |",
        "|---|---|---|---|",
        *(f"| {name} | {median[name]:.1f} | {_rates(runs[name])} | {median_cpu[name]:.1f} |" for name in runs),
        "",
        f"JSON mode / unconstrained, decode tokens per CPU second: **{ratio_cpu:.3f}** "
        f"(cost {100 * (1 - ratio_cpu):.1f}%); median of the rounds' paired ratios {paired:.3f}; "
        f"per wall second: {ratio:.3f}.",
        "",
        f"Grammar work timed inside the worker (matchers taking last step's tokens, the batch bitmask fill, "
        f"the mask on the logits): **{100 * grammar_share:.2f}%** of JSON-mode decode wall time (median over "
        f"rounds).",
        "",
        f"Wall-clock rates swing between rounds with whatever else runs on the {os.cpu_count()} cores; the CPU "
        "time of this process and the grammar's own timed share are the steadier figures.",
        "",
    ])
    out.with_suffix(".md").write_text(md)
    print(md)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
