"""Tensor parallelism on Ray, on CPU: two gloo workers against the local
executor (greedy tokens identical, chunked prefill included), and the failure
contract — a worker killed or hung mid-generation fails the in-flight
requests with a clear error and turns /health to 503 within 10 s.

One Ray instance, started the way the daemon starts it (loopback only, no
dashboard), serves the whole module; Ray's start is the slow part.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.executor import ExecutorError
from fluidserve.engine.loader import build_model, checkpoint_targets, load_hf_config, load_weights
from fluidserve.engine.parallel import TensorParallel, loaded_weights

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "Long prompt " * 9, "你好, wörld"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BUDGET = 8  # tokens per step: every prompt above 8 tokens is prefilled in chunks
CPU = dict(device="cpu", num_kv_blocks=128, max_num_batched_tokens=BUDGET, max_num_seqs=4)
TP2 = dict(executor="ray", tensor_parallel_size=2)
DEADLINE_S = 10.0  # the failure contract


@pytest.fixture(scope="module")
def ray_cluster():
    from fluidserve.engine.executor.ray import start_local_ray

    if ray.is_initialized():  # another module's instance: not ours to configure or stop
        yield
        return
    start_local_ray(num_cpus=4)
    yield
    ray.shutdown()


def _generate(model_dir: str, **kwargs) -> list[list[int]]:
    llm = LLM(model=model_dir, **CPU, **kwargs)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.kv.num_used_blocks == 0
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


# -- correctness -----------------------------------------------------------------


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),  # GQA, 2 KV heads: one per rank
    ("opt", {}),  # MHA, biases on every projection, tied LM head
    ("qwen2", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: replicated; q/k/v biases
    ("qwen2_moe", {}),  # every expert's features split, the router whole, a shared expert
    ("gemma3", {}),  # four norms a layer, per-head q/k norms, a rope per layer type
    # q/k norms over the whole projection: their mean squares summed across
    # ranks, the one KV head counted once a rank.
    ("olmo3", {"num_key_value_heads": 1}),
    ("glm4", {}),  # q/k rows reordered within heads before each rank takes its share
    ("glm4_moe", {}),  # grouped sigmoid routing (the router and its bias whole), an ungated shared expert
    ("granitemoeshared", {}),  # stacked expert tensors cut per expert, then per rank; multipliers
], ids=["llama-gqa", "opt", "qwen2-kv1", "qwen2-moe", "gemma3", "olmo3-kv1", "glm4", "glm4-moe", "granite-moe-shared"])
@pytest.mark.slow
def test_tp2_greedy_tokens_identical_to_local(ray_cluster, tiny_model, arch, overrides):
    path = tiny_model(arch, **overrides)
    local = _generate(path)
    assert max(len(p) for p in PROMPTS) > BUDGET  # chunked prefill is in play
    assert _generate(path, **TP2) == local


def test_steps_take_unix_sockets_on_one_node_and_ray_calls_give_the_same_tokens(ray_cluster, tiny_model):
    """Ranks on the engine's node take their steps over Unix sockets; Ray
    calls (ranks elsewhere, or --ray-transport ray-calls) must agree."""
    path = tiny_model("llama")
    local = _generate(path)
    transports = []

    def generate(**kwargs) -> list[list[int]]:
        llm = LLM(model=path, **CPU, **TP2, **kwargs)
        try:
            transports.append(llm.engine.executor.step_transport)
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.engine.shutdown()

    assert generate() == local
    assert generate(ray_transport="ray-calls") == local
    assert transports == ["unix sockets", "ray calls"]


@pytest.mark.parametrize("transport", ["auto", "ray-calls"])
def test_a_step_that_raises_on_the_ranks_fails_the_executor_naming_the_error(ray_cluster, tiny_model, transport):
    """A swap from a device block no rank holds: every rank's step raises;
    the executor fails with the rank's exception, whichever way steps go."""
    from fluidserve.engine.batch import ModelInput

    llm = LLM(model=tiny_model("llama"), **CPU, **TP2, ray_transport=transport)
    try:
        with pytest.raises(ExecutorError, match=r"worker rank [01] failed the step: IndexError"):
            llm.engine.executor.execute(ModelInput(swap_out=[(10**6, 0)]))
        with pytest.raises(ExecutorError, match="failed the step"):  # stays failed
            llm.engine.executor.check_health()
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_swapping_keeps_greedy_tokens(ray_cluster, tiny_model):
    """A device pool too small for the batch: each rank swaps its own head
    shard of the same blocks to host and back, tokens stay the local ones."""
    path = tiny_model("llama")
    small = dict(device="cpu", num_kv_blocks=10, block_size=8, max_model_len=64, num_host_blocks=64)
    prompts = [p[:20] for p in PROMPTS] * 2
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    local = [o.outputs[0].token_ids for o in LLM(model=path, **small).generate(prompts, params)]
    llm = LLM(model=path, **small, **TP2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == local
        counters = llm.engine.scheduler.counters
        assert counters.num_swap_outs > 0 and counters.num_recomputes == 0
        assert llm.engine.kv.num_used_blocks == 0 and llm.engine.kv.num_used_host_blocks == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_lora_adapters_like_peft(ray_cluster, tiny_model, tmp_path):
    """LoRA under tensor parallelism: each rank holds its slice of every
    adapter (engine/lora.py), one loaded at start and one while serving
    (sent with a step to both ranks); base and adapter rows share the
    steps, and each keeps PEFT's tokens."""
    from lora_utils import make_adapter, peft_greedy

    path = tiny_model("qwen2", num_key_value_heads=1)  # a KV head replicated on both ranks; q/k/v biases
    a1, a2 = make_adapter(path, tmp_path / "a1", seed=1), make_adapter(path, tmp_path / "a2", seed=2, r=8)
    llm = LLM(model=path, **CPU, **TP2, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=(("a1", a1),))
    try:
        llm.engine.add_lora("a2", a2)
        cases = [(name, p) for p in PROMPTS[:3] for name in (None, "a1", "a2")]
        outs = llm.generate([p for _, p in cases], [dataclasses.replace(GREEDY, lora=n) for n, _ in cases])
        got = [o.outputs[0].token_ids for o in outs]
        refs = {n: peft_greedy(path, a, PROMPTS[:3], 16) for n, a in [(None, None), ("a1", a1), ("a2", a2)]}
        assert got == [refs[n][PROMPTS.index(p)] for n, p in cases]
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_tp2_packed_gptq_weights_like_local(ray_cluster, tmp_path):
    """``--quantized-weights packed`` under tensor parallelism: each rank
    packs its shard of every linear (act-order groups of 24 straddling the
    row-parallel halves; q/k/v biases; a KV head a rank), and the
    all-reduced products give the local engine's tokens."""
    from quantized_utils import packed_int, random_model, write_quantized

    path = str(tmp_path / "gptq")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 24, "desc_act": True}
    write_quantized(random_model("qwen2"), tmp_path / "gptq", packed_int("gptq", 4, 24, act_order=True), qc)
    local = _generate(path, quantized_weights="packed")
    assert _generate(path, **TP2, quantized_weights="packed") == local


