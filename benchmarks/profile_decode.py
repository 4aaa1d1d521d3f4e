"""Where a decode step's time goes, read off torch's profiler.

Batch-``--batch`` greedy decode of a ``--preset``-shaped dummy model through
the engine, once per decode path (eager, then decode CUDA graphs), each after
a warm-up run. One profiled ``generate`` per path gives, per decode token:

* wall time, and the time the GPU spent inside kernels: their difference is
  the time the device sat idle waiting for the host (launches, Python);
* kernel launches and graph launches the host issued;
* the kernels that took the most GPU time, and the host ops that took the
  most CPU time of their own.

Prefill is in the profiled run too (one step of ``--output-len``); with the
default 64 tokens it weighs a few percent. On a machine without CUDA it runs
on the CPU lane (``--device cpu``, the tiny preset is the sensible one) and
reports host time only.

Writes ``profile_decode_<device>.json`` and ``.md`` to ``--out`` (with
``-<modes>`` after the device where fewer than both modes ran).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import (  # noqa: E402
    DECODE_MODES, ENGINE_DECODE_MODES, PRESETS, build_model_dir, decode_mode, device_slug, run_record,
)

# Host calls that put work on the GPU: one per kernel, one per graph replay.
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def _device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def _is_kernel(evt) -> bool:
    kind = getattr(evt, "device_type", None)
    return kind is not None and kind != torch.autograd.DeviceType.CPU


def summarize(prof, tokens: int, wall_s: float, top: int) -> dict:
    """Per-token figures and the top kernels and host ops of one profile."""
    events = prof.events()
    kernel_us = sum(_device_time_us(e) for e in events if _is_kernel(e))
    names = Counter(e.name for e in events if not _is_kernel(e))
    kernels = Counter()
    for e in events:
        if _is_kernel(e):
            kernels[e.name] += _device_time_us(e)
    host_ops = sorted((a for a in prof.key_averages() if a.self_cpu_time_total > 0),
                      key=lambda a: a.self_cpu_time_total, reverse=True)  # fmt: skip
    ms_per_token = 1e-3 / tokens  # profiler times are in microseconds
    return dict(
        tokens=tokens,
        wall_ms_per_token=wall_s * 1e3 / tokens,
        kernel_ms_per_token=kernel_us * ms_per_token,
        kernel_launches_per_token=sum(names[n] for n in KERNEL_LAUNCHES) / tokens,
        graph_launches_per_token=sum(names[n] for n in GRAPH_LAUNCHES) / tokens,
        top_kernels=[dict(name=n[:120], ms_per_token=us * ms_per_token) for n, us in kernels.most_common(top)],
        top_host_ops=[dict(name=a.key[:120], calls_per_token=a.count / tokens,
                           self_cpu_ms_per_token=a.self_cpu_time_total * ms_per_token)
                      for a in host_ops[:top]],  # fmt: skip
    )


def profile_mode(model_dir: Path, args: argparse.Namespace, settings: dict) -> dict:
    from fluidserve.engine import LLM, SamplingParams

    on_gpu = args.device == "cuda"
    llm = LLM(model=str(model_dir), load_format="dummy", device=args.device,
              dtype="bfloat16" if on_gpu else "float32", max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.output_len + 16, swap_space=0,
              **settings)  # fmt: skip
    prompts = [[5 + (37 * i + 11 * b) % 250 for i in range(args.prompt_len)] for b in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    python_top = []
    try:
        llm.generate(prompts, params)  # warm-up: compiles, captures, fills the allocator
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            sync()
            wall_s = time.perf_counter() - t0
        if args.python_top:
            python_top = python_profile(lambda: (llm.generate(prompts, params), sync()), args)
    finally:
        llm.engine.shutdown()
        llm = None
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    return {**summarize(prof, args.output_len, wall_s, args.top), "python_top": python_top}


def python_profile(run, args: argparse.Namespace) -> list[dict]:
    """The Python functions that hold the host longest, by their own time,
    over one more ``generate`` under cProfile (which slows every call, so
    shares count, not absolute times)."""
    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, ncalls, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values())
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.python_top]
    root = str(Path(__file__).resolve().parents[1]) + "/"
    def where(file: str) -> str:
        return file.replace(root, "").split("site-packages/")[-1]

    return [dict(function=f"{where(file)}:{line}({name})", calls_per_token=v[1] / args.output_len,
                 own_share=v[2] / total, cumulative_share=v[3] / total)
            for (file, line, name), v in rows]  # fmt: skip


def markdown(record: dict) -> str:
    lines = [f"# Where a decode step's time goes: {record['device']}", "",
             f"{record['preset']}-shaped dummy model, batch {record['batch']}, prompt {record['prompt_len']}, "
             f"{record['output_len']} greedy tokens in one profiled `generate` after a warm-up (prefill included). "
             "GPU idle = wall - kernel time: the device waiting for the host.", "",
             "| mode | wall ms/token | kernel ms/token | GPU idle | kernel launches/token | graph launches/token |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for mode, r in record["modes"].items():
        if "error" in r:
            lines.append(f"| {mode} | error: {r['error'][:120]} | | | | |")
            continue
        idle = f"{1 - r['kernel_ms_per_token'] / r['wall_ms_per_token']:.0%}" if r["kernel_ms_per_token"] else "-"
        lines.append(f"| {mode} | {r['wall_ms_per_token']:.2f} | {r['kernel_ms_per_token']:.2f} | {idle} | "
                     f"{r['kernel_launches_per_token']:.0f} | {r['graph_launches_per_token']:.1f} |")
    for mode, r in record["modes"].items():
        if "error" in r:
            continue
        if r["top_kernels"]:
            lines += ["", f"## {mode}: kernels by GPU time", "", "| kernel | ms/token |", "|---|---:|"]
            lines += [f"| `{k['name']}` | {k['ms_per_token']:.3f} |" for k in r["top_kernels"]]
        lines += ["", f"## {mode}: host ops by their own CPU time", "",
                  "| op | calls/token | self CPU ms/token |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| `{o['name']}` | {o['calls_per_token']:.1f} | {o['self_cpu_ms_per_token']:.3f} |"
                  for o in r["top_host_ops"]]  # fmt: skip
        if r.get("python_top"):
            lines += ["", f"## {mode}: Python functions by their own time (cProfile, one more run)", "",
                      "| function | calls/token | own share | cumulative share |", "|---|---:|---:|---:|"]  # fmt: skip
            lines += [f"| `{f['function']}` | {f['calls_per_token']:.1f} | {f['own_share']:.1%} | "
                      f"{f['cumulative_share']:.1%} |" for f in r["python_top"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=list(ENGINE_DECODE_MODES), choices=list(DECODE_MODES))
    p.add_argument("--top", type=int, default=15, help="kernels and host ops listed per mode")
    p.add_argument("--python-top", type=int, default=30,
                   help="Python functions listed per mode from one more run under cProfile (0: none)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run_record("profile_decode", args.device, preset=args.preset, batch=args.batch,
                        prompt_len=args.prompt_len, output_len=args.output_len, modes={})  # fmt: skip
    if record is None:
        return 1
    name = record["device"]
    modes = [m for m in args.modes if not m.startswith("graphs") or args.device == "cuda"]  # CUDA graphs: CUDA alone
    suffix = "" if modes == list(ENGINE_DECODE_MODES) else "-" + "-".join(modes)
    stem = args.out / f"profile_decode_{device_slug(name)}{suffix}"
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as root:
        build_model_dir(args.preset, Path(root))
        for mode in modes:
            try:
                with decode_mode(mode) as settings:
                    record["modes"][mode] = profile_mode(Path(root), args, settings)
            except Exception as exc:  # the other mode's profile is still worth having
                failed = True
                record["modes"][mode] = dict(error=f"{type(exc).__name__}: {exc}"[:500])
            # After each mode, so that a run cut off later keeps what it finished.
            stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
            stem.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {stem}.json and {stem}.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
