"""Host time of sampling a decode step whose rows carry a repetition,
presence or frequency penalty, for one or more source trees side by side
(this tree and a git checkout of an older commit, say), each in its own
process.

A penalty counts the tokens of each penalised row, every step: the prompt
and the outputs for the repetition penalty, the outputs for the other two.
The probe runs the worker's side of a step's sampling as the worker does:
the step's rows built from the engine's SampleSpecs (through the worker's
token histories, in a tree that keeps them), then ``sampler.sample`` over
random logits; each row's output grows by the token it drew, so every call
is the next decode step. Greedy rows (the draw costs nothing next to the
counting); "no penalty" is the same rows without one, for scale. The dense
work over [rows, vocab] (the penalties' ``where``, the argmax) runs on the
CPU here and is a small part of a GPU's step, so on a GPU the counting is a
larger share than these figures show.

    git archive REV | tar -x -C /tmp/old
    python benchmarks/penalty_cost.py . /tmp/old --names new old

Each figure is the median thread CPU time of ``--steps`` steps (after 3), one
torch thread; the median of ``--rounds`` processes per tree, interleaved.
Writes benchmarks/results/penalty_cost{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys

import tree_compare

_PROBE = tree_compare.TREE_PACKAGES + r'''
import gc, json, os, random, time
rows_list, prompt_len, outputs_len, vocab, steps = (json.loads(a) for a in sys.argv[2:])
import torch
torch.set_num_threads(1)
from fluidserve.engine.batch import SampleSpec
from fluidserve.engine.sampler import SamplingRow, sample
from fluidserve.engine.sampling_params import SamplingParams
TokenHistories = None
if os.path.exists(os.path.join(sys.argv[1], "engine", "token_history.py")):  # the worker keeps the histories
    from fluidserve.engine.token_history import TokenHistories

PENALTIES = {"repetition 1.1": {"repetition_penalty": 1.1},
             "frequency 0.5 + presence 0.3": {"frequency_penalty": 0.5, "presence_penalty": 0.3},
             "no penalty": {}}


def decode_steps(num_rows, penalty):
    rng = random.Random(num_rows)
    params = SamplingParams(temperature=0, **penalty)
    # As the engine builds a row's SampleSpec: the prompt travels only for the repetition penalty.
    specs = [SampleSpec(params=params, seed=None,
                        prompt_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)]
                        if params.repetition_penalty != 1.0 else [],
                        output_token_ids=[rng.randrange(vocab) for _ in range(outputs_len)])
             for _ in range(num_rows)]
    ids = [f"cmpl-{i}-0" for i in range(num_rows)]
    histories = TokenHistories() if TokenHistories is not None else None
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(num_rows))

    def step():
        kept = histories.rows(ids, specs) if histories is not None else [None] * num_rows
        rows = [SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids, None,
                            **({"history": h} if histories is not None else {})) for s, h in zip(specs, kept)]
        for s, tok in zip(specs, sample(logits, rows, None)):
            s.output_token_ids.append(tok.token_id)
    return step


gc.collect(); gc.freeze()
out = {}
for num_rows in rows_list:
    for name, penalty in PENALTIES.items():
        step, times = decode_steps(num_rows, penalty), []
        for k in range(3 + steps):
            t0 = time.thread_time()
            step()
            if k >= 3:
                times.append(time.thread_time() - t0)
        out[f"{num_rows} rows, {name}"] = sorted(times)[len(times) // 2]
print(json.dumps(out))
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_compare.add_arguments(ap)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64], help="penalised rows a step")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--outputs-len", type=int, default=200, help="outputs each row has at the first step")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    probe_args = [json.dumps(a) for a in (args.rows, args.prompt_len, args.outputs_len, args.vocab, args.steps)]
    result = tree_compare.run_trees(args, _PROBE, probe_args)
    cmd = "python benchmarks/penalty_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# Host time of sampling a decode step with penalties", "",
          f"Command: `{cmd}`; thread CPU time of the worker's side of a step's sampling (its rows built, "
          f"then `sampler.sample`), greedy rows of {args.prompt_len}-token prompts and {args.outputs_len}+ "
          f"outputs growing a token a step, vocabulary {args.vocab}, one torch thread; median of {args.steps} "
          f"steps, median of {args.rounds} processes per tree, in brackets the lowest process's; "
          f"{result.load()}.", "", *tree_compare.table(result.rows, result.first, result.rest)]
    tree_compare.save(args.out_dir, f"penalty_cost{args.tag}", cmd, result, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
