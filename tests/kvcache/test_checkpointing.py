"""Incremental checkpointing (ConServe §4.4): offline requests copy their
newly full KV blocks to the host as they run, so an online arrival that
evicts one moves (almost) nothing and the offline request resumes with the
same tokens it would have produced undisturbed."""

from __future__ import annotations

from fluidserve.engine import SamplingParams
from fluidserve.kvcache.manager import KVCacheManager
from fluidserve.scheduler.request_state import RequestClass

from token_paths import hf_greedy


def test_a_checkpointed_request_leaves_the_device_copying_only_its_tail():
    kv = KVCacheManager(8, 4, num_host_blocks=8)
    assert kv.allocate("a", 14)  # blocks: 3 full, 1 partial
    first = kv.checkpoint("a", num_computed_tokens=10, limit=8)  # 2 full blocks computed so far
    assert [d for d, _ in first] == kv.block_table("a")[:2]
    assert kv.checkpoint("a", 10, limit=8) == []  # nothing new
    more = kv.checkpoint("a", 14, limit=8)
    assert [d for d, _ in more] == kv.block_table("a")[2:3]  # the partial block never
    kv.release_pending()
    table = list(kv.block_table("a"))
    free_before = kv.num_free_blocks
    moves = kv.swap_out("a")
    assert [d for d, _ in moves] == table[3:]  # only the tail is copied
    assert kv.num_free_blocks == free_before + 3  # checkpointed blocks are free at once
    kv.check_integrity()
    kv.release_pending()
    back = kv.swap_in("a")
    assert [h for h, _ in back][:3] == [h for _, h in first + more]  # the checkpoints come back
    kv.free("a")
    kv.release_pending()
    kv.check_integrity()
    assert kv.num_used_blocks == 0 and kv.num_used_host_blocks == 0


def test_online_arrival_evicts_checkpointed_offline_work_and_tokens_are_unchanged(tiny_model, make_llm):
    path = tiny_model("llama")
    llm = make_llm(path, block_size=8, num_kv_blocks=10, max_model_len=64, num_host_blocks=64,
                   kv_checkpoint_threshold=0.0)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    offline = {f"off{i}": [5 + i, 9, 14, 20 + i, 3, 7, 11, 2, 8, 6] for i in range(2)}
    for rid, prompt in offline.items():
        engine.add_request(rid, prompt, params, klass=RequestClass.OFFLINE)
    outs: dict[str, list[int]] = {}

    def step() -> None:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)

    for _ in range(24):  # both decode; their full blocks reach the host as they go
        step()
    counters = engine.scheduler.counters
    assert counters.checkpoint_blocks >= 4
    online = list(range(30, 52))  # 3 blocks: the device is full of offline KV
    engine.add_request("on", online, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        step()
    assert counters.num_checkpoint_evictions >= 1
    # The eviction copied at most the unfinished tail of each victim.
    assert counters.swap_out_blocks <= counters.num_swap_outs
    want = hf_greedy(path, list(offline.values()) + [online], 30)
    assert [outs["off0"], outs["off1"]] == want[:2]
    assert outs["on"] == want[2][:8]
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
