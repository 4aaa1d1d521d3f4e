"""Layer-wise preemption (ConServe §4.3) on CPU: an offline-only step stops
at the next layer safepoint when interrupted, reports the layer, and leaves
KV, outputs and the prefix cache as if it never ran; the worker keeps the
stopped forward and a resumed step continues at that layer, bit for bit the
uninterrupted step; a paused step given up (its KV needed, a request
aborted) is computed again from layer 0; an online arrival interrupts a long
offline prefill through the real AsyncEngine; with tensor parallelism on Ray
both ranks stop at the same safepoint.

Interrupts are scripted from forward pre-hooks on a decoder layer, so each
one lands at a known layer of a known step: no test depends on timing.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.async_engine import AsyncEngine
from fluidserve.engine.batch import ModelInput, SampleSpec
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.preemption import PreemptionPolicy
from fluidserve.kvcache.prefix_cache import block_keys

pytestmark = pytest.mark.timeout(180)

LAYERS = 6
K = 2  # safepoints before layers 0, 2, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
PROMPTS = ["hello world " * 6, "abc " * 20, "the quick brown fox"]
# The starve limit is wall time: on a busy machine a job can starve and jump
# the queue, which changes how steps are made up and so how often a layer
# runs. Tests that count layer calls against a reference run turn it off.
NO_STARVING = dict(policy_options={"starve_limit_ms": 1e9})


def _layers(engine: LLMEngine) -> list[torch.nn.Module]:
    model = engine.executor.worker.model.model
    return list(model.layers if hasattr(model, "layers") else model.decoder.layers)


def _interrupt_on_calls(engine: LLMEngine, layer: int, calls: set[int]) -> dict:
    """Before ``layer``'s attention runs for the n-th time (n in ``calls``),
    an online arrival reaches the engine's preemption policy (as AsyncEngine
    sends it). The attention module is called whether or not safepoints
    split the layer."""
    seen = {"n": 0, "sent": 0}

    def hook(_module, _args):
        seen["n"] += 1
        if seen["n"] in calls:
            seen["sent"] += engine.preemption.on_online_arrival()

    _layers(engine)[layer].self_attn.register_forward_pre_hook(hook)
    return seen


def _count_calls(engine: LLMEngine, layer: int) -> dict:
    calls = {"n": 0}

    def hook(_module, _args):
        calls["n"] += 1

    _layers(engine)[layer].self_attn.register_forward_pre_hook(hook)
    return calls


def _run_offline(llm, params_of, interrupt_calls: set[int] = frozenset(), layer: int = 3) -> tuple[dict, dict]:
    engine = llm.engine
    seen = _interrupt_on_calls(engine, layer, set(interrupt_calls))
    seen["first_layer"] = _count_calls(engine, 0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params_of(i), klass="offline")
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens, seen


@pytest.mark.slow
@pytest.mark.parametrize("arch,k", [("llama", K), ("opt", K), ("llama", 0.5), ("opt", 0.5),
                                    ("granite", 0.5), ("qwen3_moe", 0.5)])  # scaled branches, experts
def test_paused_steps_resume_where_they_stopped(tiny_model, make_llm, arch, k):
    """Greedy and seeded tokens of offline requests equal an uninterrupted
    run (whole layers, safepoints every K), token for token, although
    prefill chunks and decodes stopped mid-forward (KV half written, no
    sample drawn): each stopped step resumes at its safepoint, so no layer
    runs twice. With k = 0.5 every stop falls between layer 3's attention
    and its MLP, and the resumed step starts with that MLP."""
    path = tiny_model(arch, num_hidden_layers=LAYERS)
    cfg = dict(num_kv_blocks=64, max_num_batched_tokens=16, **NO_STARVING)
    params_of = lambda i: SEEDED if i == 1 else GREEDY  # noqa: E731
    reference, ref_seen = _run_offline(make_llm(path, **cfg, preemption_safepoint_layers=K), params_of)
    llm = make_llm(path, **cfg, preemption_safepoint_layers=k)
    stops = []
    execute = llm.engine.executor.execute

    def recording(inp):
        result = execute(inp)
        stops.append(result.abandoned_at_layer)
        return result

    llm.engine.executor.execute = recording
    interrupted, seen = _run_offline(llm, params_of, {1, 2, 3, 5, 8, 13, 14})
    stats = llm.engine.stats()
    # The next safepoint after layer 3's attention.
    assert [s for s in stops if s is not None] == [4 if k == K else 3.5] * 7
    assert seen["sent"] == 7 and stats.num_steps_abandoned == 7
    assert stats.num_steps_resumed == 7 and stats.abandoned_tokens == 0
    # Layers 0 and 3 (before the stop) ran exactly as often as uninterrupted.
    assert seen["first_layer"]["n"] == ref_seen["first_layer"]["n"] and seen["n"] == ref_seen["n"]
    assert interrupted == reference
    assert len(reference) == len(PROMPTS) and all(len(t) == 10 for t in reference.values())


def test_a_worker_without_the_paused_state_runs_the_step_again(tiny_model, make_llm):
    """Resuming is a saving, never a requirement: a worker that kept
    nothing (here: dropped by hand after every pause) runs the resumed step
    from layer 0 and the tokens are the same."""
    path = tiny_model("llama", num_hidden_layers=LAYERS)
    cfg = dict(num_kv_blocks=64, max_num_batched_tokens=16, preemption_safepoint_layers=K, **NO_STARVING)
    reference, ref_seen = _run_offline(make_llm(path, **cfg), lambda i: GREEDY)
    llm = make_llm(path, **cfg)
    worker = llm.engine.executor.worker
    execute = worker.execute

    def forgetful(inp):
        result = execute(inp)
        worker.paused = None
        return result

    worker.execute = forgetful
    interrupted, seen = _run_offline(llm, lambda i: GREEDY, {1, 2, 3})
    assert interrupted == reference and llm.engine.stats().num_steps_resumed == 3
    assert seen["first_layer"]["n"] == ref_seen["first_layer"]["n"] + 3  # each ran again from layer 0


def test_metrics_count_abandoned_steps_and_offline_tokens(tiny_model, make_llm):
    """/metrics' figures from a real engine's stats: request preemptions by
    kind (each request of an abandoned step counts once), abandoned steps
    and their tokens, offline tokens and their rate between two scrapes."""
    from prometheus_client.parser import text_string_to_metric_families

    from fluidserve.serve.metrics import ServerMetrics

    llm = make_llm(tiny_model("llama", num_hidden_layers=LAYERS), num_kv_blocks=64, max_num_batched_tokens=16,
                   preemption_safepoint_layers=K)
    metrics = ServerMetrics("m")
    metrics.engine.update(llm.engine.stats())
    _run_offline(llm, lambda i: GREEDY, {1, 2})
    stats = llm.engine.stats()
    metrics.engine.update(stats)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}
    kind = lambda k: samples[("fluidserve_preemptions_by_kind_total", (("kind", k),))]  # noqa: E731
    assert stats.num_steps_abandoned == 2 and kind("step_abandoned") == stats.num_abandoned_preemptions >= 2
    assert kind("recomputed") == 0 and kind("swap") == 0
    assert samples[("fluidserve_steps_abandoned_total", ())] == 2
    assert samples[("fluidserve_steps_resumed_total", ())] == stats.num_steps_resumed == 2
    assert samples[("fluidserve_abandoned_tokens_total", ())] == stats.abandoned_tokens == 0  # both resumed
    assert samples[("fluidserve_offline_engine_generation_tokens_total", ())] == 10 * len(PROMPTS)
    assert samples[("fluidserve_offline_generation_tokens_per_second", ())] > 0
    offline = {k: v for k, v in samples.items() if k[0] == "fluidserve_num_requests" and ("klass", "offline") in k[1]}
    assert offline and all(v == 0 for v in offline.values())  # all finished: zeros, not gaps


def _prompt_step(step_id: int, preemptible: bool = True, n: int = 20) -> ModelInput:
    return ModelInput(
        input_ids=list(range(1, n + 1)), positions=list(range(n)), slot_mapping=list(range(n)),
        query_start_loc=[0, n], seq_lens=[n], block_tables=[[0, 1]], sample_indices=[n - 1],
        samples=[SampleSpec(SamplingParams(temperature=0.0), seed=None)], sample_ids=["r"],
        preemptible=preemptible, step_id=step_id,
    )


def _run_interrupted(llm, inp: ModelInput, module: torch.nn.Module, target: int):
    """Execute ``inp`` on the worker; step ``target`` is interrupted as
    ``module`` starts."""
    handle = module.register_forward_pre_hook(lambda m, a: llm.engine.executor.interrupt(target))
    try:
        return llm.engine.executor.worker.execute(inp)
    finally:
        handle.remove()


def test_interrupt_stops_at_the_next_safepoint(tiny_model, make_llm):
    """The worker reports the layer it stopped before: the first safepoint
    after the interrupt arrived, the last one before the head (layer 6 of 6).
    A step interrupted in its head, a step that is not preemptible, and an
    interrupt meant for another step all run to the end and sample."""
    llm = make_llm(tiny_model("llama", num_hidden_layers=LAYERS), num_kv_blocks=32, preemption_safepoint_layers=K)
    worker = llm.engine.executor.worker
    layers = list(worker.model.model.layers) + [worker.model.lm_head]
    expected = {0: 2, 1: 2, 2: 4, 3: 4, 4: 6, 5: 6, 6: None}  # interrupt while layer i (6: the head) runs -> stop
    for i, (at, stop) in enumerate(expected.items()):
        result = _run_interrupted(llm, _prompt_step(100 + i), layers[at], 100 + i)
        assert result.abandoned_at_layer == stop, at
        assert bool(result.sampled) == (stop is None)
    assert _run_interrupted(llm, _prompt_step(200, preemptible=False), layers[1], 200).abandoned_at_layer is None
    assert _run_interrupted(llm, _prompt_step(201), layers[1], 999).abandoned_at_layer is None  # another step's
    late = _prompt_step(202)
    llm.engine.executor.interrupt(201)  # a late interrupt of an ended step
    assert worker.execute(late).abandoned_at_layer is None


@pytest.mark.parametrize("k,expected", [
    # (layer, half the interrupt lands in) -> where the step stops (x.5: before layer x's MLP)
    (0.5, {(0, "self_attn"): 0.5, (0, "mlp"): 1, (2, "self_attn"): 2.5, (5, "self_attn"): 5.5, (5, "mlp"): 6}),
    (1.5, {(0, "self_attn"): 1.5, (1, "self_attn"): 1.5, (1, "mlp"): 3, (3, "mlp"): 4.5, (4, "mlp"): 6}),
])
def test_half_layer_safepoints_stop_between_attention_and_mlp(tiny_model, make_llm, k, expected):
    """Safepoints every half a layer (or one and a half) also fall between a
    layer's attention and its MLP: an interrupt that lands in an attention
    stops the step before that layer's MLP, and the kept state is the
    hidden state the MLP half reads, so resuming gives the uninterrupted
    step's token."""
    llm = make_llm(tiny_model("llama", num_hidden_layers=LAYERS), num_kv_blocks=32, preemption_safepoint_layers=k)
    worker = llm.engine.executor.worker
    layers = list(worker.model.model.layers)
    reference = worker.execute(_prompt_step(1, preemptible=False)).sampled["r"].token_id
    for i, ((layer, half), stop) in enumerate(expected.items()):
        inp = _prompt_step(100 + i)
        result = _run_interrupted(llm, inp, getattr(layers[layer], half), 100 + i)
        assert result.abandoned_at_layer == stop, (layer, half)
        if stop is None:
            assert result.sampled["r"].token_id == reference
            continue
        assert worker.paused.position == 2 * stop
        inp.resume_of, inp.step_id = inp.step_id, 1000 + i  # as the engine resends it
        assert worker.execute(inp).sampled["r"].token_id == reference


