"""Data-parallel replicas behind one endpoint (``--data-parallel-size 2``),
through a real ``fluidserve serve`` process and real Ray: greedy outputs
identical to one engine's, prefix affinity, spill-over under skew, and a
replica killed with SIGKILL mid-load — no 5xx for requests that had not
started, no hung stream, the replica back in rotation. Then a two-node Ray
cluster (``ray.cluster_utils.Cluster``) with one replica per node."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from fluidserve.serve.lora import RUNTIME_UPDATING_ENV
from tests.lora_utils import make_adapter, peft_greedy
from tests.server_utils import free_port, read_metrics, start_subprocess_server, wait_healthy

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENGINE_ARGS = ["--device", "cpu", "--num-kv-blocks", "256", "--max-model-len", "256", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "512", "--swap-space", "0"]
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "Long prompt " * 9, "你好, wörld"]
# A shared system prompt of several KV blocks (block size 16): what prefix-aware routing keeps together.
SYSTEM = "You are a careful assistant. " * 3


@pytest.fixture(scope="module")
def dp_server(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    port = free_port()
    log = tmp_path_factory.mktemp("dp") / "server.log"
    # No slack for affinity beyond the prefill a hit saves: on the tiny
    # model a whole burst is milliseconds of work, under the default's second.
    data_dir = tmp_path_factory.mktemp("dp-data")
    adapter = make_adapter(model, tmp_path_factory.mktemp("dp-lora") / "a1", seed=1)
    os.environ[RUNTIME_UPDATING_ENV] = "true"  # the routes exist, and say what replicas cannot do
    try:
        proc = start_subprocess_server([model, *ENGINE_ARGS, "--data-parallel-size", "2",
                                        "--routing-balance-threshold-ms", "0", "--enable-prompt-tokens-details",
                                        "--data-dir", str(data_dir), "--enable-lora", "--lora-modules",
                                        f"a1={adapter}"], port, log)
    finally:
        del os.environ[RUNTIME_UPDATING_ENV]
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=180, proc=proc)
    except Exception:
        proc.kill()
        print(log.read_text(errors="replace")[-4000:])
        raise
    yield model, base, proc, log, adapter
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _greedy_single(model: str) -> list[list[int]]:
    """One engine, in this process, same flags: the reference."""
    from fluidserve.engine import LLM, SamplingParams

    llm = LLM(model=model, device="cpu", num_kv_blocks=256, max_model_len=256, max_num_seqs=32,
              max_num_batched_tokens=512, swap_space=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _complete(base: str, prompt: str, **extra) -> dict:
    body = {"model": extra.pop("model", None), "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _model_id(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def _routed(base: str) -> dict[tuple[str, str], float]:
    """Router counters from /metrics: (engine, reason) -> requests."""
    out = {}
    for key, value in read_metrics(base).items():
        if key.startswith("fluidserve_router_requests_total{"):
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1:-1].split(","))
            out[(labels["engine"].strip('"'), labels["reason"].strip('"'))] = value
    return out


def _through_replicas(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], set[int], list[bool]]:
    """Each prompt in turn through a DataParallelEngine: its tokens, the
    replicas that served, and which replicas hold a replica channel."""
    async def main():
        engine.start()
        outs, served_by = [], set()
        for i, prompt in enumerate(prompts):
            stream = await engine.add_request(f"r{i}", prompt, params)
            served_by.add(engine._requests[f"r{i}"].replica)
            async for out in stream:
                last = out
            outs.append(last.outputs[0].token_ids)
        links = [r.link is not None for r in engine.replicas]
        await engine.shutdown()
        return outs, served_by, links

    return asyncio.run(main())


def test_two_replicas_answer_concurrent_requests_as_one_engine_does(dp_server):
    model, base, _, _, _ = dp_server
    expected = _greedy_single(model)
    name = _model_id(base)

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(prompt: str):
                r = await client.post(f"{base}/v1/completions", json={
                    "model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["token_ids"]

            async def chat():
                r = await client.post(f"{base}/v1/chat/completions", json={
                    "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            return await asyncio.gather(*(one(p) for p in PROMPTS * 2), chat(), chat())

    *tokens, chat_a, chat_b = asyncio.run(main())
    assert tokens == expected * 2
    assert isinstance(chat_a, str) and chat_a == chat_b  # greedy: the same text from whichever replica
    routed = _routed(base)
    assert {engine for engine, _ in routed} == {"0", "1"}, routed  # both replicas served

    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "replicas_healthy": 2, "replicas_total": 2}


def test_streamed_and_whole_replies_agree_through_the_replicas(dp_server):
    """After a request's first output a replica sends what came since the
    one before (engine/output_wire.py), and the front rebuilds the rest:
    seeded n=2 replies with logprobs, streamed and whole, agree choice by
    choice in text, token ids and logprobs, and usage counts every token."""
    _, base, _, _, _ = dp_server
    body = {"model": _model_id(base), "prompt": "Long prompt " * 9, "max_tokens": 20, "temperature": 0.8,
            "seed": 7, "n": 2, "logprobs": 2, "ignore_eos": True, "return_token_ids": True}
    whole = _complete(base, body.pop("prompt"), **body)
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120,
                      json={**body, "prompt": "Long prompt " * 9, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text, ids, tokens = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for chunk in chunks:
        for c in chunk["choices"]:
            text[c["index"]] += c["text"]
            ids[c["index"]] += c.get("token_ids") or []
            tokens[c["index"]] += (c.get("logprobs") or {}).get("tokens") or []
    assert len(chunks) > 20  # a chunk a step, not one reply
    for c in whole["choices"]:
        i = c["index"]
        assert len(c["token_ids"]) == 20
        assert (text[i], ids[i], tokens[i]) == (c["text"], c["token_ids"], c["logprobs"]["tokens"])
    usage = chunks[-1]["usage"]  # the second may find the first's prompt cached: details aside
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"], 40)
    assert whole["usage"]["completion_tokens"] == 40


def test_lora_adapters_are_served_by_every_replica(dp_server):
    """``--lora-modules`` reach every replica: an adapter's requests give
    PEFT's tokens on whichever replica serves them.
    Loading one at runtime is a 400 that says why (each replica would need
    it, and a restarted replica would come back without it)."""
    model, base, _, _, adapter = dp_server
    cards = {m["id"]: m for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]}
    assert cards["a1"]["parent"] == _model_id(base) and cards["a1"]["root"] == adapter
    replies = [_complete(base, p, model="a1") for p in PROMPTS]
    assert [r["choices"][0]["token_ids"] for r in replies] == peft_greedy(model, adapter, PROMPTS, 12)
    assert {r["model"] for r in replies} == {"a1"}
    load = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapter}, timeout=30)
    assert load.status_code == 400 and "--data-parallel-size" in load.json()["error"]["message"]


def test_requests_sharing_a_prefix_land_where_it_is_cached(dp_server):
    _, base, _, _, _ = dp_server
    name = _model_id(base)
    first = _complete(base, SYSTEM + "Question one?", model=name)
    cached = [_complete(base, SYSTEM + f"Question {i}?", model=name)["usage"]["prompt_tokens_details"]
              ["cached_tokens"] for i in range(2, 8)]
    assert first["usage"]["prompt_tokens"] > 48
    # Sent one at a time, loads stay even: every later request finds the
    # shared blocks on the replica that computed them.
    assert min(cached) >= 48, cached


def test_a_skewed_burst_spills_over_to_the_other_replica(dp_server):
    _, base, _, _, _ = dp_server
    name = _model_id(base)
    before = _routed(base)

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int):
                r = await client.post(f"{base}/v1/completions", json={
                    "model": name, "prompt": SYSTEM + f"Burst {i}", "max_tokens": 24, "ignore_eos": True})
                assert r.status_code == 200, r.text

            await asyncio.gather(*(one(i) for i in range(24)))

    asyncio.run(main())
    after = _routed(base)
    per_engine = {e: sum(v - before.get(k, 0) for k, v in after.items() if k[0] == e) for e in ("0", "1")}
    # All 24 share one prefix; affinity alone would put them on one replica.
    assert min(per_engine.values()) >= 2, per_engine


def test_a_batch_job_spreads_over_the_replicas(dp_server):
    """Batch API lines run as offline requests, on whichever replica has the
    least backlog: both replicas take lines, and every line completes."""
    import openai

    _, base, _, _, _ = dp_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    before = _routed(base)
    rows = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Batch line {i} " * 4, "max_tokens": 16, "temperature": 0, "ignore_eos": True}}
            for i in range(16)]
    up = client.files.create(file=("in.jsonl", "\n".join(json.dumps(r) for r in rows).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed" and batch.request_counts.completed == 16, batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 16 for o in out)
    offline = {e: v - before.get((e, r), 0) for (e, r), v in _routed(base).items() if r == "offline"}
    assert len(offline) == 2 and min(offline.values()) >= 1, offline


def _replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::EngineReplica"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_replica_killed_mid_load_fails_no_unstarted_request_and_rejoins(dp_server):
    _, base, _, _, _ = dp_server
    name = _model_id(base)
    pids = _replica_pids()
    assert len(pids) == 2, pids
    results: dict[str, list] = {"ok": [], "stream_error": [], "status": []}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": name, "prompt": f"Stream {i} " * 3, "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            results["status"].append(r.status_code)
            got_done, errored = False, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    got_done = True
                elif line.startswith("data: ") and '"error"' in line:
                    err = json.loads(line[6:])["error"]
                    assert err["message"] and err["type"]  # OpenAI's error shape
                    errored = True
            assert got_done  # every stream ends: no hang
            results["stream_error" if errored else "ok"].append(i)

    async def plain(client: httpx.AsyncClient, i: int) -> None:
        r = await client.post(f"{base}/v1/completions", json={
            "model": name, "prompt": f"Queued {i} " * 4, "max_tokens": 8, "ignore_eos": True})
        results["status"].append(r.status_code)
        assert r.status_code == 200, r.text  # not started when the replica died: sent again

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            streams = [asyncio.ensure_future(stream(client, i)) for i in range(8)]
            await asyncio.sleep(0.5)  # streams are running on both replicas
            os.kill(pids[0], signal.SIGKILL)
            late = [asyncio.ensure_future(plain(client, i)) for i in range(12)]
            await asyncio.wait_for(asyncio.gather(*streams, *late), 120)

    asyncio.run(main())
    assert all(s < 500 for s in results["status"]), results
    assert len(results["ok"]) + len(results["stream_error"]) == 8
    # /health stayed 200 with one replica; the killed one comes back.
    deadline = time.monotonic() + 120
    while True:
        h = httpx.get(f"{base}/health", timeout=10)
        assert h.status_code == 200, h.text
        if h.json()["replicas_healthy"] == 2:
            break
        assert time.monotonic() < deadline, h.json()
        time.sleep(0.5)
    new_pids = _replica_pids()
    assert len(new_pids) == 2 and pids[0] not in new_pids
    assert _complete(base, "after the restart", model=name)["choices"][0]["token_ids"]


def test_two_node_cluster_places_one_replica_per_node(tiny_model):
    """Two virtual nodes of one machine, joined with ``ray_address`` as
    ``--ray-address`` joins a real cluster. The replica on this process's
    node takes the replica channel, the other Ray calls; both give one
    engine's greedy tokens."""
    from fluidserve.engine import LLM
    from ray.cluster_utils import Cluster

    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.data_parallel import DataParallelEngine
    from fluidserve.engine.sampling_params import SamplingParams

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        flags = dict(model=tiny_model("llama"), device="cpu", num_kv_blocks=64, max_model_len=128, swap_space=0)
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        prompts = [[1, 2, 3, 4 + i] for i in range(4)]
        expected = [o.outputs[0].token_ids for o in LLM(**flags).generate(prompts, greedy)]
        config = EngineConfig.create(**flags, data_parallel_size=2, ray_address=cluster.address,
                                     routing_policy="round-robin")
        engine = DataParallelEngine(config, torch_threads=1)
        try:
            nodes = {r.node_id for r in engine.replicas}
            assert len(nodes) == 2, nodes
            # the count is read on each replica's engine thread, the one that steps it
            assert [r.torch_threads for r in engine.replicas] == [1, 1]

            outs, served_by, links = _through_replicas(engine, prompts, greedy)
            assert outs == expected
            assert served_by == {0, 1}
            assert sorted(links) == [False, True]  # this node's replica on its channel, the other's on Ray calls
        finally:
            engine._kill_all()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def _replicas_against_one_engine(model: str, **config) -> tuple[set[int], list[bool]]:
    """Four prompts in turn through 2 replicas (round-robin; ``config``
    added) on the Ray instance this process has joined. Asserts one engine's
    greedy tokens; returns the replicas that served and which of them hold
    a replica channel."""
    from fluidserve.engine import LLM
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.data_parallel import DataParallelEngine
    from fluidserve.engine.sampling_params import SamplingParams

    flags = dict(model=model, device="cpu", num_kv_blocks=64, max_model_len=128, swap_space=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(4)]
    expected = [o.outputs[0].token_ids for o in LLM(**flags).generate(prompts, greedy)]
    engine = DataParallelEngine(EngineConfig.create(**flags, data_parallel_size=2, routing_policy="round-robin",
                                                    **config), torch_threads=1)
    try:
        outs, served_by, links = _through_replicas(engine, prompts, greedy)
    finally:
        engine._kill_all()
    assert outs == expected
    return served_by, links