def test_tp2_prompt_logprobs_like_local(ray_cluster, tiny_model):
    """Prompt logprobs project every prompt position through the LM head in
    slices, each gathered on rank 0: every rank must take part in every
    slice. A 300-token prompt spans two slices; the numbers are the local ones."""
    from fluidserve.engine.prompt_logprobs import ROWS_PER_SLICE

    path = tiny_model("llama")
    ids = [(7 * j) % 250 + 3 for j in range(300)]
    assert len(ids) > ROWS_PER_SLICE + 1
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    local = LLM(model=path, device="cpu", num_kv_blocks=64).generate([ids], params)[0].prompt_logprobs
    llm = LLM(model=path, device="cpu", num_kv_blocks=64, **TP2)
    try:
        tp = llm.generate([ids], params)[0].prompt_logprobs
    finally:
        llm.engine.shutdown()
    assert len(tp) == len(local) == 300 and tp[0] is None
    for a, b in zip(tp[1:], local[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


def test_tp2_embeddings_like_local(ray_cluster, tiny_model):
    """Every rank holds the whole final hidden states; rank 0 pools them."""
    from fluidserve.engine import PoolingParams

    path = tiny_model("llama")
    prompts = [[(5 * j) % 250 + 3 for j in range(n)] for n in (40, 9)]
    local = LLM(model=path, **CPU, runner="pooling").embed(prompts, PoolingParams("mean"))
    llm = LLM(model=path, **CPU, **TP2, runner="pooling")
    try:
        tp = llm.embed(prompts, PoolingParams("mean"))
    finally:
        llm.engine.shutdown()
    for a, b in zip(tp, local):
        assert len(a.embedding) == len(b.embedding)
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-5


@pytest.mark.slow
def test_tp2_penalties_and_token_histories_like_local(ray_cluster, tiny_model):
    """Rank 0 keeps each sequence's sampler row and is sent what it lacks
    (engine/sample_specs.py): the penalties, min_tokens and bad words read
    the prompt and outputs it rebuilt, so every token is the local one,
    with more requests than run at once (rows that come and go)."""
    path = tiny_model("llama")
    kinds = [SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5),
             SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=0.9, presence_penalty=0.4),
             SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, bad_words_token_ids=[[40, 41], [7]]),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    prompts = PROMPTS * 2
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    local = LLM(model=path, **CPU).generate(prompts, params)
    plain = LLM(model=path, **CPU).generate(prompts, GREEDY)
    penalised = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty]
    assert any(local[i].outputs[0].token_ids[:16] != plain[i].outputs[0].token_ids for i in penalised)
    llm = LLM(model=path, **CPU, **TP2)
    try:
        tp = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in tp] == [o.outputs[0].token_ids for o in local]
        assert llm.engine.kv.num_used_blocks == 0
    finally:
        llm.engine.shutdown()


