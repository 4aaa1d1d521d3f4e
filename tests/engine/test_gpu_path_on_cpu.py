"""The GPU's code path, run on CPU.

Four bugs once stopped the engine on its first GPU, all in code only CUDA
tensors reached. ``FLUIDSERVE_KERNELS=triton`` sends a CPU engine down
that path: the planner (``plan_for``, work plans, packing, the variant check
a launch makes), the Triton kernels through Triton's interpreter, and the
static decode plans and padded buckets of engine/cuda_graphs.py run without
a graph, over the CPU stand-in of engine/runtime.py. Each of the four bugs
has its regression test here, and a small set of engine tests runs in the
lane in fp32 and bf16: greedy tokens equal to the CPU kernels' in fp32, and
in bf16 equal but for a near-tie (tests/token_paths.py).

On a GPU the real path runs instead (tests/engine/test_engine_gpu.py,
tests/engine/test_cuda_graphs.py), so the lane is skipped there.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.runtime import pick_device
from fluidserve.kernels import ops
from token_paths import assert_agree_but_for_near_ties

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Long prompt " * 6]
# (arch, config overrides): GQA at head_dim 16 (llama's tiny default) and
# 128 (Qwen3), OPT at head_dim 80 (padded to 128 in the tile), and a
# sliding-window Mistral whose window the generation crosses.
LANE_CASES = [
    ("llama", {}),
    ("qwen3", {"head_dim": 128, "hidden_size": 256}),
    ("opt", {"hidden_size": 160, "word_embed_proj_dim": 160, "num_attention_heads": 2}),
    ("mistral", {"sliding_window": 12}),
    # A dense layer (the fused row and batch paths) before a MoE layer (the
    # experts through the Triton grouped GEMM, kernels/moe.py).
    ("qwen3_moe", {"mlp_only_layers": [0]}),
    ("gemma3", {}),  # a sliding layer and a full one, each with its rope table
    ("phi3", {"partial_rotary_factor": 0.75}),  # rope on 12 of 16 features: the fused launch's partial variant
    ("olmo3", {}),  # q/k normed over the whole projection, norms after each branch, a sliding layer
    ("smollm3", {}),  # a fused layer, then a NoPE layer through its modules
    ("gemma2", {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}),  # scores capped in the kernel
    ("glm4", {}),  # half of each head rotated (interleaved pairs reordered into halves at load)
    ("glm4_moe", {}),  # grouped sigmoid routing into the Triton experts, float32 weights
    ("granitemoeshared", {}),  # the chosen experts' softmax, a shared expert, Granite's multipliers
]
# What the GPU machines lack (benchmarks/gpu_check.sh runs there).
MISSING_ON_GPU_NODES = ("xgrammar", "ray", "fastapi", "uvicorn", "pydantic", "prometheus_client")
LANE_IDS = ["llama-gqa", "qwen3-128", "opt-80", "mistral-window", "qwen3-moe", "gemma3", "phi3-partial-rope", "olmo3",
            "smollm3", "gemma2-softcap", "glm4", "glm4-moe", "granite-moe-shared"]
# bf16 where the kernels differ by dtype: the first families, and the
# partial-rope and soft-capped variants (the other families' bf16 paths are
# those kernels', and fp32 checks their layers).
BF16_IDS = [*LANE_IDS[:6], "phi3-partial-rope", "gemma2-softcap"]
BF16_CASES = [case for case, name in zip(LANE_CASES, LANE_IDS) if name in BF16_IDS]
# Small steps and few tokens: the interpreter runs every program of a launch
# in Python. Chunked prompts still give mixed prefill+decode steps.
LANE_KWARGS = dict(device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, max_model_len=256)

lane_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real path (test_engine_gpu.py)")


@pytest.fixture
def triton_lane(monkeypatch):
    """FLUIDSERVE_KERNELS=triton for this test; the CPU kernels after it."""
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    assert ops.kernel_path(torch.device("cpu")) == "triton"


def generate(make_llm, path, params, **kwargs):
    return make_llm(path, **{**LANE_KWARGS, **kwargs}).generate(PROMPTS, params)


# -- 1. optional packages ---------------------------------------------------------------


def test_engine_runs_without_xgrammar_ray_or_the_server_packages(tiny_model):
    """A GPU node may lack xgrammar, ray and the server's packages: a fresh
    process where importing any of them fails builds an engine and
    generates (bug 1: the engine imported xgrammar at load)."""
    script = textwrap.dedent(f"""
        import sys
        for name in {MISSING_ON_GPU_NODES!r}:
            sys.modules[name] = None  # `import name` now raises ImportError
        from fluidserve.engine import LLM, SamplingParams
        llm = LLM(model={tiny_model("llama")!r}, device="cpu", num_kv_blocks=64)
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        print("tokens", len(out[0].outputs[0].token_ids))
        print("loaded", sorted(m for m in {MISSING_ON_GPU_NODES!r} if sys.modules.get(m) is not None))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens 4" in done.stdout and "loaded []" in done.stdout


