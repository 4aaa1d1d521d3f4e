"""What Python's cyclic garbage collector costs the engine's steps, with the
heap as it was before the run frozen (``engine/heap.py``, what ``serve``,
``run-batch`` and ``LLM.generate`` do) and without; and, frozen, with the
young-generation threshold left at Python's default instead of raised.

Streams N requests through ``engine.step`` (every step's outputs read, as
the server does), in one process, the three ways, alternating; counts the
collections of each generation with ``gc.callbacks`` and times them.

    python benchmarks/gc_pauses.py                    # tiny model, 1024 requests
    python benchmarks/gc_pauses.py --requests 256

Writes benchmarks/results/gc_pauses.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import tempfile
import time
from pathlib import Path

from dummy_models import device_name

from fluidserve.engine import LLM, SamplingParams, heap
from fluidserve.engine.engine import next_request_id
from fluidserve.engine.tiny_model import build_tiny_model

# (name, frozen, young threshold while frozen: None for the engine's own)
WAYS = (("not frozen", False, None), ("frozen, default young threshold", True, 0),
        ("frozen (the engine's)", True, None))


class CollectionClock:
    """Collections per generation and their time, from gc.callbacks."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def run(llm: LLM, requests: int, output_len: int, way: tuple[str, bool, int | None]) -> dict:
    name, frozen, young = way
    engine = llm.engine
    engines_young = heap.YOUNG_THRESHOLD
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    clock = CollectionClock()
    steps: list[float] = []
    gc.collect()  # each run starts from the same heap, whatever the last one left
    gc.callbacks.append(clock)
    if young is not None:
        heap.YOUNG_THRESHOLD = young  # frozen_heap keeps the higher of it and the current threshold
    try:
        with heap.frozen_heap() if frozen else contextlib.nullcontext():
            for i in range(requests):
                engine.add_request(next_request_id("gc"), [(i * 7 + j) % 250 for j in range(32)], params)
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                for out in engine.step():
                    for co in out.outputs:
                        len(co.text_delta)
                steps.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(clock)
        heap.YOUNG_THRESHOLD = engines_young
    return {"way": name, "frozen": frozen, "steps": len(steps), "wall_ms_per_step": sum(steps) / len(steps) * 1e3,
            "slowest_step_ms": max(steps) * 1e3, "collections": clock.count,
            "collection_ms": [s * 1e3 for s in clock.seconds]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    model = build_tiny_model(Path(tempfile.mkdtemp()), "llama")
    blocks = args.requests * -(-(32 + args.output_len) // 16) + 16
    llm = LLM(model=str(model), device="cpu", num_kv_blocks=blocks, max_model_len=512, max_num_seqs=args.requests)
    rows = [run(llm, args.requests, args.output_len, way) for _ in range(args.rounds) for way in WAYS]
    device = device_name("cpu")
    lines = [f"# Garbage collection during steps on {device}", "",
             f"Tiny Llama, {args.requests} streamed requests (32 prompt tokens, {args.output_len} output), "
             f"every step's outputs read; the three ways alternate, one engine. The engine's young threshold while "
             f"frozen: {heap.YOUNG_THRESHOLD} allocations (Python's default: {gc.get_threshold()[0]}).", "",
             "| heap before the run | wall ms per step | slowest step (ms) | full collections | their time (ms) "
             "| young collections (gen 0 / 1) | their time (ms) | young collections' ms per step |",
             "|---|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['wall_ms_per_step']:.1f} | "
                     f"{r['slowest_step_ms']:.0f} | {r['collections'][2]} | {r['collection_ms'][2]:.0f} | "
                     f"{r['collections'][0]} / {r['collections'][1]} | "
                     f"{r['collection_ms'][0]:.0f} / {r['collection_ms'][1]:.0f} | "
                     f"{(r['collection_ms'][0] + r['collection_ms'][1]) / r['steps']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gc_pauses.json").write_text(json.dumps({"device": device, "requests": args.requests, "rows": rows},
                                                   indent=2))
    (out / "gc_pauses.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
