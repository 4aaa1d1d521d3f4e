"""How well the attention planner's plans are predicted, and what the
two-launch plan should gain, from a GPU's stored kernel timings (no GPU
needed).

A plan's time is modelled the way the kernel runs it: every work item costs
``a * keys + b`` microseconds by its kind (a decode tile in the decode-only
variant, a decode tile in the mixed variant, a prefill tile), a packed plan
takes its busiest unit's sum (its programs fill the GPU in one wave), an
unpacked plan list-schedules its programs on the GPU's slots in launch order
(as the hardware does), and every launch adds a floor, every merge a fixed
cost. The seven constants are fitted (non-negative least squares on the
relative error, refitted until each plan's longest path stops moving) to one
device's figures together:

* ``kernels_<device>.json``: decode-only steps (batch x context, as a CUDA
  graph replays them), whole prompts, one mixed step in three plans;
* ``attention_tuning_<device>.json``: the mixed steps of twelve shapes in
  the one-launch packed, unpacked and split-unpacked plans.

It prints and saves the fit (each figure against its prediction), the
fitted decode tile's slowdown inside the mixed variant, and the predicted
time of the two-launch plan (``paged_attention.plan_for``'s choice for long
decodes) beside the measured one-launch plans. These are predictions from a
fitted model, not timings; ``kernel_bench.py`` and ``attention_tuning.py`` time
the two-launch plan itself on a GPU.

    python benchmarks/plan_model.py                      # nvidia_h200
    python benchmarks/plan_model.py --device nvidia_h200 --units 33 --decode-units 49 --slots 264

Writes ``benchmarks/results/plan_model_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import numpy as np

from fluidserve.kernels import packing

RESULTS = Path(__file__).resolve().parent / "results"
# The stored figures' shape: Llama-3-8B attention (8 KV heads, group 4, head 128), bf16.
KV_HEADS, GROUP = 8, 4
PREFILL_TOKENS, DECODE_TOKENS = 128 // GROUP, 16 // GROUP  # tokens per prefill tile, per decode tile
PARAMS = ("a_decode", "b_decode", "a_mixed", "a_prefill", "b_prefill", "launch", "merge")


@dataclass(frozen=True)
class Case:
    """One timed plan: its items per unit (packed) or in launch order
    (unpacked), each as (kind, keys), and the launches and merges it runs."""

    label: str
    measured_ms: float
    units: tuple[tuple[tuple[str, int], ...], ...]  # per unit (packed) or per program (unpacked)
    packed: bool
    launches: int
    merges: int
    step: tuple[int, int, int] | None = None  # (chunk, decodes, longest context) of a mixed step


def items_of(plan: packing.WorkPlan, variant_has_prefill: bool) -> list[list[tuple[str, int]]]:
    """A plan's units as lists of (kind, keys); a decode tile's kind says
    which variant runs it."""
    out = []
    rows = plan.work.tolist()
    offsets = plan.unit_offsets.tolist()
    for u in range(plan.num_units):
        unit = []
        for row in rows[offsets[u]:offsets[u + 1]]:
            keys = row[packing.F_KV_HI] - row[packing.F_KV_LO]
            tokens = row[packing.F_Q_HI] - row[packing.F_Q_LO]
            kind = "prefill" if tokens > plan.decode_tokens_per_tile else ("mixed" if variant_has_prefill else "decode")
            unit.append((kind, keys))
        out.append(unit)
    return out


@contextmanager
def keys_balanced() -> Iterator[None]:
    """The planner as it balanced plans before it took ``PLAN_COSTS``
    (stored runs without ``lpt_costs``): LPT balanced the items by the
    split length's key counts (``packing.split_costs``). A timed plan is
    rebuilt as it was built, or the fit would explain one plan's timing by
    another plan's items."""
    saved = packing.item_costs
    packing.item_costs = lambda rows, decode_tokens_per_tile, mixed: packing.split_costs(rows, decode_tokens_per_tile)
    try:
        yield
    finally:
        packing.item_costs = saved


# The plan costs of the planner that balanced the stored runs which record
# how (``lpt_costs``) but not by what values: the planner had these until
# runs recorded their own (``plan_costs``).
UNRECORDED_PLAN_COSTS = packing.PlanCosts(decode_key=0.0410, decode_item=3.06, mixed_decode_key=0.0421,
                                          prefill_key=0.0559, prefill_item=26.8, launch=3.45)  # fmt: skip


def as_built(record: dict):
    """The planner a stored run's plans were built by: by keys, or by the
    plan costs the run recorded. A timed plan is rebuilt as it was built,
    and the fit then does not move with the engine's costs."""
    if record.get("lpt_costs") != packing.LPT_COSTS:
        return keys_balanced()
    costs = record.get("plan_costs")
    return patch.object(packing, "PLAN_COSTS", packing.PlanCosts(**costs) if costs else UNRECORDED_PLAN_COSTS)


