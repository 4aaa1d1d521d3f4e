"""A decode step's time on the engine's path, for one or more source trees
side by side (this tree and a git checkout of an older commit, say), each
in its own process: what a change to the step path (the step's input, the
worker, the model runner, the linears) costs a step that does not use it.

The probe builds an engine on the built-in tiny model (CPU, one torch
thread), admits ``--requests`` greedy requests, runs their prefill, then
times each decode step: the whole ``engine.step()`` in wall time, and the
step's input (``_model_input``) in thread CPU time.

    git archive REV | tar -x -C /tmp/old
    python benchmarks/step_path_cost.py . /tmp/old --names new old

Each figure is the median of ``--steps`` decode steps, the median of
``--rounds`` processes per tree, interleaved (the lowest process's in
brackets). Writes benchmarks/results/step_path_cost{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys

import tree_compare

_PROBE = tree_compare.TREE_PACKAGES + r'''
import gc, json, time
requests_list, steps = (json.loads(a) for a in sys.argv[2:])
import torch
torch.set_num_threads(1)
from fluidserve.engine import LLMEngine, EngineConfig, SamplingParams
out = {}
for n in requests_list:
    engine = LLMEngine(EngineConfig.create(device="cpu", num_kv_blocks=4096, max_num_seqs=n,
                                           max_num_batched_tokens=max(2048, 32 * n), seed=0))
    inner, built = engine._model_input, []

    def timed(*a, **k):
        t0 = time.thread_time()
        inp = inner(*a, **k)
        built.append(time.thread_time() - t0)
        return inp

    engine._model_input = timed
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"r{i}", [1 + (i + j) % 200 for j in range(32)], params)
    engine.step()  # every prompt in one step
    gc.collect(); gc.freeze()
    walls = []
    del built[:]
    for _ in range(3 + steps):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    walls, built = sorted(walls[3:]), sorted(built[3:])
    out[f"{n} requests: decode step"] = walls[len(walls) // 2]
    out[f"{n} requests: its input"] = built[len(built) // 2]
    for i in range(n):
        engine.abort(f"r{i}")
    gc.unfreeze()
print(json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_compare.add_arguments(ap)
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 256], help="decoding requests a step")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)
    probe_args = [json.dumps(a) for a in (args.requests, args.steps)]
    result = tree_compare.run_trees(args, _PROBE, probe_args)
    cmd = "python benchmarks/step_path_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# A decode step on the engine's path", "",
          f"Command: `{cmd}`; the built-in tiny model on the CPU, one torch thread, greedy requests of 32-token "
          f"prompts; the whole `engine.step()` (wall) and the step's input (`_model_input`, thread CPU time), "
          f"median of {args.steps} decode steps, median of {args.rounds} processes per tree, in brackets the "
          f"lowest process's; {result.load()}.", "", *tree_compare.table(result.rows, result.first, result.rest)]
    tree_compare.save(args.out_dir, f"step_path_cost{args.tag}", cmd, result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
