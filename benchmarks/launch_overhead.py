"""Host time of a Triton launch: Triton's JIT path against kernels/launch.py's
relaunch, side by side in one process.

``--device cpu`` (the default; no GPU needed) runs both paths of every kernel
the engine wraps up to the launcher, with Triton's driver stood in for by
one that returns device 0 and stream 0 and a kept kernel whose launcher
returns at once: what is timed is the Python each path runs before the
launcher, which is the part relaunching removes (the launcher itself and
the device are the same on both paths). The relaunch includes
``Relaunch.launch``'s test for a launch hook, which decides the path on a
GPU (Triton 3.5 on keeps an empty hook chain there, never None: a test for
None sent every launch down the JIT path). Arguments are of each kernel's
arity and kinds (tensors for pointers, ints, floats), not a real step's.

A third path per kernel is the launcher ``Relaunch.kept`` hands a call
site whose arguments change only in tensors of the same dtype and
alignment (a prepared GEMV's rows, a step's caches): the same launch,
without a key.

``--device cuda`` times real launches of three of the engine's kernels
through their wrappers (kernels/gemv.py, fused_norm.py, activation.py; the
GEMV also as a ``PreparedGemv``) on tiny shapes, so the host, not the GPU,
sets the pace: the whole per-call host cost, launcher included, with
relaunching on and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import triton
from dummy_models import device_name

from fluidserve.kernels import activation, cache_ops, fused_norm, gemv, launch, paged_attention, rope_cache

MODULES = (gemv, fused_norm, rope_cache, activation, paged_attention, cache_ops)
# Launches per decoder layer of a batch-1 eager step on a GPU (op_counts:
# the six-launch layer; benchmarks/results/op_counts-batch1-fusions.md).
BATCH1_LAYER = {"_GEMV": 4, "_ROPE_AND_CACHE": 1, "_PAGED_ATTENTION": 1}


class _Driver:
    """Triton's driver as far as JITFunction.run and the relaunch ask it."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class _Kept:
    """A compiled kernel whose launcher returns at once."""

    function = 0
    packed_metadata = ()

    @staticmethod
    def run(*args) -> None:
        return None

    def launch_metadata(self, grid, stream, *args) -> None:
        return None


def synthetic_call(relaunch: launch.Relaunch) -> tuple[list, dict]:
    """Arguments of the kernel's arity and kinds: a distinct aligned tensor
    per pointer, 4096 for an int, 0.5 for a float; 16 for a constexpr."""
    args = []
    for p in relaunch.fn.params:
        if p.is_constexpr:
            continue
        if p.name.endswith("_ptr"):
            args.append(torch.empty(64, dtype=torch.bfloat16))
        else:
            args.append(0.5 if p.name in ("eps", "qk_scale") else 4096)
    kwargs = {p.name: 16 for p in relaunch.fn.params if p.is_constexpr}
    kwargs["num_warps"] = 4
    return args, kwargs


