"""Predicted outputs (OpenAI's ``prediction``): what passing the text a
reply will repeat buys, side by side in one process with the same engine's
n-gram drafts alone and with no drafts at all.

A real model (SmolLM2-135M-Instruct, ``--model DIR`` from
``benchmarks/smollm2.py prepare``), greedy, through the chat template, each
prompt alone (the latency a user feels), two workloads:

* **edit** (``benchmarks/speculative.py``'s: fix the typos in a paragraph,
  add type hints to a function, rename a table in a query, ...): the
  prediction is the text the prompt asks to edit, as OpenAI's guide passes
  the file being edited. The n-gram lookup finds that text in the prompt
  anyway.
* **known reply**: open questions (``benchmarks/kv_cache_dtype.py``'s), the
  prediction the model's own reply to the same question under a system
  prompt ("You are a helpful assistant."): a reply an application holds
  from before (a regenerated answer, a cached one), which the prompt does
  not contain.

Per setting: the replies' output tokens a second, steps, the ratio to the
run without drafts, how many replies equal that run's, and for the
prediction the predicted tokens drafted and kept and thrown away.
``--rounds`` runs every setting that many times, interleaved, and keeps
each one's best round.

    python benchmarks/predicted_outputs.py --model /path/to/SmolLM2-135M-Instruct

Writes ``benchmarks/results/predicted_outputs{--tag}.{json,md}``. ``--server``
measures the same through ``fluidserve serve`` (default flags but the
prefix cache, off so that no setting finds the prompts another sent, and
``--speculative-config`` for the drafts): each chat request streamed alone
with the OpenAI body, its prediction in ``prediction``; per setting the
median time to the first token and per output token after it, tokens a
second, the replies against the run without drafts, and the usage's
prediction counts: ``predicted_outputs-server{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dummy_models import device_name, save_results
from kv_cache_dtype import CHAT_PROMPTS
from speculative import EDIT_PROMPTS, chat_ids, ngram

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("no drafts", "n-gram drafts", "n-gram drafts + prediction")
SYSTEM = "You are a helpful assistant."


def edited_text(prompt: str) -> str:
    """The text an edit prompt hands over: everything after its instruction,
    code fences and all."""
    return prompt.split("\n\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from fluidserve.engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as safetensors (smollm2.py prepare)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens (drafts chosen per step, the default)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--server", action="store_true", help="through fluidserve serve instead of in-process")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.server:
        return through_server(args)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    common = dict(model=args.model, device="cpu", dtype="float32", max_model_len=2048, enable_prefix_caching=False)
    engines = {"no drafts": LLM(**common),
               "n-gram drafts": LLM(**common, speculative_config=json.dumps(ngram(args.k)))}
    engines["n-gram drafts + prediction"] = engines["n-gram drafts"]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    with_system = [list(tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]) for p in CHAT_PROMPTS]
    workloads = {
        "edit": (chat_ids(args.model, EDIT_PROMPTS),
                 [tok.encode(edited_text(p), add_special_tokens=False) for p in EDIT_PROMPTS]),
        "known reply": (chat_ids(args.model, CHAT_PROMPTS),
                        [list(o.outputs[0].token_ids) for o in engines["no drafts"].generate(with_system, greedy)]),
    }

    def run(setting: str, prompts: list[list[int]], predictions: list[list[int]]) -> dict:
        llm = engines[setting]
        replies, steps, kept, thrown = [], 0, 0, 0
        start = time.perf_counter()
        for ids, predicted in zip(prompts, predictions):
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                    prediction_token_ids=predicted if setting.endswith("prediction") else None)
            before = llm.engine.stats().num_steps
            out = llm.generate([ids], params)[0].outputs[0]
            steps += llm.engine.stats().num_steps - before
            replies.append(list(out.token_ids))
            kept += out.accepted_prediction_tokens or 0
            thrown += out.rejected_prediction_tokens or 0
        wall = time.perf_counter() - start
        tokens = sum(len(r) for r in replies)
        return dict(wall_s=wall, output_tokens=tokens, tok_s=tokens / wall, steps=steps, replies=replies,
                    accepted_prediction_tokens=kept, rejected_prediction_tokens=thrown)

    prompts, predictions = workloads["edit"]
    for setting in SETTINGS:  # warm-up: every path once
        run(setting, prompts[:1], [p[:8] for p in predictions[:1]])
    best: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for name, (prompts, predictions) in workloads.items():
            for setting in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
                got = run(setting, prompts, predictions)
                if (name, setting) not in best or got["tok_s"] > best[name, setting]["tok_s"]:
                    best[name, setting] = got
                print(name, setting, f"{got['tok_s']:.1f} tok/s, {got['steps']} steps", flush=True)
    rows = []
    for name, (prompts, predictions) in workloads.items():
        base = best[name, "no drafts"]
        for setting in SETTINGS:
            b = best[name, setting]
            rows.append(dict(workload=name, setting=setting, tok_s=b["tok_s"], vs_no_drafts=b["tok_s"] / base["tok_s"],
                             steps=b["steps"], output_tokens=b["output_tokens"], wall_s=b["wall_s"],
                             same_replies=sum(a == c for a, c in zip(b["replies"], base["replies"])),
                             prompts=len(prompts), prediction_tokens=sum(len(p) for p in predictions),
                             accepted_prediction_tokens=b["accepted_prediction_tokens"],
                             rejected_prediction_tokens=b["rejected_prediction_tokens"]))
    record = dict(benchmark="predicted_outputs", command=" ".join(["benchmarks/predicted_outputs.py", *sys.argv[1:]]),
                  device=device_name("cpu"), torch_threads=torch.get_num_threads(), model=Path(args.model).name,
                  k=args.k, max_tokens=args.max_tokens, rounds=args.rounds, system=SYSTEM, rows=rows)
    save_results(RESULTS / f"predicted_outputs{args.tag}", record, to_markdown(record))
    return 0


def through_server(args: argparse.Namespace) -> int:
    """Every prompt of both workloads streamed alone as a chat request, to a
    server without drafts, then to one with n-gram drafts, with and without
    its prediction."""
    import httpx
    from serve_bench import launch, stop_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", args.model, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--log-level", "warning",
           "--no-enable-prefix-caching"]  # every setting sends the same prompts: each computes its own
    workloads = {"edit": [([{"role": "user", "content": p}], edited_text(p)) for p in EDIT_PROMPTS],
                 "known reply": [([{"role": "user", "content": p}], None) for p in CHAT_PROMPTS]}

    def one(client: httpx.Client, model: str, messages: list[dict], prediction: str | None) -> dict:
        body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if prediction is not None:
            body["prediction"] = {"type": "content", "content": prediction}
        start, first, usage, text = time.perf_counter(), None, None, []
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
                if delta and first is None:
                    first = time.perf_counter()
                text.append(delta or "")
                usage = chunk.get("usage") or usage
        end, n = time.perf_counter(), usage["completion_tokens"]
        details = usage.get("completion_tokens_details") or {}
        return dict(ttft=first - start, tpot=(end - first) / (n - 1) if n > 1 else None, tokens=n,
                    seconds=end - start, text="".join(text), kept=details.get("accepted_prediction_tokens"),
                    thrown=details.get("rejected_prediction_tokens"))

    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in (None, ngram(args.k)):
            flags = shlex.split(f"--speculative-config '{json.dumps(spec)}'") if spec else []
            proc = launch(cmd + flags, f"{base}/v1/models", None, Path(tmp) / "server.log", 600, "server",
                          cwd=tempfile.gettempdir())
            try:
                with httpx.Client(timeout=600) as client:
                    model = client.get(f"{base}/v1/models").json()["data"][0]["id"]
                    if spec is None:  # the known replies: the model's answers under a system prompt
                        workloads["known reply"] = [
                            (m, one(client, model, [{"role": "system", "content": SYSTEM}, *m], None)["text"])
                            for m, _ in workloads["known reply"]]
                    one(client, model, workloads["edit"][0][0], None)  # warm
                    for name, items in workloads.items():
                        settings = ("no drafts",) if spec is None else SETTINGS[1:]
                        for setting in settings:
                            runs[name, setting] = [one(client, model, m, p if setting.endswith("prediction") else None)
                                                   for m, p in items]
            finally:
                stop_server(proc)
    rows = []
    for name in workloads:
        off = runs[name, "no drafts"]
        off_rate = sum(r["tokens"] for r in off) / sum(r["seconds"] for r in off)
        for setting in SETTINGS:
            reqs = runs[name, setting]
            rate = sum(r["tokens"] for r in reqs) / sum(r["seconds"] for r in reqs)
            rows.append(dict(workload=name, setting=setting, tok_s=rate, vs_no_drafts=rate / off_rate,
                             median_ttft_ms=1000 * statistics.median(r["ttft"] for r in reqs),
                             median_tpot_ms=1000 * statistics.median(r["tpot"] for r in reqs if r["tpot"]),
                             same_replies=sum(a["text"] == b["text"] for a, b in zip(reqs, off)), prompts=len(reqs),
                             accepted_prediction_tokens=sum(r["kept"] or 0 for r in reqs),
                             rejected_prediction_tokens=sum(r["thrown"] or 0 for r in reqs)))
    record = dict(benchmark="predicted_outputs-server", device=device_name("cpu"), model=Path(args.model).name,
                  command=" ".join(["benchmarks/predicted_outputs.py", *sys.argv[1:]]), k=args.k,
                  max_tokens=args.max_tokens, system=SYSTEM, rows=rows)
    save_results(RESULTS / f"predicted_outputs-server{args.tag}", record, server_markdown(record))
    return 0


def server_markdown(r: dict) -> str:
    lines = [f"# Predicted outputs through fluidserve serve: {r['model']}", "",
             f"Command: `{r['command']}`; {r['device']}. Each chat request streamed alone (OpenAI's body, "
             f"`prediction` in it), greedy, up to {r['max_tokens']} tokens; a server with default flags but "
             "`--no-enable-prefix-caching` (each setting computes the prompts the others sent too), then one "
             f"with `--speculative-config` (n-gram, up to {r['k']} drafts chosen per step) without and with the "
             "predictions of the in-process run's two workloads. Prediction counts from the usage chunk.", "",
             "| workload | setting | median TTFT ms | median TPOT ms | output tok/s | vs no drafts | same replies "
             "| prediction tokens kept / thrown away |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in r["rows"]:
        counts = (f"{row['accepted_prediction_tokens']} / {row['rejected_prediction_tokens']}"
                  if row["setting"].endswith("prediction") else "–")
        lines.append(f"| {row['workload']} | {row['setting']} | {row['median_ttft_ms']:.1f} | "
                     f"{row['median_tpot_ms']:.1f} | {row['tok_s']:.1f} | {row['vs_no_drafts']:.2f}x | "
                     f"{row['same_replies']} of {row['prompts']} | {counts} |")
    return "\n".join(lines) + "\n"


def to_markdown(r: dict) -> str:
    lines = [f"# Predicted outputs: {r['model']}", "",
             f"Command: `{r['command']}`; {r['device']}. Each prompt alone through the chat template, greedy, up to "
             f"{r['max_tokens']} tokens; n-gram drafts up to {r['k']} a step, chosen per step (the default). "
             "**edit**: the prediction is the text each prompt asks to edit, which the prompt holds too. "
             f"**known reply**: the prediction is the model's reply to the same question under the system prompt "
             f"\"{r['system']}\", which the prompt does not hold. Best of {r['rounds']} interleaved rounds.", "",
             "| workload | setting | output tok/s | vs no drafts | steps | same replies as no drafts "
             "| prediction tokens kept | prediction tokens thrown away |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        kept, thrown = "–", "–"
        if row["setting"].endswith("prediction"):
            kept = f"{row['accepted_prediction_tokens']} of {row['prediction_tokens']}"
            thrown = str(row["rejected_prediction_tokens"])
        lines.append(f"| {row['workload']} | {row['setting']} | {row['tok_s']:.1f} | {row['vs_no_drafts']:.2f}x | "
                     f"{row['steps']} | {row['same_replies']} of {row['prompts']} | {kept} | {thrown} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