def test_grammar_request_without_xgrammar_is_refused_naming_the_package(tiny_model, make_llm, monkeypatch):
    from fluidserve.engine.sampling_params import StructuredOutputs

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    llm = make_llm(tiny_model("llama"), num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(regex="[ab]+"))
    with pytest.raises(ValueError, match="structured_outputs: the 'xgrammar' package is not installed"):
        llm.engine.add_request("r", "Hello", params)
    assert not llm.engine.has_unfinished_requests()  # nothing was enqueued
    assert llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


def test_server_answers_a_grammar_request_without_xgrammar_with_a_400(tiny_model, monkeypatch):
    import httpx

    from server_utils import start_server

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    server = start_server(tiny_model("llama"))
    try:
        body = {"model": server.extra.get("model", "tiny"), "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "response_format": {"type": "json_object"}}
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        body["model"] = models["data"][0]["id"]
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "response_format" and "xgrammar" in err["message"]
        del body["response_format"]
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    finally:
        server.stop()


# -- 2. the CUDA device carries its index ---------------------------------------------------


def test_a_cuda_device_is_resolved_to_an_index(monkeypatch):
    """``torch.cuda.set_device`` refuses a bare "cuda" (torch >= 2.11): the
    worker's device must name its GPU."""
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name in ("cuda", "auto"):
        device = pick_device(name)
        assert device == torch.device("cuda", 0)
        assert _get_device_index(device, optional=False) == 0  # what set_device calls
    assert pick_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda")


# -- 3 and the lane: the engine on the Triton path ----------------------------------------------


@lane_only
@pytest.mark.parametrize("arch, overrides", LANE_CASES, ids=LANE_IDS)
def test_triton_lane_fp32_gives_the_cpu_kernels_tokens(tiny_model, make_llm, triton_lane, monkeypatch,
                                                        arch, overrides):
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lane = generate(make_llm, path, params, dtype="float32")
    monkeypatch.delenv(ops.KERNELS_ENV)
    ref = generate(make_llm, path, params, dtype="float32")
    assert [o.outputs[0].token_ids for o in lane] == [o.outputs[0].token_ids for o in ref]


@lane_only
@pytest.mark.parametrize("arch, overrides", BF16_CASES, ids=BF16_IDS)
def test_triton_lane_bf16_agrees_with_the_cpu_kernels(tiny_model, make_llm, triton_lane, monkeypatch,
                                                       arch, overrides):
    """bf16 end to end: the planner is handed a query of the model's dtype
    (a float32 one failed the layout check against bf16 caches at the first
    step, bug 3); tokens agree but for near-ties."""
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    llm = make_llm(path, **{**LANE_KWARGS, "dtype": "bfloat16"})
    assert llm.engine.executor.worker.runner._query_like.dtype == torch.bfloat16
    lane = llm.generate(PROMPTS, params)
    monkeypatch.delenv(ops.KERNELS_ENV)
    ref = generate(make_llm, path, params, dtype="bfloat16")
    assert_agree_but_for_near_ties(lane, ref, arch)


@lane_only
@pytest.mark.parametrize("arch, overrides, enforce_eager", [(*LANE_CASES[0], False), (*LANE_CASES[1], True)],
                         ids=["llama-gqa-graphs", "qwen3-128-eager"])
def test_triton_lane_over_an_fp8_cache_gives_the_cpu_kernels_tokens(tiny_model, make_llm, triton_lane, monkeypatch,
                                                                     arch, overrides, enforce_eager):
    """--kv-cache-dtype fp8 on the GPU's path: the rope launch (Qwen3's q/k
    norms in it) and the cache write round K/V as the CPU path does, and
    the attention launches (eager, or the decode buckets' static plans)
    read them back as stored: fp32 tokens equal the CPU kernels' over the
    same cache."""
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = dict(dtype="float32", kv_cache_dtype="fp8", enforce_eager=enforce_eager)
    llm = make_llm(path, **{**LANE_KWARGS, **kwargs})
    lane = llm.generate(PROMPTS, params)
    graphs = llm.engine.executor.worker.graphs
    assert enforce_eager or sum(graphs.replays.values()) > 0
    monkeypatch.delenv(ops.KERNELS_ENV)
    ref = generate(make_llm, path, params, **kwargs)
    assert [o.outputs[0].token_ids for o in lane] == [o.outputs[0].token_ids for o in ref]


@lane_only
def test_triton_lane_verifies_drafts_as_the_cpu_kernels_do(tiny_model, make_llm, triton_lane, monkeypatch):
    """Speculative decoding on the GPU's path: a decode and its drafts run as
    a short query over the paged cache (the attention's mixed variant,
    beside other rows' decodes, outside the decode graphs): fp32 tokens
    equal the CPU kernels' with the same drafts, and some drafts stood."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
             "adaptive": False}
    llm = make_llm(path, **{**LANE_KWARGS, "dtype": "float32", "speculative_config": ngram,
                            "enforce_eager": False})
    lane = llm.generate(PROMPTS, params)
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    monkeypatch.delenv(ops.KERNELS_ENV)
    ref = generate(make_llm, path, params, dtype="float32")
    assert [o.outputs[0].token_ids for o in lane] == [o.outputs[0].token_ids for o in ref]


# -- 4. decode buckets over the static plans -------------------------------------------------


@lane_only
def test_lane_decode_buckets_give_eager_tokens_and_kv_bit_for_bit(tiny_model, make_llm, triton_lane):
    """``enforce_eager=False`` in the lane runs decode steps in padded
    buckets over the static plans a captured graph reads (3 rows in bucket
    4): tokens and the whole KV cache are the eager Triton path's, so no
    padding row wrote KV anywhere. No row is long enough to split, so every
    step runs over the direct plans (no merge)."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype="float32", block_size=8, scheduling_policy="fcfs")
    eager_llm = make_llm(path, **kwargs)
    graph_llm = make_llm(path, enforce_eager=False, **kwargs)
    graphs = graph_llm.engine.executor.worker.graphs
    assert graphs is not None and all(b.plans for b in graphs.buckets.values())  # the static plans exist
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS[:3], params)]
    graphed = [o.outputs[0].token_ids for o in graph_llm.generate(PROMPTS[:3], params)]
    assert graphed == eager
    assert graphs.direct_replays.get(4, 0) == graphs.replays.get(4, 0) >= 8
    for (k1, v1), (k2, v2) in zip(eager_llm.engine.executor.worker.kv_caches,
                                  graph_llm.engine.executor.worker.kv_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@lane_only
@pytest.mark.parametrize("fused_merge", [False, True], ids=["merge-kernel", "fused-merge"])
def test_lane_decode_buckets_through_the_capture_loop(tiny_model, make_llm, triton_lane, fused_merge,
                                                    monkeypatch):
    """The capture loop (``capture_largest_first``) over the CPU runtime's
    stand-in, whose replay re-runs what it was given with the metadata of
    the capture, as a graph replays its launches: tokens are eager's. So
    too with every row's pieces merged inside the attention launch, whose
    counters each layer and each replay finds at zero. Rows split from 64
    keys here (``MIN_KV_CHUNK`` 1, no ``ITEM_OVERHEAD``; eager's plans
    too): the long prompt's
    steps replay the split graph of bucket 4, and once it ends the two
    short rows replay bucket 2's direct graph."""
    from fluidserve.kernels import packing
    from fluidserve.kernels import paged_attention as pa

    monkeypatch.setattr(packing, "MIN_KV_CHUNK", 1)
    monkeypatch.setattr(packing, "ITEM_OVERHEAD", 0)
    path = tiny_model("llama")
    short, long = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 3))
    prompts, params = PROMPTS[1:], [short, short, long]  # the last prompt is 72 tokens long
    kwargs = dict(LANE_KWARGS, dtype="float32", block_size=8, scheduling_policy="fcfs")
    eager = [o.outputs[0].token_ids for o in make_llm(path, **kwargs).generate(prompts, params)]
    with pa.tiles(fused_merge=fused_merge):
        graph_llm = make_llm(path, enforce_eager=False, **kwargs)
        graphs = graph_llm.engine.executor.worker.graphs
        graphs._capture_all()  # what capture=True runs on CUDA
        assert all(b.replay is not None and b.replay_direct is not None for b in graphs.buckets.values())
        assert [o.outputs[0].token_ids for o in graph_llm.generate(prompts, params)] == eager
    assert graphs.replays.get(4, 0) >= 2 and graphs.direct_replays.get(4, 0) == 0
    assert graphs.direct_replays.get(2, 0) == graphs.replays.get(2, 0) >= 2
    assert not next(iter(graphs.buckets.values())).spec.merge_counts.any()


