"""Offline throughput: fluidserve against Hugging Face transformers on the same
model, prompts and device, in one run.

Baselines: transformers ``generate`` on left-padded batches, and its own
continuous batching (``generate_batch`` with paged attention) where that runs.
Every system produces exactly ``--output-len`` tokens per prompt (EOS ignored),
so tokens/s compare like for like. Prompt lengths are sampled from a real
length file (ShareGPT by default) and scaled down with ``--length-scale``.

    python benchmarks/throughput.py                      # CPU preset: 4-layer, hidden-512 dummy Llama, 64 prompts
    python benchmarks/throughput.py --preset llama3-8b   # on a GPU: Llama-3-8B-shaped dummy model, decode graphs
    python benchmarks/throughput.py --preset llama3-8b --enforce-eager   # fluidserve without CUDA graphs

Prints the ratios and writes JSON + a markdown table to benchmarks/results/:
``throughput-cpu-<preset>`` on CPU, ``throughput-<device>-<preset>`` on a GPU
(``-graphs`` appended unless ``--enforce-eager``, ``-<n>prompts`` unless
there are 64), rewritten as each system
finishes so a run cut off keeps the systems done.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from dummy_models import PRESETS, add_model_args, build_model_dir, device_name, device_slug

from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE
from fluidserve.scheduler.workloads import DEFAULT_WORKLOAD_DIR, SHAREGPT, read_rows

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LENGTHS = DEFAULT_WORKLOAD_DIR / SHAREGPT


def sample_prompts(path: Path, n: int, scale: float, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    lengths = [int(r["prompt_tokens"]) for r in read_rows(path)]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(4, min(max_len, int(rng.choice(lengths) * scale)))
        out.append([rng.randrange(vocab // 4, vocab) for _ in range(length)])
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_fluidserve(model_dir: Path, prompts, output_len: int, device: str, dtype: str, args,
                   async_scheduling: bool = False, piecewise: bool = False) -> dict:
    from fluidserve.engine import LLM, SamplingParams

    llm = LLM(model=str(model_dir), load_format="dummy", device=device, dtype=dtype,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              num_kv_blocks=args.num_kv_blocks, max_model_len=max(map(len, prompts)) + output_len,
              enforce_eager=args.enforce_eager, async_scheduling=async_scheduling, piecewise_graphs=piecewise)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(device)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    # Engine internals, read only to confirm the graphs path ran: None when
    # the engine holds no graphs (eager, or not on CUDA).
    worker = getattr(llm.engine.executor, "worker", None)
    replays = getattr(getattr(worker, "graphs", None), "replays", None)
    pieces = getattr(getattr(worker, "piecewise", None), "replays", None)
    llm.engine.shutdown()
    return {"elapsed_s": elapsed, "output_tokens": tokens, "steps": stats.num_steps,
            "steps_launched_ahead": stats.num_steps_launched_ahead,
            "graph_replays": None if replays is None else sum(replays.values()),
            "piecewise_replays": None if pieces is None else sum(pieces.values()),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}


def _hf_model(model_dir: Path, device: str, dtype: str, attn: str | None = None):
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kwargs = {"attn_implementation": attn} if attn else {}
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **kwargs)
    return model.eval()


def run_hf_padded(model_dir: Path, prompts, output_len: int, device: str, dtype: str, batch_size: int) -> dict:
    model = _hf_model(model_dir, device, dtype)
    pad = 0

    def generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    generate(prompts[:2])  # warm-up
    sync(device)
    t0 = time.perf_counter()
    tokens = sum(generate(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size))
    sync(device)
    return {"elapsed_s": time.perf_counter() - t0, "output_tokens": tokens, "batch_size": batch_size}


def run_hf_continuous(model_dir: Path, prompts, output_len: int, device: str, dtype: str) -> dict:
    import transformers

    attn = "sdpa"  # generate_batch pages the KV cache itself
    model = _hf_model(model_dir, device, dtype, attn)
    cfg = transformers.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                        eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=cfg, progress_bar=False)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    sync(device)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"elapsed_s": elapsed, "output_tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=None, help="tokens per prompt (default 32 CPU / 256 GPU)")
    ap.add_argument("--lengths", type=Path, default=DEFAULT_LENGTHS, help="CSV with a prompt_tokens column")
    ap.add_argument("--length-scale", type=float, default=None,
                    help="multiply sampled prompt lengths (default 0.05 CPU / 0.25 GPU)")
    ap.add_argument("--max-prompt-len", type=int, default=2048)
    ap.add_argument("--hf-batch-size", type=int, default=None,
                    help="padded batch size (default: all prompts, at most 64; 256 padded prompts of up to "
                         "2k tokens do not fit an 8B model's KV and logits on one GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--skip-continuous", action="store_true", help="skip transformers' generate_batch")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                    help="fluidserve eager; by default (the engine's) it captures decode CUDA graphs on a GPU")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also run fluidserve with async scheduling (the default with CUDA), right after the "
                         "synchronous run")
    ap.add_argument("--piecewise-graphs", action="store_true",
                    help="also run fluidserve with --piecewise-graphs (synchronous, as the first run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args(argv)

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = auto if args.device == "auto" else args.device
    gpu = device == "cuda"
    preset = args.preset or ("llama3-8b" if gpu else "cpu-small")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    output_len = args.output_len or (256 if gpu else 32)
    scale = args.length_scale or (0.25 if gpu else 0.05)
    prompts = sample_prompts(args.lengths, args.num_prompts, scale, args.max_prompt_len,
                             PRESETS[preset].get("vocab_size", BYTE_VOCAB_SIZE), args.seed)
    if args.num_kv_blocks is None and not gpu:
        need = sum(-(-(len(p) + output_len) // 16) for p in prompts)
        args.num_kv_blocks = need + 16

    base = {
        "benchmark": "throughput", "device": device_name(device), "preset": preset, "dtype": dtype,
        "enforce_eager": args.enforce_eager, "model_shape": PRESETS[preset], "num_prompts": len(prompts),
        "output_len": output_len,
        "prompt_lengths": {"source": _shown(args.lengths), "scale": scale,
                           "mean": sum(map(len, prompts)) / len(prompts), "max": max(map(len, prompts))},
        "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    graphs = "" if args.enforce_eager or not gpu else "-graphs"
    size = "" if len(prompts) == 64 else f"-{len(prompts)}prompts"
    stem = args.out / f"throughput-{device_slug(base['device']) if gpu else 'cpu'}-{preset}{graphs}{size}"
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(preset, Path(tmp))
        print(f"device: {device_name(device)}; model preset {preset} ({dtype}); {len(prompts)} prompts, "
              f"mean prompt {sum(map(len, prompts)) / len(prompts):.0f} tokens, {output_len} output tokens each; "
              f"fluidserve {'eager' if args.enforce_eager else 'with decode CUDA graphs where the device has them'}")
        runs = [("fluidserve", lambda: run_fluidserve(model_dir, prompts, output_len, device, dtype, args))]
        if args.async_scheduling:
            runs.append(("fluidserve_async", lambda: run_fluidserve(model_dir, prompts, output_len, device, dtype,
                                                                    args, async_scheduling=True)))
        runs += [("hf_generate_padded", lambda: run_hf_padded(model_dir, prompts, output_len, device, dtype,
                                                              args.hf_batch_size or min(len(prompts), 64)))]
        if not args.skip_continuous:
            runs.append(("hf_generate_batch", lambda: run_hf_continuous(model_dir, prompts, output_len, device, dtype)))
        if args.piecewise_graphs:  # last: a run cut off short loses it, not a baseline
            runs.append(("fluidserve_piecewise", lambda: run_fluidserve(model_dir, prompts, output_len, device,
                                                                        dtype, args, piecewise=True)))
        reference: list[list[int]] = []
        for name, fn in runs:
            try:
                r = fn()
                r["tokens_per_s"] = r["output_tokens"] / r["elapsed_s"]
                r["requests_per_s"] = len(prompts) / r["elapsed_s"]
            except Exception as exc:  # a baseline that cannot run here is reported, not fatal
                r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            ids = r.pop("token_ids", None)
            if ids is not None and name == "fluidserve":
                reference = ids
            elif ids is not None:
                # Greedy over the same steps: any other run of ours must give
                # the synchronous run's tokens (a figure here, a test on the GPU).
                r["same_tokens_as_fluidserve"] = sum(a == b for a, b in zip(ids, reference)) / len(ids)
            results[name] = r
            print(f"{name:>22}: " + (f"{r['tokens_per_s']:9.1f} tok/s  {r['requests_per_s']:7.2f} req/s  "
                                     f"({r['elapsed_s']:.2f} s)" if "error" not in r else r["error"]))
            write_results(stem, base, results)
            # The last system's weights (and an engine's KV cache) sit in
            # reference cycles: free them before the next system loads its own.
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()

    for ours, ratios in speedups(results).items():
        for k, v in ratios.items():
            print(f"{ours} / {k}: {v:.2f}x")
    print(f"wrote {stem}.json")
    return 1 if "error" in results["fluidserve"] else 0  # a baseline's error is only reported


def _shown(path: Path) -> str:
    """The lengths file as the results name it: repository-relative."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def speedups(results: dict) -> dict[str, dict[str, float]]:
    """Each run of ours over every run before it that is not ours, and the
    async and piecewise runs over the default one: ``{ours: {other: ratio}}``."""
    out: dict[str, dict[str, float]] = {}
    for ours in ("fluidserve", "fluidserve_async", "fluidserve_piecewise"):
        mine = results.get(ours, {}).get("tokens_per_s")
        if mine:
            out[ours] = {k: mine / v["tokens_per_s"] for k, v in results.items()
                         if k != ours and "tokens_per_s" in v and (ours != "fluidserve" or k.startswith("hf_"))}
    return out


