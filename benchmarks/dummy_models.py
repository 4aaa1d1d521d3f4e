"""Model shapes the benchmarks share, built as a config + byte tokenizer only:
every system under test loads random (dummy) weights of the same shape.

Benchmarks run as scripts (``python benchmarks/x.py``), so this directory is on
``sys.path`` and they import this module by its bare name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

PRESETS = {
    # The tests' tiny model: compute is negligible, so a step is nearly all overhead.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048),
    # Small enough for 2 CPU cores; vocab kept realistic so the LM head costs what it should.
    "cpu-small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=4096),
    # Many thin layers: a long offline step a layer safepoint can cut finely (benchmarks/coserving.py).
    "cpu-deep": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=16, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=4096),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0),
}

# The decode paths the engine offers, as engine settings: ``eager`` launches
# every kernel from Python each step; ``graphs`` replays a decode CUDA graph
# captured at start-up; ``graphs-async`` (the default on CUDA) also queues
# each decode step before the previous step's tokens are read
# (--async-scheduling), so the host's work hides behind the device's.
# Up to 4 drafts a step from 2- to 4-grams (benchmarks/speculative.py's setting).
NGRAM_DRAFTS = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
DECODE_MODES = {
    "eager": dict(enforce_eager=True, async_scheduling=False),
    "graphs": dict(enforce_eager=False, async_scheduling=False),
    "graphs-async": dict(enforce_eager=False, async_scheduling=True),
    # The eager step with one of its host savings undone, to time each:
    # cuBLAS linears and separate norms (no batch-1 row kernels), and
    # Triton's own launch path (no relaunching, kernels/launch.py).
    "eager-cublas": dict(enforce_eager=True, async_scheduling=False, row_kernels=False),
    "eager-no-relaunch": dict(enforce_eager=True, async_scheduling=False, relaunch=False),
    # Decode graphs whose split-K pieces merge inside the attention launch
    # (kernels/paged_attention.py, Tiles.fused_merge): a graph's plan merges
    # every row, so this drops a launch a layer from every decode step.
    "graphs-fused-merge": dict(enforce_eager=False, async_scheduling=False, fused_merge=True),
    # The default (graphs, async scheduling) without the direct graphs a
    # step that splits no row replays (engine/cuda_graphs.py): every step
    # then merges, one launch a layer more.
    "graphs-async-always-merge": dict(enforce_eager=False, async_scheduling=True, direct_plans=False),
    # The default, and eager, with the batch-1 GEMVs launched as programmatic
    # dependents (kernels/gemv.py, FLUIDSERVE_GEMV_PDL; off by default): each
    # starts while the launch before it drains; "l2", each program first
    # fetches more of its rows into L2; and with the attention letting the o
    # projection start as it begins (Tiles.launch_dependents).
    "graphs-async-pdl": dict(enforce_eager=False, async_scheduling=True, gemv_pdl="on"),
    "graphs-async-pdl-l2": dict(enforce_eager=False, async_scheduling=True, gemv_pdl="l2"),
    "graphs-async-pdl-l2-attention": dict(enforce_eager=False, async_scheduling=True, gemv_pdl="l2",
                                          launch_dependents=True),
    "eager-pdl": dict(enforce_eager=True, async_scheduling=False, gemv_pdl="on"),
    # N-gram drafts (--speculative-config, the adaptive policy), whose verifying
    # steps decode graphs leave to the eager path: synchronous steps; beside
    # async scheduling, where steps that carry no drafts go ahead; and with
    # the verifying steps as piecewise graphs. A dummy model's greedy text
    # soon repeats itself, so drafts stand (the record counts them).
    "graphs-drafts": dict(enforce_eager=False, async_scheduling=False, speculative_config=NGRAM_DRAFTS),
    "graphs-async-drafts": dict(enforce_eager=False, async_scheduling=True, speculative_config=NGRAM_DRAFTS),
    "graphs-async-drafts-piecewise": dict(enforce_eager=False, async_scheduling=True,
                                          speculative_config=NGRAM_DRAFTS, piecewise_graphs=True),
}
# Settings of DECODE_MODES that are attention tiles (kernels/paged_attention.py).
TILE_SETTINGS = ("fused_merge", "launch_dependents")
# The engine's own decode paths (the other modes: eager with a switch off).
ENGINE_DECODE_MODES = ("eager", "graphs", "graphs-async")


@contextmanager
def decode_mode(mode: str) -> Iterator[dict]:
    """The engine settings of ``mode``, with the process switches it names
    (``row_kernels``: kernels/ops.py; ``relaunch``: kernels/launch.py;
    ``TILE_SETTINGS``: the attention tiles; ``direct_plans``:
    engine/cuda_graphs.py; ``gemv_pdl``: kernels/gemv.py) set while the
    block runs."""
    from fluidserve.engine import cuda_graphs
    from fluidserve.kernels import gemv, launch, ops
    from fluidserve.kernels import paged_attention as pa

    settings = dict(DECODE_MODES[mode])
    with ExitStack() as undo:
        for name, switch in (("row_kernels", ops.set_eager_row_kernels), ("relaunch", launch.set_enabled),
                             ("direct_plans", cuda_graphs.set_direct_plans),
                             ("gemv_pdl", gemv.set_dependent_launch)):
            if name in settings:
                undo.callback(switch, switch(settings.pop(name)))
        tiles = {name: settings.pop(name) for name in TILE_SETTINGS if name in settings}
        if tiles:
            undo.enter_context(pa.tiles(**tiles))
        yield settings


def build_model_dir(preset: str, root: Path) -> Path:
    """Write the preset's Llama config and the byte tokenizer to ``root``."""
    from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

    config = tiny_config("llama", **PRESETS[preset])
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(root)
    save_byte_tokenizer(root)
    return root


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def run_record(script: str, device: str, **fields) -> dict | None:
    """The head of a GPU benchmark's record (the device as torch names it,
    time, torch) with ``fields``; None, after saying why on stderr, where
    CUDA is asked for and torch sees none."""
    import sys
    import time

    if device == "cuda" and not torch.cuda.is_available():
        print(f"{script}: torch sees no CUDA device; use --device cpu", file=sys.stderr)
        return None
    return dict(device=device_name(device), time=time.strftime("%Y-%m-%d %H:%M:%S"), torch=torch.__version__,
                **fields)  # fmt: skip


