"""On a CUDA device the engine runs the Triton kernels; their greedy tokens
must equal the reference path's. Skipped without a GPU (CI is CPU-only);
run on a GPU machine with `python -m pytest -m gpu` (benchmarks/gpu_check.sh
does)."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from token_paths import assert_agree_but_for_near_ties

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "Long prompt " * 30]
# (arch, config overrides): GQA with head_dim 64 and 128, and OPT (MHA) at
# head_dim 64 and 80 (OPT-2.7B's; the kernel pads it to 128).
ARCH_CASES = [
    ("llama", {"head_dim": 64, "hidden_size": 256}),
    ("qwen3", {"head_dim": 128, "hidden_size": 512}),
    ("opt", {"hidden_size": 256}),
    ("opt", {"hidden_size": 320, "word_embed_proj_dim": 320}),
    ("qwen3_moe", {"head_dim": 128, "hidden_size": 512, "num_experts": 16, "num_experts_per_tok": 4,
                   "mlp_only_layers": [0]}),  # a dense layer's fused paths, then the experts
    ("mixtral", {"head_dim": 64, "hidden_size": 256}),
    ("gemma3", {"head_dim": 128, "hidden_size": 256, "query_pre_attn_scalar": 128}),
    ("granite", {"head_dim": 64, "hidden_size": 256}),
    ("phi3", {"head_dim": 128, "hidden_size": 512, "partial_rotary_factor": 0.75}),  # Phi-4-mini's rope
    ("olmo3", {"head_dim": 128, "hidden_size": 512}),
    ("smollm3", {"head_dim": 128, "hidden_size": 512}),
    ("gemma2", {"head_dim": 128, "hidden_size": 256, "query_pre_attn_scalar": 128, "attn_logit_softcapping": 1.0}),
    ("glm4", {"head_dim": 128, "hidden_size": 512}),
    ("glm4_moe", {"head_dim": 128, "hidden_size": 512, "n_routed_experts": 16, "num_experts_per_tok": 4}),
    ("granitemoeshared", {"head_dim": 64, "hidden_size": 256}),
    ("ernie4_5", {"head_dim": 128, "hidden_size": 512}),
    ("exaone4", {"head_dim": 128, "hidden_size": 512}),
]
ARCH_IDS = ["llama-64", "qwen3-128", "opt-64", "opt-80", "qwen3-moe-128", "mixtral-64", "gemma3-128", "granite-64",
            "phi3-partial-128", "olmo3-128", "smollm3-128",
            "gemma2-softcap-128", "glm4-128", "glm4-moe-128", "granite-moe-shared-64",
            "ernie-4.5-128", "exaone-4-128"]


@pytest.mark.parametrize("arch, overrides", ARCH_CASES, ids=ARCH_IDS)
def test_triton_path_greedy_equals_reference_path(tiny_model, make_llm, arch, overrides):
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256)
    ref = make_llm(path, device="cpu", **kwargs).generate(PROMPTS, params)
    gpu = make_llm(path, device="cuda", **kwargs).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("arch, overrides", ARCH_CASES, ids=ARCH_IDS)
def test_bf16_triton_path_matches_reference_path_token_for_token(tiny_model, make_llm, arch, overrides):
    """bf16 end to end on one GPU: the same model, weights and matmuls, once
    with the Triton kernels and once with the torch reference attention
    (ops.reference_path). Greedy tokens agree token for token; the only
    divergence allowed is at a near-tie of the reference's own logprobs,
    after which the continuations legitimately differ."""
    from fluidserve.kernels import ops

    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    kwargs = dict(device="cuda", dtype="bfloat16", max_num_batched_tokens=32, num_kv_blocks=256)
    triton_out = make_llm(path, **kwargs).generate(PROMPTS, params)
    with ops.reference_path():
        ref_out = make_llm(path, **kwargs).generate(PROMPTS, params)
    assert_agree_but_for_near_ties(triton_out, ref_out, arch)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("arch, overrides", [ARCH_CASES[0], ARCH_CASES[1]], ids=ARCH_IDS[:2])
def test_an_fp8_cache_on_a_gpu_gives_the_cpu_paths_tokens(tiny_model, make_llm, kv, arch, overrides):
    """--kv-cache-dtype on a GPU (decode graphs on, the default): fp32
    tokens agree with the CPU path's over the same fp8 cache (both round K/V
    as kernels/cache_dtype.py does and read them back widened) but for a
    near-tie: a last-bit difference in a projection can move one stored
    value a whole fp8 step."""
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256, kv_cache_dtype=kv)
    ref = make_llm(path, device="cpu", **kwargs).generate(PROMPTS, params)
    gpu = make_llm(path, device="cuda", enforce_eager=False, **kwargs).generate(PROMPTS, params)
    assert_agree_but_for_near_ties(gpu, ref, f"{arch} {kv}")


@pytest.mark.parametrize("arch, overrides", [ARCH_CASES[0], ARCH_CASES[1]], ids=ARCH_IDS[:2])
def test_speculative_decoding_on_a_gpu_gives_the_cpu_paths_tokens(tiny_model, make_llm, arch, overrides):
    """--speculative-config ngram on a GPU: verifying steps run eagerly
    (the mixed attention variant) between decode-graph steps, with async
    scheduling off; fp32 greedy tokens equal the CPU path's without drafts."""
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
             "adaptive": False}
    ref = make_llm(path, device="cpu", **kwargs).generate(PROMPTS, params)
    llm = make_llm(path, device="cuda", enforce_eager=False, speculative_config=ngram, **kwargs)
    gpu = llm.generate(PROMPTS, params)
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_embeddings_on_a_gpu_equal_the_reference_path(tiny_model, make_llm, dtype, tol):
    """An embedding model (``runner="pooling"``) on the Triton kernels, with
    graphs asked for: vectors of chunked prompts within ``tol`` of the
    torch reference attention's on the same device, and no decode graphs
    captured (no request of it decodes)."""
    from fluidserve.kernels import ops

    path = tiny_model("llama")
    kwargs = dict(device="cuda", dtype=dtype, max_num_batched_tokens=32, num_kv_blocks=256, runner="pooling",
                  enforce_eager=False)
    llm = make_llm(path, **kwargs)
    assert llm.engine.executor.worker.graphs is None
    got = [o.embedding for o in llm.embed(PROMPTS)]
    with ops.reference_path():
        want = [o.embedding for o in make_llm(path, **kwargs).embed(PROMPTS)]
    assert max(abs(a - b) for u, v in zip(got, want) for a, b in zip(u, v)) < tol