@lane_only
def test_lane_embeddings_equal_the_cpu_kernels_and_capture_no_decode_graphs(tiny_model, make_llm, triton_lane,
                                                                           monkeypatch):
    """An embedding model on the CUDA code path: chunked prompts (32-token
    steps) pool to the CPU kernels' vectors (fp32, 1e-5), and with graphs
    asked for no decode bucket is built, since no request of it decodes."""
    path = tiny_model("llama")
    prompts = [list(b"The quick brown fox jumps over the lazy dog, twice over."), list(b"Hello!")]
    llm = make_llm(path, **LANE_KWARGS, dtype="float32", runner="pooling", enforce_eager=False)
    assert llm.engine.executor.worker.graphs is None
    lane = [o.embedding for o in llm.embed(prompts)]
    monkeypatch.delenv(ops.KERNELS_ENV)
    ref = [o.embedding for o in make_llm(path, **LANE_KWARGS, dtype="float32", runner="pooling").embed(prompts)]
    assert max(abs(a - b) for u, v in zip(lane, ref) for a, b in zip(u, v)) < 1e-5


@lane_only
def test_lane_piecewise_steps_give_eager_tokens_and_kv(tiny_model, make_llm, triton_lane):
    """Piecewise graphs' pieces in the lane (Triton norms, rope and KV write,
    attention between them on the step's real rows), run over the padded
    static buffers a capture reads, beside the lane's decode buckets: a
    prefill chunk and a mixed step give the eager Triton path's tokens, and
    its KV cache to fp32 rounding."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype="float32", block_size=8, scheduling_policy="fcfs")
    eager_llm = make_llm(path, **kwargs)
    piece_llm = make_llm(path, piecewise_graphs=True, **kwargs)  # the lane runs the buckets without a graph
    worker = piece_llm.engine.executor.worker
    assert worker.piecewise is not None
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS[:3], params)]
    pieces = [o.outputs[0].token_ids for o in piece_llm.generate(PROMPTS[:3], params)]
    assert pieces == eager
    assert set(worker.piecewise.replays) == {16, 32}  # the prefill chunk, then the mixed step
    assert sum(worker.graphs.replays.values()) >= 4  # the lane's decode buckets took the decode steps
    # The lane's GEMMs (F.linear) round by their row count: 11 rows padded
    # to 16 differ from 11 in the last bit, as cuBLAS's do on a GPU.
    for (k1, v1), (k2, v2) in zip(eager_llm.engine.executor.worker.kv_caches, worker.kv_caches):
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)


@lane_only
def test_lane_piecewise_steps_run_the_experts_in_their_pieces(tiny_model, make_llm, triton_lane):
    """A MoE layer's block runs inside the pieces a graph captures, over
    the padded rows of the static buffers (a padded row routes somewhere
    and is dropped): the eager Triton path's tokens."""
    path = tiny_model("qwen3_moe")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype="float32", block_size=8, scheduling_policy="fcfs")
    eager = [o.outputs[0].token_ids for o in make_llm(path, **kwargs).generate(PROMPTS[:3], params)]
    piece_llm = make_llm(path, piecewise_graphs=True, **kwargs)
    pieces = [o.outputs[0].token_ids for o in piece_llm.generate(PROMPTS[:3], params)]
    assert pieces == eager
    assert piece_llm.engine.executor.worker.piecewise.replays


