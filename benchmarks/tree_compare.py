"""Running one probe against several source trees side by side (this tree and
a git checkout of an older commit, say), each in its own process so their
packages never mix, interleaved so a neighbour's load hits every tree alike;
and the table of the figures it printed.

A probe is Python source run as ``python -c PROBE TREE [ARGS...]``: it makes
``fluidserve`` the tree's packages and prints one JSON object, case -> seconds,
as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# The first lines of every probe: the tree's packages under the import name.
TREE_PACKAGES = ('import sys, types\n'
                 'pkg = types.ModuleType("fluidserve"); pkg.__path__ = [sys.argv[1]]\n'
                 'sys.modules["fluidserve"] = pkg\n')


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The trees, their labels, the processes per tree and where results go."""
    ap.add_argument("trees", nargs="+", help="source trees (the repository root of each)")
    ap.add_argument("--names", nargs="+", help="a label per tree for the table (default: the paths)")
    ap.add_argument("--rounds", type=int, default=3, help="processes per tree, interleaved")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="", help="appended to the result files' name")


@dataclass
class Comparison:
    names: dict[str, str]  # tree -> label
    runs: dict[str, list[dict[str, float]]]  # tree -> each process's figures
    rows: list[dict]  # ``compare``'s
    load_start: float  # the 1-minute load average before the first process

    @property
    def first(self) -> str:
        return next(iter(self.names.values()))

    @property
    def rest(self) -> list[str]:
        return list(self.names.values())[1:]

    def load(self) -> str:
        return f"load average {self.load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"


def run_trees(args: argparse.Namespace, probe: str, probe_args: list[str] = ()) -> Comparison:
    """``probe`` over ``args.trees`` (see ``add_arguments``), compared."""
    names = dict(zip(args.trees, args.names or args.trees))
    load_start = os.getloadavg()[0]
    runs = run_probes(probe, args.trees, args.rounds, probe_args)
    return Comparison(names, runs, compare(runs, names), load_start)


def run_probes(probe: str, trees: list[str], rounds: int, args: list[str] = ()) -> dict[str, list[dict[str, float]]]:
    """Each tree's figures, one dict per process, ``rounds`` processes a tree."""
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            done = subprocess.run([sys.executable, "-c", probe, str(Path(tree).resolve()), *args],
                                  capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"the probe failed on {tree}:\n{done.stderr[-3000:]}")
            runs[tree].append(json.loads(done.stdout.splitlines()[-1]))
    return runs


def compare(runs: dict[str, list[dict[str, float]]], names: dict[str, str]) -> list[dict]:
    """Per case, each tree's median over its processes and its lowest process,
    in ms: a process now and then runs 1.5-2x slower throughout (the
    machine's other load), which moves a median of few processes."""
    cases = list(next(iter(runs.values()))[0])
    return [{"shape": case,
             **{names[t]: statistics.median(r[case] for r in rs) * 1e3 for t, rs in runs.items()},
             "lowest": {names[t]: min(r[case] for r in rs) * 1e3 for t, rs in runs.items()}}
            for case in cases]


def save(out_dir: str, stem: str, cmd: str, result: Comparison, md: list[str]) -> None:
    """``stem``.json (the command, the compared rows and every process's
    figures) and ``stem``.md under ``out_dir``; the markdown printed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(
        {"command": cmd, "trees": list(result.names.values()), "rows": result.rows,
         "runs": {result.names[t]: rs for t, rs in result.runs.items()}}, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def table(rows: list[dict], first: str, rest: list[str], what: str = "step") -> list[str]:
    """Markdown: each tree's ms (the lowest process's in brackets), then each
    other tree's time over the first's."""
    md = ["| " + what + " | " + " | ".join(f"{n} (ms)" for n in (first, *rest))
          + "".join(f" | {n} / {first}" for n in rest) + " |",
          "|---|" + "---:|" * (1 + 2 * len(rest))]
    for r in rows:
        low = r["lowest"]
        md.append(f"| {r['shape']} | " + " | ".join(f"{r[n]:.3f} ({low[n]:.3f})" for n in (first, *rest))
                  + "".join(f" | {r[n] / r[first]:.1f}x ({low[n] / low[first]:.1f}x)" for n in rest) + " |")
    return md


def main(argv: list[str] | None, *, doc: str, probe: str, stem: str, title: str,
         describe: Callable[[str, argparse.Namespace, Comparison], str], what: str = "step") -> int:
    """The whole of a benchmark that takes no arguments but the trees': its
    probe over them, the table under ``title`` and ``describe(command, args,
    result)``, saved as ``stem``{--tag}."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    result = run_trees(args, probe)
    cmd = f"python benchmarks/{stem}.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"# {title}", "", describe(cmd, args, result), "", *table(result.rows, result.first, result.rest, what)]
    save(args.out_dir, f"{stem}{args.tag}", cmd, result, md)
    return 0
