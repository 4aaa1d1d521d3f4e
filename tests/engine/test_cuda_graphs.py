"""Decode CUDA graphs (engine/cuda_graphs.py).

On CPU the buckets run eagerly over their static buffers (``capture=False``):
the same copy-pad-run-slice path a graph replays, so the padding, the
buffers and the bucket choice are checked here token for token against the
plain eager path. The tests marked ``gpu`` capture real graphs and need a
CUDA device; the static attention plan meets the Triton kernel in
tests/kernels/test_static_decode_plan.py (interpreter on CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.batch import ModelInput, PromptLogprobSpec
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.cuda_graphs import (
    DEFAULT_CAPTURE_SIZES,
    PARTIAL_ROWS,
    capture_sizes,
    ineligible,
    max_splits_for,
    pick_bucket,
    plan_decode,
)
from fluidserve.kernels import packing
from padded_rows import assert_as_eager

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Long prompt " * 6, "xyz", "one two three",
           "Mary had a little lamb", "Z"]


# -- buckets and eligibility --------------------------------------------------------


def test_capture_sizes_follow_the_row_cap():
    assert capture_sizes(256) == DEFAULT_CAPTURE_SIZES
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(1000) == DEFAULT_CAPTURE_SIZES  # past the largest: eager
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(10, (8, 1, 4, 4)) == (1, 4, 8)
    assert capture_sizes(6, (8, 1, 4, 4)) == (1, 4, 6)
    with pytest.raises(ValueError):
        capture_sizes(8, (0, 4))


@pytest.mark.parametrize("rows, bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (256, 256), (257, None)])
def test_pick_bucket_is_the_smallest_that_holds_the_rows(rows, bucket):
    assert pick_bucket(rows, DEFAULT_CAPTURE_SIZES) == bucket


def test_split_cap_bounds_the_partial_buffers():
    for b in DEFAULT_CAPTURE_SIZES + (100, 512, 4096, 8192):
        cap = max_splits_for(b)
        assert 1 <= cap <= packing.MAX_SPLITS
        assert b * cap <= max(PARTIAL_ROWS, b)
    assert max_splits_for(64) == packing.MAX_SPLITS


def decode_input(seq_lens: list[int], block_size: int = 8, first_block: int = 1) -> ModelInput:
    """One decode token per sequence, each over its own run of blocks."""
    tables, nxt = [], first_block
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    return ModelInput(
        input_ids=[(7 * i + 3) % 50 for i in range(len(seq_lens))], positions=[n - 1 for n in seq_lens],
        slot_mapping=[t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)],
        query_start_loc=list(range(len(seq_lens) + 1)), seq_lens=list(seq_lens), block_tables=tables,
        sample_indices=list(range(len(seq_lens))),
    )


def test_only_plain_decode_steps_fit_a_bucket():
    assert ineligible(decode_input([5, 9, 3]), 256, 64) is None
    prefill = ModelInput(input_ids=[1, 2, 3], positions=[0, 1, 2], slot_mapping=[8, 9, 10], query_start_loc=[0, 3],
                         seq_lens=[3], block_tables=[[1]], sample_indices=[2])
    assert ineligible(prefill, 256, 64) == "not decode-only"
    mixed = decode_input([5, 9])
    mixed.input_ids += [4, 4]
    mixed.positions += [0, 1]
    mixed.slot_mapping += [80, 81]
    mixed.query_start_loc += [4]
    mixed.seq_lens += [2]
    mixed.block_tables += [[10]]
    assert ineligible(mixed, 256, 64) == "not decode-only"
    logprobs = decode_input([5])
    logprobs.prompt_logprobs = [PromptLogprobSpec("r", 0, [1], 0)]
    assert ineligible(logprobs, 256, 64) == "prompt logprobs"
    preemptible = decode_input([5])
    preemptible.preemptible = True
    assert ineligible(preemptible, 256, 64) == "preemptible"
    assert ineligible(decode_input([4] * 9), 8, 64) == "larger than the largest bucket"
    assert ineligible(decode_input([40]), 8, 4) == "block table wider than max_model_len"
    assert ineligible(ModelInput(), 8, 4) == "no tokens"


# -- the static plan on the host -------------------------------------------------------


@pytest.mark.parametrize("window", [None, 600])
def test_plan_decode_splits_as_the_eager_planner_does(window):
    seq_lens = [3000, 17, 900, 1, 260, 4100]
    units = 6
    work = plan_decode(seq_lens, num_units=units, max_splits=packing.MAX_SPLITS, sliding_window=window)
    eager = packing.plan_attention([1] * len(seq_lens), seq_lens, num_units=units, tokens_per_tile=1,
                                   sliding_window=window)
    assert len(work.unit_offsets) == units + 1 and work.unit_offsets[-1] == len(work.rows)
    items = [packing.WorkItem(*r) for r in work.rows.tolist()]
    # The same pieces (sequence, KV range) as eager, every one written to its row's own merge row.
    assert sorted((i.seq, i.kv_lo, i.kv_hi) for i in items) == sorted((i.seq, i.kv_lo, i.kv_hi) for i in eager.items())
    assert all(i.merge_row == i.q_lo == i.seq for i in items)
    for row in range(len(seq_lens)):
        pieces = sorted((i for i in items if i.seq == row), key=lambda i: i.split)
        assert [p.split for p in pieces] == list(range(work.num_splits[row]))
        first = 0 if window is None else max(0, seq_lens[row] - window)
        assert pieces[0].kv_lo == first and pieces[-1].kv_hi == seq_lens[row]
        assert all(a.kv_hi == b.kv_lo for a, b in zip(pieces, pieces[1:]))
    assert max(work.num_splits) > 1  # the long rows do split


def test_plan_decode_respects_the_split_cap():
    seq_lens = [20000, 5, 9000]
    work = plan_decode(seq_lens, num_units=8, max_splits=3, sliding_window=None)
    assert max(work.num_splits) <= 3 and sum(work.num_splits) == len(work.rows)
    one = plan_decode(seq_lens, num_units=8, max_splits=1, sliding_window=None)
    assert one.num_splits == [1, 1, 1]


# -- the padded bucket against the eager path -----------------------------------------


def run_llm(make_llm, path, prompts, graphs: bool, params: SamplingParams = GREEDY, **kwargs):
    """Greedy outputs and the worker (its KV cache as the run left it)."""
    llm = make_llm(path, **dict(dict(num_kv_blocks=96, block_size=8, max_model_len=256), **kwargs))
    worker = llm.engine.executor.worker
    if graphs:
        worker.graphs = worker.decode_graphs(capture=False)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], worker


@pytest.mark.parametrize("arch, num_prompts, bucket", [
    ("llama", 3, 4), ("llama", 5, 8), ("llama", 1, 1), ("llama", 8, 8), ("mistral", 5, 8), ("opt", 3, 4),
])
def test_bucketed_decode_tokens_equal_eager(tiny_model, make_llm, arch, num_prompts, bucket):
    """Padded buckets over 30 decode steps, block tables growing by a block
    every 8 tokens: the greedy tokens and the whole KV cache afterwards are
    the eager path's (bit for bit where the CPU linear allows:
    tests/padded_rows.py), so padding rows wrote nothing."""
    path = tiny_model(arch)
    prompts = PROMPTS[:num_prompts]
    eager, w_eager = run_llm(make_llm, path, prompts, graphs=False)
    graphed, w_graph = run_llm(make_llm, path, prompts, graphs=True)
    assert graphed == eager
    assert bucket in w_graph.graphs.replays and w_graph.graphs.replays[bucket] >= 20
    assert w_graph.graphs.fallbacks.get("not decode-only", 0) >= 1  # the prefill ran eagerly
    for (k1, v1), (k2, v2) in zip(w_eager.kv_caches, w_graph.kv_caches):
        assert_as_eager(k2, k1)
        assert_as_eager(v2, v1)


def test_arrivals_mid_decode_move_between_buckets_and_eager(tiny_model, make_llm):
    """Requests joining and finishing: steps shrink and grow across buckets,
    mixed steps fall back to eager; tokens are eager's."""
    path = tiny_model("llama")
    lengths = [12, 30, 5, 22, 17]

    def run(graphs: bool):
        llm = make_llm(path, num_kv_blocks=96, block_size=8, max_model_len=256)
        worker = llm.engine.executor.worker
        if graphs:
            worker.graphs = worker.decode_graphs(capture=False)
        engine, done = llm.engine, {}
        for step in range(200):
            if step < len(lengths) * 3 and step % 3 == 0:
                i = step // 3
                engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=lengths[i],
                                                                      ignore_eos=True))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if len(done) == len(lengths):
                break
        return done, worker

    eager, _ = run(False)
    graphed, worker = run(True)
    assert graphed == eager
    assert len(worker.graphs.replays) >= 3  # several buckets were used
    assert worker.graphs.fallbacks["not decode-only"] >= 3  # prefills (some share a step) ran eagerly


