"""Structured output with and without JSON whitespace: what a model writes
under a forced tool call or a JSON schema when the grammar lets it place
whitespace anywhere (the default) and when it allows compact JSON only
(``--structured-outputs-config '{"disable_any_whitespace": true}'``).

    python benchmarks/structured_whitespace.py --model ~/models/SmolLM2-135M-Instruct
    python benchmarks/structured_whitespace.py --model DIR --vllm-python ~/vllm-venv/bin/python

Each server is started in turn in one run, with each setting, and sent the
same greedy requests one at a time: ``tool_choice: "required"``, a named
tool, and a ``json_schema`` response format, each over ``--prompts`` user
turns. Per server, setting and case: how many replies closed their JSON
within ``--max-tokens`` (finish reason ``tool_calls`` or ``stop``), how many
followed its schema (a tool's parameters, or the response format's), the
mean reply tokens and seconds a reply, and the share of the replies' JSON
characters that are whitespace outside strings. Writes
benchmarks/results/structured_whitespace{--tag}.{json,md}.
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
import jsonschema

import serve_bench
from dummy_models import save_results

RESULTS = Path(__file__).resolve().parent / "results"
REQUIRED = 'tool_choice "required"'
TAIL = 60  # characters of each reply's JSON printed
# vLLM 0.32 takes disable_any_whitespace only with the backend named.
COMPACT = ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"]}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "Book a table at a restaurant",
        "parameters": {"type": "object", "properties": {
            "restaurant": {"type": "string"}, "people": {"type": "integer"}, "time": {"type": "string"}},
            "required": ["restaurant", "people", "time"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "hobbies"]}
QUESTIONS = [
    "What will the weather be like in Paris for the next three days?",
    "Book a table for four at Luigi's at 8pm, please.",
    "Is it going to rain in Tokyo this week? Give me Fahrenheit.",
    "I need a table for two at The Green Door tomorrow at noon.",
    "How warm will Lisbon be over the weekend?",
    "Reserve dinner for six people at Sakura at 19:30.",
    "Tell me the forecast for Oslo for the next five days in celsius.",
    "Can you get us a table at Chez Paul for three at 7 pm?",
]
PEOPLE = ["Ada, a 36-year-old mathematician who likes chess and poetry.",
          "Tom, 12, who plays football and collects stamps.",
          "Maria, a retired teacher of 70 who gardens, paints and swims.",
          "Ken, 25, a cook who loves hiking.",
          "Lena, 41, a pilot who reads and runs marathons.",
          "Sam, 8, who likes lego, drawing and cats.",
          "Priya, a 29-year-old doctor who plays the violin.",
          "Omar, 55, who fishes and does woodwork."]


def cases(model: str, n: int, max_tokens: int) -> dict[str, list[dict]]:
    common = {"model": model, "temperature": 0, "max_tokens": max_tokens}
    return {
        REQUIRED: [{**common, "messages": [{"role": "user", "content": q}], "tools": TOOLS,
                                    "tool_choice": "required"} for q in QUESTIONS[:n]],
        "named tool": [{**common, "messages": [{"role": "user", "content": q}], "tools": TOOLS,
                        "tool_choice": {"type": "function", "function": {"name": TOOLS[i % 2]["function"]["name"]}}}
                       for i, q in enumerate(QUESTIONS[:n])],
        "json_schema": [{**common, "messages": [{"role": "user", "content": f"Describe this person as JSON: {p}"}],
                         "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": PERSON}}}
                        for p in PEOPLE[:n]],
    }


def outside_whitespace(text: str) -> int:
    """Whitespace characters outside JSON strings."""
    count, in_string, escaped = 0, False, False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = ch == "\\", ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in " \t\r\n":
            count += 1
    return count


def reply_json(choice: dict) -> list[tuple[str, dict | None]]:
    """The JSON texts of a reply, each with the schema it must follow: each
    call's arguments (None: no tool of that name), or the content."""
    calls = choice["message"].get("tool_calls") or []
    if calls:
        return [(c["function"]["arguments"], SCHEMAS.get(c["function"]["name"])) for c in calls]
    return [(choice["message"].get("content") or "", PERSON)]


