"""Profiler: measures the cost model the scheduler consults.

``fluidserve profile --model DIR -o profile.json`` (``main``) runs the real
engine on prompts of chosen shapes, records every step's shape and measured
time, and fits ``LinearCostModel`` coefficients to them (``--roofline DEVICE``
writes the analytic model instead). Choosing and loading a cost model is
``scheduler/cost_model.py``'s (``cost_model_for_engine``, ``load_profile``);
this module is only the measuring command, and imports no torch at the top.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from fluidserve.scheduler.cost_model import (
    DTYPE_BYTES,
    DeviceSpec,
    LinearCoefficients,
    LinearCostModel,
    ModelShape,
    RooflineCostModel,
    plan_shape,
)

# -- fitting -------------------------------------------------------------------
FEATURES = ("base", "per_prefill_token", "per_decode_seq", "per_context_token", "per_attn_pair")


def fit_linear(samples: list[dict], meta: dict | None = None) -> LinearCostModel:
    """Least-squares fit of the step-time coefficients to measured samples
    (dicts with prefill_tokens, decode_seqs, total_context, attn_pairs,
    seconds); negative coefficients (noise) are dropped and the rest refit."""
    import numpy as np

    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps, got {len(samples)}")
    x = np.array([[1.0, s["prefill_tokens"], s["decode_seqs"], s["total_context"], s["attn_pairs"]]
                  for s in samples], dtype=np.float64)
    y = np.array([s["seconds"] for s in samples], dtype=np.float64)
    active = list(range(len(FEATURES)))
    while True:
        scale = np.maximum(np.abs(x[:, active]).max(axis=0), 1e-12)  # conditioning
        coef, *_ = np.linalg.lstsq(x[:, active] / scale, y, rcond=None)
        coef = coef / scale
        negative = [a for a, c in zip(active, coef) if c < 0]
        if not negative:
            break
        active = [a for a in active if a not in negative]
        if not active:
            coef, active = np.array([float(y.mean())]), [0]
            break
    values = dict.fromkeys(FEATURES, 0.0)
    for a, c in zip(active, coef):
        values[FEATURES[a]] = float(c)
    return LinearCostModel(LinearCoefficients(**values), meta)


# -- measuring -----------------------------------------------------------------
class StepRecorder:
    """Wraps ``scheduler.update_from_output`` to record each step's shape
    (read before the step is accounted) and the time the engine measured."""

    def __init__(self, scheduler: Any) -> None:
        self.samples: list[dict] = []
        self._scheduler = scheduler
        self._inner = scheduler.update_from_output
        scheduler.update_from_output = self._update

    def _update(self, plan: Any, outcome: Any) -> None:
        if plan.scheduled:
            prefill, decode, context, pairs = plan_shape(plan, self._scheduler.seqs)
            self.samples.append({"prefill_tokens": prefill, "decode_seqs": decode, "total_context": context,
                                 "attn_pairs": pairs, "seconds": outcome.step_time})
        self._inner(plan, outcome)


def _run(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    from fluidserve.engine.engine import next_request_id
    from fluidserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(next_request_id("profile"), p, params)
    while engine.has_unfinished_requests():
        engine.step()


def measure(engine: Any, prefill_sizes: list[int], batch_sizes: list[int], contexts: list[int],
            decode_steps: int = 8, repeats: int = 2, seed: int = 0) -> list[dict]:
    """Run prefill-only and decode-heavy shapes on ``engine``; one sample per
    step. The first (warm-up) run is discarded."""
    rng = random.Random(seed)
    vocab = engine.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    _run(engine, [prompt(8)], 2)  # warm-up: allocator, kernels
    rec = StepRecorder(engine.scheduler)
    for _ in range(repeats):
        for n in prefill_sizes:
            _run(engine, [prompt(n)], 1)
        for b in batch_sizes:
            for c in contexts:
                _run(engine, [prompt(c) for _ in range(b)], decode_steps)
    return rec.samples


def main(argv: list[str] | None = None) -> int:
    """``fluidserve profile --model DIR -o profile.json``."""
    ap = argparse.ArgumentParser(prog="fluidserve profile",
                                 description="Measure step times on this device and fit the cost model.")
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("-o", "--output", required=True, help="where to write profile.json")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--max-prefill", type=int, default=2048, help="largest prefill measured (tokens)")
    ap.add_argument("--max-batch", type=int, default=64, help="largest decode batch measured")
    ap.add_argument("--contexts", default="128,1024", help="decode context lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--roofline", default=None, metavar="DEVICE",
                    help="write the analytic model for DEVICE (h100, h200, a100, cpu) from the "
                         "model's config.json instead of measuring")
    args = ap.parse_args(argv)
    if args.roofline:
        return _write_roofline(args)

    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.engine import LLMEngine

    contexts = [int(c) for c in args.contexts.split(",") if c]
    sizes = _powers_of_two(16, args.max_prefill)
    batches = _powers_of_two(1, args.max_batch)
    engine = LLMEngine(EngineConfig.create(
        model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
        max_num_batched_tokens=max(args.max_prefill, args.max_batch), max_num_seqs=args.max_batch,
        scheduling_policy="fcfs", max_model_len=max(args.max_prefill, max(contexts)) + 64,
    ))
    try:
        t0 = time.perf_counter()
        samples = measure(engine, sizes, batches, contexts, repeats=args.repeats)
        meta = {"model": engine.model_name, "device": args.device, "dtype": args.dtype,
                "measured_s": round(time.perf_counter() - t0, 3), "samples": samples}
        model = fit_linear(samples, meta)
    finally:
        engine.shutdown()
    with open(args.output, "w") as f:
        json.dump(model.to_json(), f, indent=1)
    print(f"wrote {args.output}: {len(samples)} steps, coefficients {model.to_json()['coefficients']}",
          file=sys.stderr)
    return 0


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi]


def _write_roofline(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.model is None:
        raise SystemExit("--roofline needs --model (a directory with config.json)")
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    dtype_bytes = DTYPE_BYTES.get(args.dtype, 2)
    model = RooflineCostModel(ModelShape.from_hf_config(cfg, dtype_bytes), DeviceSpec.named(args.roofline))
    with open(args.output, "w") as f:
        json.dump(model.describe(), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
