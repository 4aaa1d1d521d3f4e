"""Memory a CPU engine holds for its weights, for one or more source trees
side by side (this tree and a git checkout of an older commit, say), each
in its own process: since oneDNN's reordered copy runs every product of a
linear (and cpu_moe.c's panels every fp32 expert's), does dropping the
weights they were packed from halve what those hold, without costing a
decode step anything?

Each process builds an engine (``LLM``, dummy weights, ``--dtype``) of a
model of ``--shape`` cut to ``--layers`` decoder layers: Llama-3-8B's
(hidden 4096, MLP 14336, 32 query / 8 KV heads, vocab 128256) or
Qwen3-30B-A3B's (hidden 2048, 128 experts of 768 features, 8 a token, 32
query / 4 KV heads, vocab 151936), then decodes ``--tokens`` greedy tokens
for one prompt (after a warm-up of 4). Figures: the process's resident
memory before the engine (torch and the tree's packages imported), after
it was built, and at its peak (``VmHWM``); the build's seconds; decode ms a
token; and the tokens themselves, which every tree must give alike
(checked). The weights' bytes are their parameters' shapes' (a weight
given up keeps its shape).

    git archive HEAD~1 | tar -x -C /tmp/old
    python benchmarks/cpu_weight_memory.py . /tmp/old --names new old

``--serve DIR`` measures a real model through ``fluidserve serve`` instead:
each tree's server (``--dtype``) takes one greedy chat request of
``--tokens`` tokens, then its resident memory and high-water mark are read;
every tree must reply alike (checked)::

    python benchmarks/cpu_weight_memory.py . /tmp/old --names new old --serve DIR --dtype float32

Writes benchmarks/results/cpu_weight_memory{-serve}{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import tree_compare
from dummy_models import PRESETS

_PROBE = tree_compare.TREE_PACKAGES + r'''
import json, resource, time
from pathlib import Path


def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024


from fluidserve.engine import LLM, SamplingParams

model, dtype, tokens = sys.argv[2], sys.argv[3], int(sys.argv[4])
before = status("VmRSS")
start = time.perf_counter()
llm = LLM(model=model, device="cpu", dtype=dtype, load_format="dummy", num_kv_blocks=16, max_model_len=256)
built = time.perf_counter() - start
after = status("VmRSS")
prompt = ["The weights of a model, held once"]
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))[0].outputs[0]
decode = (time.perf_counter() - start) / tokens
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / tokens
# The weights' bytes by their shapes (a parameter given up keeps its shape), each tensor once.
import torch
params = {id(p): p for p in llm.engine.executor.worker.model.parameters()}.values()
embedded = {id(p) for m in llm.engine.executor.worker.model.modules() if "Embedding" in type(m).__name__
            for p in m.parameters()}
weights = sum(p.numel() * p.element_size() for p in params)
embedding = sum(p.numel() * p.element_size() for p in params if id(p) in embedded)
print(json.dumps({"rss_before": before, "rss_built": after, "peak": status("VmHWM"), "build_s": built,
                  "decode_s": decode, "faults": faults, "weights": weights, "embedding": embedding,
                  "tokens": out.token_ids}))
'''


# The server of a tree: its packages under the import name, then the CLI.
_SERVE = tree_compare.TREE_PACKAGES + (
    'from fluidserve.serve.cli import main\n'
    'sys.argv = ["fluidserve", *sys.argv[2:]]\n'
    'raise SystemExit(main())\n')


def status(pid: int, field: str) -> int:
    """A field of /proc/PID/status (kB) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def serve_figures(tree: str, model_dir: str, dtype: str, tokens: int, port: int) -> dict:
    """One tree's server after one chat request: resident and peak bytes, the reply."""
    import httpx

    from serve_bench import launch, stop_server

    cmd = [sys.executable, "-c", _SERVE, str(Path(tree).resolve()), "serve", model_dir, "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    proc = launch(cmd, f"http://127.0.0.1:{port}/health", timeout=600)
    try:
        started = status(proc.pid, "VmRSS")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600, json={
            "model": model_dir, "temperature": 0, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
        return {"rss_started": started, "rss_served": status(proc.pid, "VmRSS"), "peak": status(proc.pid, "VmHWM"),
                "reply": reply["choices"][0]["message"]["content"]}
    finally:
        stop_server(proc)


def interleaved(trees: list[str], rounds: int, run: Callable[[str], dict]) -> dict[str, list[dict]]:
    """``run(tree)`` ``rounds`` times a tree, the trees' order reversed every
    round: a process's figures depend on where it falls in the run (decode
    times moved 10% either way with the order held fixed)."""
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for i in range(rounds):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            runs[tree].append(run(tree))
    return runs


# Model shapes: Llama-3-8B's, and Qwen3-30B-A3B's (128 experts of 768 features, 8 a token).
SHAPES = {
    "llama3-8b": ("llama", "LlamaForCausalLM", PRESETS["llama3-8b"]),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=8192, tie_word_embeddings=False)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    tree_compare.add_arguments(ap)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--serve", metavar="DIR", help="a real model's directory: measure each tree's server on it")
    ap.add_argument("--port", type=int, default=8731)
    args = ap.parse_args(argv)
    cmd = "python benchmarks/cpu_weight_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.serve:
        return serve_main(args, cmd)
    from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

    arch, architecture, shape = SHAPES[args.shape]
    shape = {**shape, "num_hidden_layers": args.layers}
    names = dict(zip(args.trees, args.names or args.trees))
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        config = tiny_config(arch, **shape)
        config.architectures = [architecture]
        config.save_pretrained(root)
        save_byte_tokenizer(root)
        probe_args = [root, args.dtype, str(args.tokens)]
        runs = interleaved(args.trees, args.rounds,
                           lambda tree: tree_compare.run_probes(_PROBE, [tree], 1, probe_args)[tree][0])
    tokens = {names[t]: {str(r.pop("tokens")) for r in rs} for t, rs in runs.items()}
    if len(set().union(*tokens.values())) != 1:
        raise SystemExit(f"the trees decode different tokens: {tokens}")
    weights, embedding = (statistics.median(r[k] for rs in runs.values() for r in rs) for k in ("weights", "embedding"))
    gib = 2**30
    rows = []
    for tree, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        rows.append({"tree": names[tree], **med, "held": med["rss_built"] - med["rss_before"],
                     "fastest": min(r["decode_s"] for r in rs)})
    md = [f"# CPU engine memory: the weights as loaded beside oneDNN's packed copies ({args.dtype})", "",
          f"{args.shape}-shaped model cut to {args.layers} decoder layers, dummy weights in {args.dtype}: "
          f"{weights / gib:.2f} GiB of weights, {embedding / gib:.2f} GiB of them the embedding. Each tree in its "
          f"own process, {args.rounds} a tree, "
          f"interleaved, the order reversed every round; medians (decode: the fastest process's in "
          f"brackets). **held** = resident memory after building the engine less before it "
          f"(torch and the packages imported); **peak** = the process's high-water mark (build and "
          f"decode); decode = greedy, batch 1, {args.tokens} tokens, the same tokens in every tree "
          f"(checked); {torch.get_num_threads()} torch threads. The run's 1-minute load average went from "
          f"{load_start:.2f} to {os.getloadavg()[0]:.2f}.", "",
          f"`{cmd}`", "",
          "| tree | held GiB | peak GiB | held / weights | build s | decode ms/token |",
          "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['tree']} | {r['held'] / gib:.2f} | {r['peak'] / gib:.2f} | "
                  f"{r['held'] / weights:.2f}x | {r['build_s']:.1f} | {r['decode_s'] * 1e3:.1f} "
                  f"({r['fastest'] * 1e3:.1f}) |")
    first = rows[0]
    for r in rows[1:]:
        md.append("")
        md.append(f"{first['tree']} against {r['tree']}: held {first['held'] / r['held']:.2f}x, "
                  f"peak {first['peak'] / r['peak']:.2f}x, decode time {first['decode_s'] / r['decode_s']:.2f}x.")
    save(args, "", {"command": cmd, "shape": shape, "dtype": args.dtype,
                    "weights_bytes": {"all": weights, "embedding": embedding},
                    "rows": rows, "runs": {names[t]: rs for t, rs in runs.items()}}, md)
    return 0


def serve_main(args: argparse.Namespace, cmd: str) -> int:
    names = dict(zip(args.trees, args.names or args.trees))
    load_start = os.getloadavg()[0]
    runs = interleaved(args.trees, args.rounds,
                       lambda tree: serve_figures(tree, args.serve, args.dtype, args.tokens, args.port))
    replies = {names[t]: {r.pop("reply") for r in rs} for t, rs in runs.items()}
    if len(set().union(*replies.values())) != 1:
        raise SystemExit(f"the trees reply differently: {replies}")
    reply = next(iter(set().union(*replies.values())))
    gib = 2**30
    rows = [{"tree": names[t], **{k: statistics.median(r[k] for r in rs) for k in rs[0]}} for t, rs in runs.items()]
    md = [f"# `fluidserve serve` on the CPU: resident memory after a request ({args.dtype})", "",
          f"`{Path(args.serve).name}`, each tree's server started {args.rounds} times, interleaved, the order "
          f"reversed every round; medians. **started** = resident when /health first answered; **served** = "
          f"after one greedy chat request of {args.tokens} tokens (the same reply from every tree, checked: "
          f"{reply!r}); **peak** = the high-water mark. {torch.get_num_threads()} "
          f"torch threads; the 1-minute load average went from {load_start:.2f} to {os.getloadavg()[0]:.2f}.", "",
          f"`{cmd}`", "",
          "| tree | started GiB | served GiB | peak GiB |",
          "|---|---:|---:|---:|"]
    md += [f"| {r['tree']} | {r['rss_started'] / gib:.2f} | {r['rss_served'] / gib:.2f} | {r['peak'] / gib:.2f} |"
           for r in rows]
    for r in rows[1:]:
        md += ["", f"{rows[0]['tree']} against {r['tree']}: served {rows[0]['rss_served'] / r['rss_served']:.2f}x, "
                   f"peak {rows[0]['peak'] / r['peak']:.2f}x."]
    save(args, "-serve", {"command": cmd, "model": Path(args.serve).name, "dtype": args.dtype, "rows": rows,
                          "reply": reply,
                          "runs": {names[t]: rs for t, rs in runs.items()}}, md)
    return 0


def save(args: argparse.Namespace, kind: str, record: dict, md: list[str]) -> None:
    out = Path(args.out_dir)
    stem = f"cpu_weight_memory{kind}{args.tag}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    raise SystemExit(main())