def test_replicas_under_a_deep_temporary_directory_still_take_their_channels(tiny_model, tmp_path):
    """The replicas' TMPDIR is too deep for a Unix socket's path: their
    channels are made under /tmp instead, with one engine's greedy tokens."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"TMPDIR": str(deep)}})
    try:
        assert _replicas_against_one_engine(tiny_model("llama")) == ({0, 1}, [True, True])
    finally:
        ray.shutdown()


def test_replicas_of_tensor_parallel_workers_give_one_engines_tokens(tiny_model):
    """2 replicas x 2 tensor-parallel workers: each replica's engine drives
    its workers over their step channels, the front end the replicas over
    theirs."""
    from fluidserve.engine.executor.ray import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(num_cpus=6)
    try:
        served_by, links = _replicas_against_one_engine(tiny_model("llama"), tensor_parallel_size=2, executor="ray")
        assert (served_by, links) == ({0, 1}, [True, True])
    finally:
        ray.shutdown()


def test_replicas_and_workers_with_no_temporary_directory_serve_over_ray_calls(tiny_model, tmp_path):
    """Where a replica or a tensor-parallel worker cannot make its socket
    (here: no temporary directory it can write), Ray calls carry what the
    socket would have, with the same greedy tokens."""
    from fluidserve.engine import LLM
    from fluidserve.engine.sampling_params import SamplingParams

    gone = str(tmp_path / "gone")

    def no_temporary_directory() -> None:
        import tempfile
        tempfile.tempdir = gone

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"worker_process_setup_hook": no_temporary_directory})
    try:
        model = tiny_model("llama")
        assert _replicas_against_one_engine(model) == ({0, 1}, [False, False])

        flags = dict(model=model, device="cpu", num_kv_blocks=64, max_model_len=128, swap_space=0)
        greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompts = [[1, 2, 3, 4 + i] for i in range(4)]
        expected = [o.outputs[0].token_ids for o in LLM(**flags).generate(prompts, greedy)]
        llm = LLM(**flags, executor="ray", tensor_parallel_size=2)
        try:
            assert llm.engine.executor.step_transport == "ray calls"
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
        finally:
            llm.engine.shutdown()
    finally:
        ray.shutdown()


def test_a_replica_given_up_on_while_it_lives_drops_what_it_held(tiny_model):
    """The front end takes a replica out of rotation while its process lives
    (its channel closed, or a call to it failed): the request it was
    generating fails, and the replica comes back in the same process
    holding no request and no KV block, then serves one engine's tokens."""
    from fluidserve.engine import LLM
    from fluidserve.engine.async_engine import RequestFailedError
    from fluidserve.engine.config import EngineConfig
    from fluidserve.engine.data_parallel import DataParallelEngine
    from fluidserve.engine.sampling_params import SamplingParams

    if ray.is_initialized():
        ray.shutdown()
    flags = dict(model=tiny_model("llama"), device="cpu", num_kv_blocks=128, max_model_len=2048, swap_space=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4 + i] for i in range(2)]
    expected = [o.outputs[0].token_ids for o in LLM(**flags).generate(prompts, greedy)]
    engine = DataParallelEngine(EngineConfig.create(**flags, data_parallel_size=2, routing_policy="round-robin"),
                                torch_threads=1)

    async def main():
        engine.start()
        # Long enough to be generating still when the replica is back.
        stream = await engine.add_request("long", [5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True))
        replica = engine.replicas[engine._requests["long"].replica]
        pid = replica.pid
        outputs = stream.__aiter__()
        await outputs.__anext__()  # it has started
        assert replica.link is not None
        engine._mark_down(replica, "given up on by the front end")
        with pytest.raises(RequestFailedError, match="failed while this request was generating"):
            async for _ in outputs:
                pass
        deadline = time.monotonic() + 60
        while not replica.healthy:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert replica.pid == pid  # the same process: Ray restarted nothing
        stats = (await engine.get_stats())[str(replica.index)]
        assert (stats.requests, stats.kv_blocks_used) == ({}, 0)
        outs = []
        for i, prompt in enumerate(prompts):
            async for out in await engine.add_request(f"after-{i}", prompt, greedy):
                pass
            outs.append(out.outputs[0].token_ids)
        assert outs == expected
        assert replica.link is not None  # a new channel
        await engine.shutdown()

    try:
        asyncio.run(main())
    finally:
        engine._kill_all()