def plan(q_lens: list[int], seq_lens: list[int], units: int, **kw) -> packing.WorkPlan:
    return packing.plan_attention(q_lens, seq_lens, num_units=units, tokens_per_tile=PREFILL_TOKENS,
                                  decode_tokens_per_tile=DECODE_TOKENS, **kw)  # fmt: skip


def case(label: str, ms: float, p: packing.WorkPlan, packed: bool, step: tuple[int, int, int] | None = None) -> Case:
    return Case(label, ms, tuple(tuple(u) for u in items_of(p, p.has_prefill_tiles)), packed,
                launches=1, merges=int(p.num_merge_rows > 0), step=step)


def mixed_lens(chunk: int, decodes: int, longest: int) -> tuple[list[int], list[int]]:
    """The mixed step kernel_bench.py times (its seed-0 contexts)."""
    rng = random.Random(0)
    return [chunk] + [1] * decodes, [chunk] + [rng.randint(512, longest) for _ in range(decodes)]


def load_cases(device: str, units: int, decode_units: int) -> tuple[list[Case], dict[str, float]]:
    """The timed plans the model is fitted to, and the two-launch plan's
    timings where the stored run has them (kept out of the fit: they test
    its prediction). Decode-only steps ran on the decode-only variant's
    units, the rest on the mixed variant's."""
    kern = json.loads((RESULTS / f"kernels_{device}.json").read_text())
    cases = []
    with as_built(kern):
        for r in kern["decode"]:
            if "graph_ms" in r:
                b, ctx = r["batch"], r["context"]
                cases.append(case(f"decode {b} x {ctx}", r["graph_ms"], plan([1] * b, [ctx] * b, decode_units), True))
        for r in kern["prefill"]:
            cases.append(case(f"prompt {r['len']}", r["ms"], plan([r["len"]], [r["len"]], units), True))
    mixed = [(8192, 128, 32768, kern["mixed"], " (kernel_bench.py)", kern)]
    tuning = RESULTS / f"attention_tuning_{device}.json"
    if tuning.exists():
        run = json.loads(tuning.read_text())
        for r in run["rows"]:
            if r["kind"] == "plans" and "error" not in r:
                mixed.append((r["chunk"], r["decodes"], r["longest_context"],
                              {k.removesuffix("_ms"): {"ms": v} for k, v in r.items() if k.endswith("_ms")}, "", run))
    two_launch = {}
    for chunk, decodes, longest, m, source, record in mixed:
        name = f"{chunk} + {decodes} x 512-{longest}{source}"
        if "separate" in m:
            two_launch[name] = m["separate"]["ms"]
        q, s = mixed_lens(chunk, decodes, longest)
        with as_built(record):
            cases.append(case(f"{name} packed", m["packed"]["ms"], plan(q, s, units), True,
                              (chunk, decodes, longest)))  # fmt: skip
            cases.append(case(f"{name} unpacked", m["unpacked"]["ms"], plan(q, s, units, pack=False), False))
            if "split_unpacked" in m:
                cases.append(case(f"{name} split unpacked", m["split_unpacked"]["ms"],
                                  plan(q, s, units, pack=False, kv_chunk=2048), False))
    return cases, two_launch


# Features of an item's time: its coefficient on each parameter.
FEATURE = {"decode": (0, 1), "mixed": (2, 1), "prefill": (3, 4)}  # (per-key, per-item) parameter indices


def critical_path(c: Case, x: np.ndarray, slots: int) -> np.ndarray:
    """The features of the case's longest path under parameters ``x``: the
    busiest unit (packed), the slot that ends last (unpacked), plus its
    launches and merges. Its dot with ``x`` is the predicted time in us."""
    def features(unit) -> np.ndarray:
        f = np.zeros(len(PARAMS))
        for kind, keys in unit:
            per_key, per_item = FEATURE[kind]
            f[per_key] += keys
            f[per_item] += 1
        return f

    if c.packed:  # units x heads programs in one wave
        paths = [features(u) for u in c.units] or [np.zeros(len(PARAMS))]
        path = max(paths, key=lambda f: f @ x)
    else:  # one program per item and head, heads outermost, on the GPU's slots, in launch order
        items = [features(u) for u in c.units] * KV_HEADS
        heap = [(0.0, i) for i in range(min(slots, max(len(items), 1)))]
        acc = [np.zeros(len(PARAMS)) for _ in heap]
        for f in items:
            t, i = heapq.heappop(heap)
            acc[i] = acc[i] + f
            heapq.heappush(heap, (t + f @ x, i))
        path = max(acc, key=lambda f: f @ x)
    path = path.copy()
    path[PARAMS.index("launch")] = c.launches
    path[PARAMS.index("merge")] = c.merges
    return path


