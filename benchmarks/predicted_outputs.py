"""Predicted outputs (OpenAI's ``prediction``): what passing the text a
reply will repeat buys, side by side in one process with the same engine's
n-gram drafts alone and with no drafts at all.

A real model (SmolLM2-135M-Instruct, ``--model DIR`` from
``benchmarks/smollm2.py prepare``), greedy, the edit workload of
``benchmarks/speculative.py`` (fix the typos in a paragraph, add type
hints to a function, rename a table in a query, ...) through the chat
template, each prompt alone (the latency a user feels). The prediction is
the text the prompt asks to edit, as OpenAI's guide passes the file being
edited. Per setting: the replies' output tokens a second, steps a reply,
the ratio to the run without drafts, how many replies equal that run's,
and for the prediction the predicted tokens drafted and kept and thrown
away. ``--rounds`` runs every setting that many times, interleaved, and
keeps each one's best round.

    python benchmarks/predicted_outputs.py --model /path/to/SmolLM2-135M-Instruct

Writes ``benchmarks/results/predicted_outputs{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dummy_models import device_name, save_results
from speculative import EDIT_PROMPTS, chat_ids, ngram

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("no drafts", "n-gram drafts", "n-gram drafts + prediction")


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
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    prompts = chat_ids(args.model, EDIT_PROMPTS)
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    predictions = [tok.encode(edited_text(p), add_special_tokens=False) for p in EDIT_PROMPTS]
    common = dict(model=args.model, device="cpu", dtype="float32", max_model_len=2048, enable_prefix_caching=False)
    engines = {"no drafts": LLM(**common),
               "n-gram drafts": LLM(**common, speculative_config=json.dumps(ngram(args.k)))}
    engines["n-gram drafts + prediction"] = engines["n-gram drafts"]

    def run(setting: str) -> dict:
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

    for setting in SETTINGS:  # warm-up: every path once
        engines[setting].generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8,
                                                               prediction_token_ids=predictions[0]
                                                               if setting.endswith("prediction") else None))
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            got = run(setting)
            if setting not in best or got["tok_s"] > best[setting]["tok_s"]:
                best[setting] = got
            print(setting, f"{got['tok_s']:.1f} tok/s, {got['steps']} steps", flush=True)
    base = best["no drafts"]
    rows = []
    for setting in SETTINGS:
        b = best[setting]
        rows.append(dict(setting=setting, tok_s=b["tok_s"], vs_no_drafts=b["tok_s"] / base["tok_s"],
                         steps=b["steps"], output_tokens=b["output_tokens"], wall_s=b["wall_s"],
                         same_replies=sum(a == c for a, c in zip(b["replies"], base["replies"])),
                         accepted_prediction_tokens=b["accepted_prediction_tokens"],
                         rejected_prediction_tokens=b["rejected_prediction_tokens"]))
    record = dict(benchmark="predicted_outputs", command=" ".join(["benchmarks/predicted_outputs.py", *sys.argv[1:]]),
                  device=device_name("cpu"), torch_threads=torch.get_num_threads(), model=Path(args.model).name,
                  k=args.k, max_tokens=args.max_tokens, prompts=len(prompts), rounds=args.rounds,
                  prediction_tokens=sum(len(p) for p in predictions), rows=rows)
    save_results(RESULTS / f"predicted_outputs{args.tag}", record, to_markdown(record))
    return 0


def to_markdown(r: dict) -> str:
    lines = [f"# Predicted outputs: {r['model']}, the edit workload", "",
             f"Command: `{r['command']}`; {r['device']}. {r['prompts']} edit prompts through the chat template, each "
             f"alone, greedy, up to {r['max_tokens']} tokens; n-gram drafts up to {r['k']} a step, chosen per step "
             f"(the default); the prediction: the text each prompt asks to edit ({r['prediction_tokens']} tokens in "
             f"all). Best of {r['rounds']} interleaved rounds.", "",
             "| setting | output tok/s | vs no drafts | steps | same replies as no drafts | prediction tokens kept "
             "| prediction tokens thrown away |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        predicted = row["setting"].endswith("prediction")
        lines.append(f"| {row['setting']} | {row['tok_s']:.1f} | {row['vs_no_drafts']:.2f}x | {row['steps']} | "
                     f"{row['same_replies']} of {r['prompts']} | "
                     f"{row['accepted_prediction_tokens'] if predicted else '–'} | "
                     f"{row['rejected_prediction_tokens'] if predicted else '–'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
