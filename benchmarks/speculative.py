"""``--speculative-config`` (n-gram drafts): what verifying drafts buys and
costs, each setting side by side in one process, and vLLM's n-gram drafting
over the same prompts (``--vllm-python``).

A real model (SmolLM2-135M-Instruct, ``--model DIR`` from
``benchmarks/smollm2.py prepare``), greedy, workloads through its chat
template:

* **edit**: the reply repeats much of the prompt (fix the typos in a
  paragraph, add type hints to a function, rename a table in a query):
  where n-gram drafts stand.
* **chat**: open questions, where the reply seldom repeats the prompt:
  what the drafts cost when they fail.

* **mixed**: both, interleaved, as one burst only: sequences whose drafts
  stand beside sequences whose drafts fail, in the same steps.
* **extract**: a message's sender, email, company, city and request as
  JSON of a schema (the replies constrained by it, as response_format's
  json_schema does): grammar rows whose values repeat the prompt.

``--workloads`` picks some of them.

Each workload runs at batch 1 (one request at a time: the latency a user
feels) and as one burst of all its prompts. Settings: ``--k`` every draft
verified (vLLM's behaviour; ``"adaptive": false`` for fluidserve),
``--up-to`` drafts only up to a batch size, ``--adaptive-k`` drafts chosen
per step (fluidserve's default; engine/draft_policy.py), ``--async-k`` those with
``--async-scheduling`` too (steps that carry no drafts go ahead). Per setting: output tokens a
second (prefill included), the ratio to the run without drafts, the share
of draft tokens that stood, tokens kept per verifying step, and how many
replies equal the run without drafts'. ``--rounds`` runs every setting
that many times, settings interleaved, and keeps each one's best round.

    python benchmarks/speculative.py --model /path/to/SmolLM2-135M-Instruct [--vllm-python VENV/bin/python]

Writes ``benchmarks/results/speculative{--tag}.{json,md}``. ``--server``
measures the same prompts through ``fluidserve serve`` and vLLM's server
instead, each prompt streamed alone (TTFT, TPOT, tokens a second), without
drafts and with them: ``speculative-server{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dummy_models import device_name, save_results
from kv_cache_dtype import CHAT_PROMPTS

RESULTS = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 2048
LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
EDIT_PROMPTS = [
    "Correct the spelling mistakes in this paragraph and return the whole corrected paragraph:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the vilage, and the childern were "
    "playing in the park. Their parents watched from the benchs, talking about the wether and the upcoming "
    "festival.",
    "Add type hints to this Python function and return the whole function:\n\n```python\n"
    "def merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n        if key in result:\n"
    "            result[key] = result[key] + value\n        else:\n            result[key] = value\n"
    "    return result\n```",
    "Rename the table users to customers in this SQL query and return the full query:\n\n"
    "SELECT users.id, users.name, orders.total FROM users JOIN orders ON orders.user_id = users.id "
    "WHERE users.active = 1 ORDER BY orders.total DESC LIMIT 10;",
    "Convert this list into a numbered list, keeping every item:\n\n- buy milk\n- call the plumber about the "
    "kitchen sink\n- send the report to Maria\n- book train tickets to Lyon\n- water the plants on the balcony",
    "Rewrite this email so it is more polite, keeping every detail:\n\nSend me the invoice for order 4471 by "
    "Friday. The delivery to 12 Harbour Street was two days late and the box was damaged. Fix it.",
    "Add a docstring to this function and return the whole function:\n\n```python\n"
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    out = []\n    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i:i + window]) / window)\n"
    "    return out\n```",
    "Put this address into one line, separated by commas:\n\nDr. Emily Carter\nDepartment of Physics\n"
    "University of Northfield\n221 College Road\nNorthfield, NF 20451\nUnited Kingdom",
    "Change every temperature in this text from Celsius to say 'degrees Celsius' in full:\n\n"
    "Monday will be 21C and sunny. Tuesday drops to 15C with rain in the afternoon. By Thursday it is back to "
    "19C, and the weekend stays near 18C with light winds.",
]
# The two, interleaved, as one burst: sequences whose drafts stand beside
# sequences whose drafts fail, in the same steps.
MIXED = [p for pair in itertools.zip_longest(EDIT_PROMPTS, CHAT_PROMPTS) for p in pair if p is not None]
# Fields copied from a text into JSON of a schema: each reply follows the
# schema (response_format's json_schema), its values repeat the prompt.
EXTRACT_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string"}, "company": {"type": "string"},
    "city": {"type": "string"}, "request": {"type": "string"}},
    "required": ["name", "email", "company", "city", "request"], "additionalProperties": False}
EXTRACT_PROMPTS = [
    "Extract the sender's name, email, company, city and request from this message as JSON:\n\n" + text
    for text in (
        "Hello, this is Maria Gonzalez (maria.gonzalez@northwind-traders.com) from Northwind Traders in Seville. "
        "Could you send us the updated price list for the spring catalogue?",
        "Hi team, Tom Becker here, from Becker & Sons Logistics in Hamburg (tom.becker@beckerlogistics.de). "
        "We need to reschedule the delivery of order 5512 to next Tuesday.",
        "Good morning. My name is Aiko Tanaka, I work for Sakura Design Studio in Osaka. Please reset the password "
        "of the account aiko.tanaka@sakuradesign.jp, which is locked.",
        "Dear support, Pierre Lambert of Lambert Boulangerie, Lyon. Our card reader stopped working this morning; "
        "please send a technician. You can reach me at pierre@lambert-boulangerie.fr.",
        "This is Grace Okafor from Lagos, at Brightpath Solar (g.okafor@brightpathsolar.ng). We would like a quote "
        "for forty solar panels for a school roof.",
        "Hey, Lars Nilsson, Nordic Timber AB, Umea. Email lars.nilsson@nordictimber.se. Can you confirm that the "
        "invoice 2024-118 was paid in full?",
        "Greetings from Buenos Aires. I am Sofia Romero of Romero Hermanos Wines, sofia@romerohermanos.com.ar, and "
        "I want to cancel the tasting event booked for the 14th.",
        "Hi, it's Daniel Cohen from Cohen Analytics in Tel Aviv, daniel.cohen@cohenanalytics.io. Please add two "
        "more seats to our subscription starting next month.",
    )
]
WORKLOADS = {"edit": EDIT_PROMPTS, "chat": CHAT_PROMPTS, "mixed": MIXED, "extract": EXTRACT_PROMPTS}
MODES = {"edit": ("batch1", "burst"), "chat": ("batch1", "burst"), "mixed": ("burst",),
         "extract": ("batch1", "burst")}
SCHEMAS = {"extract": EXTRACT_SCHEMA}  # the workloads whose replies a JSON schema constrains


def ngram(k: int, up_to_batch: int | None = None, adaptive: bool | None = None) -> dict:
    """vLLM's config of ``k`` drafts; with ``up_to_batch``, none in steps of
    more sequences; ``adaptive`` (fluidserve's key; None: not given)."""
    config = {"method": "ngram", "num_speculative_tokens": k, **LOOKUP}
    if up_to_batch is not None:
        config["num_speculative_tokens_per_batch_size"] = [[1, up_to_batch, k], [up_to_batch + 1, 4096, 0]]
    if adaptive is not None:
        config["adaptive"] = adaptive
    return config


ASYNC = ", async"  # a setting's name ends so where its engine runs with --async-scheduling


def settings_of(ks: list[int], up_to: list[str], adaptive_ks: list[int] = (),
                async_ks: list[int] = ()) -> dict[str, dict | None]:  # fmt: skip
    """Setting name -> --speculative-config (None: off). ``ks``: every draft
    verified (vLLM's behaviour; given to fluidserve as "adaptive": false);
    ``up_to``: "K:B" pairs; ``adaptive_ks``: fluidserve's default, drafts
    chosen per step; ``async_ks``: the same with async scheduling, whose
    steps without drafts go ahead. vLLM's settings are those of ``ks``."""
    fixed = False if adaptive_ks or up_to else None
    out: dict[str, dict | None] = {"off": None, **{f"ngram k={k}": ngram(k, adaptive=fixed) for k in ks}}
    for pair in up_to:
        k, b = map(int, pair.split(":"))
        out[f"ngram k={k}, batch <= {b}"] = ngram(k, b)
    for k in adaptive_ks:
        out[f"ngram k={k}, adaptive"] = ngram(k)
    for k in async_ks:
        out[f"ngram k={k}, adaptive{ASYNC}"] = ngram(k)
    return out


def chat_ids(model: str, prompts: list[str]) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for p in prompts]