def test_daemon_started_ray_is_loopback_only():
    """What start_local_ray promises: Ray's control plane on 127.0.0.1 and
    no process of that Ray (the caller's children: its GCS, raylet and their
    agents and workers) listening on another interface. In a process of its
    own, so that neither a Ray this process joined before nor another Ray on
    the machine (a test beside this one, another user's) is the one judged."""
    import subprocess
    import sys

    pytest.importorskip("psutil")
    code = ("import json, psutil, ray\n"
            "from fluidserve.engine.executor.ray import start_local_ray\n"
            "start_local_ray(num_cpus=1)\n"
            "ours = {p.pid: ' '.join(p.cmdline())[:80] for p in psutil.Process().children(recursive=True)}\n"
            "listening = [(c.laddr.ip, ours[c.pid]) for c in psutil.net_connections(kind='inet')\n"
            "             if c.status == psutil.CONN_LISTEN and c.pid in ours]\n"
            "print(json.dumps([ray.get_runtime_context().gcs_address, len(ours), listening]))\n"
            "ray.shutdown()\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    gcs, processes, listening = json.loads(done.stdout.strip().splitlines()[-1])
    assert gcs.startswith("127.0.0.1:")
    assert processes and listening, "start_local_ray started no process that listens"
    exposed = [(ip, name) for ip, name in listening if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed


def test_daemon_starts_its_own_ray_beside_another(ray_cluster):
    """Another Ray instance on the machine (this module's, also named by
    RAY_ADDRESS): a daemon without ``ray_address`` still starts its own,
    loopback-only, rather than joining the one Ray finds (a second server's
    replicas on the first server's cluster)."""
    import subprocess
    import sys

    ours = ray.get_runtime_context().gcs_address
    code = ("import ray\n"
            "from fluidserve.engine.executor.ray import start_local_ray\n"
            "start_local_ray(num_cpus=1)\n"
            "print(ray.get_runtime_context().gcs_address)\n"
            "ray.shutdown()\n")  # fmt: skip
    env = dict(os.environ, RAY_ADDRESS=ours)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = done.stdout.strip().splitlines()[-1]
    assert theirs.startswith("127.0.0.1:") and theirs != ours


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("opt", {}), ("qwen2", {"num_key_value_heads": 1})],
                         ids=["llama-gqa", "opt", "qwen2-kv1"])
