"""What serving LoRA adapters costs the engine, in-process: the same greedy
requests (``LLM.generate``, ``ignore_eos``) under the base model, one
adapter, K adapters mixed row by row, and K adapters beside base rows, on
one engine holding K random adapters (``--enable-lora``). The four runs
take turns in every round; the lowest time of each over the rounds is
reported, and its ratio to the base model's.

    python benchmarks/lora_cost.py --model /path/to/SmolLM2-135M-Instruct --tag=-smollm2

Writes benchmarks/results/lora_cost{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Tell me a story about a dragon who guards a library."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory")
    p.add_argument("--adapters", type=int, default=4, help="random adapters held (K)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.tiny_model import build_random_adapter

    scratch = Path(tempfile.mkdtemp(prefix="lora-cost-"))
    names = [f"a{i}" for i in range(args.adapters)]
    modules = tuple((n, str(build_random_adapter(args.model, scratch / n, seed=i, r=args.rank, scale=0.03)))
                    for i, n in enumerate(names))
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, enable_lora=True, max_loras=args.adapters,
              max_lora_rank=args.rank, lora_modules=modules)
    runs = {"base model": [None], "one adapter": names[:1], f"{args.adapters} adapters mixed": names,
            f"{args.adapters} adapters and base rows": [None, *names]}

    def run(models: list[str | None]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                                 lora=models[i % len(models)]) for i in range(args.requests)]
        start = time.perf_counter()
        llm.generate([PROMPT] * args.requests, params)
        return time.perf_counter() - start

    for models in runs.values():  # warm-up: every form of step once
        run(models)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, models in runs.items():
            times[name].append(run(models))
    best = {name: min(t) for name, t in times.items()}
    base = best["base model"]
    lines = ["# What LoRA adapters cost the engine", "",
             f"{Path(args.model).name} ({args.dtype} on {args.device}), {args.adapters} random adapters of rank "
             f"{args.rank} on every linear, {args.requests} greedy requests of {args.tokens} tokens per run "
             f"(`LLM.generate`), lowest of {args.rounds} rounds taking turns.", "",
             "| requests to | seconds | against the base model |", "|---|---|---|"]
    lines += [f"| {name} | {t:.3f} | {t / base:.2f}x |" for name, t in best.items()]
    print("\n".join(lines))
    save_results(RESULTS / f"lora_cost{args.tag}", {"benchmark": "lora_cost", "model": Path(args.model).name,
                                                    "adapters": args.adapters, "rank": args.rank,
                                                    "requests": args.requests, "tokens": args.tokens,
                                                    "device": args.device, "times_s": times, "best_s": best},
                 "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
