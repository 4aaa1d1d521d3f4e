"""Multi-LoRA serving (engine/lora.py) against PEFT: every row of a batch
generates with its own adapter, or none, token for token as PEFT's model
with that adapter; adapters' KV is never shared through the prefix cache;
adapters come and go while requests run; what cannot be served is refused
by name; tensor-parallel shards add up to the whole adapter."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.lora import AdapterError, LoRASlots, LoRAStep, read_adapter
from fluidserve.engine.loader import build_model, load_hf_config, load_weights
from fluidserve.engine.parallel import TensorParallel
from fluidserve.kernels import ops
from lora_utils import make_adapter, peft_greedy

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Long prompt " * 6]
TOKENS = 12
# Two adapters unlike each other: every linear at rank 4, and a few linears
# at rank 8 with rsLoRA's scaling (OPT names its MLP fc1 / fc2).
SECOND_TARGETS = {"opt": ["q_proj", "v_proj", "fc1"]}


def greedy(name: str | None, max_tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, lora=name)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    """adapters(arch) -> (model dir, {name: adapter dir}), made once per arch."""
    made: dict = {}

    def get(arch: str):
        if arch not in made:
            path = tiny_model(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            made[arch] = path, {
                "a1": make_adapter(path, root / "a1", seed=1, r=4),
                "a2": make_adapter(path, root / "a2", seed=2, r=8, use_rslora=True,
                                   targets=SECOND_TARGETS.get(arch, ["q_proj", "v_proj", "down_proj"])),
            }
        return made[arch]

    return get


def run_mixed(llm, names, prompts=PROMPTS) -> dict:
    """Every prompt under every name in one generate call: name -> tokens."""
    cases = [(n, p) for p in prompts for n in names]
    outs = llm.generate([p for _, p in cases], [greedy(n) for n, _ in cases])
    got: dict = {n: [] for n in names}
    for (n, _), out in zip(cases, outs):
        got[n].append(out.outputs[0].token_ids)
    return got


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "gemma3", "qwen3_moe", "olmo2", "gemma2", "glm4", "phi3"],
                         ids=["llama-gqa", "qwen2-bias", "opt", "gemma3", "qwen3-moe-attention", "olmo2", "gemma2",
                              "glm4-fused-gate-up-interleaved-rope", "phi3-fused-qkv-gate-up"])
def test_each_row_generates_with_its_own_adapter_as_peft_does(adapters, make_llm, arch):
    path, made = adapters(arch)
    refs = {None: peft_greedy(path, None, PROMPTS, TOKENS), **{n: peft_greedy(path, a, PROMPTS, TOKENS)
                                                                 for n, a in made.items()}}
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None] and refs["a1"] != refs["a2"]
    # Eight tokens a step: prompts in chunks beside other rows' decodes, every mix of adapters in a step.
    llm = make_llm(path, enable_lora=True, max_lora_rank=8, lora_modules=tuple(made.items()),
                   max_num_batched_tokens=8)
    assert run_mixed(llm, [None, "a1", "a2"]) == refs


def test_vllms_lora_request_loads_the_adapter_on_first_use(adapters, make_llm):
    from fluidserve.engine import LoRARequest

    path, made = adapters("llama")
    llm = make_llm(path, enable_lora=True, max_loras=2, max_lora_rank=8)
    ref = peft_greedy(path, made["a1"], PROMPTS[:2], TOKENS)
    outs = llm.generate(PROMPTS[:2], greedy(None), lora_request=LoRARequest("a1", 1, made["a1"]))
    assert [o.outputs[0].token_ids for o in outs] == ref
    outs = llm.generate(PROMPTS[:2], greedy(None), lora_request=[None, LoRARequest("a1", 1, made["a1"])])
    assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(path, None, PROMPTS[:1], TOKENS)[0], ref[1]]
    assert llm.engine.lora_names() == {"a1": made["a1"]}


def test_rank_pattern_scales_each_module_by_its_own_rank(tiny_model, make_llm, tmp_path):
    path = tiny_model("llama")
    adapter = make_adapter(path, tmp_path / "a", seed=3, r=4, rank_pattern={"q_proj": 2, "down_proj": 6})
    llm = make_llm(path, enable_lora=True, max_lora_rank=6, lora_modules=(("a", adapter),))
    outs = llm.generate(PROMPTS, greedy("a"))
    assert [o.outputs[0].token_ids for o in outs] == peft_greedy(path, adapter, PROMPTS, TOKENS)


def test_an_adapters_kv_is_shared_only_with_its_own_requests(adapters, make_llm):
    path, made = adapters("llama")
    llm = make_llm(path, enable_lora=True, lora_modules=(("a1", made["a1"]),), max_lora_rank=8)
    prompt = "Long prompt " * 6  # 73 tokens: four full blocks to cache
    stats = llm.engine.kv.prefix_stats

    def hits(name):
        before = stats.hit_tokens
        (out,) = llm.generate([prompt], greedy(name))
        return stats.hit_tokens - before, out.outputs[0].token_ids

    base_hits, base = hits(None)
    a1_hits, a1 = hits("a1")  # the base model's blocks are cached: none of them is the adapter's KV
    a1_again_hits, a1_again = hits("a1")
    base_again_hits, base_again = hits(None)
    assert (base_hits, a1_hits) == (0, 0)
    assert a1_again_hits >= 64 and base_again_hits >= 64
    assert a1 == a1_again == peft_greedy(path, made["a1"], [prompt], TOKENS)[0]
    assert base == base_again != a1


def test_adapters_load_and_unload_while_requests_run(adapters, make_llm):
    path, made = adapters("llama")
    llm = make_llm(path, enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.engine
    ref1 = peft_greedy(path, made["a1"], PROMPTS[:2], TOKENS)
    ref2 = peft_greedy(path, made["a2"], PROMPTS[:2], TOKENS)
    engine.add_lora("a1", made["a1"])
    with pytest.raises(ValueError, match="all 1 adapter slots are in use"):
        engine.add_lora("a2", made["a2"])
    engine.add_request("r", PROMPTS[0], greedy("a1"))
    engine.step()
    engine.step()
    assert engine.stats().lora_info == (1, (), ("a1",))  # vLLM's lora_requests_info: slots, waiting, running
    # Unloaded mid-answer: new requests may no longer name it, the running one finishes with it,
    # and its slot stays its own until then.
    engine.remove_lora("a1")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a1'"):
        engine.add_request("late", PROMPTS[0], greedy("a1"))
    with pytest.raises(ValueError, match="slots are in use"):
        engine.add_lora("a2", made["a2"])
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
    assert tokens == ref1[0]
    engine.add_lora("a2", made["a2"])  # the slot is free now: a2's weights replace a1's
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy("a2"))] == ref2
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("a2", made["a2"])
    engine.remove_lora("a2")
    engine.add_lora("a1", made["a1"])  # loaded again: the same tokens as the first time
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy("a1"))] == ref1
    assert engine.lora_names() == {"a1": made["a1"]}
    assert engine.stats().lora_info == (1, (), ())


def test_adapters_that_cannot_be_served_are_refused_by_name(tiny_model, make_llm, tmp_path):
    path = tiny_model("llama")
    model = build_model(load_hf_config(path), torch.float32, torch.device("meta"))

    def refused(adapter, match, max_rank=16):
        with pytest.raises(AdapterError, match=match):
            read_adapter(adapter, model, max_rank)

    refused(make_adapter(path, tmp_path / "dora", 1, use_dora=True), "DoRA adapters are not supported")
    refused(make_adapter(path, tmp_path / "emb", 1, targets=["embed_tokens", "q_proj"]),
            "embedding and LM-head adapters are not supported")
    refused(make_adapter(path, tmp_path / "wide", 1, r=32), "rank 32 of .* exceeds max_lora_rank=16")
    refused(make_adapter(path, tmp_path / "bias", 1, bias="all"), "bias terms")
    refused(make_adapter(path, tmp_path / "arrow", 1, arrow_config={"top_k": 2}), "arrow_config is not supported")
    make_adapter(path, tmp_path / "loftq", 1, loftq_config={"loftq_bits": 4})  # how it was made: served
    assert read_adapter(tmp_path / "loftq", model, 16).rank == 4
    other = tiny_model("llama", hidden_size=32, head_dim=8)
    refused(make_adapter(other, tmp_path / "other", 1), r"down_proj.*do not fit a linear of 128 inputs and 64 outputs")
    refused(tmp_path / "missing", "is not a folder")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "no adapter_config.json")
    llm = make_llm(path)
    with pytest.raises(ValueError, match="need --enable-lora"):
        llm.engine.add_lora("a", str(tmp_path / "wide"))
    with pytest.raises(ValueError, match="model: no LoRA adapter named 'a'"):
        llm.engine.add_request("r", "hi", greedy("a"))
    with pytest.raises(ValueError, match="lora_modules.*need --enable-lora"):
        make_llm(path, lora_modules=(("a", str(tmp_path / "wide")),))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen2", {"num_key_value_heads": 1})],
                         ids=["llama-gqa", "qwen2-kv1"])
def test_tensor_parallel_shards_add_up_to_the_whole_adapter(tiny_model, tmp_path, arch, overrides):
    """Each rank's slots hold its slice: a column-parallel linear's adapter
    rows (each part split as its weight is, a lone KV head whole on both
    ranks), a row-parallel one's partial product over its input columns,
    which the layer's all-reduce sums."""
    path = tiny_model(arch, **overrides)
    adapter_dir = make_adapter(path, tmp_path / "a", seed=4, r=4)
    cfg = load_hf_config(path)

    def slots(tp):
        model = build_model(cfg, torch.float32, torch.device("cpu"), tp)
        load_weights(model, path)
        lora = LoRASlots(model, 2, 4)
        lora.load(1, read_adapter(adapter_dir, model, 4))
        lora.state.step = LoRAStep((1, slice(None)))
        return lora

    whole, ranks = slots(None), [slots(TensorParallel(r, 2)) for r in range(2)]
    torch.manual_seed(0)
    checked = 0
    for name, site in whole.sites.items():
        x = torch.randn(3, site.module.weight.shape[1])
        full = site.module.lora.add_to(x, torch.zeros(3, site.module.weight.shape[0]))
        assert full.abs().sum() > 0, name
        parts = [r.sites[name] for r in ranks]
        spec = parts[0].spec
        if spec is not None and spec.dim == 1:  # row-parallel: partial sums over each rank's columns
            xs = [x[:, p.spec.start:p.spec.stop] for p in parts]
            total = sum(p.module.lora.add_to(xi, torch.zeros(3, p.module.weight.shape[0]))
                        for p, xi in zip(parts, xs))
            torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)
        else:  # column-parallel: each rank's rows of this part
            for p in parts:
                mine = p.module.lora.add_to(x, torch.zeros(3, p.module.weight.shape[0]))
                start, stop = (p.spec.start, p.spec.stop) if p.spec is not None else (0, site.rows)
                torch.testing.assert_close(mine[:, p.offset:p.offset + p.rows],
                                           full[:, site.offset + start:site.offset + stop])
        checked += 1
    assert checked == len(whole.sites) == 7 * cfg.num_hidden_layers


