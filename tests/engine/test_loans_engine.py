"""KV loans on the real engine (CPU): a request that leaves first takes the
device blocks owed to a stream parked on the host, every output stays the
greedy one, and /metrics counts the backfill."""

from __future__ import annotations

from fluidserve.engine import SamplingParams


def _run(make_llm, path: str, backfill: bool) -> tuple[dict[str, list[int]], dict[str, int], object]:
    """Streams ``a`` and ``b`` fill a 16-block pool; ``a`` grows and parks
    ``b`` on the host, owed its blocks until ``a`` ends. ``w`` (8 tokens)
    arrives 60 steps in: the step it is admitted, counted from its arrival."""
    llm = make_llm(path, num_kv_blocks=16, block_size=16, num_host_blocks=400, max_model_len=256,
                   max_num_batched_tokens=256, swap_loan_tokens=4, swap_backfill=backfill)
    engine = llm.engine
    stream = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    engine.add_request("a", list(range(3, 103)), stream)
    engine.add_request("b", list(range(103, 203)), stream)
    tokens: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == 60:
            engine.add_request("w", list(range(7, 23)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
        step += 1
        assert step < 2000, "the engine made no progress"
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_used_host_blocks == 0
    return tokens, first, engine.stats()


def test_a_request_that_leaves_first_takes_the_blocks_owed_to_a_parked_stream(tiny_model, make_llm):
    from prometheus_client.parser import text_string_to_metric_families

    from fluidserve.serve.metrics import ServerMetrics

    path = tiny_model("llama")
    on, on_first, on_stats = _run(make_llm, path, backfill=True)
    off, off_first, off_stats = _run(make_llm, path, backfill=False)
    assert on_stats.num_swaps > 0  # the case: b is parked on the host while a grows
    assert on == off and [len(on[r]) for r in "abw"] == [150, 150, 8]  # scheduling changes no token
    assert on_stats.num_backfills == 1 and off_stats.num_backfills == 0
    assert on_first["w"] - 60 <= 1 < off_first["w"] - 60 - 50  # at once, against waiting for a to end
    metrics = ServerMetrics("m")
    metrics.engine.update(on_stats)
    samples = {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode())
               for s in fam.samples}
    assert samples["fluidserve_backfills_total"] == 1