def test_the_budget_plans_for_the_longer_half_of_a_layer():
    """The share of a step an interrupted arrival may wait: k / layers for
    whole layers; where safepoints split a layer, the longer half by
    weights (a gated MLP of 3 x 256 x 768 against attention of 4 x 256 x 256
    is 9/13 of a layer; OPT's MLP of 2 x 256 x 1024, 2/3)."""
    from types import SimpleNamespace

    from fluidserve.engine.preemption import feed_forward_share, safepoint_shares

    llama = SimpleNamespace(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                            intermediate_size=768, num_hidden_layers=16)
    opt = SimpleNamespace(hidden_size=256, num_attention_heads=4, ffn_dim=1024, num_hidden_layers=12)
    assert feed_forward_share(llama) == pytest.approx(9 / 13)
    assert feed_forward_share(opt) == pytest.approx(2 / 3)
    assert feed_forward_share(SimpleNamespace(num_hidden_layers=4)) == 0.5  # the config does not say
    assert safepoint_shares(2, llama)[0] == 2 / 16
    assert safepoint_shares(0.5, llama)[0] == pytest.approx(9 / 13 / 16)
    assert safepoint_shares(1.5, llama)[0] == pytest.approx((1 + 9 / 13) / 16)
    assert safepoint_shares(0, llama)[0] is None
    assert safepoint_shares(40, opt)[0] == 1.0
    # The attention's share: the layers a stretch holds whole, of the model's.
    assert safepoint_shares(2, llama)[1] == 2 / 16 and safepoint_shares(0.5, llama)[1] == 1 / 16
    assert safepoint_shares(0, llama) == (None, None)