def test_step_rows_by_adapter():
    cpu = torch.device("cpu")
    step = LoRAStep.build([1, 1, -1, 0, 1], [0, 3, 4, 9, 10, 12], cpu)
    assert step.run is None
    assert step.slot_of_row.tolist() == [1, 1, 1, 1, -1, -1, -1, -1, -1, 0, 1, 1]
    groups = {slot: rows for slot, rows in step.groups}
    assert groups[0] == slice(9, 10)  # one run: a view, no gather
    assert groups[1].tolist() == [0, 1, 2, 3, 10, 11]  # adjacent rows merged, then an index
    # Each row's own slot's columns (two slots of width 2): a base row owns none.
    assert step.mask(2, 2, torch.float32)[[0, 4, 9]].tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]]
    assert LoRAStep.build([-1, 2, 2, -1], [0, 2, 3, 5, 6], cpu).run == (2, slice(2, 5))
    assert LoRAStep.build([-1, -1], [0, 2, 3], cpu) is None


def test_wide_slots_gather_each_adapters_rows_instead(adapters, make_llm, monkeypatch):
    """Past ``DENSE_MAX_WIDTH`` a step mixing adapters adds each slot's
    rows on their own (a gather where they are not one run): PEFT's tokens
    either way."""
    from fluidserve.engine import lora

    monkeypatch.setattr(lora, "DENSE_MAX_WIDTH", 0)
    path, made = adapters("llama")
    refs = {None: peft_greedy(path, None, PROMPTS, TOKENS), **{n: peft_greedy(path, a, PROMPTS, TOKENS)
                                                                 for n, a in made.items()}}
    llm = make_llm(path, enable_lora=True, max_lora_rank=8, lora_modules=tuple(made.items()))
    assert run_mixed(llm, [None, "a1", "a2"]) == refs


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the real path")
def test_adapter_rows_take_the_plain_products_on_the_gpu_path(adapters, make_llm, monkeypatch):
    """FLUIDSERVE_KERNELS=triton (the GPU's code path, on the CPU): steps
    with adapter rows leave the fused row and batch launches for the
    modules, whose fused norm + GEMM, GEMM + SiLU-mul and GEMM + residual
    give way to the plain product and the adapter's; the base rows of the
    same steps, and base-only steps, keep their tokens."""
    path, made = adapters("llama")
    prompts = PROMPTS[:2]
    refs = {None: peft_greedy(path, None, prompts, 6), "a1": peft_greedy(path, made["a1"], prompts, 6)}
    monkeypatch.setenv(ops.KERNELS_ENV, "triton")
    llm = make_llm(path, enable_lora=True, lora_modules=(("a1", made["a1"]),), num_kv_blocks=64,
                   max_num_batched_tokens=16, max_model_len=128)
    cases = [(n, p) for p in prompts for n in (None, "a1")]
    outs = llm.generate([p for _, p in cases], [greedy(n, 6) for n, _ in cases])
    got = {None: [], "a1": []}
    for (n, _), out in zip(cases, outs):
        got[n].append(out.outputs[0].token_ids)
    assert got == refs