def timed_runs(generate, prompts: list[list[int]], modes: tuple[str, ...]) -> dict:
    """Batch 1 (each prompt alone) and one burst of them all, of ``modes``:
    wall seconds and output tokens of each, with the replies."""
    out = {}
    if "batch1" in modes:
        start = time.perf_counter()
        replies = [generate([p])[0] for p in prompts]
        out["batch1"] = dict(seconds=time.perf_counter() - start, tokens=sum(map(len, replies)), replies=replies)
    start = time.perf_counter()
    replies = generate(prompts)
    out["burst"] = dict(seconds=time.perf_counter() - start, tokens=sum(map(len, replies)), replies=replies)
    return out


def ours(model: str, settings: dict[str, dict | None], workloads: dict[str, list[list[int]]], tokens: int,
         rounds: int) -> dict:
    """Every setting's engine built once, then each round runs them in turn."""
    from fluidserve.engine import LLM, SamplingParams
    from fluidserve.engine.sampling_params import StructuredOutputs

    def params_of(wl: str) -> SamplingParams:
        schema = SCHEMAS.get(wl)
        return SamplingParams(temperature=0.0, max_tokens=tokens,
                              structured_outputs=StructuredOutputs(json=json.dumps(schema)) if schema else None)

    llms = {}
    for name, config in settings.items():
        extra = {"speculative_config": config} if config else {}
        if name.endswith(ASYNC):
            extra["async_scheduling"] = True
        llms[name] = LLM(model, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, cpu_kv_cache_gb=0.5,
                         **extra)
        for wl, prompts in workloads.items():  # warm, a grammar's compiled one included
            llms[name].generate([prompts[0]], dataclasses.replace(params_of(wl), max_tokens=8))

    best: dict = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            for wl, prompts in workloads.items():
                before = _spec_counts(llm)
                params = params_of(wl)
                runs = timed_runs(lambda ps: [list(o.outputs[0].token_ids) for o in llm.generate(ps, params)], prompts,
                                  MODES[wl])
                after = _spec_counts(llm)
                counts = {k: after[k] - before[k] for k in after}
                key = (name, wl)
                total = sum(r["seconds"] for r in runs.values())
                if key not in best or total < best[key]["total"]:
                    best[key] = dict(total=total, runs=runs, spec=counts)
    return best


