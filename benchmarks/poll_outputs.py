"""Host time of a data-parallel replica's poll: the step's outputs of its
streamed requests sent to the front (engine/data_parallel.py), for one or
more source trees side by side (this tree and a git checkout of an older
commit, say), each in its own process.

Every streamed request has an output every step, and a replica's poll hands
them to the front through Ray, pickled on the replica (under the GIL its
engine steps with) and unpickled in the server's process. The probe keeps
each request's output as the engine's output processor does (live token
and logprob lists, text grown by each step's delta, the prompt's token ids)
and, each call, adds a step's token to every request and sends their
outputs as the tree's replica does: through its ``OutputSender`` and the
front's ``rebuild`` where the tree has them (engine/output_wire.py), else
the outputs as they are. One call is a poll: the replica's side (cut,
pickled with protocol 5) and the front's (unpickled, rebuilt) together.

    git archive REV | tar -x -C /tmp/old
    python benchmarks/poll_outputs.py . /tmp/old --names new old

Each figure is the median thread CPU time of ``--steps`` polls (after 3);
the median of ``--rounds`` processes per tree, interleaved. Writes
benchmarks/results/poll_outputs{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys

import tree_compare

# (requests, prompt tokens, output tokens so far, completions each, top logprobs or None)
SHAPES = [(64, 200, 100, 1, None), (256, 2000, 500, 1, None), (256, 2000, 500, 1, 5), (64, 2000, 200, 2, None),
          (32, 8000, 2000, 1, None)]

_PROBE = tree_compare.TREE_PACKAGES + r'''
import gc, json, os, pickle, random, time
shapes, steps = (json.loads(a) for a in sys.argv[2:])
from fluidserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
WIRE = os.path.exists(os.path.join(sys.argv[1], "engine", "output_wire.py"))  # a tree that sends tails
if WIRE:
    from fluidserve.engine.output_wire import OutputSender, rebuild


def requests(num, prompt_len, out_len, n, top):
    rng = random.Random(num)
    state = []
    for i in range(num):
        prompt = [rng.randrange(50_000) for _ in range(prompt_len)]
        comps = []
        for j in range(n):
            ids = [rng.randrange(50_000) for _ in range(out_len)]
            lps = [{t: Logprob(-0.5, 1, "tok")} | {k: Logprob(-3.0, k + 2, "alt") for k in range(top)}
                   for t in ids] if top is not None else None
            comps.append([" tok" * out_len, ids, lps])
        state.append((f"cmpl-{i}", prompt, comps))
    return state


def poll(state, top):
    """Every request's output after one more step, as the output processor makes it."""
    outs = []
    for rid, prompt, comps in state:
        made = []
        for j, c in enumerate(comps):
            t = 7 + j
            c[0] += " tok"
            c[1].append(t)
            new_lp = None
            if c[2] is not None:
                new_lp = [{t: Logprob(-0.5, 1, "tok")} | {k: Logprob(-3.0, k + 2, "alt") for k in range(top)}]
                c[2] += new_lp
            made.append(CompletionOutput(j, c[0], c[1], c[2], None, None, " tok", [t], new_lp))
        outs.append(RequestOutput(rid, None, prompt, made, False, None, 1.0, None, num_cached_tokens=0))
    return outs


gc.collect(); gc.freeze()
out = {}
for num, prompt_len, out_len, n, top in shapes:
    state = requests(num, prompt_len, out_len, n, top)
    sender, held = (OutputSender(), {}) if WIRE else (None, None)
    times, sizes = [], []
    for k in range(3 + steps):
        outs = poll(state, top)
        t0 = time.thread_time()
        if WIRE:
            data = pickle.dumps(sender.wire(outs), protocol=5)
            for tail in pickle.loads(data):
                held[tail.output.request_id] = rebuild(held.get(tail.output.request_id), tail)
        else:
            data = pickle.dumps(outs, protocol=5)
            pickle.loads(data)
        if k >= 3:
            times.append(time.thread_time() - t0)
            sizes.append(len(data))
    name = (f"{num} requests, {prompt_len}-token prompts, {out_len}+ out" + (f", n={n}" if n > 1 else "")
            + (f", {top} top logprobs" if top is not None else ""))
    out[name] = sorted(times)[len(times) // 2]
    out[name + " (bytes)"] = sorted(sizes)[len(sizes) // 2]
print(json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_compare.add_arguments(ap)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    result = tree_compare.run_trees(args, _PROBE, [json.dumps(SHAPES), json.dumps(args.steps)])
    timed = [r for r in result.rows if not r["shape"].endswith("(bytes)")]
    # compare() scales every figure to ms (x 1e3): the sizes back to bytes.
    sizes = {r["shape"].removesuffix(" (bytes)"): r for r in result.rows if r["shape"].endswith("(bytes)")}
    cmd = "python benchmarks/poll_outputs.py " + " ".join(argv if argv is not None else sys.argv[1:])
    names = [result.first, *result.rest]
    md = ["# Host time of a data-parallel replica's poll of streamed outputs", "",
          f"Command: `{cmd}`; thread CPU time of one poll, every request one token further: the replica's side "
          f"(its outputs cut to what the front lacks where the tree does so, pickled) and the front's "
          f"(unpickled, rebuilt); median of {args.steps} polls, median of {args.rounds} processes per tree, in "
          f"brackets the lowest process's; {result.load()}.", "",
          *tree_compare.table(timed, result.first, result.rest, what="poll"), "",
          "Pickled bytes a poll:", "",
          "| poll | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
          *(f"| {step} | " + " | ".join(f"{sizes[step][name] / 1e3:,.0f}" for name in names) + " |"
            for step in sizes)]
    tree_compare.save(args.out_dir, f"poll_outputs{args.tag}", cmd, result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
