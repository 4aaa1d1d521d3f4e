"""What a layer safepoint costs, against what a decoder layer costs: the
measurement behind ``--preemption-safepoint-layers``' default.

* one rank: the check is a host-side read of the interrupt flag (no device
  work); timed alone over many calls, and around each check inside a real
  forward with every layer a safepoint;
* tensor parallel: the ranks' vote, one all-reduce of a one-element CPU
  tensor over gloo, timed between two real processes;
* Ray: what giving ``interrupt`` its own thread costs every step's call;
* a decoder layer: a forward's time over its number of layers, for a
  prefill chunk and a decode batch of the benchmark model.

It prints the check's share of the layer time for k = 1, 2, 4, 8 (a check
every k layers), next to the worst-case wait for an interrupt (k layers).

    python benchmarks/preemption.py          # ~1 min on 2 cores
Writes benchmarks/results/preemption.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dummy_models import build_model_dir

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.parallel import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from fluidserve.engine.preemption import Safepoints
from fluidserve.engine.worker import Worker

KS = (1, 2, 4, 8)
SHAPES = ("prefill 512 tokens", "decode 32 seqs, context 512")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _step(num_seqs: int, tokens_each: int, context: int, block_size: int) -> ModelInput:
    """``num_seqs`` sequences each running ``tokens_each`` tokens after ``context`` cached ones."""
    inp = ModelInput()
    blocks_per_seq = -(-(context + tokens_each) // block_size)
    for s in range(num_seqs):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        pos = range(context, context + tokens_each)
        inp.input_ids += [1 + (p % 200) for p in pos]
        inp.positions += pos
        inp.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in pos]
        inp.query_start_loc.append(inp.query_start_loc[-1] + tokens_each)
        inp.seq_lens.append(context + tokens_each)
        inp.block_tables.append(table)
    return inp


def single_rank(model_dir: Path, repeats: int) -> dict:
    worker = Worker(EngineConfig.create(model=str(model_dir), load_format="dummy", device="cpu",
                                 preemption_safepoint_layers=1), str(model_dir))
    worker.init_cache(1100)  # the decode batch: 32 x 33 blocks
    layers = worker.num_layers
    out: dict = {"num_layers": layers}
    sp = Safepoints(0.5, TensorParallel(), torch.device("cpu"))  # every position checks
    sp.arm(1)
    n = 200_000
    t = time.perf_counter()
    for i in range(n):
        sp.stop_before(i)
    out["check_s"] = (time.perf_counter() - t) / n
    shapes = {SHAPES[0]: _step(1, 512, 0, 16), SHAPES[1]: _step(32, 1, 512, 16)}
    # Time spent inside the checks of a real armed forward, measured around
    # each check: a whole-forward A/B would drown ns in the noise of other processes.
    spent = {"s": 0.0, "n": 0}
    check = worker.safepoints.stop_before

    def timed_check(layer: int) -> bool:
        t0 = time.perf_counter()
        stop = check(layer)
        spent["s"] += time.perf_counter() - t0
        spent["n"] += 1
        return stop

    worker.safepoints.stop_before = timed_check
    for name, inp in shapes.items():
        forward = lambda: worker._forward(inp)  # noqa: E731
        offs = []
        with torch.inference_mode():
            forward()  # warm
            for _ in range(repeats):
                offs.append(_timed(forward))
                worker.safepoints.arm(7)  # never interrupted: only the checks run
                forward()
                worker.safepoints.disarm()
        off = min(offs)  # the least disturbed run
        out[name] = {"layer_s": off / layers, "forward_s": off}
    out["in_forward_check_s"] = spent["s"] / spent["n"]
    return out


def _vote_rank(rank: int, init: str, n: int, result) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, init, "gloo")
    sp = Safepoints(0.5, tp, torch.device("cpu"))  # every position checks
    sp.arm(1)
    for i in range(50):
        sp.stop_before(i)
    t = time.perf_counter()
    for i in range(n):
        sp.stop_before(i)
    result[rank] = (time.perf_counter() - t) / n
    destroy_tensor_parallel()


def tp_vote(n: int) -> float:
    """Seconds per safepoint vote between two gloo ranks (the slower rank)."""
    ctx = mp.get_context("spawn")
    init = f"file://{tempfile.gettempdir()}/fluidserve-vote-{os.getpid()}"
    with ctx.Manager() as manager:
        result = manager.dict()
        procs = [ctx.Process(target=_vote_rank, args=(r, init, n, result)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        return max(result.values())


def ray_channel(calls: int) -> dict:
    """What the interrupt's own channel costs every step on Ray: the round
    trip of a step-sized call to an actor with a ``control`` concurrency
    group (its calls then run on a worker thread, not the main one) against
    a plain actor. Interleaved, median of each."""
    import ray

    from fluidserve.engine.executor.ray import start_local_ray

    class Plain:
        def execute(self, inp: ModelInput) -> int:
            return len(inp.input_ids)

    class WithControl(Plain):
        @ray.method(concurrency_group="control")
        def interrupt(self, step_id: int) -> None:
            pass

    start_local_ray(num_cpus=2)
    try:
        plain = ray.remote(num_cpus=0)(Plain).remote()
        control = ray.remote(num_cpus=0, concurrency_groups={"control": 1})(WithControl).remote()
        inp = _step(32, 1, 512, 16)  # a decode step of 32 requests: the common payload
        times: dict[str, list[float]] = {"plain actor": [], "actor with a control thread": []}
        for _ in range(20):  # warm
            ray.get([plain.execute.remote(inp), control.execute.remote(inp)])
        for _ in range(calls):
            for name, actor in (("plain actor", plain), ("actor with a control thread", control)):
                t = time.perf_counter()
                ray.get(actor.execute.remote(inp))
                times[name].append(time.perf_counter() - t)
        return {name: statistics.median(v) for name, v in times.items()}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--votes", type=int, default=2000)
    ap.add_argument("--ray-calls", type=int, default=300)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    model_dir = build_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="fluidserve-preempt-")))
    one = single_rank(model_dir, args.repeats)
    vote = tp_vote(args.votes)
    channel = ray_channel(args.ray_calls)
    rows = []
    for shape in SHAPES:
        layer = one[shape]["layer_s"]
        for k in KS:
            rows.append({"shape": shape, "k": k, "layer_ms": layer * 1e3,
                         "check_share": one["in_forward_check_s"] / (k * layer), "vote_share": vote / (k * layer),
                         "worst_wait_ms": k * layer * 1e3})
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# Layer safepoints: cost against a layer", "",
          f"Command: `python benchmarks/preemption.py {cmd}`. Model preset `{args.preset}` "
          f"({one['num_layers']} layers, random weights), fp32 on CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads).", "",
          f"* one rank, one check (host-side flag read): {one['check_s'] * 1e9:.0f} ns",
          f"* tensor parallel 2, one vote (gloo all-reduce of one int between two processes): "
          f"{vote * 1e6:.0f} us",
          "* Ray, the interrupt's channel (a `control` concurrency group, so the actor's calls run on a "
          "thread): a decode step's call round trip "
          + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in channel.items())
          + f" ({channel['actor with a control thread'] / channel['plain actor']:.2f}x)", ""]
    md.append(f"* one rank, a check timed inside an armed forward (every layer a safepoint): "
              f"{one['in_forward_check_s'] * 1e9:.0f} ns; forward without checks (least disturbed of "
              f"{args.repeats}): " + ", ".join(f"{s} {one[s]['forward_s'] * 1e3:.1f} ms" for s in SHAPES))
    md += ["", "| step | k (layers per safepoint) | layer (ms) | check / k layers, one rank | "
           "vote / k layers, TP 2 | longest wait for an interrupt (ms) |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['shape']} | {r['k']} | {r['layer_ms']:.2f} | {r['check_share']:.4%} | "
                  f"{r['vote_share']:.2%} | {r['worst_wait_ms']:.1f} |")
    text = "\n".join(md) + "\n"
    dest = Path(args.out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "preemption.json").write_text(json.dumps(
        {"preset": args.preset, "single_rank": one, "tp2_vote_s": vote, "ray_call_s": channel, "rows": rows}, indent=1))
    (dest / "preemption.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