def _spec_counts(llm) -> dict:
    s = llm.engine.stats()
    return dict(drafts=s.spec_num_drafts, draft_tokens=s.spec_num_draft_tokens, accepted=s.spec_num_accepted_tokens,
                steps=s.num_steps, ahead=s.num_steps_launched_ahead)


# Run by vLLM's Python (``--vllm-python``) in a scratch folder: one setting,
# the same prompts at batch 1 and in one burst, ``rounds`` times.
VLLM_SCRIPT = """
import json, sys, time


def counters(llm):
    want = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(want.values(), 0)
    for m in llm.get_metrics():
        if m.name in want:
            out[want[m.name]] += int(m.value)
    return out


def main():
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    model, data, spec, tokens, rounds = (sys.argv[1], json.load(open(sys.argv[2])), json.loads(sys.argv[3]),
                                         int(sys.argv[4]), int(sys.argv[5]))
    workloads, modes, schemas = data["workloads"], data["modes"], data["schemas"]
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enable_prefix_caching=False, seed=0,
              speculative_config=spec, disable_log_stats=False)

    def params_of(wl, max_tokens):
        schema = schemas.get(wl)
        return SamplingParams(temperature=0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema) if schema else None)

    def generate(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    for wl, prompts in workloads.items():
        params = params_of(wl, 8)
        generate([prompts[0]])
    best = {}
    for _ in range(rounds):
        for wl, prompts in workloads.items():
            params = params_of(wl, tokens)
            before = counters(llm)
            runs = {}
            if "batch1" in modes[wl]:
                start = time.perf_counter()
                replies = [generate([p])[0] for p in prompts]
                runs["batch1"] = dict(seconds=time.perf_counter() - start, tokens=sum(map(len, replies)),
                                      replies=replies)
            start = time.perf_counter()
            replies = generate(prompts)
            runs["burst"] = dict(seconds=time.perf_counter() - start, tokens=sum(map(len, replies)), replies=replies)
            after = counters(llm)
            total = sum(r["seconds"] for r in runs.values())
            if wl not in best or total < best[wl]["total"]:
                best[wl] = dict(total=total, runs=runs, spec={k: after[k] - before[k] for k in after})
    print("RESULT " + json.dumps(best))


if __name__ == "__main__":
    main()
"""


