"""What the Ray executor costs against the local one, on one device, in one run.

The same model (dummy weights, same seed), prompts and engine settings run
under ``executor="local"`` and under ``executor="ray"`` with one worker
(optionally also ``--tp N`` Ray workers). Two figures each:

* throughput: ``--num-prompts`` prompts, exactly ``--output-len`` tokens each
  (EOS ignored), through ``LLM.generate`` — output tokens/s;
* per-step time of pure decode steps at a few batch sizes (``--batches``):
  mean and median of ``LLMEngine.step()``. ``--repetition-penalty``: every
  request sets it, so each step's sampler rows carry prompt and outputs. The Ray path's extra time per step
  over the local path is its overhead: serialising the ModelInput, the
  step's way to the workers, the result's way back.

Each Ray size runs twice, side by side (``--transports``): steps over the
Unix sockets the executor takes on one node (``ray-tpN``), and over Ray
calls (``ray-tpN-calls``), what it takes where the workers are elsewhere.

    python benchmarks/ray_overhead.py                       # CPU: small dummy Llama
    python benchmarks/ray_overhead.py --preset llama3-8b    # one GPU: Llama-3-8B-shaped dummy model
    python benchmarks/ray_overhead.py --tp 2                # also time 2 tensor-parallel Ray workers

On CPU a Ray worker gets one thread (Ray sets OMP_NUM_THREADS to the actor's
one CPU), so the local run is pinned to one thread too (``--threads``) for a
like-for-like comparison. Writes benchmarks/results/ray_overhead-<device>-<preset><tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dummy_models import PRESETS, add_model_args, build_model_dir, device_name

REPO = Path(__file__).resolve().parent.parent



def make_llm(model_dir: Path, device: str, dtype: str, executor: str, tp: int, transport: str, args):
    from fluidserve.engine import LLM

    return LLM(model=str(model_dir), load_format="dummy", device=device, dtype=dtype, executor=executor,
               tensor_parallel_size=tp, ray_transport=transport,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
               num_kv_blocks=args.num_kv_blocks,
               max_model_len=args.prompt_len + max(args.output_len, args.decode_steps) + 16)


def greedy(max_tokens: int, repetition_penalty: float):
    from fluidserve.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          repetition_penalty=repetition_penalty)


def throughput(llm, prompts: list[list[int]], output_len: int, penalty: float) -> dict:
    llm.generate(prompts[:2], greedy(4, penalty))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(output_len, penalty))
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "steps": llm.engine.stats().num_steps}


def decode_step_times(llm, prompts: list[list[int]], batch: int, steps: int, penalty: float) -> dict:
    """Prefill ``batch`` requests, then time ``steps`` steps that are all decode."""
    engine = llm.engine
    params = greedy(steps + 8, penalty)
    ids = [f"bench-{batch}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while any(len(engine.requests[r].seqs[0].output_token_ids) == 0 for r in ids):
        engine.step()  # prefill (chunks) until every request has its first token
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return {"batch": batch, "steps": steps, "mean_ms": 1e3 * statistics.fmean(times),
            "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}


def measure(llms: dict, prompts, args) -> dict:
    """Every figure ``--rounds`` times, the engines taking turns within a
    round, so drift in the machine's load hits them alike; medians reported."""
    results: dict = {name: {"throughput_rounds": [], "decode_rounds": {b: [] for b in args.batches}}
                     for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            penalty = args.repetition_penalty
            results[name]["throughput_rounds"].append(throughput(llm, prompts, args.output_len, penalty))
            for b in args.batches:
                results[name]["decode_rounds"][b].append(decode_step_times(llm, prompts, b, args.decode_steps,
                                                                        penalty))
    for name, r in results.items():
        r["tokens_per_s"] = statistics.median(t["tokens_per_s"] for t in r["throughput_rounds"])
        r["decode_median_ms"] = {b: statistics.median(d["median_ms"] for d in rounds)
                                 for b, rounds in r["decode_rounds"].items()}
        r["decode_rounds"] = {str(b): rounds for b, rounds in r["decode_rounds"].items()}
        print(f"{name:>10}: {r['tokens_per_s']:9.1f} tok/s; "
              + "  ".join(f"decode step b={b}: {ms:.2f} ms" for b, ms in r["decode_median_ms"].items()))
    return results


def compare(results: dict) -> dict:
    """Each Ray run against the local run: throughput ratio, extra ms per decode step."""
    base = results["local"]
    return {
        name: {
            "tokens_per_s_ratio": r["tokens_per_s"] / base["tokens_per_s"],
            "step_overhead_ms": {str(b): ms - base["decode_median_ms"][b] for b, ms in r["decode_median_ms"].items()},
        }
        for name, r in results.items() if name != "local"
    }


def markdown(record: dict) -> str:
    s = record["settings"]
    batches = s["batches"]
    lines = [
        f"# Ray executor against the local one: {record['device']}",
        "",
        f"Preset {record['preset']} ({record['dtype']}), torch {record['torch']}; {s['num_prompts']} prompts x "
        f"{s['prompt_len']} tokens -> {s['output_len']} tokens for throughput; pure decode steps timed at batch "
        f"{', '.join(map(str, batches))} ({s['decode_steps']} steps); repetition penalty {s['repetition_penalty']}; "
        f"median of {s['rounds']} rounds, the engines taking turns. Decode step: median `LLMEngine.step()`; "
        "extra: over the local run's.",
        "",
        "| run | output tok/s | vs local | " + " | ".join(f"step b={b} ms | extra b={b} ms" for b in batches) + " |",
        "|---|---:|---:|" + "---:|---:|" * len(batches),
    ]
    base = record["runs"]["local"]
    for name, r in record["runs"].items():
        ratio = r["tokens_per_s"] / base["tokens_per_s"]
        cells = []
        for b in batches:
            ms, local = r["decode_median_ms"][b], base["decode_median_ms"][b]
            cells.append(f"{ms:.2f} | {ms - local:+.2f}")
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {ratio:.2f}x | " + " | ".join(cells) + " |")
    lines += ["", "ray-tpN: steps over a Unix socket a worker (`--ray-transport auto` on one node); "
              "ray-tpN-calls: over Ray actor calls (`--ray-transport ray-calls`).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--tp", type=int, default=1, help="also run this many tensor-parallel Ray workers (>1)")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 16 CPU / 64 GPU")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 32 CPU / 256 GPU)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens per prompt (default 32 CPU / 128 GPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes to time")
    ap.add_argument("--decode-steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="repetitions, engines taking turns")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="per engine (default: sized for the prompts, so the engines fit side by side)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the local run on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="every request's: the sampler then counts each row's prompt and outputs")
    ap.add_argument("--transports", nargs="+", default=["auto", "ray-calls"], choices=["auto", "ray-calls"],
                    help="--ray-transport of the Ray runs: auto (Unix sockets here; runs named ray-tpN) and "
                         "ray-calls (runs named ray-tpN-calls), side by side")
    ap.add_argument("--tag", default="", help="appended to the result file's name")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device == "cuda"
    preset = args.preset or ("llama3-8b" if gpu else "cpu-small")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.num_prompts = args.num_prompts or (64 if gpu else 16)
    args.prompt_len = args.prompt_len or (256 if gpu else 32)
    args.output_len = args.output_len or (128 if gpu else 32)
    if not gpu:
        torch.set_num_threads(args.threads)
    n = max(args.num_prompts, max(args.batches))
    if args.num_kv_blocks is None:
        args.num_kv_blocks = n * -(-(args.prompt_len + max(args.output_len, args.decode_steps) + 16) // 16) + 16
    rng = random.Random(args.seed)
    vocab = PRESETS[preset].get("vocab_size", 261)
    prompts = [[rng.randrange(0, vocab) for _ in range(args.prompt_len)] for _ in range(n)]

    from fluidserve.engine.executor.ray import start_local_ray

    t0 = time.perf_counter()
    # Logical CPUs for Ray's accounting: the engines live side by side, one CPU per worker.
    start_local_ray(num_cpus=max(os.cpu_count() or 1, len(args.transports) * (1 + args.tp)))
    ray_start_s = time.perf_counter() - t0
    runs = [("local", "local", 1, "auto")]
    for tp in [1] + ([args.tp] if args.tp > 1 else []):
        for transport in args.transports:
            runs.append((f"ray-tp{tp}" + ("-calls" if transport == "ray-calls" else ""), "ray", tp, transport))
    llms: dict = {}
    startup: dict = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = build_model_dir(preset, Path(tmp))
            print(f"device: {device_name(device)}; preset {preset} ({dtype}); {args.num_prompts} prompts x "
                  f"{args.prompt_len} tokens -> {args.output_len} tokens; {args.rounds} rounds; "
                  f"Ray started in {ray_start_s:.1f} s")
            # All engines live side by side (KV sized explicitly), so the
            # rounds can interleave them.
            for name, executor, tp, transport in runs:
                t0 = time.perf_counter()
                llms[name] = make_llm(model_dir, device, dtype, executor, tp, transport, args)
                startup[name] = time.perf_counter() - t0
            results = measure(llms, prompts[: args.num_prompts], args)
            for name in results:
                results[name]["startup_s"] = startup[name]
    finally:
        for llm in llms.values():
            llm.engine.shutdown()
        import ray

        ray.shutdown()

    summary = compare(results)
    for name, c in summary.items():
        steps = ", ".join(f"b={b}: {ms:+.2f} ms" for b, ms in c["step_overhead_ms"].items())
        print(f"{name} vs local: throughput x{c['tokens_per_s_ratio']:.3f}; extra time per decode step {steps}")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ray_overhead-{device}-{preset}{args.tag}.json"
    record = {
        "benchmark": "ray_overhead", "device": device_name(device), "device_kind": device, "preset": preset,
        "model_shape": PRESETS[preset], "dtype": dtype, "torch": torch.__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cpu_count": os.cpu_count(), "load_average_1_5_15": os.getloadavg(),
        "ray_start_s": ray_start_s, "runs": results, "vs_local": summary,
        "note": "CPU numbers: 1 torch thread per worker and for the local run" if not gpu else "one GPU",
    }
    path.write_text(json.dumps(record, indent=2))
    path.with_suffix(".md").write_text(markdown(record))
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