def test_steps_with_adapter_rows_leave_the_graphs_to_base_steps(adapters, make_llm):
    """Decode graphs and piecewise graphs (their CPU stand-ins: the same
    static buffers, run without capture) were captured without adapters:
    a step with an adapter row runs eagerly, a base-only step still
    replays its bucket, and every row keeps PEFT's tokens."""
    path, made = adapters("llama")
    prompts = PROMPTS[:3]
    refs = {None: peft_greedy(path, None, prompts, TOKENS), "a1": peft_greedy(path, made["a1"], prompts, TOKENS)}
    llm = make_llm(path, enable_lora=True, lora_modules=(("a1", made["a1"]),), num_kv_blocks=96, block_size=8,
                   max_model_len=256, max_num_batched_tokens=40)
    worker = llm.engine.executor.worker
    worker.graphs = worker.decode_graphs(capture=False)
    worker.piecewise = worker.piecewise_graphs(capture=False)
    assert run_mixed(llm, [None, "a1"], prompts) == refs
    replays = sum(worker.graphs.replays.values())
    outs = llm.generate(prompts, greedy(None))  # base rows alone: the graphs take their decodes
    assert [o.outputs[0].token_ids for o in outs] == refs[None]
    assert sum(worker.graphs.replays.values()) >= replays + TOKENS - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_adapters_like_the_cpu_with_decode_graphs_on(adapters, make_llm, dtype):
    """On CUDA, decode graphs captured (the default) and the Triton kernels:
    a step with adapter rows leaves the graphs, base-only steps replay
    them, and every row's tokens are the CPU engine's in fp32 (in bf16,
    equal but for a near-tie of the fp32 reference's logprobs)."""
    from token_paths import assert_agree_but_for_near_ties

    path, made = adapters("llama")
    kwargs = dict(enable_lora=True, max_lora_rank=8, lora_modules=tuple(made.items()), max_num_batched_tokens=16)
    cases = [(n, p) for p in PROMPTS for n in (None, "a1", "a2")]
    params = [SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, lora=n, logprobs=2)
              for n, _ in cases]
    ref = make_llm(path, device="cpu", **kwargs).generate([p for _, p in cases], params)
    llm = make_llm(path, device="cuda", dtype=dtype, **kwargs)
    gpu = llm.generate([p for _, p in cases], params)
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in ref]
    else:
        assert_agree_but_for_near_ties(gpu, ref, f"lora {dtype}")
    graphs = llm.engine.executor.worker.graphs
    assert graphs is not None
    replays = sum(graphs.replays.values())
    base = llm.generate(PROMPTS, greedy(None))  # base rows alone: their decode steps replay the graphs
    assert sum(graphs.replays.values()) >= replays + TOKENS - 1
    if dtype == "float32":
        assert [o.outputs[0].token_ids for o in base] == [o.outputs[0].token_ids
                                                          for (n, _), o in zip(cases, ref) if n is None]