def _per_call_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` calls, in us."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def bench_cpu(calls: int, repeats: int) -> list[dict]:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Driver())
    rows = []
    for module in MODULES:
        for name, wrapped in vars(module).items():
            if not isinstance(wrapped, launch.Relaunch):
                continue
            fn = wrapped.fn
            if not isinstance(fn, JITFunction):
                raise SystemExit("run without TRITON_INTERPRET: the JIT path is what is timed")
            relaunch = launch.Relaunch(fn)
            args, kwargs = synthetic_call(relaunch)
            kernel_cache = fn.device_caches[0][0]
            # Triton's first call "compiles" to the kept kernel, under Triton's own key.
            fn._do_compile = lambda key, *a, cache=kernel_cache, **k: cache.setdefault(key, _Kept())
            grid = (8, 1)
            jit = fn[grid]
            relaunch.relaunch(grid, args, kwargs)  # the miss: through Triton, which returns the kept kernel
            jit(*args, **kwargs)
            assert relaunch.cached() == 1 and len(kernel_cache) == 1  # both paths hit from here on
            # Relaunch.launch's choice, less its device test (these tensors are on the CPU): a launch
            # hook Triton reports as set sends the call down Triton's path, as on a GPU.
            if launch.launch_hooks_set():
                raise SystemExit("a Triton launch hook is set: every launch would take Triton's path")

            def relaunched() -> Any:
                return jit(*args, **kwargs) if launch.launch_hooks_set() else relaunch.relaunch(grid, args, kwargs)

            # A site's kept launcher (Relaunch.kept, past its device test), as a
            # prepared GEMV launches: the call's arguments as one tuple, no key.
            launcher = relaunch._keep(grid, args, kwargs)
            assert launcher is not None
            site_args = tuple(args)

            jit_us, re_us, kept_us = [], [], []
            for _ in range(repeats):  # alternate the three paths
                jit_us.append(_per_call_us(lambda: jit(*args, **kwargs), calls, 1))
                re_us.append(_per_call_us(relaunched, calls, 1))
                kept_us.append(_per_call_us(lambda: launcher(site_args), calls, 1))
            rows.append({"kernel": name, "runtime_args": len(args), "constexprs": len(kwargs) - 1,
                         "jit_us": statistics.median(jit_us), "relaunch_us": statistics.median(re_us),
                         "kept_us": statistics.median(kept_us)})  # fmt: skip
    return rows


def bench_cuda(calls: int, repeats: int) -> list[dict]:
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(1, 256, dtype=dtype, device=dev)
    w = torch.randn(256, 256, dtype=dtype, device=dev)
    gate_up = torch.randn(8, 512, dtype=dtype, device=dev)
    norm_w = torch.ones(256, dtype=dtype, device=dev)
    prepared, row_out = gemv.PreparedGemv(w), torch.empty(1, 256, dtype=dtype, device=dev)
    cases = {
        "gemv.launch": lambda: gemv.launch(x, w, None, None),
        "gemv.PreparedGemv": lambda: prepared(x, row_out),
        "fused_norm.rms_norm": lambda: fused_norm.rms_norm(x.clone(), norm_w, 1e-5),
        "activation.silu_and_mul": lambda: activation.silu_and_mul(gate_up),
    }
    rows = []
    for name, call in cases.items():
        timings: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for on in (False, True):
                launch.set_enabled(on)
                call()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                host = (time.perf_counter() - t0) / calls * 1e6  # before the device catches up
                torch.cuda.synchronize()
                timings[on].append(host)
        launch.set_enabled(True)
        rows.append({"kernel": name, "jit_us": statistics.median(timings[False]),
                     "relaunch_us": statistics.median(timings[True])})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="", help="suffix of the results' file name (e.g. -triton3.6)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        rows = bench_cuda(args.calls, args.repeats)
        what = ("real launches through the kernel wrappers (tiny shapes: the host sets the pace), host time per "
                "call from the first call to the last being issued")
    else:
        rows = bench_cpu(args.calls, args.repeats)
        what = ("each path up to the launcher, with Triton's driver and the kept kernel's launcher stood in for "
                "(the host work relaunching removes; the launcher and the device are the same on both paths); "
                "arguments of each kernel's arity and kinds")
    device = device_name(args.device)
    cpu = args.device == "cpu"
    lines = [f"# Host time of a Triton launch on {device}: Triton's JIT path against a relaunch", "",
             f"{what}; median of {args.repeats} alternating runs of {args.calls} calls each, triton "
             f"{triton.__version__}, torch {torch.__version__}.", ""]
    if cpu:
        lines += ["kept launcher: the launcher `Relaunch.kept` hands a call site whose arguments change only in "
                  "tensors of the same dtype and alignment (a prepared GEMV's rows, a step's caches): no key is "
                  "worked out.", "",
                  "| kernel | JIT path us | relaunch us | kept launcher us | JIT / relaunch | relaunch / kept |",
                  "|---|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| kernel | JIT path us | relaunch us | JIT / relaunch |", "|---|---:|---:|---:|"]
    for r in rows:
        kept = f" {r['kept_us']:.1f} |" if cpu else ""
        ratio = f" {r['relaunch_us'] / r['kept_us']:.1f}x |" if cpu else ""
        lines.append(f"| {r['kernel']} | {r['jit_us']:.1f} | {r['relaunch_us']:.1f} |{kept} "
                     f"{r['jit_us'] / r['relaunch_us']:.1f}x |{ratio}")
    summary = {}
    if cpu:
        by = {r["kernel"]: r for r in rows}
        jit = sum(n * by[k]["jit_us"] for k, n in BATCH1_LAYER.items())
        re = sum(n * by[k]["relaunch_us"] for k, n in BATCH1_LAYER.items())
        # The row layer's four GEMVs are prepared, its step's rope and attention laid out once: every
        # launch from its call site's kept launcher.
        kept = sum(n * by[k]["kept_us"] for k, n in BATCH1_LAYER.items())
        summary = {"batch1_layer_jit_us": jit, "batch1_layer_relaunch_us": re, "batch1_layer_kept_us": kept,
                   "llama3_8b_token_saving_ms": 32 * (jit - re) / 1000,
                   "llama3_8b_token_kept_saving_ms": 32 * (re - kept) / 1000}  # fmt: skip
        launches = ", ".join(f"{n} x {k}" for k, n in BATCH1_LAYER.items())
        lines += ["", f"A batch-1 eager decoder layer's six launches ({launches}): {jit:.0f} us of this work on "
                  f"the JIT path, {re:.0f} us relaunched; over Llama-3-8B's 32 layers, "
                  f"{summary['llama3_8b_token_saving_ms']:.2f} ms less host time per token on the CPU above. "
                  f"With all six through their call sites' kept launchers (the row layer's prepared GEMVs, the "
                  f"step's rope and attention): {kept:.0f} us, {summary['llama3_8b_token_kept_saving_ms']:.2f} ms "
                  "less a token than relaunched."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"launch_overhead-{device.lower().replace(' ', '_')}" if args.device == "cuda" else "launch_overhead"
    stem += args.tag
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/launch_overhead.py", *given])
    (out / f"{stem}.json").write_text(json.dumps({"device": device, "triton": triton.__version__, "command": command,
                                                  "calls": args.calls, "repeats": args.repeats, "rows": rows,
                                                  **summary}, indent=2))  # fmt: skip
    (out / f"{stem}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
