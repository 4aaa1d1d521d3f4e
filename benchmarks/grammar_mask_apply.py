"""What putting a step's grammar masks on its logits costs, by where the
constrained rows sit among the step's sampling rows.

``TokenMask.apply`` (engine/structured.py) holds one mask row per
constrained row. Consecutive rows take it through a view of those logits
rows; rows apart have each mask row moved to its logits row's place and
xgrammar applies them by index. Timed side by side with the other way to
reach rows apart, gathering the constrained logits rows into a block,
masking the block and writing it back, on the same logits, rounds
alternating; median microseconds per call.

    python3 benchmarks/grammar_mask_apply.py
    python3 benchmarks/grammar_mask_apply.py --vocab 32000 --device cuda

Writes benchmarks/results/grammar_mask_apply-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dummy_models import device_slug, run_record, save_results  # noqa: E402

from fluidserve.engine.structured import TokenMask, xgrammar  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def gathered(mask: TokenMask, logits: torch.Tensor) -> None:
    """The other way: the constrained rows gathered, masked, written back."""
    block = logits[mask.rows]
    xgrammar().apply_token_bitmask_inplace(block, mask.bitmask.to(logits.device), vocab_size=mask.vocab_size)
    logits[mask.rows] = block


def timed(fn, logits: torch.Tensor, mask: TokenMask, calls: int) -> float:
    sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(mask, logits)
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args(argv)
    command = " ".join(map(shlex.quote, ["python3", "benchmarks/grammar_mask_apply.py",
                                         *(sys.argv[1:] if argv is None else argv)]))
    record = run_record("grammar_mask_apply", args.device, benchmark="grammar mask apply", vocab=args.vocab,
                        rounds=args.rounds, calls=args.calls, command=command)
    if record is None:
        return 1
    device = torch.device(args.device)
    cases = [(16, list(range(c))) for c in (1, 4, 8)] + [(16, list(range(1, 2 * c, 2))) for c in (4, 8)]
    cases += [(256, list(range(0, 256, 32))), (256, list(range(1, 256, 2)))]
    xgr = xgrammar()
    rows_out = []
    for num_rows, constrained in cases:
        logits = torch.randn(num_rows, args.vocab, device=device)
        mask = TokenMask(xgr.allocate_token_bitmask(len(constrained), args.vocab), constrained, args.vocab)
        ways = {"engine": TokenMask.apply, "gathered": gathered}
        for fn in ways.values():  # warm-up
            timed(fn, logits, mask, 3)
        times: dict[str, list[float]] = {k: [] for k in ways}
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                times[name].append(timed(ways[name], logits, mask, args.calls))
        med = {k: statistics.median(v) for k, v in times.items()}
        consecutive = constrained[-1] - constrained[0] + 1 == len(constrained)
        rows_out.append({"rows": num_rows, "constrained": len(constrained), "consecutive": consecutive,
                         "engine_us": med["engine"], "gathered_us": med["gathered"],
                         "gathered_over_engine": med["gathered"] / med["engine"]})
        print(f"{len(constrained):3d} of {num_rows:3d} rows, {'consecutive' if consecutive else 'apart':11s}: "
              f"engine {med['engine']:8.1f} us, gathered {med['gathered']:8.1f} us "
              f"({med['gathered'] / med['engine']:.1f}x)", flush=True)
    slug = "cpu" if device.type == "cpu" else device_slug(record["device"])
    record["results"] = rows_out
    lines = ["# Grammar masks onto a step's logits, by where the constrained rows sit", "",
             f"Vocabulary {args.vocab}, {record['device']}, torch {torch.__version__}; median of {args.rounds} "
             f"alternating rounds of {args.calls} calls each. `engine`: `TokenMask.apply` (a view of consecutive "
             "rows; mask rows moved to their places for rows apart); `gathered`: the constrained logits rows "
             "gathered, masked and written back.", "",
             f"Command: `{command}`", "",
             "| sampling rows | constrained | placed | engine us | gathered us | gathered / engine |",
             "|---:|---:|---|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['constrained']} | {'consecutive' if r['consecutive'] else 'apart'} | "
              f"{r['engine_us']:.1f} | {r['gathered_us']:.1f} | {r['gathered_over_engine']:.1f}x |" for r in rows_out]
    save_results(RESULTS / f"grammar_mask_apply-{slug}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