def predict_ms(c: Case, x: np.ndarray, slots: int) -> float:
    """The model's time of one case, in ms."""
    return float(critical_path(c, x, slots) @ x) / 1000.0


def fit(cases: list[Case], slots: int, rounds: int = 30) -> np.ndarray:
    """Least squares on relative error, non-negative: the longest paths
    depend on the parameters, so fit, find the paths again, refit, until
    they stop moving."""
    # ns-scale per key, us per item, us per launch and merge
    x = np.array([0.04, 1.0, 0.04, 0.06, 1.0, 5.0, 2.0])
    for _ in range(rounds):
        a = np.array([critical_path(c, x, slots) / (c.measured_ms * 1000.0) for c in cases])
        free = np.ones(len(PARAMS), dtype=bool)
        while True:  # drop parameters that come out negative, refit the rest
            new = np.zeros(len(PARAMS))
            new[free] = np.linalg.lstsq(a[:, free], np.ones(len(cases)), rcond=None)[0]
            if (new >= 0).all():
                break
            free &= new > 0
        if np.allclose(new, x, rtol=1e-6, atol=1e-9):
            return new
        x = new
    return x


def engine_plan(q: list[int], s: list[int], units: int, decode_units: int) -> str:
    """The plan ``paged_attention.plan_for`` gives the step: the one the
    engine's constants (``packing.PLAN_COSTS``) predict faster."""
    chosen = plan(q, s, units, decode_units=decode_units, choose=True)
    return "two launches" if chosen.decode_part is not None else "one launch"


def engine_costs_vs_fit(params: dict[str, float]) -> dict[str, tuple[float, float]]:
    """``packing.PLAN_COSTS`` beside this fit's parameters (ns per key as us)."""
    c = packing.PLAN_COSTS
    pairs = dict(decode_key=("a_decode", c.decode_key), decode_item=("b_decode", c.decode_item),
                 mixed_decode_key=("a_mixed", c.mixed_decode_key), prefill_key=("a_prefill", c.prefill_key),
                 prefill_item=("b_prefill", c.prefill_item), launch=("launch", c.launch))  # fmt: skip
    return {name: (engine, params[fitted]) for name, (fitted, engine) in pairs.items()}