def theirs(python: str, model: str, settings: dict[str, dict | None], workloads: dict[str, list[list[int]]],
           tokens: int, rounds: int) -> dict:
    """vLLM's CPU build, one process per setting (its engine holds the machine)."""
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        script, data = Path(tmp) / "spec.py", Path(tmp) / "workloads.json"
        script.write_text(VLLM_SCRIPT)
        data.write_text(json.dumps({"workloads": workloads, "modes": MODES, "schemas": SCHEMAS}))
        for name, config in settings.items():
            spec = json.dumps(config)
            done = subprocess.run([python, str(script), model, str(data), spec, str(tokens), str(rounds)], cwd=tmp,
                                  capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"vLLM gave no result ({name}):\n{done.stderr[-3000:]}")
            for wl, rec in json.loads(line.removeprefix("RESULT ")).items():
                best[(name, wl)] = rec
    return best


def served(cmd: list[str], env: dict, port: int, workloads: dict[str, list[list[int]]], tokens: int,
           log: Path) -> dict:
    """One server (``cmd``), each prompt streamed alone to /v1/completions as
    token ids, greedy: per request the time to its first token, its time per
    output token after that (TPOT), its tokens, and its token ids."""
    import httpx
    from serve_bench import launch, stop_server

    proc = launch(cmd, f"http://127.0.0.1:{port}/v1/models", env, log, 600, "server", cwd=tempfile.gettempdir())
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.Client(timeout=600) as client:
            model = client.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]

            def one(prompt: list[int], max_tokens: int, schema: dict | None = None) -> dict:
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                if schema is not None:  # vLLM's field, on both servers
                    body["structured_outputs"] = {"json": schema}
                start, first, usage, text = time.perf_counter(), None, None, []
                with client.stream("POST", url, json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and chunk["choices"][0].get("text") and first is None:
                            first = time.perf_counter()
                        text += [c["text"] for c in chunk.get("choices") or []]
                        usage = chunk.get("usage") or usage
                end = time.perf_counter()
                n = usage["completion_tokens"]
                return dict(ttft=first - start, tpot=(end - first) / (n - 1) if n > 1 else None, tokens=n,
                            seconds=end - start, text="".join(text))

            for wl, prompts in workloads.items():  # warm
                one(prompts[0], 8, SCHEMAS.get(wl))
            return {wl: [one(p, tokens, SCHEMAS.get(wl)) for p in prompts] for wl, prompts in workloads.items()}
    finally:
        stop_server(proc)


def through_servers(args: argparse.Namespace, workloads: dict[str, list[list[int]]]) -> list[dict]:
    """``fluidserve serve`` and vLLM's server, each without drafts and with
    ``--speculative-config`` (k=4), one at a time, default flags otherwise."""
    import shlex
    import statistics
    import socket

    from vs_vllm import VLLM_ENV

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    systems = {"fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", args.model,
                               *common, "--log-level", "warning"], {})}
    if args.vllm_python:
        systems["vLLM"] = ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                            *common, "--gpu-memory-utilization", "0.3", "--enforce-eager"], VLLM_ENV)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for system, (cmd, env) in systems.items():
            runs = {}
            for name, config in (("off", None), ("ngram k=4", ngram(4))):
                flags = shlex.split(f"--speculative-config '{json.dumps(config)}'") if config else []
                runs[name] = served(cmd + flags, env, port, workloads, args.max_tokens, Path(tmp) / "server.log")
            for wl in workloads:
                for name, reqs in runs.items():
                    seconds = sum(r["seconds"] for r in reqs[wl])
                    toks = sum(r["tokens"] for r in reqs[wl])
                    off = runs["off"][wl]
                    out.append(dict(engine=system, workload=wl, setting=name,
                                    median_ttft_ms=round(1000 * statistics.median(r["ttft"] for r in reqs[wl]), 1),
                                    median_tpot_ms=round(1000 * statistics.median(
                                        r["tpot"] for r in reqs[wl] if r["tpot"] is not None), 1),
                                    tok_s=round(toks / seconds, 2),
                                    vs_off=round((toks / seconds) / (sum(r["tokens"] for r in off)
                                                                     / sum(r["seconds"] for r in off)), 3),
                                    same_as_off=sum(a["text"] == b["text"] for a, b in zip(reqs[wl], off)),
                                    replies=len(reqs[wl])))
    return out


