"""Host time of a predicted output's drafting (OpenAI's ``prediction``) on the
engine's thread, for one or more source trees side by side (this tree and a
git checkout of an older commit, say), each in its own process.

A request with a prediction gets, as it is added, an index of where each
n-gram of the prediction ends (``engine/speculative.py``); each of its ``n``
sequences drafts from it. That admission runs on the engine's thread
between steps, so its time stalls every running sequence once. After an
edit the drafter looks up the outputs' suffix in the index to find its
place again (``propose`` off the prediction), once a step while off it.

Cases: predictions of 1k, 10k and 30k tokens, their ids drawn from a 32k
vocabulary (few repeats) or from 200 ids (many, as in code), n-grams of 2 to
3 tokens (the ``prompt_lookup_min`` / ``_max`` of the tests), ``n`` = 1 and
4 sequences: "admit" builds what the engine builds for the request (a tree
with ``PredictionIndex`` one index shared by the drafters, an older one a
drafter each); "find" is the ``propose(4)`` right after an edit of 5 tokens
inserted and 5 skipped in the middle of the prediction, the outputs before
it already followed; "find again" the same after a second such edit 100
tokens on (the index's first lookup and a later one).

    git archive REV | tar -x -C /tmp/old
    python benchmarks/prediction_index.py . /tmp/old --names new old

Each figure is the median thread CPU time of 7 admissions (after one) and of
50 finds, the median of ``--rounds`` processes per tree, interleaved.
Writes benchmarks/results/prediction_index{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse

import tree_compare

_PROBE = tree_compare.TREE_PACKAGES + r'''
import json, random, statistics, time
from fluidserve.engine import speculative as sp

LO, HI = 2, 3
shared = hasattr(sp, "PredictionIndex")


def admit(pred, n):
    index = sp.PredictionIndex(pred, LO, HI) if shared else None
    out = []
    for _ in range(n):
        outputs = []
        ngram = sp.NgramDrafter([1, 2, 3], outputs, LO, HI)
        out.append(sp.PredictionDrafter(pred, outputs, ngram, index) if shared
                   else sp.PredictionDrafter(pred, outputs, ngram))
    return out


def timed(fn, calls):
    times = []
    for _ in range(calls):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return statistics.median(times)


figures = {}
for length in (1000, 10000, 30000):
    for vocab in (32000, 200):
        rng = random.Random(length + vocab)
        pred = [rng.randrange(vocab) for _ in range(length)]
        for n in (1, 4):
            admit(pred, n)
            figures[f"admit {length // 1000}k tokens of {vocab} ids, n={n}"] = timed(lambda: admit(pred, n), 7)
        mid = length // 2
        edit = [vocab + i for i in range(5)] + pred[mid + 5:mid + 8]  # 5 tokens in, 5 of the prediction out

        later = [vocab + 5 + i for i in range(5)] + pred[mid + 100:mid + 103]  # a second edit, further on

        def find():
            d = admit(pred, 1)[0]
            d._outputs.extend(pred[:mid])
            d.propose(4)  # on the prediction up to the edit (its outputs followed, and indexed by the n-grams)
            took = []
            for tokens in (edit, pred[mid + 8:mid + 100], later):
                d._outputs.extend(tokens)
                t = time.thread_time()
                d.propose(4)
                took.append(time.thread_time() - t)
            return took[0], took[2]

        find()
        first, again = zip(*(find() for _ in range(50)))
        figures[f"find {length // 1000}k tokens of {vocab} ids"] = statistics.median(first)
        figures[f"find again {length // 1000}k tokens of {vocab} ids"] = statistics.median(again)
print(json.dumps(figures))
'''


def _describe(cmd: str, args: argparse.Namespace, result: tree_compare.Comparison) -> str:
    return (f"Command: `{cmd}`; thread CPU time, median of {args.rounds} processes per tree (each the median of 7 "
            f"admissions or 50 finds), in brackets the lowest process's; {result.load()}. "
            "admit: what the engine builds as a request with a prediction is added (n-grams of 2-3 tokens; n "
            "sequences); find: a `propose(4)` after an edit (5 tokens inserted, 5 skipped mid-prediction), which "
            "looks the outputs' suffix up in the index; find again: the same after a second edit 100 tokens on.")


def main(argv: list[str] | None = None) -> int:
    return tree_compare.main(argv, doc=__doc__, probe=_PROBE, stem="prediction_index",
                             title="Host time of a predicted output's drafting on the engine's thread",
                             describe=_describe, what="case")


if __name__ == "__main__":
    raise SystemExit(main())