def test_prefix_cache_registers_no_block_of_an_abandoned_step(tiny_model, make_llm):
    path = tiny_model("llama", num_hidden_layers=LAYERS)
    llm = make_llm(path, num_kv_blocks=32, max_num_batched_tokens=256, preemption_safepoint_layers=K)
    engine = llm.engine
    prompt = list(range(3, 3 + 64))  # four full blocks of 16
    keys = block_keys(prompt, engine.kv.block_size)
    seen = _interrupt_on_calls(engine, 1, {1})
    engine.add_request("a", prompt, GREEDY, klass="offline")
    engine.step()  # the whole prompt in one step, stopped before layer 2
    assert seen["sent"] == 1 and engine.stats().num_steps_abandoned == 1
    assert engine.kv.cached_prefix_tokens(keys, len(prompt)) == 0
    seq = engine.seqs["a#0"]
    assert seq.state.num_computed_tokens == 0 and not seq.output_token_ids
    engine.step()  # resumed at layer 2 and run to the end
    assert engine.stats().num_steps_resumed == 1 and seq.state.num_computed_tokens == len(prompt)
    assert engine.kv.cached_prefix_tokens(keys, len(prompt)) > 0
    while engine.has_unfinished_requests():
        engine.step()


def test_a_pause_given_up_for_online_kv_recomputes_the_chunk(tiny_model, make_llm):
    """The paused prefill holds the device KV an online arrival needs: the
    pause is given up, the online request runs, and the offline request
    computes its prompt again from layer 0, with the tokens it would have
    had; no block leaks."""
    path = tiny_model("llama", num_hidden_layers=LAYERS)
    cfg = dict(num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=256, preemption_safepoint_layers=K,
               enable_prefix_caching=False)
    offline_prompt = [5 + i % 40 for i in range(200)]  # 13 of the 16 blocks
    alone = make_llm(path, **cfg).generate([offline_prompt], GREEDY)[0].outputs[0].token_ids
    llm = make_llm(path, **cfg)
    engine = llm.engine
    seen = _interrupt_on_calls(engine, 1, {1})
    engine.add_request("off", offline_prompt, GREEDY, klass="offline")
    engine.step()
    assert seen["sent"] == 1 and engine.scheduler.paused_requests == 1
    engine.add_request("on", list(range(3, 3 + 60)), SamplingParams(temperature=0.0, max_tokens=4), klass="online")
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    stats = engine.stats()
    assert tokens["off"] == list(alone) and len(tokens["on"]) == 4
    assert stats.num_steps_resumed == 0 and stats.abandoned_tokens == 200
    assert engine.scheduler.counters.num_dropped_pauses == 1
    assert engine.kv.num_used_blocks == 0
    engine.kv.check_integrity()