def rows(best: dict, settings: dict[str, dict | None], engine: str) -> list[dict]:
    """One row per (workload, mode, setting), against the same engine's run without drafts."""
    out = []
    for wl in dict.fromkeys(w for _, w in best):
        for mode in MODES[wl]:
            base = best[("off", wl)]["runs"][mode]
            for name in settings:
                rec = best[(name, wl)]
                run = rec["runs"][mode]
                spec = rec["spec"]
                tps = run["tokens"] / run["seconds"]
                out.append(dict(
                    engine=engine, workload=wl, mode=mode, setting=name, tokens=run["tokens"],
                    seconds=round(run["seconds"], 3), tok_s=round(tps, 2),
                    vs_off=round(tps / (base["tokens"] / base["seconds"]), 3),
                    # Both modes together: the counters are the workload's.
                    accepted_share=round(spec["accepted"] / spec["draft_tokens"], 3) if spec["draft_tokens"] else None,
                    tokens_per_verify=(round(1 + spec["accepted"] / spec["drafts"], 2) if spec["drafts"] else None),
                    same_as_off=sum(a == b for a, b in zip(run["replies"], base["replies"])),
                    replies=len(run["replies"]),
                    # Async scheduling: steps queued before the last one's tokens were read, of all.
                    steps_ahead=f"{spec['ahead']}/{spec['steps']}" if spec.get("ahead") else None,
                ))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M-Instruct as safetensors (smollm2.py prepare)")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens settings")
    ap.add_argument("--up-to", nargs="*", default=["4:4"],
                    help="K:B settings: K drafts in steps of up to B sequences, none above "
                         "(num_speculative_tokens_per_batch_size)")
    ap.add_argument("--adaptive-k", type=int, nargs="*", default=[4],
                    help="settings with drafts chosen per step (fluidserve's default), up to K a sequence")
    ap.add_argument("--async-k", type=int, nargs="*", default=[],
                    help="settings with drafts chosen per step and --async-scheduling (steps without drafts go "
                         "ahead; on a CPU nothing overlaps, so this checks what it costs)")
    ap.add_argument("--vllm-k", type=int, nargs="+", default=[4], help="vLLM's settings beside its run without")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm-python", help="a Python with vLLM's CPU build: its n-gram drafting over the same prompts")
    ap.add_argument("--server", action="store_true",
                    help="through the servers instead: each prompt streamed alone to fluidserve serve and vLLM's "
                         "server (--vllm-python), without drafts and with 4, default flags otherwise")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    workloads = {wl: chat_ids(args.model, WORKLOADS[wl]) for wl in args.workloads}
    if args.server:
        record = dict(benchmark="speculative-server", device=device_name("cpu"), model=Path(args.model).name,
                      dtype="float32", max_tokens=args.max_tokens, lookup=LOOKUP,
                      rows=through_servers(args, {wl: ps for wl, ps in workloads.items() if "batch1" in MODES[wl]}),
                      argv=sys.argv[1:])
        text = server_markdown(record)
        print(text)
        save_results(RESULTS / f"speculative-server{args.tag}", record, text)
        return 0
    settings = settings_of(args.k, args.up_to, args.adaptive_k, args.async_k)
    table = rows(ours(args.model, settings, workloads, args.max_tokens, args.rounds), settings, "fluidserve")
    if args.vllm_python:
        vsettings = settings_of(args.vllm_k, [])
        table += rows(theirs(args.vllm_python, args.model, vsettings, workloads, args.max_tokens, args.rounds),
                      vsettings, "vLLM")
    record = dict(benchmark="speculative", device=device_name("cpu"), model=Path(args.model).name,
                  dtype="float32", max_tokens=args.max_tokens, rounds=args.rounds, lookup=LOOKUP,
                  threads=_threads(), rows=table, argv=sys.argv[1:])
    text = to_markdown(record)
    print(text)
    save_results(RESULTS / f"speculative{args.tag}", record, text)
    return 0


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def server_markdown(r: dict) -> str:
    lines = [f"# Speculative decoding through the servers: {r['model']}, {r['dtype']}, {r['device']}", "",
             f"Each prompt streamed alone to /v1/completions (token ids, greedy, up to {r['max_tokens']} tokens), "
             "each server without drafts and with `--speculative-config` ngram k=4 over "
             f"{r['lookup']['prompt_lookup_min']}..{r['lookup']['prompt_lookup_max']}-grams, default flags "
             "otherwise, one server at a time. TPOT: a request's time after its first token over its other "
             "tokens; tok/s: all output tokens over all requests' time.", "",
             "| engine | workload | setting | median TTFT ms | median TPOT ms | tok/s | vs off | same text |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['engine']} | {row['workload']} | {row['setting']} | {row['median_ttft_ms']:.1f} "
                     f"| {row['median_tpot_ms']:.1f} | {row['tok_s']:.1f} | {row['vs_off']:.2f}x "
                     f"| {row['same_as_off']}/{row['replies']} |")
    return "\n".join(lines) + "\n"