def device_slug(name: str) -> str:
    """A device name as result files carry it: ``NVIDIA H100 80GB HBM3`` ->
    ``nvidia_h100_80gb_hbm3`` (as benchmarks/kernel_bench.py and gpu_check.sh
    name theirs)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def save_results(stem: Path, record: dict, text: str) -> None:
    """Print a benchmark's markdown and write it beside its JSON record
    (``stem``.md, ``stem``.json)."""
    print(text)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
    stem.with_suffix(".md").write_text(text)


def kernel_rows(kernel, shapes, rounds: int) -> list[dict]:
    """``kernel(*shape, dtype, rounds)`` for every shape in fp32 and bf16, each
    row printed as it comes (the CPU kernel benchmarks' sweep)."""
    rows = []
    with torch.inference_mode():
        for shape in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                rows.append(kernel(*shape, dtype, rounds))
                print(rows[-1], flush=True)
    return rows


def cpu_kernel_record(name: str, kernel, shapes, rounds: int, engine: Callable[[], dict], **fields) -> dict:
    """A CPU kernel benchmark run on one torch thread: ``kernel`` over
    ``shapes`` (``kernel_rows``), then ``engine()``; its record, with the
    load average before and after."""
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    rows = kernel_rows(kernel, shapes, rounds)
    eng = engine()
    print(eng, flush=True)
    return {"benchmark": name, "device": device_name("cpu"), "torch": torch.__version__, **fields,
            "command": " ".join(["python", *sys.argv]), "load_average_start": load_start,
            "load_average_end": os.getloadavg(), "kernel": rows, "engine": eng}


def alternating_calls(calls: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, float], dict]:
    """Each call's best thread CPU time (ms) over ``rounds``, the calls taking
    turns (in reverse order every other round), and each one's last result."""
    names = list(calls)
    ms: dict[str, list[float]] = {name: [] for name in names}
    outs = {}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            c0 = time.thread_time()
            outs[name] = calls[name]()
            ms[name].append((time.thread_time() - c0) * 1e3)
    return {name: min(v) for name, v in ms.items()}, outs


def alternating_steps(engine, module, attr: str, ways: dict[str, object], steps: int) -> dict[str, float]:
    """The median wall time (ms) of ``engine.step()`` under each of ``ways``
    (a value for ``module.attr``), the ways taking turns step by step; the
    attribute is restored after."""
    names = list(ways)
    kept = getattr(module, attr)
    ms: dict[str, list[float]] = {name: [] for name in names}
    try:
        for s in range(steps):
            name = names[s % len(names)]
            setattr(module, attr, ways[name])
            t0 = time.perf_counter()
            engine.step()
            ms[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        setattr(module, attr, kept)
    return {name: statistics.median(v) for name, v in ms.items()}


def model_choice(args: argparse.Namespace) -> tuple[str, str, str]:
    """(device, preset, dtype) from ``add_model_args``'s flags, their
    defaults filled in for the device torch sees."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = args.preset or ("cpu-small" if device == "cpu" else "llama3-8b")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    return device, preset, dtype


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags every benchmark takes to choose its model and device."""
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model shape (default: cpu-small on CPU, llama3-8b on CUDA)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
