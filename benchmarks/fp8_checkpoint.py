"""FP8 checkpoints on a real model: what serving one gives against the
checkpoint it was made from, each side by side in one run.

From a real model (SmolLM2-135M-Instruct, ``--model DIR`` from
``benchmarks/smollm2.py prepare``) this writes two FP8 checkpoints of it,
every decoder linear in float8 (e4m3) beside its scales: transformers'
``fp8`` format with 128 x 128 blocks (SmolLM2's 576 features are no
multiple of 128, so the last blocks are cut short, as in DeepSeek-V3's
checkpoints), the same with 64 x 64 blocks, which divide every weight, and
compressed-tensors' FP8 with one scale per output channel. For each it
reports the checkpoint's bytes, the engine's start-up time, and the greedy
chat replies against the original model's (how many are the same, how many
tokens each keeps before it parts), and, for the whole-block ``fp8`` one,
whether transformers' own dequantizing load gives the same replies as ours
(it must: both multiply float8 by the scale in fp32; transformers' CPU
load refuses blocks cut short, and compressed-tensors needs its package).

    python benchmarks/fp8_checkpoint.py --model /path/to/SmolLM2-135M-Instruct

Writes ``benchmarks/results/fp8_checkpoint{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dummy_models import device_name, save_results
from kv_cache_dtype import agreement, chat_prompts, replies

RESULTS = Path(__file__).resolve().parent / "results"
MAX_MODEL_LEN = 2048
FORMATS = {
    "fp8, 128x128 blocks": ((128, 128), "_scale_inv",
                            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    "fp8, 64x64 blocks": ((64, 64), "_scale_inv",
                          {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}),
    "compressed-tensors, per channel": ("channel", "_scale", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}}),
}


def write_fp8_checkpoint(src: Path, dst: Path, grain, scale_suffix: str, quantization_config: dict) -> None:
    """``src``'s checkpoint with every decoder linear's weight in float8 and
    its scale beside it; everything else (embeddings, norms, tokenizer) as is."""
    from fluidserve.engine.quantization import quantize_fp8

    def quantize(name: str, weight: torch.Tensor) -> dict:
        q, scale = quantize_fp8(weight, grain)
        return {name: q, name + scale_suffix: scale}

    rewrite_linears(src, dst, quantization_config, quantize)


def rewrite_linears(src: Path, dst: Path, quantization_config: dict, quantize) -> None:
    """``src``'s checkpoint in ``dst`` with ``quantization_config`` and every
    decoder linear's weight replaced by the tensors ``quantize(name,
    weight)`` gives; everything else (embeddings, norms, tokenizer) as is."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, value in load_file(str(f)).items():
            if ".layers." in name and name.endswith("_proj.weight"):
                tensors.update(quantize(name, value))
            else:
                tensors[name] = value
        save_file(tensors, str(dst / f.name))


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def reply_nll(llm, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Mean negative log-likelihood (nats a token) the served model gives the
    original model's greedy replies: how far its predictions moved, where
    replies that part at a near-tie say little."""
    from fluidserve.engine import SamplingParams

    outs = llm.generate([p + a for p, a in zip(prompts, answers)], SamplingParams(max_tokens=1, prompt_logprobs=0))
    total = count = 0
    for out, prompt, answer in zip(outs, prompts, answers):
        for pos, token in enumerate(answer, start=len(prompt)):
            total -= out.prompt_logprobs[pos][token].logprob
            count += 1
    return total / count


def hf_replies(model: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype) -> list[list[int]]:
    """transformers' greedy replies, one prompt at a time, stopping at the model's end of turn."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    out = []
    for ids in prompts:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    from fluidserve.engine import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a real model's directory (benchmarks/smollm2.py prepare)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    src, chats = Path(args.model), chat_prompts(args.model)
    record = dict(benchmark="fp8_checkpoint", command=" ".join(["benchmarks/fp8_checkpoint.py", *sys.argv[1:]]),
                  device=device_name("cpu"), model=src.name, dtype=args.dtype, reply_tokens=args.reply_tokens,
                  prompts=len(chats), original_bytes=checkpoint_bytes(src), formats={})

    def serve(folder: Path, reference: list[list[int]] | None) -> tuple[list[list[int]], float, float]:
        start = time.perf_counter()
        llm = LLM(model=str(folder), device="cpu", dtype=args.dtype, max_model_len=MAX_MODEL_LEN)
        started = time.perf_counter() - start
        answers = replies(llm, chats, args.reply_tokens)
        nll = reply_nll(llm, chats, reference or answers)
        del llm
        gc.collect()
        return answers, started, nll

    original, record["original_start_s"], record["original_nll"] = serve(src, None)
    with tempfile.TemporaryDirectory() as tmp:
        for label, (grain, suffix, qc) in FORMATS.items():
            folder = Path(tmp) / label.split(",")[0]
            write_fp8_checkpoint(src, folder, grain, suffix, qc)
            ours, started, nll = serve(folder, original)
            row = dict(bytes=checkpoint_bytes(folder), start_s=started, nll=nll, vs_original=agreement(ours, original))
            if "64x64" in label:
                theirs = hf_replies(folder, chats, args.reply_tokens, getattr(torch, args.dtype))
                row["transformers_same"] = agreement(ours, theirs)
            record["formats"][label] = row
            print(label, row, flush=True)
    save_results(RESULTS / f"fp8_checkpoint{args.tag}", record, to_markdown(record))
    return 0


def _kept(rep: dict) -> str:
    return ", ".join(f"{k}/{n}" for k, n in zip(rep["tokens_before_parting"], rep["reply_tokens"]))


def to_markdown(r: dict) -> str:
    lines = [f"# FP8 checkpoints of {r['model']} ({r['dtype']})", "",
             f"Command: `{r['command']}`; {r['device']}. Every decoder linear's weight in float8 (e4m3) beside its "
             "scales, embeddings and norms as they were; each checkpoint served in turn in one process, "
             f"{r['prompts']} chat prompts, greedy, up to {r['reply_tokens']} tokens each. The original: "
             f"{r['original_bytes'] / 1e6:.0f} MB of safetensors, engine start {r['original_start_s']:.1f} s, "
             f"{r['original_nll']:.3f} nats a token on its own greedy replies. **NLL**: the mean negative "
             "log-likelihood each checkpoint gives the original's replies (nats a token; the prompt's logprobs).", "",
             "| checkpoint | MB | engine start s | NLL | same replies as the original | tokens kept before parting "
             "(each reply) | transformers' load: same replies as ours |", "|---|---:|---:|---:|---:|---|---:|"]
    for label, row in r["formats"].items():
        rep, hf = row["vs_original"], row.get("transformers_same")
        hf_text = f"{hf['same']} of {hf['of']}" if hf else "–"
        lines.append(f"| {label} | {row['bytes'] / 1e6:.0f} | {row['start_s']:.1f} | {row['nll']:.3f} "
                     f"| {rep['same']} of {rep['of']} "
                     f"| {_kept(rep)} | {hf_text} |")
    lines += ["", "transformers' load is run on the whole-block checkpoint alone: its CPU dequantization refuses "
              "blocks cut short (576 features in blocks of 128), and compressed-tensors' format needs the "
              "compressed-tensors package.", "",
              "The weights are dequantized to the model's dtype as they load: the replies differ from the "
              "original's only by the float8 rounding of the weights, and serving runs at the original's speed "
              "and memory.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
