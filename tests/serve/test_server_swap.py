"""The server with a device KV pool far smaller than its load: requests are
swapped to host memory and back while clients stream, some clients drop
mid-stream (aborting requests that may be on the host), and the server
stays healthy with every block of both tiers back."""

from __future__ import annotations

import asyncio
import json

import httpx

from server_utils import read_metrics, start_server
from server_utils import wait_idle


async def _completion_tokens(client: httpx.AsyncClient, body: dict, drop_after: int | None) -> int | None:
    """Stream a completion; its completion_tokens from the usage chunk, or
    None when the client drops after ``drop_after`` chunks."""
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                return data["usage"]["completion_tokens"]
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without a usage chunk")


def test_streams_survive_swapping_and_dropped_clients_free_both_tiers(tiny_model):
    server = start_server(tiny_model("llama"), num_kv_blocks=24, block_size=8, num_host_blocks=512, max_model_len=128,
                          max_num_seqs=16)
    try:
        wait_idle(server)

        async def main() -> list[int | None]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=40)) as c:
                jobs = []
                for i in range(16):
                    dropped = i % 4 == 0
                    body = {"prompt": f"client {i} asks a question of some length", "max_tokens": 40,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": 0}
                    jobs.append(_completion_tokens(c, body, drop_after=5 if dropped else None))
                return await asyncio.gather(*jobs)

        chunks = asyncio.run(main())
        assert [n for i, n in enumerate(chunks) if i % 4] == [40] * 12  # every kept stream is whole
        after = wait_idle(server)
        assert after["fluidserve_swaps_total"] > 0  # the pool did force swapping
        assert after['fluidserve_preemptions_by_kind_total{kind="swap"}'] > 0
        assert after['fluidserve_kv_blocks_used{tier="host"}'] == 0
        assert after['fluidserve_kv_blocks_total{tier="host"}'] == 512
        assert server.engine.kv.num_used_host_blocks == 0 and server.engine.kv.num_used_blocks == 0
        server.engine.kv.check_integrity()
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        r = httpx.post(f"{server.base_url}/v1/completions",
                       json={"prompt": "still serving", "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        m = read_metrics(server.base_url)
        assert m["fluidserve_swap_out_bytes_total"] > 0
        # 16 prompts "client {i} asks ...": the first block ("client ") is shared.
        hits, queries = (m[f'fluidserve_prefix_cache_{n}_total{{tier="device"}}'] for n in ("hits", "queries"))
        assert 0 < hits <= queries
        assert next(v for k, v in m.items() if k.startswith("vllm:prefix_cache_hits_total{")) > 0
    finally:
        server.stop()
        server.async_engine.engine.shutdown()
