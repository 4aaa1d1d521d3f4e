"""The engine core against Hugging Face transformers on tiny random models:
exact greedy tokens, close logits, chunked prefill, arrivals mid-decode, KV
pressure, sampling controls, finish reasons and input validation."""

from __future__ import annotations

import pytest
import torch
import transformers

from fluidserve.engine import SamplingParams
from fluidserve.engine.batch import ModelInput
from token_paths import PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "opt", "granite"])
def test_greedy_tokens_identical_to_transformers(tiny_model, make_llm, arch):
    path = tiny_model(arch)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_mlp_biases_of_a_llama_checkpoint_are_read(tiny_model, make_llm):
    """A Llama config's ``mlp_bias`` (and ``attention_bias``) puts biases on
    the MLP's linears (and the attention's), which the checkpoint holds."""
    path = tiny_model("llama", mlp_bias=True, attention_bias=True)
    outs = make_llm(path).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_tiny_token_budget_forces_chunked_prefill(tiny_model, make_llm, arch):
    path = tiny_model(arch)
    llm = make_llm(path, max_num_batched_tokens=5, max_num_seqs=3)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS)


def test_requests_arriving_mid_decode(tiny_model):
    path = tiny_model("llama")
    from fluidserve.engine import LLM

    llm = LLM(model=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=8)
    engine = llm.engine
    done: dict[str, list[int]] = {}
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    for step in range(200):
        if not engine.has_unfinished_requests() and step > 9:
            break
        if step == 4:
            engine.add_request("c", PROMPTS[3], GREEDY)
        if step == 9:
            engine.add_request("d", PROMPTS[4], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert not engine.has_unfinished_requests()
    ref = hf_greedy(path, [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[4]])
    assert [done[k] for k in "abcd"] == ref
    assert engine.kv.num_used_blocks == 0


def test_logits_close_to_transformers(tiny_model):
    """Prefill in two chunks over a shuffled block table; fp32 logits within 1e-4."""
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.worker import Worker

    path = tiny_model("qwen3")
    worker = Worker(EngineConfig.create(model=path, device="cpu", num_kv_blocks=16), path)
    worker.init_cache(16)
    ids = list(range(20, 60))
    table = [9, 2, 14]

    def run(start: int, end: int) -> torch.Tensor:
        return worker.logits(ModelInput(
            input_ids=ids[start:end], positions=list(range(start, end)),
            slot_mapping=[table[p // 16] * 16 + p % 16 for p in range(start, end)],
            query_start_loc=[0, end - start], seq_lens=[end], block_tables=[table],
            sample_indices=list(range(end - start)),
        ))

    ours = torch.cat([run(0, 21), run(21, 40)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_kv_pressure_preempts_and_still_matches(tiny_model, make_llm):
    """Too few blocks for all requests at once: some are preempted and
    recomputed, and generation is unchanged."""
    path = tiny_model("llama")
    llm = make_llm(path, num_kv_blocks=10, block_size=8, max_model_len=64)
    prompts = [p[:20] for p in PROMPTS] * 2
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    # The worker's copy of the block tables forgets every table that went,
    # a recomputed request's first one too, once the next step says so.
    mirror = llm.engine.executor.worker.runner.tables
    assert mirror.converted_blocks > 0
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))
    assert len(mirror) == 1


def test_seeded_sampling_is_reproducible(tiny_model, make_llm):
    path = tiny_model("llama")
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    llm = make_llm(path)
    alone = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, params)[1].outputs[0].token_ids  # other rows in the batch
    again = make_llm(path).generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    assert alone == batched == again
    other = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_n_completions(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # seeded per completion, not copies
    greedy = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_finish_reasons_stop_string_stop_token_and_length(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path)
    tok = llm.tokenizer
    prompt = PROMPTS[1]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 16
    assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)

    # Stop on a token id: generation ends on it, and it is the stop reason.
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: first + 1]

    # Stop on a string: the text ends right before it.
    text = base.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]

    # The default EOS stop: a model whose EOS is its first greedy token ends at once.
    eos_first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base.token_ids[0]]))
    assert eos_first[0].outputs[0].token_ids == base.token_ids[:1]


