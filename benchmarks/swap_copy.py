"""What a KV swap costs on the device: the worker's own copy path
(``CacheEngine.swap``) against a plain pinned copy of the same bytes, and a
decode step's time with a swap running beside it on the copy stream against
the same step alone.

KV of a ``--preset``-shaped model (Llama-3-8B by default: 32 layers, 8 KV
heads of 128, bf16, blocks of 16 tokens: 2 MiB a block over all layers):

* bandwidth: ``--blocks`` blocks out (device to host) and back in, laid out
  as runs of ``--run`` adjacent blocks (a request's blocks are adjacent when
  the allocator could keep them so; 1 = fully scattered), through
  ``CacheEngine.swap``, against one ``copy_`` of a pinned buffer of the same
  size each way;
* interference: a stand-in decode step (the preset's four GEMMs per layer at
  batch ``--batch``, the weights read once per layer, as a decode step reads
  them) timed on the compute stream alone, then with the swap-out and
  swap-in of ``--blocks`` blocks issued on the copy stream just before it.

Targets: the swap path at >= 80% of the pinned copy's bandwidth;
a step with a concurrent swap <= 1.1x the step alone. On the CPU (``--device
cpu``, small shapes) the same code runs with synchronous copies and no
overlap: a check that it works, not a measurement of anything a GPU does.

Writes ``swap_copy_<device>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import PRESETS, device_slug, run_record  # noqa: E402

from fluidserve.engine.cache_engine import CacheEngine  # noqa: E402

BLOCK_SIZE = 16


class Timer:
    """Seconds between two points of the current stream (CUDA events), or of
    the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Timer:
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.seconds = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            fn()
        times.append(t.elapsed())
        sync(device)
    return statistics.median(times)