def two_launch_ms(q: list[int], s: list[int], units: int, decode_units: int, x: np.ndarray, slots: int) -> float:
    """The two-launch plan's predicted time: decode tiles on the decode-only
    variant, prefill tiles on the mixed one, then one merge."""
    p = plan(q, s, units, decode_units=decode_units)
    main = Case("", 1.0, tuple(tuple(u) for u in items_of(p, True)), True, launches=1, merges=0)
    part = Case("", 1.0, tuple(tuple(u) for u in items_of(p.decode_part, False)), True, launches=1,
                merges=int(p.num_merge_rows > 0))
    return predict_ms(main, x, slots) + predict_ms(part, x, slots)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="nvidia_h200", help="slug of the stored results (kernels_<device>.json)")
    ap.add_argument("--units", type=int, default=33, help="units per KV head of the mixed variant on that device")
    ap.add_argument("--decode-units", type=int, default=49,
                    help="units per KV head of the decode-only variant (H200: 132 SMs x 3 programs // 8 heads)")
    ap.add_argument("--slots", type=int, default=264, help="programs resident at once (SMs x programs per SM)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not (RESULTS / f"kernels_{args.device}.json").exists():
        print(f"no stored kernels_{args.device}.json in {RESULTS}", file=sys.stderr)
        return 1
    cases, two_launch_measured = load_cases(args.device, args.units, args.decode_units)
    x = fit(cases, args.slots)
    rows = [dict(case=c.label, measured_ms=c.measured_ms, predicted_ms=predict_ms(c, x, args.slots)) for c in cases]
    errors = [abs(r["predicted_ms"] / r["measured_ms"] - 1) for r in rows]
    params = dict(zip(PARAMS, map(float, x)))
    slowdown = params["a_mixed"] / params["a_decode"]
    shapes = []
    for c in cases:
        if c.step is None:
            continue
        q, s = mixed_lens(*c.step)
        name = c.label.removesuffix(" packed")
        unpacked = next(r["measured_ms"] for r in rows if r["case"] == f"{name} unpacked")
        two = two_launch_ms(q, s, args.units, args.decode_units, x, args.slots)
        # The one-launch plan as the planner balances it now, beside the timed one, both predicted.
        as_timed = next(r["predicted_ms"] for r in rows if r["case"] == c.label)
        now = predict_ms(case("", 1.0, plan(q, s, args.units), True), x, args.slots)
        shapes.append(dict(shape=name, decode_keys=sum(s[1:]), packed_ms=c.measured_ms,
                           packed_predicted_ms=as_timed, one_launch_now_predicted_ms=now,
                           unpacked_ms=unpacked, two_launch_predicted_ms=two, vs_packed=c.measured_ms / two,
                           vs_unpacked=unpacked / two, two_launch_measured_ms=two_launch_measured.get(name),
                           engine_plan=engine_plan(q, s, args.units, args.decode_units)))
    report = dict(device=args.device, units=args.units, decode_units=args.decode_units, slots=args.slots, params=params,
                  decode_slowdown_in_mixed_variant=slowdown, median_abs_error=statistics.median(errors),
                  max_abs_error=max(errors), rows=rows, two_launch=shapes,
                  engine_costs_vs_fit=engine_costs_vs_fit(params))  # fmt: skip
    text = markdown(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"plan_model_{args.device}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


def markdown(r: dict) -> str:
    p = r["params"]
    lines = [f"# Attention plans: a fitted model of the stored {r['device']} timings", "",
             f"{len(r['rows'])} timed plans (kernels_{r['device']}.json, attention_tuning_{r['device']}.json), "
             f"{r['units']} units per KV head ({r.get('decode_units', r['units'])} for decode-only steps), "
             f"{r['slots']} resident programs. Fitted, per item: "
             f"{p['a_decode'] * 1e3:.3f} ns per key + {p['b_decode']:.2f} us (decode tile, decode-only variant), "
             f"{p['a_mixed'] * 1e3:.3f} ns per key (decode tile, mixed variant), "
             f"{p['a_prefill'] * 1e3:.3f} ns per key + {p['b_prefill']:.2f} us (prefill tile); "
             f"{p['launch']:.1f} us per launch, {p['merge']:.1f} us per merge.", "",
             f"**A decode tile in the mixed variant: {r['decode_slowdown_in_mixed_variant']:.2f}x the decode-only "
             f"variant's time per key.** Prediction error: median {r['median_abs_error']:.1%}, "
             f"largest {r['max_abs_error']:.1%}.", "",
             "## Mixed steps: measured one-launch plans, predicted two-launch plan", "",
             "Predictions, not timings: `kernel_bench.py` and `attention_tuning.py` time the two-launch plan on a GPU. "
             "The engine gives a mixed step the plan, one launch or two, `packing.predicted_us` finds faster "
             "with its constants (`packing.PLAN_COSTS`, the H200 fit's; against this fit below), one more eager "
             "launch's host time "
             f"({packing.PLAN_COSTS.host_launch:.0f} us) included: its choice is the last column.", "",
             "| step | decode keys | packed ms | unpacked ms | two launches, predicted ms | vs packed | vs unpacked "
             "| two launches, measured ms | the engine's plan |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for s in r["two_launch"]:
        measured = s.get("two_launch_measured_ms")
        lines.append(f"| {s['shape']} | {s['decode_keys']:,} | {s['packed_ms']:.3f} | {s['unpacked_ms']:.3f} | "
                     f"{s['two_launch_predicted_ms']:.3f} | {s['vs_packed']:.2f}x | {s['vs_unpacked']:.2f}x | "
                     f"{f'{measured:.3f}' if measured else 'not yet timed'} | {s.get('engine_plan', '–')} |")
    now = [s for s in r["two_launch"] if "one_launch_now_predicted_ms" in s]
    if now:
        lines += ["", "## One launch, balanced by the predicted time of each item", "",
                  "The packed one-launch plan as the stored run balanced it (by keys, a prefill key counted twice "
                  "and 64 per item, in runs that do not record `lpt_costs`) against the plan LPT makes now, "
                  "balancing each item's `PLAN_COSTS` time; both through this fit (predictions):", "",
                  "| step | as timed, predicted ms | as balanced now, predicted ms | speed-up |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for s in now:
            lines.append(f"| {s['shape']} | {s['packed_predicted_ms']:.3f} | {s['one_launch_now_predicted_ms']:.3f} "
                         f"| {s['packed_predicted_ms'] / s['one_launch_now_predicted_ms']:.2f}x |")
    if "engine_costs_vs_fit" in r:
        lines += ["", "The engine's constants (`packing.PLAN_COSTS`, us) against this fit: " + "; ".join(
            f"{name} {engine:g} / {fitted:.4g}" for name, (engine, fitted) in r["engine_costs_vs_fit"].items()) + "."]
    lines += ["", "## Every timed plan against the model", "", "| plan | measured ms | predicted ms | error |",
              "|---|---:|---:|---:|"]  # fmt: skip
    for row in r["rows"]:
        lines.append(f"| {row['case']} | {row['measured_ms']:.3f} | {row['predicted_ms']:.3f} | "
                     f"{row['predicted_ms'] / row['measured_ms'] - 1:+.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
