"""What a request with a long predicted output (OpenAI's ``prediction``) costs
the requests already streaming, through ``fluidserve serve``, for one or
more source trees side by side (this tree and a git checkout of an older
commit, say), each tree's server in a process of its own.

Each server runs a tiny random-weight Llama with a 32k context (a
prediction may be as long as the model's context) on the CPU with the
default flags but ``--speculative-config`` (a prediction drafts only with
speculative decoding on). A completion streams 400 tokens; after its 40th chunk a chat
request arrives with ``n`` = 4 and either a prediction of ``--chars``
characters (the tiny model's byte tokenizer: as many tokens) or none
("plain", the same request's own cost). Per case: the longest gap between
the stream's chunks from the second request's sending to the stream's end,
and the median gap, in ms; the median over ``--rounds`` rounds, the trees
and cases interleaved.

    git archive REV | tar -x -C /tmp/old
    python benchmarks/prediction_stall.py . /tmp/old --names new old

Writes benchmarks/results/prediction_stall{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import tree_compare

MODEL = "tiny"
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
_SERVE = tree_compare.TREE_PACKAGES + "from fluidserve.serve.cli import main\nraise SystemExit(main(sys.argv[2:]))\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: str, model: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(Path(tree).resolve()), "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--model", model, "--served-model-name", MODEL,
                             "--speculative-config", json.dumps(SPECULATIVE)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server of {tree} did not start")


def one_round(base: str, prediction: str | None) -> tuple[float, float]:
    """(longest, median) gap in ms between the stream's chunks from the
    second request's sending on."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Edit this."}], "max_tokens": 1, "n": 4,
            "temperature": 0.8}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    sent: list[float] = []
    answers: list[httpx.Response] = []

    def second() -> None:
        sent.append(time.perf_counter())
        answers.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120))

    arrivals, helper = [], None
    stream = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=stream, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == 40:
                helper = threading.Thread(target=second)
                helper.start()
    helper.join()
    answers[0].raise_for_status()  # the second request was served, its prediction taken
    after = [t for t in arrivals if t >= sent[0]]
    gaps = [1e3 * (b - a) for a, b in zip(after, after[1:])]
    return max(gaps), statistics.median(gaps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_compare.add_arguments(ap)
    ap.add_argument("--chars", type=int, default=30000, help="characters (tokens) of the prediction")
    args = ap.parse_args(argv)
    names = dict(zip(args.trees, args.names or args.trees))
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "return", "value", "self", "index", "=", "(", ")", ":"]
    prediction = ""
    while len(prediction) < args.chars:
        prediction += rng.choice(words) + " "
    prediction = prediction[:args.chars]
    from fluidserve.engine.tiny_model import build_tiny_model

    model = str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-32k", "llama", max_position_embeddings=32768))
    servers = {tree: start(tree, model) for tree in args.trees}
    cases = {"plain": None, f"prediction of {args.chars} tokens": prediction}
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {t: {c: [] for c in cases} for t in args.trees}
    try:
        for tree, (_, base) in servers.items():
            one_round(base, None)  # warm-up
        for _ in range(args.rounds):
            for case, pred in cases.items():
                for tree, (_, base) in servers.items():
                    runs[tree][case].append(one_round(base, pred))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    cmd = "python benchmarks/prediction_stall.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = ["# A long predicted output's cost to the requests already streaming, through the server", "",
          f"Command: `{cmd}`; a tiny random-weight Llama with a 32k context on the CPU, default flags but "
          f"`--speculative-config {json.dumps(SPECULATIVE)}`; a 400-token completion streams while a chat "
          "request with n=4 arrives after its 40th chunk, with or without a prediction; the stream's longest "
          f"and median gap between chunks from then on, ms, median of {args.rounds} rounds.", "",
          "| case | " + " | ".join(f"{names[t]}: longest gap | {names[t]}: median gap" for t in args.trees) + " |",
          "|---|" + "---:|" * (2 * len(args.trees))]
    rows = []
    for case in cases:
        cells, row = [], {"case": case}
        for tree in args.trees:
            longest = statistics.median(r[0] for r in runs[tree][case])
            median = statistics.median(r[1] for r in runs[tree][case])
            row[names[tree]] = {"longest_gap_ms": longest, "median_gap_ms": median}
            cells += [f"{longest:.1f}", f"{median:.1f}"]
        rows.append(row)
        md.append(f"| {case} | " + " | ".join(cells) + " |")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prediction_stall{args.tag}.json").write_text(json.dumps(
        {"command": cmd, "rows": rows, "runs": {names[t]: v for t, v in runs.items()}}, indent=1) + "\n")
    (out / f"prediction_stall{args.tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