@lane_only
def test_lane_mixed_steps_in_two_launches_give_one_launch_tokens(tiny_model, make_llm, triton_lane, monkeypatch):
    """Every mixed step planned as two launches (decode tiles in the
    decode-only variant, prefill tiles in the mixed one) gives the tokens of
    one launch through the engine, for full attention and a sliding window."""
    from fluidserve.kernels import packing
    from fluidserve.kernels import paged_attention as pa

    # A launch that repays its host time: every step with both kinds of tile splits.
    split_all = dataclasses.replace(packing.PLAN_COSTS, host_launch=-1e9)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype="float32", scheduling_policy="fcfs")
    for arch, overrides in (("llama", {}), ("mistral", dict(sliding_window=24))):
        path = tiny_model(arch, **overrides)
        one = [o.outputs[0].token_ids for o in generate(make_llm, path, params, **kwargs)]
        decode_launches = []
        with monkeypatch.context() as patch:
            patch.setattr(packing, "PLAN_COSTS", split_all)
            patch.setattr(pa, "_decode_launch", lambda *a, f=pa._decode_launch: decode_launches.append(1) or f(*a))
            two = [o.outputs[0].token_ids for o in generate(make_llm, path, params, **kwargs)]
        assert decode_launches, "no step ran its decode tiles in a launch of their own"
        assert two == one


@lane_only
@pytest.mark.parametrize("dtype, cases", [("float32", [LANE_CASES[0], LANE_CASES[3]]), ("bfloat16", LANE_CASES[:2])],
                         ids=["float32-llama-mistral", "bfloat16-llama-qwen3"])  # fmt: skip
