"""What the Responses API costs over the chat route for the same
conversation: one ``fluidserve serve`` process, the same greedy request sent
in turn as ``POST /v1/chat/completions`` and as ``POST /v1/responses``
(whole and streamed), one at a time, so each latency is one request's own.

    python benchmarks/responses_overhead.py                       # the built-in tiny model
    python benchmarks/responses_overhead.py --model ~/models/SmolLM2-135M-Instruct --dtype float32
    python benchmarks/responses_overhead.py --model DIR --dtype float32 --with-data-dir

Per route and reply length: the median client latency over ``--rounds``
requests (whole: until the body; streamed: until the first text delta and
until the stream ends), the routes taking turns request by request so that
both see the same machine. The Responses route turns its body into the chat
body it stands for, renders the reply as a Response object and keeps it
(``store``); the difference of medians is that work, plus its bigger
response. ``--with-data-dir`` starts the server a second time in the same
run with ``--data-dir`` (a fresh folder), where each kept response is also
written to SQLite (``synchronous=FULL``) before its reply goes out. Writes
benchmarks/results/responses_overhead{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

import serve_bench

RESULTS = Path(__file__).resolve().parent / "results"
MESSAGES = [{"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is the capital of France, and why is it famous?"}]


def bodies(model: str, max_tokens: int, stream: bool) -> dict[str, dict]:
    common = {"model": model, "temperature": 0, "ignore_eos": True, "stream": stream}
    chat = {**common, "messages": MESSAGES, "max_tokens": max_tokens}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    responses = {**common, "instructions": MESSAGES[0]["content"], "input": MESSAGES[1]["content"],
                 "max_output_tokens": max_tokens}
    return {"chat": chat, "responses": responses}


def timed(client: httpx.Client, path: str, body: dict) -> tuple[float, float | None, int]:
    """(seconds to the whole reply, seconds to the first text, reply tokens)."""
    start = time.perf_counter()
    if not body["stream"]:
        r = client.post(path, json=body)
        r.raise_for_status()
        usage = r.json()["usage"]
        return time.perf_counter() - start, None, usage.get("completion_tokens", usage.get("output_tokens"))
    first, tokens = None, 0
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            text = (data.get("delta") if data.get("type") == "response.output_text.delta"
                    else (data.get("choices") or [{}])[0].get("delta", {}).get("content"))
            if text and first is None:
                first = time.perf_counter() - start
            usage = data.get("usage") or (data.get("response") or {}).get("usage")
            if usage:
                tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return time.perf_counter() - start, first, tokens


def measure(base: str, model: str, lengths: list[int], rounds: int) -> list[dict]:
    paths = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}
    rows = []
    with httpx.Client(base_url=base, timeout=300) as client:
        for stream in (False, True):
            for max_tokens in lengths:
                sent = bodies(model, max_tokens, stream)
                for name in paths:  # warm-up: the prefix cache and the first call's imports
                    timed(client, paths[name], sent[name])
                got: dict[str, list] = {name: [] for name in paths}
                for i in range(rounds):
                    order = list(paths) if i % 2 == 0 else list(paths)[::-1]
                    for name in order:
                        got[name].append(timed(client, paths[name], sent[name]))
                row = {"stream": stream, "max_tokens": max_tokens}
                for name, runs in got.items():
                    assert all(tokens == max_tokens for _, _, tokens in runs), (name, runs[:3])
                    row[f"{name}_ms"] = statistics.median(t for t, _, _ in runs) * 1e3
                    if stream:
                        row[f"{name}_first_ms"] = statistics.median(f for _, f, _ in runs) * 1e3
                row["extra_ms"] = row["responses_ms"] - row["chat_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def to_markdown(record: dict) -> str:
    lines = ["# The Responses API beside the chat route", "",
             f"`fluidserve serve` ({record['model']}; flags: `{' '.join(record['flags']) or 'none'}`"
             f"{'; started again with `--data-dir`' if len(record['stores']) > 1 else ''}), "
             f"one request at a time, the two routes taking turns; medians of {record['rounds']} requests each. "
             "The same greedy conversation (a system message and a question; `ignore_eos`), "
             "as `instructions` and `input` on `/v1/responses`; kept responses in memory, or with `--data-dir` "
             "in SQLite too.", "",
             "| kept | reply | tokens | chat ms | responses ms | responses - chat ms | chat first text ms | "
             "responses first text ms |", "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        kind = "streamed" if r["stream"] else "whole"
        firsts = (f"{r['chat_first_ms']:.2f} | {r['responses_first_ms']:.2f}" if r["stream"] else "- | -")
        lines.append(f"| {r.get('kept', 'memory')} | {kind} | {r['max_tokens']} | {r['chat_ms']:.2f} | "
                     f"{r['responses_ms']:.2f} | {r['extra_ms']:+.2f} | {firsts} |")
    lines += ["", f"`{record['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the built-in tiny model)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--with-data-dir", action="store_true",
                   help="also run the server with --data-dir, where kept responses go to SQLite too")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    flags = ([args.model] if args.model else []) + (["--dtype", args.dtype] if args.dtype else [])
    stores = {"memory": []}
    if args.with_data_dir:
        stores["sqlite"] = ["--data-dir", tempfile.mkdtemp(prefix="responses-overhead-")]
    base = f"http://127.0.0.1:{args.port}"
    rows = []
    for kept, extra in stores.items():
        proc = serve_bench.start_server(args.port, flags + extra)
        try:
            model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            rows += [{"kept": kept, **row} for row in measure(base, model, args.lengths, args.rounds)]
        finally:
            serve_bench.stop_server(proc)
    name = Path(args.model).name if args.model else "tiny (built in)"
    given = list(argv if argv is not None else sys.argv[1:])
    if args.model:  # the directory is the reader's own
        given = [("DIR" if a == args.model else a) for a in given]
    command = " ".join(["python benchmarks/responses_overhead.py", *given])
    record = {"model": name, "flags": flags[1:] if args.model else flags, "rounds": args.rounds, "rows": rows,
              "stores": list(stores), "command": command}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"responses_overhead{args.tag}"
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(to_markdown(record))
    print(to_markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