def test_shards_reassemble_the_checkpoint(tiny_model, arch, overrides):
    """Each rank loads only its slice; the slices of both ranks, concatenated
    (padding cut off), are the whole checkpoint tensor, also inside the fused
    q/k/v and gate/up weights (each rank holds its shard of each part).
    Replicated tensors (norms, row-parallel biases, a lone KV head) are whole
    on every rank."""
    from safetensors.torch import load_file

    path = tiny_model(arch, **overrides)
    checkpoint = load_file(str(Path(path) / "model.safetensors"))
    cfg = load_hf_config(path)
    ranks, values = [], []
    for rank in range(2):
        m = build_model(cfg, torch.float32, torch.device("cpu"), TensorParallel(rank, 2))
        load_weights(m, path)
        ranks.append(checkpoint_targets(m))
        values.append(loaded_weights(m))  # a weight given up once packed, read back
    checked = 0
    for name, whole in checkpoint.items():
        name = "model." + name if arch == "opt" and name.startswith("decoder.") else name
        if name not in ranks[0]:
            continue
        parts = [r[name].view(v[r[name].param_name]) for r, v in zip(ranks, values)]
        spec = ranks[0][name].spec
        if spec is None:
            assert all(torch.equal(p, whole) for p in parts), name
        else:
            joined = torch.cat(parts, dim=spec.dim).narrow(spec.dim, 0, spec.full)
            assert torch.equal(joined, whole), name
        checked += 1
    assert checked == len(ranks[0])  # every tensor the model reads was compared


def test_size_that_does_not_split_the_heads_is_a_value_error(tiny_model):
    # Checked before any actor starts (and before Ray is even needed).
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide"):
        LLMEngine(EngineConfig.create(model=tiny_model("llama"), device="cpu", executor="ray", tensor_parallel_size=3))


# -- failure ---------------------------------------------------------------------


def _stream_until_error(base_url: str, body: dict, first_token: threading.Event) -> str:
    """Stream a completion; return the error message it ends with."""
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return event["error"]["message"]
            first_token.set()
    return "stream ended without an error"


def test_killed_worker_fails_in_flight_requests_and_health_within_10s(ray_cluster, tiny_model):
    from server_utils import start_server

    server = start_server(tiny_model("llama"), **TP2, max_num_seqs=4)
    try:
        executor = server.engine.executor
        victim = executor.worker_pids()[1]
        body = {"model": server.engine.model_name, "prompt": "Hello there", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True}
        first_token = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(_stream_until_error, server.base_url, body, first_token)
            plain = pool.submit(httpx.post, f"{server.base_url}/v1/completions", json=body, timeout=30)
            assert first_token.wait(30), "generation never started"
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            stream_error = streaming.result(timeout=DEADLINE_S)
            plain_resp = plain.result(timeout=DEADLINE_S)
        assert time.monotonic() - killed_at < DEADLINE_S
        assert "tensor-parallel worker rank 1 died during the step" in stream_error, stream_error
        assert plain_resp.status_code == 503
        assert "tensor-parallel worker rank" in plain_resp.json()["error"]["message"]
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503
        assert time.monotonic() - killed_at < DEADLINE_S
        with pytest.raises(ExecutorError):
            executor.check_health()
    finally:
        server.stop()
        server.engine.shutdown()


@pytest.mark.slow
def test_hung_worker_fails_the_step_within_10s(ray_cluster, tiny_model):
    engine = LLMEngine(EngineConfig.create(model=tiny_model("opt"), **CPU, **TP2))
    victim = engine.executor.worker_pids()[1]
    try:
        engine.add_request("r", "Hello there", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(victim, signal.SIGSTOP)  # alive but stuck: only the step timeout can tell
        stopped_at = time.monotonic()
        with pytest.raises(ExecutorError, match="did not finish the step"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - stopped_at < DEADLINE_S
        with pytest.raises(ExecutorError):  # stays failed: the daemon must not report healthy
            engine.executor.check_health()
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(victim, sig)
            except ProcessLookupError:
                pass
        engine.shutdown()


def test_idle_worker_death_fails_the_health_check(ray_cluster, tiny_model):
    """No request in flight: the engine loop's idle health poll still notices
    the dead worker, so the AsyncEngine (what /health reads) reports dead."""
    from fluidserve.engine.async_engine import AsyncEngine

    import asyncio

    engine = LLMEngine(EngineConfig.create(model=tiny_model("llama"), **CPU, **TP2))

    async def scenario() -> None:
        async_engine = AsyncEngine(engine, health_check_interval=0.2)
        async_engine.start()
        engine.executor.check_health()
        assert async_engine.health().ok
        os.kill(engine.executor.worker_pids()[0], signal.SIGKILL)
        killed_at = time.monotonic()
        while async_engine.health().ok and time.monotonic() - killed_at < DEADLINE_S:
            await asyncio.sleep(0.1)
        health = async_engine.health()
        assert not health.ok and "rank 0 died" in health.reason, health
        with pytest.raises(ExecutorError, match="rank 0 died"):  # no step runs on a failed executor
            engine.executor.check_health()
        await async_engine.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