def test_lane_batch1_layers_in_six_launches_give_the_nine_launch_bits(tiny_model, make_llm, triton_lane,
                                                                      monkeypatch, dtype, cases):  # fmt: skip
    """A decode step of one row runs each decoder layer as the batch-1
    GEMVs with the norms, the residual adds and the SiLU-mul folded in (six
    launches, as a decode graph does). Through the engine, for a GQA Llama
    (fp32, bf16), a sliding-window Mistral (fp32) and a Qwen3 (q/k norms,
    head_dim 128; bf16, where a misplaced rounding shows), its tokens and
    its whole KV cache equal the
    nine-launch layer's bit for bit: the fused launches round where the
    unfused ones do. The layer launches them from the weights it read once
    (``LlamaDecoderLayer.prepack``); through the modules, which check
    every call, the bits are the same again. Every family's layers share
    one step's buffers and attention launches (``PagedAttention.step_launches``,
    made once a decode step, launched by every layer), a Mistral's over a
    window the generation crosses, a Qwen3's with each layer's q and k norm
    weights (normed in the rope launch, as the modules' attention norms
    them)."""
    from types import SimpleNamespace

    from fluidserve.engine.layers import PagedAttention
    from fluidserve.engine.models import llama
    from fluidserve.kernels import gemv

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype=dtype, scheduling_policy="fcfs")
    for arch, overrides in cases:
        path = tiny_model(arch, **overrides)
        runs = {}
        for name, patches in [("six", []), ("six through the modules", [(llama.LlamaDecoderLayer, "prepack",
                                                                          lambda self: None)]),
                              ("nine", [(llama, "ops", SimpleNamespace(gemv_row=lambda x, w: False,
                                                                       batch_steps=lambda: False))])]:  # fmt: skip
            normed, built, attended = [], [], []

            def step_launches(self, *a, f=PagedAttention.step_launches, **k):
                launches = f(self, *a, **k)
                built.append(launches)
                return launches and (lambda kv, norms: attended.append((kv, norms)) or launches(kv, norms))

            class NormsCounted:  # every GEMV launch, whichever way it is made: was the norm in its prologue?
                def __getitem__(self, grid, inner=gemv._GEMV):
                    return lambda *a, **k: normed.append(k["NORM"]) or inner[grid](*a, **k)

                def kept(self, grid, args, kwargs, inner=gemv._GEMV):
                    normed.append(kwargs["NORM"])
                    return inner.kept(grid, args, kwargs)

            with monkeypatch.context() as patch:
                patch.setattr(gemv, "_GEMV", NormsCounted())
                patch.setattr(PagedAttention, "step_launches", step_launches)
                for target, attr, value in patches:
                    patch.setattr(target, attr, value)
                llm = make_llm(path, **kwargs)
                tokens = llm.generate(PROMPTS[1:2], params)[0].outputs[0].token_ids
            runs[name] = tokens, llm.engine.executor.worker.kv_caches
            # two GEMVs with the norm in their prologue per layer in every decode step of the six-launch layers
            assert (sum(normed) >= 2 * 5) is (name != "nine"), name
            if name == "six":
                # made once a decode step (five, and the start-up's warm-up), launched by every layer in turn
                assert len(built) >= 5 and all(built)
                layers = [m.self_attn for m in llm.engine.executor.worker.model.modules()
                          if isinstance(m, llama.LlamaDecoderLayer)]  # fmt: skip
                assert [id(k) for (k, _), _ in attended] == [id(k) for k, _ in runs[name][1]] * len(built)
                ids = [None if a.norms() is None else (id(a.q_norm.weight), id(a.k_norm.weight)) for a in layers]
                assert [n and tuple(map(id, n)) for _, n in attended] == ids * len(built)
                assert (ids[0] is not None) is (arch == "qwen3")
            else:
                assert built == [], (arch, name)
        tokens, caches = runs["nine"]
        for name in ("six", "six through the modules"):
            assert runs[name][0] == tokens, (arch, name)
            for (k1, v1), (k2, v2) in zip(runs[name][1], caches):
                assert torch.equal(k1, k2) and torch.equal(v1, v2), (arch, name)


@lane_only
@pytest.mark.parametrize("dtype, cases", [("float32", [LANE_CASES[0], LANE_CASES[3]]),
                                          ("bfloat16", [LANE_CASES[0], ("qwen2", {}), LANE_CASES[1]])],
                         ids=["float32-llama-mistral", "bfloat16-llama-qwen2-qwen3"])  # fmt: skip