def test_aborting_a_paused_request_frees_its_blocks(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama", num_hidden_layers=LAYERS), num_kv_blocks=32, max_num_batched_tokens=256,
                   preemption_safepoint_layers=K)
    engine = llm.engine
    _interrupt_on_calls(engine, 1, {1})
    engine.add_request("off", list(range(3, 3 + 100)), GREEDY, klass="offline")
    engine.step()
    assert engine.scheduler.paused_requests == 1 and engine.kv.num_used_blocks > 0
    engine.abort("off")
    assert engine.scheduler.paused_requests == 0 and engine.kv.num_used_blocks == 0
    out = llm.generate(["after"], GREEDY)[0]  # the engine goes on serving
    assert len(out.outputs[0].token_ids) == 10
    engine.kv.check_integrity()


def test_any_online_arrival_interrupts_a_running_step_once():
    """An online arrival interrupts the running preemptible step, SLO or
    not (the step resumes, so stopping it costs a resume, where waiting for
    its predicted end costs the arrival an unreliable wait). One interrupt
    per step; none between steps."""
    sent: list[int] = []
    policy = PreemptionPolicy(sent.append)
    assert not policy.on_online_arrival()  # nothing running
    policy.step_started(1)
    assert policy.on_online_arrival()
    assert not policy.on_online_arrival()  # already interrupted
    policy.step_ended()
    assert not policy.on_online_arrival()
    policy.step_started(2)
    assert policy.on_online_arrival()
    policy.step_ended()
    assert sent == [1, 2] and policy.num_requests == 2


