"""Co-serving through the server: a Batch API job beside streamed online
chats, on one real uvicorn server. The online streams keep a bounded gap
between tokens while the batch runs (a generous bound: this checks that
offline work cannot stall a stream, not how fast it is), and nothing is
lost on either side."""

from __future__ import annotations

import asyncio
import io
import json
import time

import openai
import pytest

from fluidserve.serve.batches import BatchConfig
from server_utils import start_server, wait_idle

ONLINE, ONLINE_TOKENS = 6, 16
LINES, LINE_TOKENS = 48, 12
MAX_GAP_S = 2.0


@pytest.mark.parametrize("engine_kwargs", [{}, {"online_slowdown_cap": 1.2}], ids=["defaults", "slowdown-cap"])
def test_online_streams_beside_a_batch_keep_their_token_gaps_and_nothing_is_lost(tiny_model, tmp_path,
                                                                                  engine_kwargs):
    server = start_server(tiny_model("llama"), batch_config=BatchConfig(str(tmp_path), max_in_flight=16),
                          max_num_batched_tokens=256, **engine_kwargs)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        lines = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"model": model, "prompt": f"Document {i}: " + "lorem ipsum dolor " * 12,
                           "max_tokens": LINE_TOKENS, "temperature": 0, "ignore_eos": True}} for i in range(LINES)]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")

        async def stream_all() -> list[tuple[int, float, str | None]]:
            aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)

            async def one(i: int) -> tuple[int, float, str | None]:
                await asyncio.sleep(0.15 * i)  # arrivals spread over the batch's run
                stamps, finish = [], None
                stream = await aclient.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Hello {i}"}], max_tokens=ONLINE_TOKENS,
                    temperature=0, stream=True, logprobs=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    choice = chunk.choices[0] if chunk.choices else None
                    if choice is not None and choice.logprobs and choice.logprobs.content:
                        stamps.extend([time.monotonic()] * len(choice.logprobs.content))
                    if choice is not None and choice.finish_reason:
                        finish = choice.finish_reason
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                return len(stamps), max(gaps, default=0.0), finish

            try:
                return await asyncio.gather(*(one(i) for i in range(ONLINE)))
            finally:
                await aclient.close()

        online = asyncio.run(stream_all())
        for tokens, max_gap, finish in online:
            assert tokens == ONLINE_TOKENS and finish == "length"
            assert max_gap < MAX_GAP_S, f"a stream waited {max_gap:.2f} s between two tokens"

        deadline = time.monotonic() + 240
        while (b := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
            time.sleep(0.1)
        assert b.status == "completed" and b.request_counts.completed == LINES and b.request_counts.failed == 0
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)  # each once
        assert all(o["response"]["body"]["usage"]["completion_tokens"] == LINE_TOKENS for o in out)
        wait_idle(server, timeout=10.0)  # every KV block back
    finally:
        server.stop()