def test_lane_steps_of_several_rows_run_the_modules_bits_from_prepared_buffers(tiny_model, make_llm, triton_lane,
                                                                              monkeypatch, dtype, cases):  # fmt: skip
    """A step of several rows (prefill chunks, a chunk beside decodes,
    decodes of several sequences) runs each decoder layer's nine launches
    from buffers and launches the step's first layer prepares (the batch
    path, ``_BatchStep``): the products into the step's buffers, the norms,
    the SiLU-mul, rope, KV write and attention laid out once. Through the
    engine, for a GQA Llama and a sliding-window Mistral (fp32) and a
    Llama, a Qwen2 with its q/k/v bias and a Qwen3 with its q/k norms
    (bf16), tokens and the whole KV cache equal the modules'
    (``ops.set_batch_steps(False)``) bit for bit."""
    from fluidserve.engine.models import llama
    from fluidserve.kernels import ops as kernel_ops

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 7)]
    kwargs = dict(LANE_KWARGS, dtype=dtype, scheduling_policy="fcfs")
    for arch, overrides in cases:
        path = tiny_model(arch, **overrides)
        runs = {}
        for on in (True, False):
            steps = []
            with monkeypatch.context() as patch:
                patch.setattr(llama._BatchStep, "run", lambda self, *a, f=llama._BatchStep.run: steps.append(
                    self.qkv.shape[0]) or f(self, *a))  # fmt: skip
                was = kernel_ops.set_batch_steps(on)
                try:
                    llm = make_llm(path, **kwargs)
                    outs = llm.generate(PROMPTS, params)
                finally:
                    kernel_ops.set_batch_steps(was)
            runs[on] = [o.outputs[0].token_ids for o in outs], llm.engine.executor.worker.kv_caches
            if on:
                # chunks of the 72-token prompt (32 tokens a step) and decodes of four rows and fewer
                assert {32, 4, 2} <= set(steps), (arch, sorted(set(steps)))
            else:
                assert steps == [], (arch, on)
        assert runs[True][0] == runs[False][0], arch
        for (k1, v1), (k2, v2) in zip(runs[True][1], runs[False][1]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2), arch


def test_the_batch_path_is_on_by_default_and_an_environment_variable_rules_it_out():
    """``FLUIDSERVE_BATCH_STEPS=0`` (read at import) sends steps of several
    rows through the modules; unset or 1, the batch path."""
    import os
    import subprocess
    import sys

    code = "from fluidserve.kernels import ops; print(ops.batch_steps())"
    env = {k: v for k, v in os.environ.items() if k != "FLUIDSERVE_BATCH_STEPS"}
    seen = [subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                           timeout=120).stdout.strip()
            for extra in ({}, {"FLUIDSERVE_BATCH_STEPS": "1"}, {"FLUIDSERVE_BATCH_STEPS": "0"})]  # fmt: skip
    assert seen == ["True", "True", "False"]


@lane_only
def test_row_and_batch_layers_leave_their_input_and_alternate_between_two_step_buffers(tiny_model, make_llm,
                                                                                       triton_lane):  # fmt: skip
    """A step's layers on the row path (one row) and on the batch path
    (several) write their outputs into two buffers the step keeps,
    alternately, rather than a new tensor a layer: each layer leaves its
    input as it was (the next layer's input is never the buffer it
    writes), and a step's three layers use just the two."""
    from fluidserve.engine.models.llama import LlamaDecoderLayer

    path = tiny_model("llama", num_hidden_layers=3)
    steps: list[tuple[str, list[tuple[int, int]]]] = []  # per step: its path, (input, output) addresses per layer
    kept: dict[int, torch.Tensor] = {}

    def kind(kwargs) -> str | None:
        return "row" if kwargs.get("row") else "batch" if kwargs.get("batch") else None

    def before(layer, args, kwargs):
        if kind(kwargs):
            if layer is layers[0]:
                steps.append((kind(kwargs), []))
            kept[id(layer)] = args[1].clone()

    def after(layer, args, kwargs, out):
        if kind(kwargs):
            x = args[1]
            assert torch.equal(x, kept.pop(id(layer))), "a layer wrote over its input"
            steps[-1][1].append((x.data_ptr(), out.data_ptr()))

    llm = make_llm(path, **LANE_KWARGS, dtype="float32", scheduling_policy="fcfs")
    layers = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert len(layers) == 3
    for layer in layers:
        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_hook(after, with_kwargs=True)
    # two rows a step, then one once the shorter request ends
    llm.generate(PROMPTS[1:3], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 2)])
    assert {k for k, _ in steps} == {"row", "batch"}
    for _, step in steps:
        outs = [o for _, o in step]
        assert len(step) == 3 and all(i != o for i, o in step)
        assert [i for i, _ in step[1:]] == outs[:-1] and outs[0] == outs[2] != outs[1]