def test_flags_reach_the_engine_config():
    from fluidserve.scheduler.options import DEFAULT_SAFEPOINT_LAYERS
    from fluidserve.serve import cli

    def config(*flags: str) -> EngineConfig:
        return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *flags]))

    c = config("--online-ttft-slo-ms", "250", "--online-tpot-slo-ms", "40", "--preemption-safepoint-layers", "4")
    assert (c.online_ttft_slo_ms, c.online_tpot_slo_ms, c.preemption_safepoint_layers) == (250, 40, 4)
    d = config()
    assert d.online_ttft_slo_ms is None and d.preemption_safepoint_layers == DEFAULT_SAFEPOINT_LAYERS
    assert config("--preemption-safepoint-layers", "0.5").preemption_safepoint_layers == 0.5
    for flag, value in (("--online-ttft-slo-ms", "0"), ("--preemption-safepoint-layers", "-1"),
                        ("--preemption-safepoint-layers", "0.3")):
        with pytest.raises(ValueError, match=flag):
            config(flag, value)


def test_arrivals_interrupt_under_a_ttft_slo_too(tiny_model, make_llm):
    """A TTFT SLO no step could endanger does not stop arrivals from
    interrupting: the same scripted arrivals interrupt as many steps as
    without an SLO, and the offline tokens are those of an uninterrupted
    run (the stopped steps resumed)."""
    path = tiny_model("llama", num_hidden_layers=LAYERS)
    cfg = dict(num_kv_blocks=64, max_num_batched_tokens=16, preemption_safepoint_layers=K)
    reference, _ = _run_offline(make_llm(path, **cfg), lambda i: GREEDY)
    llm = make_llm(path, **cfg, online_ttft_slo_ms=1e9)
    tokens, seen = _run_offline(llm, lambda i: GREEDY, {1, 2, 3})
    assert seen["sent"] == 3 and llm.engine.stats().num_steps_abandoned == 3
    assert tokens == reference


def _online_arrives_during_offline_prefill(path: str, safepoint_layers: int) -> dict:
    """Scripted through the real AsyncEngine: a 200-token offline prompt
    prefills in one step; while its layer 1 runs, an online request arrives
    (the layer waits until ``add_request`` has returned control). Returns
    the layers that ran between the arrival and the first step to carry the
    online prompt, that step's input, the layers that ran the offline
    prompt, and the offline tokens."""
    engine = LLMEngine(EngineConfig.create(model=path, device="cpu", num_kv_blocks=64, max_num_batched_tokens=256,
                                    enable_prefix_caching=False, preemption_safepoint_layers=safepoint_layers))
    trace: list[tuple] = []
    blocked, go = threading.Event(), threading.Event()
    first = {"pending": True}

    def on_step(_module, args):
        trace.append(("step", args[0].tolist()))

    def on_layer(index):
        def hook(_module, args):
            trace.append(("layer", index, args[-3].shape[0]))  # (rope, x, kv, meta): x's tokens
            if index == 1 and first["pending"]:
                first["pending"] = False
                blocked.set()
                assert go.wait(60), "the test never released the step"
        return hook

    engine.executor.worker.model.register_forward_pre_hook(on_step)
    for i, layer in enumerate(engine.executor.worker.model.model.layers):
        layer.register_forward_pre_hook(on_layer(i))
    offline_prompt = [7 + i % 50 for i in range(200)]
    online_prompt = [200 + i for i in range(8)]

    async def script() -> tuple[int, list[int]]:
        ae = AsyncEngine(engine)
        ae.start()
        try:
            offline = await ae.add_request("off", offline_prompt, GREEDY, klass="offline")
            assert await asyncio.to_thread(blocked.wait, 60)
            mark = len(trace)  # the entry of layer 1, which is about to run
            arrival = asyncio.create_task(
                ae.add_request("on", online_prompt, SamplingParams(temperature=0.0, max_tokens=1), klass="online"))
            await asyncio.sleep(0)  # add_request runs up to its first await: the interrupt is sent
            go.set()
            online = await arrival
            async for out in online:
                if out.outputs[0].token_ids:
                    break
            tokens = []
            async for out in offline:
                tokens = list(out.outputs[0].token_ids)
            return mark, tokens
        finally:
            go.set()
            await ae.shutdown()

    mark, offline_tokens = asyncio.run(script())
    steps = [i for i, e in enumerate(trace) if e[0] == "step" and i >= mark]
    assert engine.kv.num_used_blocks == 0
    engine.kv.check_integrity()
    return {"tail_layers": sum(1 for e in trace[mark - 1:steps[0]] if e[0] == "layer"),
            "next_step_input": trace[steps[0]][1], "online_prompt": online_prompt,
            "offline_tokens": offline_tokens, "abandoned": engine.stats().num_steps_abandoned,
            "prefill_layers": sorted(e[1] for e in trace if e[0] == "layer" and e[2] == len(offline_prompt))}


