"""Model families beyond the Llama family's dense models, served side by
side with vLLM: the same checkpoint (random weights of a Qwen3-MoE, Mixtral,
Gemma 3, Phi-3, Granite 3, Phi-4-mini, OLMo 3, Gemma 2, SmolLM3, GLM-4,
GLM-4.5 or Granite 3 MoE shape, written here with the byte tokenizer), the
same requests.

    python benchmarks/models_vs_vllm.py --vllm-python /work/vllm-venv/bin/python --arch qwen3_moe --tag=-qwen3-moe

Each server is started in turn in one run and takes:

* greedy completions of a few prompts (``--max-tokens`` tokens each,
  ``ignore_eos``, token ids returned): whether both servers give the same
  tokens from the same weights;
* after a burst of 16 requests (not measured), two loads from the same
  client (``fluidserve bench``, vLLM's random dataset): ``--num-requests``
  sent at once (throughput), then the same number at ``--rate`` requests/s
  (latency under a steady load).

Writes benchmarks/results/models_vs_vllm{--tag}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

import httpx

import serve_bench
from dummy_models import save_results
from lora_vs_vllm import LOAD_KEYS, PROMPTS, load_table, replies
from vs_vllm import VLLM_ENV, add_peer_load_args, vllm_problem

RESULTS = Path(__file__).resolve().parent / "results"
# Shapes small enough for two CPU cores, with the experts' proportions of
# the real models: Qwen3-30B-A3B routes each token to 8 of 128 experts of
# 768 features (hidden 2048); Mixtral-8x7B to 2 of 8 of 14336 (hidden 4096).
# Gemma 3 1B's layout: five sliding layers (window 512) a full one, head 256.
# Phi-3.5-mini's LongRoPE with a pretraining length of 32, so that replies
# and loads cross it; Granite 3's multipliers. Phi-4-mini's partial rope (3/4
# of each head), grouped KV heads and tied head. OLMo 3's layout: three
# sliding layers to a full one, q/k normed over the whole projection. Gemma
# 2 2B's: sliding and full layers in turn, head 256, its two soft caps.
# SmolLM3's: no rope on every fourth layer. GLM-4's interleaved rope on half
# of each head; GLM-4.5-Air's routing in small (4 of 32 experts, a shared one,
# a dense first layer). Granite 3.1 3B-A800M's: 8 of 32 experts (its 40),
# stacked in the checkpoint, and Granite's multipliers.
SHAPES = {
    "qwen3_moe": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=192,
                      norm_topk_prob=True, max_position_embeddings=4096),
    "mixtral": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=64, num_local_experts=8, num_experts_per_tok=2, intermediate_size=1792,
                    max_position_embeddings=4096),
    "gemma3": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=4096,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "phi3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                  "short_factor": [1.0 + 0.02 * i for i in range(32)],
                                  "long_factor": [1.0 + 0.25 * i for i in range(32)]}),
    "granite": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, embedding_multiplier=12.0,
                    residual_multiplier=0.22, attention_multiplier=1 / 64, logits_scaling=8.0),
    "phi4_mini": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, partial_rotary_factor=0.75,
                      tie_word_embeddings=True),
    "olmo3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, sliding_window=512,
                  layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    "gemma2": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   layer_types=["sliding_attention", "full_attention"] * 3, max_position_embeddings=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "smollm3": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, no_rope_layer_interval=4,
                    tie_word_embeddings=True),
    "glm4": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=4096),
    "glm4_moe": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, n_routed_experts=32,
                     num_experts_per_tok=4, moe_intermediate_size=192, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, routed_scaling_factor=2.5),
    "granitemoe": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                       max_position_embeddings=4096, num_local_experts=32, num_experts_per_tok=8, intermediate_size=192,
                       embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 64,
                       logits_scaling=8.0),
}
# A shape's model family where the key is not one.
FAMILY = {"phi4_mini": "phi3"}


def build_checkpoint(arch: str, root: Path) -> Path:
    """Random weights of ``SHAPES[arch]`` and the byte tokenizer, as safetensors."""
    from fluidserve.engine.tiny_model import build_tiny_model

    return build_tiny_model(root, FAMILY.get(arch, arch), seed=0, **SHAPES[arch])


def load(base: str, args: argparse.Namespace, rate: str, count: int) -> dict:
    rep = serve_bench.load(base, ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                                  "--random-output-len", str(args.output_len), "--num-prompts", str(count),
                                  "--request-rate", rate, "--seed", str(args.seed), "--ignore-eos"])
    return {k: rep.get(k) for k in LOAD_KEYS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(SHAPES), default="qwen3_moe")
    p.add_argument("--model", default=None, help="a model directory to serve instead of the random one")
    add_peer_load_args(p, rate=1.0, num_requests=32, port=8097)
    args = p.parse_args(argv)
    problem = vllm_problem(args.vllm_python)
    if problem:
        print(f"vLLM cannot run: {problem}")
        return 1
    scratch = Path(tempfile.mkdtemp(prefix="models-vs-vllm-"))
    model = args.model or str(build_checkpoint(args.arch, scratch / "model"))
    config = json.loads((Path(model) / "config.json").read_text())
    port = ["--host", "127.0.0.1", "--port", str(args.port)]
    servers = {
        "fluidserve": ([sys.executable, "-m", "fluidserve.serve.cli", "serve", model, *port, "--dtype", args.dtype,
                        "--max-model-len", "2048", "--log-level", "warning"], {}),
        "vLLM": ([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *port,
                  "--dtype", args.dtype, "--max-model-len", "2048", "--enforce-eager"], VLLM_ENV),
    }
    base_url = f"http://127.0.0.1:{args.port}"
    shape = {k: config.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_experts",
                                        "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                                        "moe_intermediate_size", "intermediate_size") if config.get(k) is not None}
    record: dict = {"benchmark": "models_vs_vllm", "command": " ".join(map(shlex.quote, sys.argv)),
                    "model": args.model and Path(args.model).name or f"random {args.arch}", "shape": shape,
                    "dtype": args.dtype, "servers": {}}
    for name, (cmd, env) in servers.items():
        # Started outside the repository: its top-level folders would shadow vLLM's imports.
        proc = serve_bench.launch(cmd, f"{base_url}/health", env, log=scratch / f"{name}.log", timeout=900,
                                  name=name, cwd=str(scratch))
        try:
            served = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
            load(base_url, args, "inf", 16)  # warm-up, not measured
            got = replies(base_url, served, args.max_tokens)
            loads = {"burst": load(base_url, args, "inf", args.num_requests),
                     f"{args.rate:g}/s": load(base_url, args, str(args.rate), args.num_requests)}
            record["servers"][name] = {"replies": got, "loads": loads}
            print(name, json.dumps(loads), flush=True)
        finally:
            serve_bench.stop_server(proc)
    ours, theirs = (record["servers"][s].pop("replies") for s in ("fluidserve", "vLLM"))
    same = sum(a == b for a, b in zip(ours, theirs))
    record["same_replies"], record["replies_compared"] = same, len(PROMPTS)
    experts = shape.get("num_experts") or shape.get("num_local_experts") or shape.get("n_routed_experts")
    routing = (f", each token routed to {shape.get('num_experts_per_tok')} of {experts} experts" if experts
               else "")
    lines = [f"# {record['model']} beside vLLM", "",
             f"{record['model']} ({args.dtype}): {shape.get('num_hidden_layers')} layers of hidden "
             f"{shape.get('hidden_size')}{routing}; each server started in turn in one run with the same "
             "checkpoint.", "",
             f"Greedy replies ({args.max_tokens} tokens, {len(PROMPTS)} prompts): **{same} of {len(PROMPTS)} the "
             "same tokens** on both servers.", "",
             f"Loads: {args.num_requests} random prompts of {args.input_len} tokens, {args.output_len} out "
             f"(`ignore_eos`), all at once (burst), then at {args.rate:g} req/s (Poisson).", "",
             *load_table(record["servers"]), ""]
    for kind in record["servers"]["fluidserve"]["loads"]:
        a, b = (record["servers"][s]["loads"][kind] for s in ("fluidserve", "vLLM"))
        lines.append(f"{kind}: fluidserve's output tok/s {a['output_throughput'] / b['output_throughput']:.2f}x "
                     f"vLLM's; median TTFT {b['median_ttft_ms'] / a['median_ttft_ms']:.2f}x lower, "
                     f"median TPOT {b['median_tpot_ms'] / a['median_tpot_ms']:.2f}x lower.")
    save_results(RESULTS / f"models_vs_vllm{args.tag}", record, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