@pytest.mark.parametrize(
    "prompt, params, param_name",
    [
        ("x" * 300, SamplingParams(max_tokens=4), "prompt"),
        ("", SamplingParams(max_tokens=4), "prompt"),
        ([], SamplingParams(max_tokens=4), "prompt"),
        ([5, 99999], SamplingParams(max_tokens=4), "prompt"),
        ("hello", SamplingParams(max_tokens=250), "max_tokens"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_model, make_llm, prompt, params, param_name):
    llm = make_llm(tiny_model("llama"), max_model_len=256)
    with pytest.raises(ValueError, match=param_name):
        llm.generate([PROMPTS[0], prompt], params)
    out = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 16


@pytest.mark.parametrize(
    "kwargs, param_name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": -1}, "logprobs"),  # the cap of 20 is the server's (--max-logprobs)
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, param_name):
    with pytest.raises(ValueError, match=param_name):
        SamplingParams(**kwargs)


def test_logprobs_match_log_softmax_of_reference(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path)
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    tok = llm.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok.encode(PROMPTS[0]) + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(tok.encode(PROMPTS[0]))
    for i, (tid, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[n - 1 + i]
        assert entry[tid].rank == 1
        assert abs(entry[tid].logprob - row[tid].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_tracks_fp32(tiny_model, dtype):
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.worker import Worker

    path = tiny_model("llama")
    ids = list(range(30, 50))
    inp = ModelInput(input_ids=ids, positions=list(range(20)), slot_mapping=list(range(20)),
                     query_start_loc=[0, 20], seq_lens=[20], block_tables=[[0, 1]], sample_indices=list(range(20)))
    logits = {}
    for dt in ("float32", dtype):
        w = Worker(EngineConfig.create(model=path, device="cpu", dtype=dt, num_kv_blocks=4), path)
        w.init_cache(4)
        assert w.kv_caches[0][0].dtype == getattr(torch, dt)
        logits[dt] = w.logits(inp)
    torch.testing.assert_close(logits[dtype], logits["float32"], atol=0.1, rtol=0.05)


def test_a_cpu_that_refuses_packed_weights_keeps_f_linear(tiny_model, monkeypatch):
    """oneDNN refuses to pack bf16 weights on a CPU without AVX-512 or
    AVX-NE-CONVERT: the linears then stay on F.linear, with the same logits."""
    from fluidserve.engine import parallel
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.worker import Worker

    path = tiny_model("llama")
    inp = ModelInput(input_ids=list(range(30, 50)), positions=list(range(20)), slot_mapping=list(range(20)),
                     query_start_loc=[0, 20], seq_lens=[20], block_tables=[[0, 1]], sample_indices=list(range(20)))

    def run():
        w = Worker(EngineConfig.create(model=path, device="cpu", dtype="float32", num_kv_blocks=4), path)
        w.init_cache(4)
        linears = [m for m in w.model.modules() if isinstance(m, parallel._PrepackedLinear)]
        return w.logits(inp), linears

    def refuse(*args):
        raise RuntimeError("mkldnn_reorder_linear_weight: needs the cpu support avx512bw")

    packed, packed_linears = run()
    assert all(m._packed is not None for m in packed_linears)  # fp32 packs wherever oneDNN runs
    monkeypatch.setattr(parallel, "_PREPACKS", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    plain, plain_linears = run()
    assert plain_linears and all(m._packed is None for m in plain_linears)
    assert parallel._PREPACKS == {torch.float32: False}
    torch.testing.assert_close(plain, packed, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, tied", [("llama", True), ("glm4_moe", False)])
def test_packed_weights_give_up_the_weights_they_were_packed_from(tiny_model, make_llm, arch, tied):
    """Once oneDNN holds a linear's weight, the weight as loaded is dropped:
    its parameter keeps the shape, dtype and shard but no memory, and the
    packed copy reads back to the checkpoint's values. An LM head tied to the
    embedding (which looks rows up in it) and GLM-4.5's router (whose float32
    scores read it) keep theirs. fp32 experts, which cpu_moe.c's panels run
    at every row count, give up their stacks too. The tokens stay
    transformers'."""
    from safetensors.torch import load_file

    from fluidserve.engine import parallel

    path = tiny_model(arch, tie_word_embeddings=tied)
    llm = make_llm(path)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, PROMPTS[:2], 16)
    model = llm.engine.executor.worker.model
    saved = load_file(f"{path}/model.safetensors")
    held = dict((n, m) for n, m in model.named_modules() if isinstance(m, parallel.HeldWeights))
    kept = {n for n, m in held.items() if not m.dense_dropped}
    expected = {n for n in held if n.endswith(".gate") and arch == "glm4_moe"} | ({"lm_head"} if tied else set())
    assert kept == expected
    assert arch == "llama" or any(n.endswith(".experts") for n in held)
    for name, m in held.items():
        for leaf, values in m.dense_values().items():
            param = getattr(m, leaf)
            if name in kept:
                assert param.untyped_storage().nbytes() == param.numel() * param.element_size()
                continue
            assert param.untyped_storage().nbytes() == param.element_size()  # one NaN, expanded
            assert param.isnan().all() and param.shape == values.shape
            key = f"{name}.{leaf}"
            if key in saved:
                assert torch.equal(values, saved[key]), key
    o_proj = held["model.layers.0.self_attn.o_proj"]
    assert torch.equal(o_proj.dense_weight(), saved["model.layers.0.self_attn.o_proj.weight"])
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_linear_without_its_dense_weight_takes_rows_of_another_dtype():
    """Rows of another dtype than the weight's would have gone to the dense
    weight; once it is dropped they take the packed one's dtype and come
    back in their own, with the residual added as before."""
    from fluidserve.engine.parallel import ColumnParallelLinear, TensorParallel, prepack_linears

    torch.manual_seed(0)
    linear = ColumnParallelLinear(32, 48, True, TensorParallel(0, 1))
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.normal_()
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    prepack_linears(linear)
    assert linear.dense_dropped and linear.weight.isnan().all()
    x, residual = torch.randn(3, 32).bfloat16(), torch.randn(3, 48).bfloat16()
    expected = torch.nn.functional.linear(x.float(), weight, bias)
    y = linear(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected, atol=0.1, rtol=0.02)
    y = linear._linear(x, linear.bias, residual)
    torch.testing.assert_close(y.float(), expected + residual.float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
def test_each_linear_frees_its_weight_before_the_next_is_packed(tiny_model, monkeypatch, dummy):
    """Loading packs the linears one by one, each dropping the weight it
    was packed from; nothing else may hold those weights by then (the
    read's own bookkeeping included), or their memory is freed only after
    every packed copy was allocated beside it: the process then peaks at
    every weight twice and keeps the holes resident."""
    import weakref

    from fluidserve.engine import parallel
    from fluidserve.engine.loader import build_model, init_dummy_weights, load_hf_config, load_weights

    path = tiny_model("llama")
    model = build_model(load_hf_config(path), torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, parallel._PrepackedLinear)]
    dense = [weakref.ref(m.weight) for m in linears]
    assert parallel.can_prepack(linears[0].weight)  # its trial pack done before counting
    alive, reorder = [], torch.ops.mkldnn._reorder_linear_weight

    def counting(weight):
        alive.append(sum(r() is not None for r in dense))
        return reorder(weight)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", counting)
    init_dummy_weights(model) if dummy else load_weights(model, path)
    assert all(m.dense_dropped for m in linears)
    assert alive == list(range(len(linears), 0, -1))
    assert [r() for r in dense] == [None] * len(linears)


def test_bin_checkpoint_and_dummy_weights_load(tiny_model, make_llm, tmp_path):
    path = tiny_model("opt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # the pre-safetensors format
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.safetensors"))
    ref = make_llm(path).generate(PROMPTS[:2], GREEDY)
    from_bin = make_llm(str(tmp_path)).generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in from_bin] == [o.outputs[0].token_ids for o in ref]
    dummy = make_llm(path, load_format="dummy").generate(PROMPTS[:2], GREEDY)
    assert all(len(o.outputs[0].token_ids) == 16 for o in dummy)


def test_abort_frees_blocks_at_once(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"))
    engine = llm.engine
    engine.add_request("x", PROMPTS[3], GREEDY)
    engine.add_request("y", PROMPTS[1], GREEDY)
    engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort("x")
    engine.abort("y")
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert engine.step() == []
