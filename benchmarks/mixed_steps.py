"""Steps decode graphs cannot hold, eager against piecewise graphs
(``--piecewise-graphs``, engine/piecewise.py), on one engine in one run;
and eager with the decoder layers' batch path (a step of several rows run
from buffers and launches its first layer prepares, the default) against
the same step through the modules (``ops.set_batch_steps(False)``).

A step here is one prefill chunk of C tokens beside D decodes over
``--context`` tokens each (C = 0: decode-only, which decode graphs also
run: that row shows all three paths). Each path runs the same step
``--reps`` times back to back and is timed from the first launch to the
last result: the host's launches and the device's work both count, as in
serving. The hidden states of the two paths are compared too.

    python benchmarks/mixed_steps.py                       # llama3-8b on CUDA
    python benchmarks/mixed_steps.py --device cpu --preset tiny   # plumbing only

On the CPU the pieces run without graphs (nothing to replay), so the
figures there say nothing about speed. Writes
benchmarks/results/mixed_steps_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from dummy_models import build_model_dir, device_slug, run_record, save_results

from fluidserve.engine import LLM
from fluidserve.engine.batch import ModelInput
from fluidserve.kernels import ops

# (prefill chunk tokens, decodes): every step at most 512 tokens, the
# largest piecewise bucket.
SHAPES = [(0, 1), (0, 32), (16, 1), (64, 16), (128, 32), (256, 1), (448, 64)]
BLOCK = 16


def step_input(chunk: int, decodes: int, context: int) -> ModelInput:
    """A prefill chunk from position 0 (its own blocks), then ``decodes``
    sequences decoding at position ``context`` (their own blocks each)."""
    ids, pos, slots, qsl, lens, tables, sample = [], [], [], [0], [], [], []
    nxt = 1  # block 0 stays free
    if chunk:
        need = -(-chunk // BLOCK)
        table = list(range(nxt, nxt + need))
        nxt += need
        ids += [5 + i % 200 for i in range(chunk)]
        pos += list(range(chunk))
        slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(chunk)]
        qsl.append(chunk)
        lens.append(chunk)
        tables.append(table)
        sample.append(chunk - 1)
    for _ in range(decodes):
        need = -(-(context + 1) // BLOCK)
        table = list(range(nxt, nxt + need))
        nxt += need
        ids.append(7)
        pos.append(context)
        slots.append(table[context // BLOCK] * BLOCK + context % BLOCK)
        qsl.append(qsl[-1] + 1)
        lens.append(context + 1)
        tables.append(table)
        sample.append(len(ids) - 1)
    return ModelInput(input_ids=ids, positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=lens,
                      block_tables=tables, sample_indices=sample)


def blocks_needed(context: int) -> int:
    chunk = max(c for c, _ in SHAPES)
    decodes = max(d for _, d in SHAPES)
    return 1 + -(-chunk // BLOCK) + decodes * -(-(context + 1) // BLOCK)


def timed(run, reps: int, sync) -> float:
    """Seconds per step: ``reps`` runs back to back, first launch to last result."""
    for _ in range(3):
        run()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync()
    return (time.perf_counter() - t0) / reps


def bench(args) -> dict:
    record = run_record("mixed_steps", args.device, preset=args.preset, context=args.context, reps=args.reps)
    if record is None:
        raise SystemExit(1)
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as root:
        model_dir = build_model_dir(args.preset, Path(root))
        t0 = time.perf_counter()
        llm = LLM(model=str(model_dir), load_format="dummy", device=args.device,
                  dtype="bfloat16" if cuda else "float32", max_num_seqs=64, max_num_batched_tokens=512,
                  max_model_len=args.context + 64, num_kv_blocks=blocks_needed(args.context), block_size=BLOCK,
                  swap_space=0, enforce_eager=not cuda, piecewise_graphs=cuda, async_scheduling=False)
        record["startup_s"] = time.perf_counter() - t0
        worker = llm.engine.executor.worker
        if worker.piecewise is None:  # the CPU: the pieces run over their static buffers, no graphs
            worker.piecewise = worker.piecewise_graphs(capture=False)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        rows = []
        with torch.inference_mode():
            for chunk, decodes in SHAPES:
                inp = step_input(chunk, decodes, args.context)

                def modules(inp=inp):
                    was = ops.set_batch_steps(False)
                    try:
                        return worker.runner.forward(inp, worker.kv_caches)[0]
                    finally:
                        ops.set_batch_steps(was)

                paths = {"eager": lambda inp=inp: worker.runner.forward(inp, worker.kv_caches)[0],
                         "eager modules": modules, "piecewise": lambda inp=inp: worker.piecewise.forward(inp)[0]}
                if not chunk and worker.graphs is not None:
                    paths["decode graph"] = lambda inp=inp: worker.graphs.forward(inp)[0]
                eager = paths["eager"]().float()
                diff = (paths["piecewise"]().float() - eager).abs().max().item()
                row = dict(chunk=chunk, decodes=decodes, tokens=chunk + decodes, max_abs_diff=diff,
                           modules_abs_diff=(paths["eager modules"]().float() - eager).abs().max().item())
                for name, run in paths.items():
                    row[f"{name}_ms"] = timed(run, args.reps, sync) * 1e3
                row["eager_over_piecewise"] = row["eager_ms"] / row["piecewise_ms"]
                row["modules_over_eager"] = row["eager modules_ms"] / row["eager_ms"]
                if "decode graph_ms" in row:
                    row["piecewise_over_graph"] = row["piecewise_ms"] / row["decode graph_ms"]
                    row["eager_over_graph"] = row["eager_ms"] / row["decode graph_ms"]
                rows.append(row)
                print(row, file=sys.stderr, flush=True)
        record.update(rows=rows, piecewise_replays=dict(worker.piecewise.replays),
                      piecewise_fallbacks=dict(worker.piecewise.fallbacks))
        llm.engine.shutdown()
        llm = worker = None
        gc.collect()
    return record


def to_markdown(record: dict) -> str:
    out = [f"# Mixed steps: eager against piecewise graphs, {record['device']}", "",
           f"Preset {record['preset']}, decodes at context {record['context']}; each step {record['reps']} times "
           "back to back, time per step from the first launch to the last result. **eager**: the default (a step "
           "of several rows on the layers' batch path); **eager, modules**: the same step through the modules "
           "(`ops.set_batch_steps(False)`, as `FLUIDSERVE_BATCH_STEPS=0`; one row takes the row path either way). "
           "Max abs diff: piecewise against eager; modules diff: eager through the modules against eager. Command: "
           f"`{record['command']}`.", "",
           "| prefill chunk | decodes | tokens | eager ms | eager, modules ms | modules / eager | piecewise ms "
           "| decode graph ms | eager / piecewise | piecewise / decode graph | max abs diff | modules diff |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in record["rows"]:
        graph = f"{r['decode graph_ms']:.2f}" if "decode graph_ms" in r else "-"
        over = f"{r['piecewise_over_graph']:.2f}x" if "piecewise_over_graph" in r else "-"
        out.append(f"| {r['chunk']} | {r['decodes']} | {r['tokens']} | {r['eager_ms']:.2f} "
                   f"| {r['eager modules_ms']:.2f} | {r['modules_over_eager']:.2f}x | {r['piecewise_ms']:.2f} "
                   f"| {graph} | {r['eager_over_piecewise']:.2f}x | {over} | {r['max_abs_diff']:.3g} "
                   f"| {r['modules_abs_diff']:.3g} |")
    if not record["device"].lower().startswith("nvidia") and "cuda" not in record["device"].lower():
        out += ["", "No graphs on this device: the pieces ran eagerly over their static buffers."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--preset", default=None, help="dummy_models preset (default: llama3-8b on CUDA, tiny on CPU)")
    ap.add_argument("--context", type=int, default=512, help="tokens each decoding sequence has seen")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    args.preset = args.preset or ("llama3-8b" if args.device == "cuda" else "tiny")
    record = bench(args)
    record["command"] = "python benchmarks/mixed_steps.py " + " ".join(argv if argv is not None else sys.argv[1:])
    save_results(Path(args.out) / f"mixed_steps_{device_slug(record['device'])}", record, to_markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