def test_classifier_on_a_gpu_equals_the_cpu(tmp_path, make_llm):
    """A sequence classifier on the Triton kernels (fp32): label
    probabilities within 1e-4 of the CPU path's, the head read on the engine."""
    from fluidserve.engine.tiny_model import build_tiny_classifier

    path = str(build_tiny_classifier(tmp_path / "classifier", "qwen3", labels=("a", "b", "c")))
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256)
    got = [o.outputs.probs for o in make_llm(path, device="cuda", **kwargs).classify(PROMPTS)]
    want = [o.outputs.probs for o in make_llm(path, device="cpu", **kwargs).classify(PROMPTS)]
    assert max(abs(a - b) for u, v in zip(got, want) for a, b in zip(u, v)) < 1e-4


def test_engine_start_up_compiles_every_attention_variant(tiny_model, make_llm):
    """The local executor's warm-up step compiles the attention variants at
    start-up (engine/layers.py): a workload of varied batches afterwards
    (lone prefills, chunked long prompts, decode-only and mixed steps)
    compiles none. Unrun on CPU-only machines."""
    from fluidserve.kernels import paged_attention as pa

    # Triton's own cache counts the compiles: it holds every specialisation,
    # the 16-byte alignment of each pointer included (engine/model_runner.py
    # keeps the step's block tables aligned whatever the batch's size).
    llm = make_llm(tiny_model("llama"), device="cuda", dtype="bfloat16", max_num_batched_tokens=64,
                   num_kv_blocks=512)
    after_start = pa.triton_compiled_count()
    assert after_start
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate(["a"], params)
    llm.generate(PROMPTS + ["Another long prompt " * 20] * 3, params)
    assert pa.triton_compiled_count() == after_start


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_batch_path_gives_the_modules_bits_on_a_gpu(tiny_model, make_llm, dtype):
    """Steps of several rows on the batch path (the products as ``torch.mm``
    into the step's buffers, weights transposed once; norms, SiLU-mul, rope,
    KV write and attention from prepared launches) against the same steps
    through the modules (``ops.set_batch_steps(False)``): through prefill
    chunks, mixed steps and decode graphs of 2-4 rows, greedy tokens and
    every KV cache are equal bit for bit, for a Llama, a Qwen2 (q/k/v
    bias) and a Qwen3 (q/k norms in the rope launch)."""
    from fluidserve.kernels import ops

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 20, 8, 16)]
    kwargs = dict(device="cuda", dtype=dtype, max_num_batched_tokens=32, num_kv_blocks=256, max_num_seqs=4,
                  cuda_graph_sizes=(1, 2, 4))  # fmt: skip
    for arch, overrides in (("llama", {"head_dim": 64, "hidden_size": 256}), ("qwen2", {}),
                            ("qwen3", {"head_dim": 128, "hidden_size": 256})):
        path = tiny_model(arch, **overrides)
        runs = {}
        for on in (True, False):
            was = ops.set_batch_steps(on)
            try:
                llm = make_llm(path, **kwargs)
                tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            finally:
                ops.set_batch_steps(was)
            runs[on] = tokens, [(k.clone(), v.clone()) for k, v in llm.engine.executor.worker.kv_caches]
        assert runs[True][0] == runs[False][0], arch
        for (k1, v1), (k2, v2) in zip(runs[True][1], runs[False][1]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), arch
