"""The server with ``--async-scheduling``: the OpenAI client gets the same
greedy text as the offline engine, streamed and not, and concurrent
streams, some dropped mid-way, end with every KV block back while decode
steps were queued ahead of their reads (a real uvicorn on localhost, the
tiny random-weight model); and beside n-gram drafts, where the steps that
carry none are queued ahead and the rest verify drafts."""

from __future__ import annotations


import json

import openai
import pytest

from fluidserve.engine import LLM, SamplingParams
from server_utils import start_server, streams_some_dropped, wait_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from fluidserve.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-async"), "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=MAX_MODEL_LEN, async_scheduling=True)
    yield srv
    srv.stop()


def test_greedy_text_streamed_and_not_equals_offline(model_dir, server):
    offline = LLM(model=model_dir, device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    expect = offline.generate("The capital of France", SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt="The capital of France", max_tokens=24, temperature=0)
    assert whole.choices[0].text == expect.text and whole.choices[0].finish_reason == expect.finish_reason
    stream = client.completions.create(model=model, prompt="The capital of France", max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expect.text
    assert server.engine.stats().num_steps_launched_ahead > 0


def test_concurrent_streams_and_dropped_ones_free_their_kv(server):
    before = wait_idle(server)
    bodies = [{"model": server.engine.model_name, "prompt": f"client {i}", "max_tokens": 150 if i % 3 == 0 else 12,
               "ignore_eos": True, "temperature": 0.8, "drop": i % 3 == 0} for i in range(24)]
    tokens = streams_some_dropped(server, bodies)
    assert tokens == [None if i % 3 == 0 else 12 for i in range(24)]
    after = wait_idle(server)
    generated = after["fluidserve_generation_tokens_total"] - before["fluidserve_generation_tokens_total"]
    assert 16 * 12 + 8 * 3 <= generated < 16 * 12 + 8 * 100  # the dropped streams were aborted
    assert server.engine.kv.num_used_blocks == 0
    server.engine.kv.check_integrity()


def test_beside_drafts_text_equals_offline_and_dropped_streams_free_their_kv(model_dir):
    """--async-scheduling with --speculative-config (the default policy):
    greedy text through the OpenAI client equals the offline engine's
    without drafts, streamed and not; concurrent streams, some dropped,
    give every kept one its tokens and leave no KV block held; steps went
    ahead and drafts stood, as /metrics reports."""
    srv = start_server(model_dir, max_model_len=MAX_MODEL_LEN, async_scheduling=True,
                       speculative_config=json.dumps(NGRAM))
    try:
        offline = LLM(model=model_dir, device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        for prompt in ("The capital of France", "one two three one two three"):
            expect = offline.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0))[0].outputs[0]
            whole = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0)
            assert whole.choices[0].text == expect.text
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0,
                                               stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expect.text
        bodies = [{"model": model, "prompt": f"client {i} client {i}", "max_tokens": 150 if i % 3 == 0 else 24,
                   "ignore_eos": True, "temperature": 0, "drop": i % 3 == 0} for i in range(12)]
        assert streams_some_dropped(srv, bodies) == [None if i % 3 == 0 else 24 for i in range(12)]
        after = wait_idle(srv)
        assert srv.engine.kv.num_used_blocks == 0
        srv.engine.kv.check_integrity()
        assert after["fluidserve_steps_launched_ahead_total"] > 0
        assert srv.engine.stats().spec_num_accepted_tokens > 0
    finally:
        srv.stop()