def one_step_eager_then_bucketed(worker, capture: bool):
    """One decode step of 3 rows (bucket 4) over a cache of random values,
    eagerly, then from the same cache through the decode buckets: the eager
    and bucketed (hidden, sample indices), the cache before and the cache
    eager left, and the step's input."""
    worker.init_cache(24)
    torch.manual_seed(0)
    for k, v in worker.kv_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
    inp = decode_input([11, 4, 18], first_block=2)
    with torch.inference_mode():
        hidden, idx = worker._forward(inp)
        hidden = hidden.clone()
        eager_caches = [(k.clone(), v.clone()) for k, v in worker.kv_caches]
        for (k, v), (k0, v0) in zip(worker.kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        worker.graphs = worker.decode_graphs(capture=capture)
        out, out_idx = worker._forward(inp)
        out = out.clone()
    assert worker.graphs.replays == {4: 1}
    return (hidden, idx), (out, out_idx), before, eager_caches, inp


def assert_only_real_slots_written_as_eager_wrote(worker, before, eager_caches, inp) -> None:
    for (k, v), (ke, ve), (k0, _) in zip(worker.kv_caches, eager_caches, before):
        assert_as_eager(k, ke)
        assert_as_eager(v, ve)
        slots = (k != k0).reshape(-1, *k.shape[2:]).flatten(1).any(1).nonzero().flatten().tolist()
        assert slots == sorted(inp.slot_mapping)


def test_one_padded_step_matches_eager_and_writes_only_real_slots(tiny_model):
    """A single decode step of 3 rows in bucket 4 over a cache of random
    values: hidden states equal the eager forward's (bit for bit where the
    CPU linear allows: tests/padded_rows.py), and the only cache slots that
    change are the 3 in the slot mapping."""
    from fluidserve.engine.worker import Worker

    path = tiny_model("llama")
    worker = Worker(EngineConfig.create(model=path, device="cpu", num_kv_blocks=24, block_size=8), path)
    (hidden, idx), (out, out_idx), before, eager_caches, inp = one_step_eager_then_bucketed(worker, capture=False)
    assert out.shape == hidden.shape
    assert_as_eager(out, hidden)
    assert out_idx.tolist() == idx.tolist() == [0, 1, 2]
    assert_only_real_slots_written_as_eager_wrote(worker, before, eager_caches, inp)


def test_steps_that_do_not_fit_run_eagerly(tiny_model, make_llm):
    """Prompt logprobs and more rows than the largest bucket: eager, same tokens."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    eager, _ = run_llm(make_llm, path, PROMPTS[:2], graphs=False, params=params)
    graphed, worker = run_llm(make_llm, path, PROMPTS[:2], graphs=True, params=params)
    assert graphed == eager
    assert worker.graphs.fallbacks.get("not decode-only", 0) >= 1

    eager, _ = run_llm(make_llm, path, PROMPTS[:5], graphs=False, max_num_seqs=8, cuda_graph_sizes=(1, 2, 4))
    graphed, worker = run_llm(make_llm, path, PROMPTS[:5], graphs=True, max_num_seqs=8, cuda_graph_sizes=(1, 2, 4))
    assert graphed == eager
    assert worker.graphs.fallbacks.get("larger than the largest bucket", 0) >= 20
    assert set(worker.graphs.replays) <= {1, 2, 4}


# -- configuration ------------------------------------------------------------------


def test_graphs_by_default_and_graphs_are_cuda_only(tiny_model, make_llm, caplog):
    from fluidserve.engine.config import CUDA_GRAPHS_BY_DEFAULT

    assert CUDA_GRAPHS_BY_DEFAULT and EngineConfig().enforce_eager is False
    path = tiny_model("llama")
    assert make_llm(path).engine.executor.worker.graphs is None
    with caplog.at_level(logging.INFO, logger="fluidserve.engine.cuda_graphs"):
        llm = make_llm(path, enforce_eager=False)
    assert llm.engine.executor.worker.graphs is None  # CPU: eager, and it says so
    assert any("only on CUDA" in r.getMessage() for r in caplog.records)
    assert llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig.create(cuda_graph_sizes=(0, 4))


def test_cli_flags_map_onto_the_engine_config():
    from fluidserve.serve import cli

    def config(*argv: str) -> EngineConfig:
        return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "/m", *argv]))

    assert config().enforce_eager is EngineConfig().enforce_eager and config().cuda_graph_sizes is None
    assert config("--enforce-eager").enforce_eager is True
    assert config("--no-enforce-eager").enforce_eager is False
    assert config("--cuda-graph-sizes", "1", "2", "8").cuda_graph_sizes == (1, 2, 8)


# -- on a GPU: real capture ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_KWARGS = dict(device="cuda", dtype="float32", block_size=16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}), ("mistral", {}), ("qwen3", {"head_dim": 128, "hidden_size": 512}),
    ("opt", {"hidden_size": 320, "word_embed_proj_dim": 320}),
], ids=["llama", "mistral-window", "qwen3-128", "opt-80"])
@pytest.mark.parametrize("num_prompts", [3, 5, 8])
def test_gpu_captured_graphs_give_eager_tokens(tiny_model, make_llm, arch, overrides, num_prompts):
    """Graphs captured at start-up replay decode steps in padded buckets
    (3 rows in 4, 5 in 8, 8 in 8); fp32 greedy tokens equal the eager CUDA
    path's and the KV caches agree. No context reaches a split here, so
    every step replays the bucket's direct graph (no merge; the split graphs'
    own test is the long-context one below). FCFS: skip-join MLFQ ranks requests by
    measured step times, which graphs change, and the ranking decides which
    request takes which free block when several grow in one step, so the
    same KV may sit in other blocks."""
    path = tiny_model(arch, **overrides)
    prompts = PROMPTS[:num_prompts]
    kwargs = dict(GPU_KWARGS, num_kv_blocks=256, max_model_len=512, scheduling_policy="fcfs")
    eager_llm = make_llm(path, **kwargs)
    graph_llm = make_llm(path, enforce_eager=False, **kwargs)
    graphs = graph_llm.engine.executor.worker.graphs
    assert graphs is not None and all(b.replay is not None for b in graphs.buckets.values())
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params)]
    graphed = [o.outputs[0].token_ids for o in graph_llm.generate(prompts, params)]
    assert graphed == eager
    bucket = pick_bucket(num_prompts, graphs.sizes)
    assert graphs.direct_replays.get(bucket, 0) == graphs.replays[bucket] >= 30
    assert all(b.replay_direct is not None for b in graphs.buckets.values())
    for (k1, v1), (k2, v2) in zip(eager_llm.engine.executor.worker.kv_caches,
                                  graph_llm.engine.executor.worker.kv_caches):
        torch.testing.assert_close(k2, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v2, v1, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_one_captured_padded_step_writes_only_real_slots(tiny_model, dtype):
    """One decode step of 3 rows replayed from the captured bucket of 4 over
    a cache of random values: hidden states equal the eager forward's, and
    the only cache slots that change are the 3 in the slot mapping (a
    padding row writes nothing), with the values eager wrote."""
    from fluidserve.engine.worker import Worker

    path = tiny_model("llama")
    config = EngineConfig.create(model=path, num_kv_blocks=24, cuda_graph_sizes=(1, 2, 4), max_num_seqs=4,
                                 **{**GPU_KWARGS, "block_size": 8, "dtype": dtype})
    worker = Worker(config, path)
    (hidden, _), (out, _), before, eager_caches, inp = one_step_eager_then_bucketed(worker, capture=True)
    torch.testing.assert_close(out, hidden, atol=1e-5, rtol=1e-5)  # split-K order may differ from eager's
    assert_only_real_slots_written_as_eager_wrote(worker, before, eager_caches, inp)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("partial_rows", [PARTIAL_ROWS, 8], ids=["uncapped", "cap-binds"])
def test_gpu_long_contexts_split_inside_the_graph(tiny_model, make_llm, monkeypatch, partial_rows):
    """Contexts of thousands of tokens: the decode rows split into split-K
    pieces inside the graph (where the cap binds, bucket 4 holds 2 pieces a
    row and the long rows run unsplit, unlike eager, over the direct plans);
    greedy tokens are eager's."""
    from fluidserve.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "PARTIAL_ROWS", partial_rows)
    path = tiny_model("llama", max_position_embeddings=4096)
    prompts = ["Long prompt " * 300, "short", "Another long one " * 200]
    kwargs = dict(GPU_KWARGS, num_kv_blocks=1024, max_model_len=4096, max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eager = [o.outputs[0].token_ids for o in make_llm(path, **kwargs).generate(prompts, params)]
    graph_llm = make_llm(path, enforce_eager=False, **kwargs)
    graphs = graph_llm.engine.executor.worker.graphs
    assert graphs.buckets[4].plans[None].max_splits == cuda_graphs.max_splits_for(4)
    assert [o.outputs[0].token_ids for o in graph_llm.generate(prompts, params)] == eager
    assert graphs.replays.get(4, 0) >= 20
    direct = graphs.direct_replays.get(4, 0)
    assert direct == 0 if partial_rows == PARTIAL_ROWS else direct == graphs.replays[4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs sm_90")  # fmt: skip
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("mode", ["on", "l2"])
def test_gpu_dependent_gemv_launches_give_the_same_tokens(tiny_model, make_llm, enforce_eager, mode):
    """With the batch-1 GEMVs launched as programmatic dependents
    (kernels/gemv.py, either mode) and the attention letting them start
    (``Tiles.launch_dependents``), one bf16 request decodes the same greedy
    tokens with the same log-probabilities as with plain launches, eager and
    replayed from decode graphs: the arithmetic is the same, and no GEMV
    reads its input before the launch before it has written it."""
    from fluidserve.kernels import gemv
    from fluidserve.kernels import paged_attention as pa

    path = tiny_model("llama")
    kwargs = dict(GPU_KWARGS, dtype="bfloat16", num_kv_blocks=64, max_model_len=256, enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)

    def run(dependent: str):
        was = gemv.set_dependent_launch(dependent)
        try:
            with pa.tiles(launch_dependents=dependent != "off"):
                out = make_llm(path, **kwargs).generate(PROMPTS[:1], params)[0].outputs[0]
        finally:
            gemv.set_dependent_launch(was)
        return out.token_ids, [sorted(step.items()) for step in out.logprobs]

    assert run(mode) == run("off")


@pytest.mark.gpu
@needs_cuda
def test_gpu_init_cache_drops_the_graphs(tiny_model, make_llm):
    """Graphs hold the cache's addresses: a new cache drops them."""
    llm = make_llm(tiny_model("llama"), num_kv_blocks=64, enforce_eager=False, cuda_graph_sizes=(1, 2), **GPU_KWARGS)
    worker = llm.engine.executor.worker
    assert set(worker.graphs.buckets) == {1, 2}
    worker.init_cache(64)
    assert worker.graphs is None


def test_the_reference_path_is_never_captured():
    """The torch reference attention reads each batch's lengths on the host
    (tests compare the Triton path with it on one GPU): a graph would freeze
    the capture batch's, so a worker on that path runs eagerly."""
    from fluidserve.engine.cuda_graphs import graph_mode
    from fluidserve.kernels import ops

    class Capturing:  # what a CUDA runtime answers; graph_mode reads no more
        can_capture_graphs = True
        device = torch.device("cpu")

    assert graph_mode(False, Capturing(), 1) == "capture"
    with ops.reference_path():
        assert graph_mode(False, Capturing(), 1) is None
    assert graph_mode(True, Capturing(), 1) is None