def test_row_weights_are_read_once_per_load_and_only_where_every_linear_takes_the_gemv(triton_lane):
    """On the Triton lane (the CPU kernels pack the weights for oneDNN and
    take no row path), a layer's row path reads its four GEMVs' weights, norms and eps once,
    as its batch path reads the same weights transposed,
    and keeps them until the loader writes the weights again
    (``parallel.prepack_linears``, after every load). Where one linear would
    not take the GEMV as the row path fuses it (an o projection with a
    bias, q/k norm weights of another dtype than the heads), the layer keeps
    none and its modules decide per call; a q/k/v bias (Qwen2) rides in the
    qkv GEMV, q/k norms (Qwen3) in the step's rope launch."""
    from fluidserve.engine.models.llama import LlamaForCausalLM
    from fluidserve.engine.parallel import prepack_linears
    from fluidserve.engine.tiny_model import tiny_config

    model = LlamaForCausalLM(tiny_config("llama"))
    prepack_linears(model)  # as the loader does after writing the weights
    layer = model.model.layers[0]
    w = layer._row
    attn, mlp = layer.self_attn, layer.mlp
    assert (w.qkv, w.qkv_bias, w.o, w.gate_up, w.down) == (attn.qkv_proj.weight, None, attn.o_proj.weight,
                                                           mlp.gate_up_proj.weight, mlp.down_proj.weight)
    assert w.input_norm == (layer.input_layernorm.weight, layer.input_layernorm.eps)
    assert w.post_norm == (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    assert layer._row is w  # read once
    layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.full_like(w.post_norm[0], 2.0))
    assert layer._row is w
    prepack_linears(model)
    assert layer._row.post_norm[0] is layer.post_attention_layernorm.weight
    # the batch path's: the same weights, transposed views as torch.mm takes them, and the norms
    b = layer._batch
    for view, module in ((b.qkv_t, attn.qkv_proj), (b.o_t, attn.o_proj), (b.gate_up_t, mlp.gate_up_proj),
                         (b.down_t, mlp.down_proj)):  # fmt: skip
        assert view.data_ptr() == module.weight.data_ptr() and view.shape == module.weight.shape[::-1]
    assert b.input_norm is layer.input_layernorm.weight and b.post_norm is layer.post_attention_layernorm.weight
    assert b.eps == (layer.input_layernorm.eps, layer.post_attention_layernorm.eps)
    with_o_bias = LlamaForCausalLM(tiny_config("llama", attention_bias=True))
    prepack_linears(with_o_bias)
    assert with_o_bias.model.layers[0]._row is None and with_o_bias.model.layers[0]._batch is None
    qwen2 = LlamaForCausalLM(tiny_config("qwen2"))
    prepack_linears(qwen2)
    bias = qwen2.model.layers[0].self_attn.qkv_proj.bias
    assert qwen2.model.layers[0]._row.qkv_bias is bias and qwen2.model.layers[0]._batch.qkv_bias is bias
    qwen3 = LlamaForCausalLM(tiny_config("qwen3"))  # q and k normed in the step's rope launch, per layer
    prepack_linears(qwen3)
    attn = qwen3.model.layers[1].self_attn
    for w in (qwen3.model.layers[1]._row, qwen3.model.layers[1]._batch):
        assert w.qk_norm[0] is attn.q_norm.weight and w.qk_norm[1] is attn.k_norm.weight
        assert w.step_key[-1] == attn.q_norm.eps
    assert qwen3.model.layers[0]._row.step_key == qwen3.model.layers[1]._row.step_key
    qwen3.model.layers[1].self_attn.k_norm.weight.data = attn.k_norm.weight.data.double()
    qwen3.model.layers[1].prepack()  # a norm weight of another dtype than the heads: the modules
    assert qwen3.model.layers[1]._row is None and qwen3.model.layers[1]._batch is None


@lane_only
def test_partial_buffers_hold_every_bucket_when_the_split_cap_binds(tiny_model, make_llm, triton_lane,
                                                                     monkeypatch):
    """With the split-K budget below the largest bucket (8 rows against a
    16-row bucket) each bucket's view of the shared partials must still fit:
    one formula sizes the buffers and the views (bug 4's reshape error)."""
    from fluidserve.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "PARTIAL_ROWS", 8)
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(LANE_KWARGS, dtype="float32", max_num_seqs=16)
    graph_llm = make_llm(path, enforce_eager=False, **kwargs)
    graphs = graph_llm.engine.executor.worker.graphs
    assert graphs.sizes[-1] == 16 and max(b * cuda_graphs.max_splits_for(b) for b in graphs.sizes) == 16
    for b, bucket in graphs.buckets.items():
        scratch = bucket.plans[None].plan.scratch
        ((out, lse),) = (v for k, v in scratch.items() if k[0] != "merge_counts")
        (counts,) = (v for k, v in scratch.items() if k[0] == "merge_counts")
        assert out.shape[:2] == lse.shape[:2] == (b, cuda_graphs.max_splits_for(b)) and counts.shape[0] == b
    graphed = [o.outputs[0].token_ids for o in graph_llm.generate(PROMPTS, params)]
    eager = [o.outputs[0].token_ids for o in make_llm(path, **kwargs).generate(PROMPTS, params)]
    assert graphed == eager and sum(graphs.replays.values()) >= 4


