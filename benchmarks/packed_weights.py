"""Quantized weights held as the checkpoint stores them
(``--quantized-weights packed``) against the same checkpoint dequantized,
side by side in one run: the bytes the decoder's linears hold, whether the
greedy replies are the same, and the decode time a token at batch 1 and
batch 8.

From a real model (SmolLM2-135M-Instruct, ``--model DIR`` from
``benchmarks/smollm2.py prepare``) it writes a 4-bit GPTQ checkpoint (groups
of 64, act-order off) and a 4-bit AWQ one, every decoder linear's codes
rounded to nearest as the test suite's writer rounds them
(``tests/quantized_utils.py``; not GPTQ's error-compensating codes, which
change the replies, not the bytes or the time), and an FP8 one (128 x 128
blocks, benchmarks/fp8_checkpoint.py's writer). Each is served both ways
by the engine in this process.

The packed weights stand for the dequantized ones bit for bit, so the
replies differ only where the products' summation order moves a near-tie.
The time is where the two paths part: on a GPU the packed linears read a
quarter of the weight bytes at batch 1 at 4 bits, half in float8
(kernels/int_linear.py, fp8_linear.py); on a CPU the torch reference
dequantizes every weight on every call.

    python benchmarks/packed_weights.py --model /path/to/SmolLM2-135M-Instruct [--device cuda]
    python benchmarks/packed_weights.py --preset llama3-8b --device cuda

``--preset`` (benchmarks/dummy_models.py's shapes; for a GPU, where no real
model is at hand) writes a GPTQ 4-bit checkpoint of random codes, groups
of 128, at that shape instead, and random token prompts: the bytes and the
decode time are the figures there, the replies only check that both sides
agree. ``--moe`` does the same for a Qwen3-MoE model (``MOE_SHAPES``: on a
GPU Qwen3-30B-A3B's layers, 128 experts of 768 features, 8 a token, fewer
of them; on a CPU a smaller model), every expert's weights GPTQ 4-bit
too, where the stacked experts are most of the bytes:

    python benchmarks/packed_weights.py --moe [--device cuda]

Writes ``benchmarks/results/packed_weights-<device>{-<preset>|-moe}{--tag}.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dummy_models import device_name, device_slug, save_results
from kv_cache_dtype import agreement, chat_prompts, replies

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

FORMATS = {
    "GPTQ 4-bit, groups of 64": ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}),
    "AWQ 4-bit GEMM, groups of 64": ("awq", {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                             "zero_point": True}),
    "FP8, 128x128 blocks": ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}),
}


def write_checkpoint(src: Path, dst: Path, method: str, qc: dict) -> None:
    """``src``'s checkpoint with every decoder linear as ``method`` stores
    it; everything else (embeddings, norms, tokenizer) as is."""
    from fp8_checkpoint import rewrite_linears, write_fp8_checkpoint
    from quantized_utils import packed_int

    if method == "fp8":
        write_fp8_checkpoint(src, dst, tuple(qc["weight_block_size"]), "_scale_inv", qc)
        return
    quantize = packed_int(method, qc["bits"], qc["group_size"])
    rewrite_linears(src, dst, qc, lambda name, weight: quantize(name, weight.float())[0])


# Qwen3-MoE shapes for ``--moe``: Qwen3-30B-A3B's layers on a GPU (48 of
# them there), a model small enough for a CPU's dequantized fp32 otherwise.
MOE_SHAPES = {
    "cuda": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                 num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 intermediate_size=6144, vocab_size=32000),
    "cpu": dict(hidden_size=512, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1024, vocab_size=4096),
}


def write_random_checkpoint(preset: str | None, dst: Path, group_size: int = 128, moe: dict | None = None) -> None:
    """A GPTQ 4-bit checkpoint of random codes, zero points and scales at
    ``preset``'s Llama shape, or at ``moe``'s Qwen3-MoE shape with every
    expert's weights so too (embeddings, norms, routers and head in bf16),
    with the byte tokenizer: what a GPU machine without a real model serves."""
    from safetensors.torch import save_file

    from dummy_models import build_model_dir

    if moe is None:
        build_model_dir(preset, dst)
    else:
        from fluidserve.engine.tiny_model import save_byte_tokenizer, tiny_config

        hf = tiny_config("qwen3_moe", **moe)
        hf.architectures = ["Qwen3MoeForCausalLM"]
        hf.save_pretrained(dst)
        save_byte_tokenizer(dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                     "desc_act": False, "checkpoint_format": "gptq_v2"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim)}
    mlp = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    if moe is None:
        shapes.update({f"mlp.{name}": shape for name, shape in mlp.items()})
    else:
        expert, count = config["moe_intermediate_size"], moe["num_experts"]
        mlp = {"gate_proj": (expert, hidden), "up_proj": (expert, hidden), "down_proj": (hidden, expert)}
        shapes.update({f"mlp.experts.{e}.{name}": shape for e in range(count) for name, shape in mlp.items()})
    g = torch.Generator().manual_seed(0)

    def words(rows: int, cols: int) -> torch.Tensor:  # random int32 words: eight random 4-bit codes each
        return torch.randint(-2**31, 2**31 - 1, (rows, cols), generator=g, dtype=torch.int64).to(torch.int32)

    tensors = {"model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        if moe is not None:
            tensors[prefix + "self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            tensors[prefix + "self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            router = torch.randn(moe["num_experts"], hidden, generator=g) * 0.02
            tensors[prefix + "mlp.gate.weight"] = router.bfloat16()
        for name, (out, features) in shapes.items():
            groups = features // group_size
            tensors[prefix + name + ".qweight"] = words(features // 8, out)
            tensors[prefix + name + ".qzeros"] = words(groups, out // 8)
            # A code's step: weights of about +-0.02 at 4 bits, as the embeddings'.
            tensors[prefix + name + ".scales"] = (torch.rand(groups, out, generator=g) * 0.004 + 0.001).half()
    save_file(tensors, str(dst / "model.safetensors"))


def random_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(count)]


def held_bytes(llm) -> dict:
    """The decoder's linears' and stacked experts' bytes as the engine
    holds them: packed integers (codes, zero points, scales, groups) or the
    dense weight."""
    from fluidserve.engine.parallel import HeldWeights

    model = llm.engine.executor.worker.model
    packed = dense = count = 0
    for name, module in model.named_modules():
        if not isinstance(module, HeldWeights) or ".layers." not in name:
            continue
        codes = module.held_codes()
        for leaf in module.code_params:
            count += 1
            if leaf in codes:
                packed += codes[leaf].nbytes()
            else:
                weight = getattr(module, leaf)
                dense += weight.numel() * weight.element_size()
    return dict(weights=count, packed_bytes=packed, dense_bytes=dense)


def decode_ms(llm, prompt: list[int], batch: int, tokens: int, rounds: int) -> float:
    """Milliseconds a decode step at ``batch`` sequences: the time of
    ``tokens`` + 1 tokens less that of the first (prefill) alone, best of
    ``rounds``, over ``tokens``."""
    from fluidserve.engine import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt] * batch, params)
        return time.perf_counter() - start

    timed(4)  # warm-up: first-call work, kernel compiles
    best = min(timed(tokens + 1) - timed(1) for _ in range(rounds))
    return best / tokens * 1000


def main(argv: list[str] | None = None) -> int:
    from fluidserve.engine import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a real model's directory (benchmarks/smollm2.py prepare)")
    source.add_argument("--preset", help="random GPTQ weights at one of benchmarks/dummy_models.py's shapes")
    source.add_argument("--moe", action="store_true", help="random GPTQ weights of a Qwen3-MoE model (MOE_SHAPES)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    moe = MOE_SHAPES[args.device] if args.moe else None
    if args.preset or moe:
        from dummy_models import PRESETS

        vocab = moe["vocab_size"] if moe else PRESETS[args.preset].get("vocab_size", 256)
        chats = random_prompts(vocab, 4, 64)
        formats = {"GPTQ 4-bit, groups of 128, random codes": ("gptq", None)}
    else:
        chats, formats = chat_prompts(args.model), FORMATS
    record = dict(benchmark="packed_weights", command=" ".join(["benchmarks/packed_weights.py", *sys.argv[1:]]),
                  device=device_name(args.device), dtype=dtype, moe_shape=moe,
                  model=args.preset or ("qwen3-moe" if moe else Path(args.model).name),
                  reply_tokens=args.reply_tokens, decode_tokens=args.decode_tokens, prompts=len(chats), formats={})
    with tempfile.TemporaryDirectory() as tmp:
        for label, (method, qc) in formats.items():
            folder = Path(tmp) / method
            if args.preset or moe:
                write_random_checkpoint(args.preset, folder, moe=moe)
            else:
                write_checkpoint(Path(args.model), folder, method, qc)
            sides = {}
            for held in ("dequantized", "packed"):
                start = time.perf_counter()
                llm = LLM(model=str(folder), device=args.device, dtype=dtype, max_model_len=2048,
                          quantized_weights=held, num_kv_blocks=512, enable_prefix_caching=False)  # fmt: skip
                started = time.perf_counter() - start
                sides[held] = dict(start_s=round(started, 2), **held_bytes(llm),
                                   replies=replies(llm, chats, args.reply_tokens),
                                   decode_ms={str(b): round(decode_ms(llm, chats[0], b, args.decode_tokens,
                                                                      args.rounds), 2) for b in (1, 8)})
                print(label, held, {k: v for k, v in sides[held].items() if k != "replies"}, flush=True)
                del llm
                gc.collect()
            packed, dense = sides["packed"], sides["dequantized"]
            record["formats"][label] = dict(
                dequantized={k: v for k, v in dense.items() if k != "replies"},
                packed={k: v for k, v in packed.items() if k != "replies"},
                replies_vs_dequantized=agreement(packed["replies"], dense["replies"]))
    device = "cpu" if args.device == "cpu" else device_slug(record["device"])
    shape = f"-{args.preset}" if args.preset else "-moe" if moe else ""
    stem = f"packed_weights-{device}{shape}{args.tag}"
    save_results(RESULTS / stem, record, report(record))
    return 0


def report(record: dict) -> str:
    lines = [f"# Quantized weights packed against dequantized ({record['model']}, {record['dtype']})", "",
             f"Device: {record['device']}. Command: `{record['command']}`.", "",
             "| checkpoint | held as | decoder weights' bytes | decode ms/token, batch 1 | batch 8 | start s |",
             "|---|---|---:|---:|---:|---:|"]
    for label, row in record["formats"].items():
        for held in ("dequantized", "packed"):
            side = row[held]
            total = side["packed_bytes"] + side["dense_bytes"]
            lines.append(f"| {label} | {held} | {total / 2**20:.1f} MiB | {side['decode_ms']['1']:.2f} | "
                         f"{side['decode_ms']['8']:.2f} | {side['start_s']:.1f} |")
    if record.get("moe_shape"):
        shape = record["moe_shape"]
        lines[2:2] = [f"Qwen3-MoE of random GPTQ 4-bit codes: {shape['num_hidden_layers']} layers, hidden "
                      f"{shape['hidden_size']}, {shape['num_experts']} experts of {shape['moe_intermediate_size']} "
                      f"features, {shape['num_experts_per_tok']} a token.", ""]
    random = record["model"] in _presets() or record.get("moe_shape")
    prompts = "random-token prompts" if random else "chat prompts"
    lines += ["", "Greedy replies of the packed model against the dequantized one's "
              f"({record['reply_tokens']} tokens, {record['prompts']} {prompts}):", ""]
    for label, row in record["formats"].items():
        agree = row["replies_vs_dequantized"]
        lines.append(f"- {label}: {agree['same']} of {agree['of']} the same; tokens before parting "
                     f"{agree['tokens_before_parting']}")
    lines += ["", "Decode ms a step: the time of the reply less that of its first token, over its tokens, best "
              "of the rounds. The packed weights stand for the dequantized ones bit for bit; only the order of "
              "the products' sums differs."]
    return "\n".join(lines) + "\n"


def _presets() -> set[str]:
    from dummy_models import PRESETS

    return set(PRESETS)


if __name__ == "__main__":
    sys.exit(main())
