"""What beam search costs (``use_beam_search``, serve/beam_search.py) beside
sampling the same number of sequences, on the engine through ``AsyncEngine``
as the server runs it.

Beam search runs above the engine, as vLLM's does: every step is one request
per live beam (``prompt + beam``, ``max_tokens=1``, ``2 * width`` logprobs),
so a 32-token search of width 4 is 128 one-token requests per prompt. What
keeps that affordable is the prefix cache: each step's request shares all but
its last token with the request before it, so only the last, partial block is
computed again. The run measures three things side by side, alternating:

* ``n=4 sampling``: one request per prompt with ``n=4``, 32 tokens each;
* ``beam width 4``: the same prompts, 4 beams of 32 tokens (ignore_eos, so
  every sequence has the full length);
* ``beam width 4, no prefix cache``: the same on an engine started with
  ``enable_prefix_caching=False``: every step recomputes every beam.

Per variant: wall time, output tokens per second (4 sequences x 32 tokens
per prompt), engine steps, and tokens the engine computed (prefill and
decode rows together).

    python benchmarks/beam_search.py          # ~2 min on 2 cores (cpu-small)
Writes benchmarks/results/beam_search-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dummy_models import add_model_args, build_model_dir, device_name, model_choice, save_results

from fluidserve.engine.async_engine import AsyncEngine
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.sampling_params import SamplingParams
from fluidserve.serve.beam_search import BeamSearchParams, beam_search

REPO = Path(__file__).resolve().parents[1]


class Counted:
    """An engine with its steps and computed tokens counted."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.steps, self.tokens = engine, 0, 0
        update = engine.scheduler.update_from_output

        def counted(plan, outcome):
            self.steps += 1
            self.tokens += sum(i.num_tokens for i in plan.scheduled)
            return update(plan, outcome)

        engine.scheduler.update_from_output = counted

    def mark(self) -> tuple[int, int]:
        return self.steps, self.tokens


async def run_sampling(ae: AsyncEngine, prompts: list[list[int]], n: int, max_tokens: int, tag: str) -> int:
    async def one(i: int, prompt: list[int]) -> int:
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=i)
        last = None
        async for out in await ae.add_request(f"{tag}-{i}", prompt, params):
            last = out
        return last.num_generated_tokens

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def run_beams(ae: AsyncEngine, prompts: list[list[int]], width: int, max_tokens: int, tag: str,
                    decode) -> int:
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width, ignore_eos=True)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, step=step, eos_token_ids=frozenset(),
                              ignore_eos=True)
    outs = await asyncio.gather(*(beam_search(ae, f"{tag}-{i}", p, params, decode) for i, p in enumerate(prompts)))
    return sum(out.num_generated_tokens for out in outs)


async def measure(args: argparse.Namespace, model_dir: Path, device: str, dtype: str) -> dict:
    kv_blocks = args.num_prompts * args.width * ((args.prompt_len + args.max_tokens) // 16 + 2) + 64
    common = dict(model=str(model_dir), load_format="dummy", device=device, dtype=dtype,
                  max_model_len=args.prompt_len + args.max_tokens + 16, num_kv_blocks=kv_blocks, seed=0)
    cached = Counted(LLMEngine(EngineConfig.create(**common)))
    uncached = Counted(LLMEngine(EngineConfig.create(**common, enable_prefix_caching=False)))
    engines = {id(cached): AsyncEngine(cached.engine), id(uncached): AsyncEngine(uncached.engine)}
    for ae in engines.values():
        ae.start()
    decode = lambda ids, skip: cached.engine.tokenizer.decode(ids, skip_special_tokens=skip)  # noqa: E731
    variants = {
        f"n={args.width} sampling": (cached, lambda ae, tag: run_sampling(ae, prompts, args.width, args.max_tokens,
                                                                          tag)),
        f"beam width {args.width}": (cached, lambda ae, tag: run_beams(ae, prompts, args.width, args.max_tokens,
                                                                       tag, decode)),
        f"beam width {args.width}, no prefix cache": (
            uncached, lambda ae, tag: run_beams(ae, prompts, args.width, args.max_tokens, tag, decode)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    work: dict[str, list[tuple[int, int, int]]] = {k: [] for k in variants}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up
            # Fresh prompts each round: no round finds the last one's prompts cached.
            prompts = [[(31 * r + 7 * i + j) % 250 + 1 for j in range(args.prompt_len)]
                       for i in range(args.num_prompts)]
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                counter, run = variants[name]
                steps0, tokens0 = counter.mark()
                start = time.perf_counter()
                generated = await run(engines[id(counter)], f"{r}-{name}")
                elapsed = time.perf_counter() - start
                if r:
                    times[name].append(elapsed)
                    work[name].append((generated, counter.steps - steps0, counter.tokens - tokens0))
    finally:
        for ae in engines.values():
            await ae.shutdown()
    rows = []
    for name in variants:
        generated, steps, computed = work[name][-1]
        med = statistics.median(times[name])
        rows.append({"variant": name, "median_s": med, "output_tok_per_s": generated / med,
                     "output_tokens": generated, "engine_steps": steps, "tokens_computed": computed})
    return {"rows": rows, "raw_s": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--width", type=int, default=4, help="beam width, and n of the sampling baseline")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4, help="searches running at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)
    device, preset, dtype = model_choice(args)
    model_dir = build_model_dir(preset, Path(tempfile.mkdtemp(prefix="fluidserve-beam-")))
    load_before = os.getloadavg()
    result = asyncio.run(measure(args, model_dir, device, dtype))
    command = "python benchmarks/beam_search.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"benchmark": "beam search cost", "command": command.strip(), "device": device_name(device),
              "preset": preset, "dtype": dtype, "width": args.width, "max_tokens": args.max_tokens,
              "prompt_len": args.prompt_len, "num_prompts": args.num_prompts, "rounds": args.rounds, **result,
              "load_average_before": load_before, "load_average_after": os.getloadavg()}
    base = result["rows"][0]["median_s"]
    md = [f"# Beam search cost ({record['device']}, {preset}, {dtype})", "",
          f"`{record['command']}`: {args.num_prompts} prompts of {args.prompt_len} tokens at once, "
          f"{args.width} sequences of {args.max_tokens} tokens each (ignore_eos); medians of {args.rounds} "
          f"alternating rounds after a warm-up; load average {load_before[0]:.1f} before, "
          f"{record['load_average_after'][0]:.1f} after.", "",
          "| variant | time s | output tok/s | time vs sampling | engine steps | tokens computed |",
          "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['variant']} | {r['median_s']:.2f} | {r['output_tok_per_s']:.0f} | {r['median_s'] / base:.1f}x | "
           f"{r['engine_steps']} | {r['tokens_computed']} |" for r in result["rows"]]
    save_results(args.out / f"beam_search-{device}", record, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