def block_pairs(blocks: int, run: int, offset: int = 0) -> list[tuple[int, int]]:
    """``blocks`` (source, destination) pairs in runs of ``run`` adjacent
    blocks with a one-block gap between runs on the source side, so that no
    two runs coalesce."""
    src = [offset + (i // run) * (run + 1) + i % run for i in range(blocks)]
    return list(zip(src, range(blocks)))


def pinned_copy_s(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """One copy of ``nbytes`` each way between a pinned host buffer and the device."""
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.random_(0, 255)
    dev.random_(0, 255)
    return dict(h2d=median_s(lambda: dev.copy_(host, non_blocking=True), device, repeats),
                d2h=median_s(lambda: host.copy_(dev, non_blocking=True), device, repeats))  # fmt: skip


def decode_step(cfg: dict, batch: int, device: torch.device, dtype: torch.dtype):
    """A decode step's weight traffic: per layer the fused QKV, O, fused
    gate/up and down GEMMs at ``batch`` rows (one set of weights reused for
    every layer, rotated over two so that no layer reads them from cache)."""
    h, inter, hq, hkv, d = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads", "head_dim"))
    shapes = [(h, (hq + 2 * hkv) * d), (hq * d, h), (h, 2 * inter), (inter, h)]
    sets = [[torch.randn(k, n, device=device, dtype=dtype) / k**0.5 for k, n in shapes] for _ in range(2)]
    inputs = [torch.randn(batch, k, device=device, dtype=dtype) for k, _ in shapes]

    def step() -> None:
        for layer in range(cfg["num_hidden_layers"]):
            for x, w in zip(inputs, sets[layer % 2]):
                x @ w

    return step, sum(w.numel() * w.element_size() for w in sets[0]) * cfg["num_hidden_layers"]


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = PRESETS[args.preset]
    layers, hkv, d = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    span = args.blocks + args.blocks // args.run + 1  # source blocks the runs cover
    cache = CacheEngine(layers, BLOCK_SIZE, hkv, d, dtype, device, num_blocks=2 * span, num_host_blocks=span)
    for k, v in cache.device_caches:
        k.normal_()
        v.normal_()
    block_bytes = 2 * layers * BLOCK_SIZE * hkv * d * torch.empty((), dtype=dtype).element_size()
    nbytes = args.blocks * block_bytes
    out_pairs = block_pairs(args.blocks, args.run)  # device blocks -> host 0..blocks-1
    in_pairs = [(h, dev + span) for dev, h in block_pairs(args.blocks, args.run)]  # host -> device, past the source

    def swap(out: list, into: list):
        def moves() -> None:
            # Issued on the copy stream; the next call makes the compute
            # stream (the timer's) wait for them, as the worker's next step does.
            cache.swap(out, into, wait=False)
            cache.swap([], [], wait=False)

        return moves

    swap_out_s = median_s(swap(out_pairs, []), device, args.repeats)
    swap_in_s = median_s(swap([], in_pairs), device, args.repeats)
    pinned = pinned_copy_s(nbytes, device, args.repeats)
    step, weight_bytes = decode_step(cfg, args.batch, device, dtype)
    alone_s = median_s(step, device, args.repeats)

    def step_beside_swap() -> None:
        cache.swap(out_pairs, in_pairs, wait=False)  # on the copy stream, as the worker issues a step's moves
        with Timer(device) as t:
            step()
        beside.append(t.elapsed())
        cache.swap([], [], wait=False)  # the next step waits for the copies, as in the worker

    beside: list[float] = []
    for _ in range(args.repeats + 1):
        step_beside_swap()
        sync(device)
    beside_s = statistics.median(beside[1:])
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    return dict(
        preset=args.preset, dtype=str(dtype).replace("torch.", ""), blocks=args.blocks, run=args.run,
        block_mib=block_bytes / 2**20, bytes=nbytes, batch=args.batch,
        swap_out_gb_s=gbs(swap_out_s), swap_in_gb_s=gbs(swap_in_s),
        pinned_d2h_gb_s=gbs(pinned["d2h"]), pinned_h2d_gb_s=gbs(pinned["h2d"]),
        swap_out_vs_pinned=pinned["d2h"] / swap_out_s, swap_in_vs_pinned=pinned["h2d"] / swap_in_s,
        step_alone_ms=alone_s * 1e3, step_beside_swap_ms=beside_s * 1e3, step_slowdown=beside_s / alone_s,
        step_weight_gb=weight_bytes / 1e9,
    )  # fmt: skip


def markdown(record: dict) -> str:
    rows = record["runs"]
    lines = [f"# KV swap on {record['device']}", "",
             f"{rows[0]['preset']}-shaped KV ({rows[0]['dtype']}, {rows[0]['block_mib']:.2f} MiB a block over all "
             f"layers), {rows[0]['blocks']} blocks each way through `CacheEngine.swap`, against one pinned copy "
             f"of the same bytes; the step is the preset's GEMMs of a decode at batch {rows[0]['batch']} "
             f"({rows[0]['step_weight_gb']:.1f} GB of weights), alone and with the swap on the copy stream "
             "beside it. Targets: swap >= 80% of the pinned copy; step beside a swap <= 1.1x.", "",
             "| blocks per run | out GB/s | in GB/s | pinned D2H GB/s | pinned H2D GB/s | out / pinned | "
             "in / pinned | step alone ms | step beside swap ms | slowdown |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['run']} | {r['swap_out_gb_s']:.1f} | {r['swap_in_gb_s']:.1f} | {r['pinned_d2h_gb_s']:.1f} "
                     f"| {r['pinned_h2d_gb_s']:.1f} | {r['swap_out_vs_pinned']:.0%} | {r['swap_in_vs_pinned']:.0%} | "
                     f"{r['step_alone_ms']:.2f} | {r['step_beside_swap_ms']:.2f} | {r['step_slowdown']:.2f}x |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--blocks", type=int, default=256, help="blocks moved each way (2 MiB each for llama3-8b)")
    p.add_argument("--runs", type=int, nargs="+", default=[64, 1],
                   help="adjacent blocks per run, one measurement each (1: fully scattered)")
    p.add_argument("--batch", type=int, default=64, help="rows of the stand-in decode step")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = run_record("swap_copy", args.device, runs=[])
    if record is None:
        return 1
    stem = args.out / f"swap_copy_{device_slug(record['device'])}"
    args.out.mkdir(parents=True, exist_ok=True)
    for run_len in args.runs:
        args.run = run_len
        record["runs"].append(run(args))
        if args.device == "cuda":
            torch.cuda.empty_cache()
        stem.with_suffix(".json").write_text(json.dumps(record, indent=2))
        stem.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