def write_results(stem: Path, base: dict, results: dict) -> None:
    every = speedups(results)
    ratios = every.get("fluidserve", {})
    record = {**base, "results": results, "speedup": ratios}
    if "fluidserve_async" in every:
        record["async_speedup"] = every["fluidserve_async"]
    if "fluidserve_piecewise" in every:
        record["piecewise_speedup"] = every["fluidserve_piecewise"]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    ours = results.get("fluidserve", {})
    mode = ("eager" if record["enforce_eager"] else
            "with decode CUDA graphs asked for" if "error" in ours or not ours else
            f"with decode CUDA graphs ({ours['graph_replays']} steps replayed one)" if ours.get("graph_replays") else
            "asked for decode CUDA graphs but replayed none (eager)")
    lines = [f"# Offline throughput — {record['device']}", "",
             f"{record['preset']} dummy weights, {record['dtype']}, {record['num_prompts']} prompts (mean "
             f"{record['prompt_lengths']['mean']:.0f} tokens, ShareGPT lengths x{record['prompt_lengths']['scale']}), "
             f"{record['output_len']} output tokens each; fluidserve {mode}.", "",
             "| system | output tok/s | req/s | fluidserve speed-up |", "|---|---:|---:|---:|"]
    for k, v in results.items():
        if "error" in v:
            lines.append(f"| {k} | error: {v['error'][:80]} | | |")
        else:
            sp = "1.00x" if k == "fluidserve" else f"{ratios[k]:.2f}x" if k in ratios else "(below)"
            lines.append(f"| {k} | {v['tokens_per_s']:.1f} | {v['requests_per_s']:.2f} | {sp} |")
    async_run = results.get("fluidserve_async", {})
    if "tokens_per_s" in async_run:
        over = ", ".join(f"{v:.2f}x {k}" for k, v in record["async_speedup"].items())
        line = f"fluidserve with async scheduling: {over}"
        if "steps_launched_ahead" in async_run:  # older result files lack the two checks
            line += (f"; {async_run['steps_launched_ahead']} of {async_run['steps']} steps queued ahead; "
                     f"{async_run['same_tokens_as_fluidserve']:.0%} of prompts gave the synchronous run's tokens")
        lines += ["", line + "."]
    piece_run = results.get("fluidserve_piecewise", {})
    if "tokens_per_s" in piece_run:
        over = ", ".join(f"{v:.2f}x {k}" for k, v in record["piecewise_speedup"].items())
        replayed = (f"{piece_run['piecewise_replays']} of {piece_run['steps']} steps replayed piecewise"
                    if piece_run.get("piecewise_replays") is not None else "no piecewise graphs on this device")
        lines += ["", f"fluidserve with piecewise graphs: {over}; {replayed}; "
                      f"{piece_run['same_tokens_as_fluidserve']:.0%} of prompts gave the synchronous run's tokens."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
