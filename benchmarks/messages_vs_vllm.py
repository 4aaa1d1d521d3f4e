"""Anthropic's Messages API side by side with vLLM's: the same model, the
same greedy requests on ``/v1/messages`` (a plain turn, a stop sequence, a
forced tool use), whole and streamed, and ``/v1/messages/count_tokens``.

    python benchmarks/messages_vs_vllm.py --model ~/models/SmolLM2-135M-Instruct \\
        --vllm-python ~/vllm-venv/bin/python

Each server is started in turn in one run (``--enable-auto-tool-choice
--tool-call-parser hermes`` on both: vLLM refuses a forced call without a
parser). Per case and server: whether the request was answered, its
``stop_reason`` and ``stop_sequence``, its usage, the number of streamed
events, whether the whole and streamed text agree, and whether the two
servers' replies are the same text. Writes
benchmarks/results/messages_vs_vllm{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

import serve_bench
from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {"name": "get_weather", "description": "Weather forecast",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CASES = {
    "plain": {"max_tokens": 60, "system": "You are a helpful assistant.",
              "messages": [{"role": "user", "content": QUESTION}]},
    "stop sequence": {"max_tokens": 60, "stop_sequences": ["Paris"],
                      "messages": [{"role": "user", "content": QUESTION}]},
    "forced tool use": {"max_tokens": 120, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
                        "messages": [{"role": "user", "content": "What's the weather in Berlin?"}]},
}


def reply(base: str, body: dict) -> dict:
    """One request whole and streamed: what each gave."""
    r = httpx.post(f"{base}/v1/messages", json=body, timeout=300)
    whole = r.json()
    text, events, ok = "", 0, r.status_code == 200 and "content" in whole
    with httpx.stream("POST", f"{base}/v1/messages", json={**body, "stream": True}, timeout=300) as s:
        for line in s.iter_lines():
            if line.startswith("event: "):
                events += 1
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                delta = data.get("delta") or {}
                text += delta.get("text") or delta.get("partial_json") or ""
    blocks = whole.get("content") or []
    whole_text = "".join(b.get("text") or json.dumps(b.get("input"), separators=(",", ":")) for b in blocks)
    streamed_same = text == whole_text or (bool(blocks) and blocks[-1].get("type") == "tool_use"
                                           and json.loads(text or "null") == blocks[-1].get("input"))
    return {"status": r.status_code, "answered": ok, "blocks": [b.get("type") for b in blocks],
            "stop_reason": whole.get("stop_reason"), "stop_sequence": whole.get("stop_sequence"),
            "usage": whole.get("usage"), "events": events, "whole_equals_stream": streamed_same,
            "text": whole_text, "error": (whole.get("error") or {}).get("message") if not ok else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory both servers can load")
    p.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--port", type=int, default=8097)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    servers = {
        "fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", args.model, *port, "--dtype", args.dtype,
                        *tools, "--log-level", "warning"], {}),
        "vLLM": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, *port,
                  "--dtype", args.dtype, "--max-model-len", "4096", "--enforce-eager", *tools],
                 {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    }
    scratch = Path(tempfile.mkdtemp(prefix="messages-vs-vllm-"))
    base = f"http://127.0.0.1:{args.port}"
    results: dict[str, dict[str, dict]] = {}
    for name, (cmd, env) in servers.items():
        # Started outside the repository: its top-level folders would shadow vLLM's imports.
        proc = serve_bench.launch(cmd, f"{base}/health", env, log=scratch / f"{name}.log", timeout=600, name=name,
                                  cwd=str(scratch))
        try:
            model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            for case, body in CASES.items():
                results.setdefault(case, {})[name] = reply(base, {"model": model, "temperature": 0, **body})
            counted = httpx.post(f"{base}/v1/messages/count_tokens", timeout=60, json={
                "model": model, "system": CASES["plain"]["system"], "messages": CASES["plain"]["messages"]}).json()
            results.setdefault("count_tokens", {})[name] = {"input_tokens": counted.get("input_tokens")}
        finally:
            serve_bench.stop_server(proc)
    lines = ["# Anthropic's Messages API beside vLLM", "",
             f"{Path(args.model).name} ({args.dtype}), greedy, each server started in turn in one run with "
             "`--enable-auto-tool-choice --tool-call-parser hermes`.", "",
             "| case | server | answered | blocks | stop_reason | usage | events streamed | whole = streamed "
             "| same text as the other |", "|---|---|---|---|---|---|---|---|---|"]
    for case, per in results.items():
        if case == "count_tokens":
            continue
        same = per["fluidserve"]["text"] == per["vLLM"]["text"] and per["fluidserve"]["answered"]
        for name, r in per.items():
            why = " ".join((r["error"] or "").split())[:90]
            answered = "yes" if r["answered"] else f"no ({r['status']}: {why})"
            usage = {k: v for k, v in (r["usage"] or {}).items() if k in ("input_tokens", "output_tokens")}
            lines.append(f"| {case} | {name} | {answered} | {', '.join(r['blocks'])} | {r['stop_reason']}"
                         f"{' ' + repr(r['stop_sequence']) if r['stop_sequence'] else ''} | {usage} | {r['events']} "
                         f"| {'yes' if r['whole_equals_stream'] else 'no'} | {'yes' if same else 'no'} |")
    counts = results["count_tokens"]
    lines += ["", f"count_tokens of the plain case: fluidserve {counts['fluidserve']['input_tokens']}, "
              f"vLLM {counts['vLLM']['input_tokens']}."]
    for per in results.values():  # the record keeps what was compared, not the replies' text
        for r in per.values():
            r.pop("text", None)
    save_results(RESULTS / f"messages_vs_vllm{args.tag}", {"model": Path(args.model).name, "results": results},
                 "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