def to_markdown(r: dict) -> str:
    lines = [f"# Speculative decoding (n-gram drafts): {r['model']}, {r['dtype']}, {r['device']}", "",
             f"Greedy, up to {r['max_tokens']} tokens a reply, drafts looked up over "
             f"{r['lookup']['prompt_lookup_min']}..{r['lookup']['prompt_lookup_max']}-grams; best of "
             f"{r['rounds']} rounds, settings interleaved. tok/s: output tokens over wall time, prefill included. "
             "Accepted: draft tokens that stood, of those verified; tokens/verify: tokens a verifying step kept "
             "(both over the workload's batch-1 and burst runs)"
             + ("; settings ending in \"async\" ran with --async-scheduling: steps that went ahead, of all its "
                "steps, are after the setting" if any(row.get("steps_ahead") for row in r["rows"]) else "")
             + ".", "",
             "| engine | workload | mode | setting | tok/s | vs off | accepted | tokens/verify | same replies |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        acc = "–" if row["accepted_share"] is None else f"{100 * row['accepted_share']:.0f}%"
        tpv = "–" if row["tokens_per_verify"] is None else f"{row['tokens_per_verify']:.2f}"
        setting = row["setting"] + (f" ({row['steps_ahead']} ahead)" if row.get("steps_ahead") else "")
        lines.append(f"| {row['engine']} | {row['workload']} | {row['mode']} | {setting} | {row['tok_s']:.1f} "
                     f"| {row['vs_off']:.2f}x | {acc} | {tpv} | {row['same_as_off']}/{row['replies']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