def follows(text: str, schema: dict | None) -> bool:
    """``text`` parses as JSON and follows ``schema``."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        jsonschema.validate(value, schema)
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return False
    return schema is not None


def measure(base: str, bodies: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    with httpx.Client(base_url=base, timeout=600) as client:
        client.post("/v1/chat/completions", json=bodies["json_schema"][0]).raise_for_status()  # warm-up
        for case, sent in bodies.items():
            rows = []
            for body in sent:
                start = time.perf_counter()
                r = client.post("/v1/chat/completions", json=body)
                seconds = time.perf_counter() - start
                if r.status_code != 200:  # a server that refuses the case: said in the table
                    out[case] = {"refused": f"{r.status_code}: {r.text[:300]}"}
                    print(f"{case}: refused, {out[case]['refused']}", flush=True)
                    break
                data = r.json()
                choice = data["choices"][0]
                texts = reply_json(choice)
                valid = bool(texts) and all(follows(t, schema) for t, schema in texts)
                texts = [t for t, _ in texts]
                rows.append({"finish_reason": choice["finish_reason"], "tokens": data["usage"]["completion_tokens"],
                             "seconds": seconds, "valid": valid,
                             "whitespace": sum(outside_whitespace(t) for t in texts),
                             "chars": sum(len(t) for t in texts)})
                # How each JSON text ends (closed, or the loop the limit cut): printed, not kept, as
                # the results hold figures, not a model's words.
                print(f"{case}: {choice['finish_reason']}, {rows[-1]['tokens']} tokens, ends "
                      f"{[t[-TAIL:] for t in texts]!r}", flush=True)
            if case in out:
                continue
            closed = sum(r["finish_reason"] in ("tool_calls", "stop") for r in rows)
            out[case] = {"replies": len(rows), "closed": closed, "valid": sum(r["valid"] for r in rows),
                         "mean_tokens": statistics.fmean(r["tokens"] for r in rows),
                         "mean_seconds": statistics.fmean(r["seconds"] for r in rows),
                         "rows": rows}
            # Under "required" the API re-serializes the calls it reads from the reply's array, so
            # their arguments do not show the whitespace the model wrote: its tokens do.
            if case != REQUIRED:
                out[case]["whitespace_share"] = (sum(r["whitespace"] for r in rows)
                                                 / max(1, sum(r["chars"] for r in rows)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory every server can load")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--vllm-python", default=None, help="a Python with vLLM installed")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--port", type=int, default=8095)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    fluid = [sys.executable, "-m", "fluidserve.serve.cli", "serve", args.model, "--dtype", args.dtype, *port,
             "--log-level", "warning"]
    servers: dict[str, tuple[list[str], dict]] = {"fluidserve": (fluid, {}),
                                                  "fluidserve, compact": (fluid + COMPACT, {})}
    if args.vllm_python:
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, *port,
                "--dtype", args.dtype, "--max-model-len", "4096", "--enforce-eager",
                # vLLM 0.32 refuses a forced tool call (required or named) without a parser set.
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        servers["vLLM"] = (vllm, {"VLLM_CPU_KVCACHE_SPACE": "2"})
        servers["vLLM, compact"] = (vllm + COMPACT, {"VLLM_CPU_KVCACHE_SPACE": "2"})
    scratch = Path(tempfile.mkdtemp(prefix="structured-ws-"))
    base = f"http://127.0.0.1:{args.port}"
    model_name = None
    results = {}
    for name, (cmd, env) in servers.items():
        # Started outside the repository: its top-level folders would shadow vLLM's imports.
        proc = serve_bench.launch(cmd, f"{base}/health", env, log=scratch / f"{name.replace(', ', '-')}.log",
                                  timeout=600, name=name, cwd=str(scratch))
        try:
            model_name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
            results[name] = measure(base, cases(model_name, args.prompts, args.max_tokens))
        finally:
            serve_bench.stop_server(proc)
    record = {"model": Path(args.model).name, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "prompts": args.prompts, "results": results}
    lines = ["# JSON whitespace under structured output", "",
             f"{record['model']} ({args.dtype}), greedy, `max_tokens` {args.max_tokens}, {args.prompts} user turns a "
             "case, one request at a time; each server started in turn in one run, by default and with "
             f"`{' '.join(COMPACT[:1])} '{COMPACT[1]}'` (compact). Closed: the reply's JSON ended "
             "within `max_tokens`; valid: every call named a tool and its arguments followed that tool's "
             "parameters, or the reply followed the response format's schema; whitespace: of the reply's JSON "
             "characters, those outside strings (not for `required`, whose calls the API re-serializes).",
             "", "| server | case | closed | valid | tokens a reply | s a reply | whitespace |",
             "|---|---|---|---|---|---|---|"]
    for name, per in results.items():
        for case, r in per.items():
            if "refused" in r:
                lines.append(f"| {name} | {case} | refused: {r['refused'][:160]} | | | | |")
                continue
            lines.append(f"| {name} | {case} | {r['closed']}/{r['replies']} | {r['valid']}/{r['replies']} | "
                         f"{r['mean_tokens']:.1f} | {r['mean_seconds']:.2f} | "
                         f"{'%.0f%%' % (100 * r['whitespace_share']) if 'whitespace_share' in r else '-'} |")
    save_results(RESULTS / f"structured_whitespace{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