def test_an_interpreter_that_cannot_run_beside_numpy_is_named():
    # Triton before 3.7 reads run-time loop bounds with int() of a
    # one-element array, which numpy 2.4 refuses: the lane (and the test
    # suite, tests/conftest.py) stops with the two versions and the fix.
    problem = ops.interpreter_incompatibility("3.6.0", "2.4.6")
    assert problem is not None
    assert all(s in problem for s in ("Triton 3.6.0", "numpy 2.4.6", "numpy<2.4", "triton>=3.7"))
    assert ops.interpreter_incompatibility("3.5.1", "2.4.0") is not None
    for triton_version, numpy_version in [("3.7.0", "2.4.6"), ("3.6.0", "2.3.5"), ("3.10.0+git1234", "2.5.0"),
                                          ("3.2.0", "1.26.4"), ("3.7.0rc1", "2.4.0")]:
        assert ops.interpreter_incompatibility(triton_version, numpy_version) is None


def test_kernel_switch_is_checked():
    import os

    before = os.environ.get(ops.KERNELS_ENV)
    try:
        os.environ[ops.KERNELS_ENV] = "cuda-please"
        with pytest.raises(ValueError, match="FLUIDSERVE_KERNELS='cuda-please': expected one of auto, triton"):
            ops.kernel_path(torch.device("cpu"))
        os.environ[ops.KERNELS_ENV] = "auto"
        assert ops.kernel_path(torch.device("cpu")) == "cpu"
        assert ops.kernel_path(torch.device("cuda", 0)) == "triton"
        with ops.reference_path():
            assert ops.kernel_path(torch.device("cuda", 0)) == "reference"
    finally:
        if before is None:
            os.environ.pop(ops.KERNELS_ENV, None)
        else:
            os.environ[ops.KERNELS_ENV] = before


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_step_plans_travel_in_the_step_upload(monkeypatch, device):
    """An eager step's attention work plans (one per sliding window, a
    two-launch plan's decode part too) are views of the step's one input
    buffer, the storage the input ids live in, each starting on 16 bytes,
    and hold what ``plan_for`` plans for the same lengths: they reach the
    device in the step's one copy, not in copies of their own."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("a GPU runs the real path")
    if device == "cpu":
        monkeypatch.setenv(ops.KERNELS_ENV, "triton")  # the lane (triton_lane's switch, which CUDA machines refuse)
    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.layers import PagedAttention
    from fluidserve.engine.model_runner import ModelRunner
    from fluidserve.kernels import packing
    from fluidserve.kernels import paged_attention as pa

    dev = torch.device(device)
    model = torch.nn.ModuleList([PagedAttention(8, 2, 64, 0.125), PagedAttention(8, 2, 64, 0.125, sliding_window=24)])
    cache = torch.empty((64, 16, 2, 64), dtype=torch.bfloat16, device=dev)
    runner = ModelRunner(model, dev, torch.bfloat16)
    # A 40-token prompt chunk beside three decodes (two launches when forced), then decodes alone.
    steps = [([40, 1, 1, 1], [40, 300, 17, 1000]), ([1, 1], [41, 301])]
    two_launch = 0
    for host_launch in (1e9, -1e9):  # one launch, then two wherever a step has both kinds of tile
        for q_lens, seq_lens in steps:
            starts = [0]
            for n in q_lens:
                starts.append(starts[-1] + n)
            t = starts[-1]
            inp = ModelInput(input_ids=list(range(t)), positions=list(range(t)), slot_mapping=list(range(t)),
                             query_start_loc=starts, seq_lens=seq_lens,
                             block_tables=[list(range(-(-s // 16))) for s in seq_lens],
                             sample_indices=[s - 1 for s in starts[1:]])  # fmt: skip
            costs = dataclasses.replace(packing.PLAN_COSTS, host_launch=host_launch)
            monkeypatch.setattr(packing, "PLAN_COSTS", costs)
            input_ids, _, meta, _ = runner.prepare(inp, [(cache, cache)])
            query = torch.empty((0, 8, 64), dtype=torch.bfloat16, device=dev)
            for window in (None, 24):
                plan = meta.work_plan(query, cache, window)
                want = pa.plan_for(query, cache, q_lens, seq_lens, window)
                parts = [(plan, want)]
                if want.decode_part is not None:
                    parts.append((plan.decode_part, want.decode_part))
                    two_launch += 1
                assert (plan.decode_part is not None) == (want.decode_part is not None)
                for got, ref in parts:
                    for name in ("work", "unit_offsets", "merge_tokens", "merge_num_splits"):
                        view, expect = getattr(got, name), getattr(ref, name)
                        assert view.device.type == dev.type and view.data_ptr() % 16 == 0, name
                        assert view.untyped_storage().data_ptr() == input_ids.untyped_storage().data_ptr(), name
                        assert torch.equal(view.cpu(), expect.cpu()), name
                    assert got.unit_costs == ref.unit_costs and got.max_splits == ref.max_splits
    assert two_launch == 2  # the mixed step, forced, for both windows
