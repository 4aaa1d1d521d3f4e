"""The server with ``--speculative-config`` (n-gram drafts): the OpenAI
client gets the offline engine's greedy text, streamed and not, while
drafts are verified and some stand; concurrent streams, some dropped
mid-way, end with every KV block back; /metrics carries vLLM's
spec_decode counters (a real uvicorn on localhost, the tiny random-weight
model)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

from fluidserve.engine import LLM, SamplingParams
from fluidserve.serve import cli
from server_utils import start_server, streams_some_dropped, wait_idle

MAX_MODEL_LEN = 256
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, '
         '"adaptive": false}')
PROMPT = "Long prompt Long prompt Long prompt"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from fluidserve.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-spec"), "llama"))


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM)
    yield srv
    srv.stop()


def metric(text: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]


def test_greedy_text_streamed_and_not_equals_offline(model_dir, server):
    offline = LLM(model=model_dir, device="cpu", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    expect = offline.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0)
    assert whole.choices[0].text == expect.text and whole.choices[0].finish_reason == expect.finish_reason
    assert whole.usage.completion_tokens == len(expect.token_ids)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expect.text
    text = httpx.get(f"{server.base_url}/metrics").text
    drafts, = metric(text, "vllm:spec_decode_num_drafts_total{")
    accepted, = metric(text, "vllm:spec_decode_num_accepted_tokens_total{")
    assert drafts > 0 and accepted > 0
    assert sum(metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total{")) == accepted
    assert len(metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total{")) == 4  # one per position
    assert metric(text, "fluidserve_spec_decode_draft_tokens_withheld_total") == [0.0]  # fixed drafts: all verified


def test_concurrent_streams_and_dropped_ones_free_their_kv(server):
    wait_idle(server)

    bodies = [{"model": server.engine.model_name, "prompt": f"{PROMPT} {i}", "max_tokens": 150 if i % 3 == 0 else 12,
               "ignore_eos": True, "temperature": 0.8, "seed": i, "drop": i % 3 == 0} for i in range(18)]
    assert streams_some_dropped(server, bodies) == [None if i % 3 == 0 else 12 for i in range(18)]
    wait_idle(server)
    assert server.engine.kv.num_used_blocks == 0
    server.engine.kv.check_integrity()


def test_the_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["serve", "/m", "--speculative-config", NGRAM])
    assert json.loads(cli.engine_config_from_args(args).speculative_config) == json.loads(NGRAM)


def test_a_method_we_do_not_build_stops_the_server_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "fluidserve.serve.cli", "serve", "some/model", "--speculative-config",
                           '{"method": "eagle", "model": "some/eagle", "num_speculative_tokens": 3}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "method 'eagle' is not implemented" in lines[0], proc.stderr


LETTERS = list(range(ord("a"), ord("z") + 1))  # ASCII replies: their text tokenizes back to their token ids


def test_a_predicted_output_gives_the_same_reply_in_fewer_steps_with_its_drafts_counted(server):
    """OpenAI's ``prediction``: the reply is the one without it, streamed and
    not, and usage counts the predicted tokens drafted and kept, and drafted
    and thrown away (an edited prediction throws some away)."""
    wait_idle(server)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    body = dict(model=server.engine.model_name, messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
                temperature=0, extra_body={"allowed_token_ids": LETTERS, "ignore_eos": True})
    plain = client.chat.completions.create(**body)
    reply = plain.choices[0].message.content
    assert len(reply) == 40 and plain.usage.completion_tokens_details is None
    steps = server.engine.stats().num_steps
    predicted = client.chat.completions.create(**body, prediction={"type": "content", "content": reply})
    assert predicted.choices[0].message.content == reply
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 30 and details.rejected_prediction_tokens == 0
    assert server.engine.stats().num_steps - steps <= 10  # five tokens a step, against one
    edited = reply[:20] + "0123" + reply[24:]  # what the reply does not say there is drafted and thrown away
    stream = client.chat.completions.create(**body, prediction={"type": "content", "content": [
        {"type": "text", "text": edited[:30]}, {"type": "text", "text": edited[30:]}]},
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply
    details = chunks[-1].usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 20 and details.rejected_prediction_tokens > 0


class _ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def test_a_prediction_is_refused_without_drafts_to_verify_or_past_the_context():
    from fluidserve.serve.errors import APIError
    from fluidserve.serve.inputs import InputProcessor, ModelInfo
    from fluidserve.serve.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "prediction": {"type": "content", "content": "hello"}})
    with pytest.raises(APIError) as err:
        InputProcessor(None, ModelInfo("m", 256, 261))._prediction(request, None)
    assert err.value.status == 400 and err.value.param == "prediction" and "--speculative-config" in str(err.value)
    long = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "prediction": {"type": "content", "content": "ab" * 200}})
    with pytest.raises(APIError, match="400 tokens, more than the model's context of 256"):
        InputProcessor(_ByteTokenizer(), ModelInfo("m", 256, 261, speculative=True))._prediction(long, None)
    with pytest.raises(ValueError, match="content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                              "prediction": {"type": "text", "content": "hello"}})