def test_online_arrival_during_a_long_offline_prefill_gets_its_first_token_sooner(tiny_model):
    """With preemption the offline prefill stops at the safepoint before
    layer 2 (one layer after the arrival) and the very next step carries the
    online prompt alone; without, the step runs its other 7 layers first.
    The stopped prefill resumes at layer 2 once the online request is done:
    both run the same layers in all and produce the same offline tokens."""
    path = tiny_model("llama", num_hidden_layers=8)
    with_ = _online_arrives_during_offline_prefill(path, safepoint_layers=2)
    without = _online_arrives_during_offline_prefill(path, safepoint_layers=0)
    for run in (with_, without):  # the online request runs in the first step after the arrival
        ids = run["next_step_input"]
        assert ids[:len(run["online_prompt"])] == run["online_prompt"]
    assert with_["abandoned"] == 1 and without["abandoned"] == 0
    assert with_["tail_layers"] == 1 and without["tail_layers"] == 7
    assert len(with_["next_step_input"]) == 8  # the offline prefill waits, paused, for it to finish
    assert with_["prefill_layers"] == without["prefill_layers"] == list(range(8))  # resumed: no layer ran twice
    assert with_["offline_tokens"] == without["offline_tokens"] and len(without["offline_tokens"]) == 10


# -- tensor parallelism on Ray ------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from fluidserve.engine.executor.ray import start_local_ray

    if ray.is_initialized():  # another module's instance: not ours to configure or stop
        yield ray
        return
    start_local_ray(num_cpus=4)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_tp2_ranks_stop_at_the_same_safepoint(ray_cluster, tiny_model, make_llm):
    """Only rank 1 is told to interrupt: the ranks vote at the safepoint, so
    rank 0 stops there too (alone, rank 1 would leave rank 0 waiting in the
    layer's all-reduce until the step timeout) and the executor sees one
    layer from both. Interrupted generation keeps the local tokens."""
    ray = ray_cluster
    path = tiny_model("llama", num_hidden_layers=LAYERS)
    cfg = dict(num_kv_blocks=64, max_num_batched_tokens=16, preemption_safepoint_layers=K)
    params_of = lambda i: GREEDY  # noqa: E731
    reference, _ = _run_offline(make_llm(path, **cfg), params_of)
    llm = make_llm(path, executor="ray", tensor_parallel_size=2, **cfg)
    engine, executor = llm.engine, llm.engine.executor
    try:
        n = 12
        inp = ModelInput(input_ids=list(range(1, n + 1)), positions=list(range(n)), slot_mapping=list(range(n)),
                         query_start_loc=[0, n], seq_lens=[n], block_tables=[[0]], sample_indices=[n - 1],
                         samples=[SampleSpec(SamplingParams(temperature=0.0), seed=None)], sample_ids=["x"],
                         preemptible=True, step_id=10_000)
        ray.get(executor.workers[1].interrupt.remote(10_000))
        result = executor.execute(inp)  # raises if the ranks stopped at different layers
        assert result.abandoned_at_layer == 0 and not result.sampled
        inp.step_id = 10_001
        assert executor.execute(inp).sampled  # the flag named the old step: this one runs

        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY, klass="offline")
        tokens, step = {}, 0
        while engine.has_unfinished_requests():
            if step % 3 == 0:  # the next step's id is the number of steps run so far
                ray.get(executor.workers[1].interrupt.remote(engine.stats_.num_steps))
            step += 1
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        assert engine.stats().num_steps_abandoned > 0
        assert tokens == reference
    finally:
        engine.shutdown()
