"""Reasoning output side by side with vLLM: the same model, the same greedy
requests, each reply's ``reasoning``, ``content`` and reasoning token count
from fluidserve and from vLLM, under each reasoning parser both have.

    python benchmarks/reasoning_vs_vllm.py --vllm-python ~/vllm-venv/bin/python

The model is the tiny random one with ``<think>`` and ``</think>`` added
(``engine/tiny_model.py``'s ``build_tiny_thinking_model``, heads of 64), in fp32, so both
servers pick the same greedy tokens; the requests steer it (``logit_bias``
on the markers, letters only) so that replies think and answer, repeat a
marker, never close their thinking, or come with thinking turned off; one
caps the thinking with ``thinking_token_budget``, and one asks for a JSON
schema that applies after the thinking. A request
counts as agreeing when both servers gave the same tokens and the same
split of them, whole and streamed. Disagreements are printed in full.
Writes benchmarks/results/reasoning_vs_vllm{--tag}.{json,md}.
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
from fluidserve.engine.tiny_model import BYTE_VOCAB_SIZE, build_tiny_thinking_model

RESULTS = Path(__file__).resolve().parent / "results"
THINK, END = BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1
LETTERS = list(range(ord("a"), ord("z") + 1)) + [ord(" ")]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
# Those whose markers the tiny model's <think> tokens are (mistral's [THINK] needs vLLM's Mistral tokenizer,
# granite's and olmo3's text markers cannot be steered to by logit bias).
PARSERS = ("deepseek_r1", "qwen3", "ernie45", "glm45")


def cases(model: str) -> dict[str, dict]:
    """Named chat bodies: greedy, letters and markers only, each marker's
    logit moved by its own amount, so that replies think and answer, never
    close their thinking, open it again, or close it at once."""
    out = {}
    for prompt, think, end in [("Think first.", 0, 1), ("Think first.", 0, 2), ("Think first.", -5, 2),
                               ("Hello", 0, 1), ("Hello", -5, 2), ("Why is the sky blue?", -5, 2),
                               ("Count to three.", 0, 2)]:
        out[f"{prompt} <think> {think:+d}, </think> {end:+d}"] = {
            "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
            "allowed_token_ids": LETTERS + [THINK, END], "logit_bias": {str(THINK): think, str(END): end}}
    out["thinking off"] = {**out["Hello <think> -5, </think> +2"], "chat_template_kwargs": {"enable_thinking": False}}
    # The end marker never chosen freely: only the budget ends the thinking.
    out["thinking_token_budget 5"] = {**out["Hello <think> +0, </think> +1"], "thinking_token_budget": 5,
                                      "logit_bias": {str(END): -50}}
    out["schema after thinking"] = {
        "messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 40,
        "allowed_token_ids": list(range(33, 127)) + [END, THINK, 257], "logit_bias": {str(END): 3.0},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    return {name: {"model": model, "temperature": 0, "return_token_ids": True, **body} for name, body in out.items()}


def ask(base: str, body: dict) -> dict:
    """One reply, whole and streamed: its tokens, reasoning, content and reasoning tokens."""
    whole = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=300).json()
    if "choices" not in whole:
        return {"error": whole.get("error", whole)}
    choice, usage = whole["choices"][0], whole["usage"]
    got = {"token_ids": choice["token_ids"], "reasoning": choice["message"].get("reasoning"),
           "content": choice["message"].get("content"), "finish_reason": choice["finish_reason"],
           "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")}
    streamed = {"reasoning": "", "content": ""}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    for key in streamed:
                        streamed[key] += c["delta"].get(key) or ""
    got["streamed"] = streamed
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    p.add_argument("--port", type=int, default=8096)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="reasoning-vs-vllm-"))
    # vLLM's CPU attention takes no head of 16 (the tiny model's default).
    model = str(build_tiny_thinking_model(scratch / "model", head_dim=64))
    base = f"http://127.0.0.1:{args.port}"
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    results: dict[str, dict[str, dict[str, dict]]] = {}
    for parser in PARSERS:
        servers = {
            "fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", model, *port, "--dtype", "float32",
                            "--reasoning-parser", parser, "--log-level", "warning"], {}),
            "vLLM": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *port,
                      "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--reasoning-parser", parser],
                     {"VLLM_CPU_KVCACHE_SPACE": "1"}),
        }
        for name, (cmd, env) in servers.items():
            # Started outside the repository: its top-level folders would shadow vLLM's imports.
            proc = serve_bench.launch(cmd, f"{base}/health", env, log=scratch / f"{name}-{parser}.log", timeout=600,
                                      name=name, cwd=str(scratch))
            try:
                served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
                results.setdefault(parser, {})[name] = {case: ask(base, body) for case, body in cases(served).items()}
            finally:
                serve_bench.stop_server(proc)
    lines = ["# Reasoning output beside vLLM", "",
             "The tiny random model with `<think>` and `</think>` added (fp32, heads of 64), greedy requests steered "
             "towards the markers, one server at a time in one run, each with `--reasoning-parser` set. Whole: the "
             "two servers' `reasoning` and `content` of the whole reply agree; streamed: their `delta.reasoning` "
             "and `delta.content` joined agree; whole = streamed: a server's two forms of the same reply agree.", "",
             "| parser | case | tokens same | whole same | streamed same | fluidserve whole = streamed "
             "| vLLM whole = streamed | reasoning tokens (fluidserve / vLLM) |",
             "|---|---|---|---|---|---|---|---|"]
    summary: dict[str, dict[str, dict]] = {}  # the record keeps the comparison, not the (noise) text

    def whole(r: dict) -> dict:
        return {"reasoning": r["reasoning"] or "", "content": r["content"] or ""}

    for parser, per in results.items():
        ours, theirs = per["fluidserve"], per["vLLM"]
        for case in ours:
            a, b = ours[case], theirs[case]
            if "error" in a or "error" in b:
                lines.append(f"| {parser} | {case} | error: {a.get('error') or b.get('error')} | | | | | |")
                summary.setdefault(parser, {})[case] = {"error": str(a.get("error") or b.get("error"))}
                continue
            row = {"tokens_same": a["token_ids"] == b["token_ids"], "whole_same": whole(a) == whole(b),
                   "streamed_same": a["streamed"] == b["streamed"],
                   "fluidserve_consistent": whole(a) == a["streamed"], "vllm_consistent": whole(b) == b["streamed"],
                   "tokens": [len(a["token_ids"]), len(b["token_ids"])],
                   "reasoning_tokens": [a["reasoning_tokens"], b["reasoning_tokens"]]}
            summary.setdefault(parser, {})[case] = row
            lines.append(f"| {parser} | {case} | " + " | ".join("yes" if row[k] else "no" for k in (
                "tokens_same", "whole_same", "streamed_same", "fluidserve_consistent", "vllm_consistent"))
                + f" | {a['reasoning_tokens']} / {b['reasoning_tokens']} |")
            if not (row["whole_same"] and row["streamed_same"]):
                print(f"{parser} / {case}:\n  fluidserve {json.dumps(a)}\n  vLLM       {json.dumps(b)}")
    counts = {k: sum(r.get(k, False) for per in summary.values() for r in per.values())
              for k in ("tokens_same", "whole_same", "streamed_same", "fluidserve_consistent", "vllm_consistent")}
    total = sum(len(per) for per in summary.values())
    lines += ["", f"Of {total} replies: tokens the same {counts['tokens_same']}, whole split the same "
              f"{counts['whole_same']}, streamed split the same {counts['streamed_same']}; whole = streamed "
              f"{counts['fluidserve_consistent']} for fluidserve, {counts['vllm_consistent']} for vLLM."]
    record = {"parsers": list(PARSERS), "total": total, **counts, "results": summary}
    save_results(RESULTS / f"reasoning_vs_vllm{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
