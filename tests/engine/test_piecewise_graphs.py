"""Piecewise graphs (engine/piecewise.py): the steps decode graphs do not
take, padded to a token bucket, attention eager between graphed pieces.

On CPU the pieces run eagerly over their static buffers (``capture=False``):
the same pad-run-slice path the graphs replay, checked token for token and
cache byte for byte against the plain eager path. The test marked ``gpu``
captures real graphs."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.engine.batch import ModelInput
from fluidserve.engine.piecewise import DEFAULT_TOKEN_SIZES, PiecewiseGraphs, supports, token_sizes
from padded_rows import assert_as_eager, max_padded_diff

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog " * 3, "a", "Long prompt " * 9, "xyz"]


def test_token_sizes_follow_the_budget():
    assert token_sizes(2048) == DEFAULT_TOKEN_SIZES
    assert token_sizes(100) == (16, 32, 48, 64, 96)
    assert token_sizes(8) == (8,)


def run(make_llm, path, prompts, piecewise: bool, decode_graphs: bool = False, **kwargs):
    """Greedy outputs and the worker, the prompts chunked over several steps."""
    llm = make_llm(path, **dict(dict(num_kv_blocks=96, block_size=8, max_model_len=256,
                                     max_num_batched_tokens=40), **kwargs))
    worker = llm.engine.executor.worker
    if decode_graphs:
        worker.graphs = worker.decode_graphs(capture=False)
    if piecewise:
        worker.piecewise = worker.piecewise_graphs(capture=False)
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], worker


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3"])
def test_piecewise_tokens_and_cache_equal_eager(tiny_model, make_llm, arch):
    """Prefill chunks beside decodes and decode steps, in buckets of 16 to
    32 tokens (budget 40: a full step is eager): the greedy tokens and the
    whole KV cache afterwards are the eager path's (bit for bit where the
    CPU linear allows: tests/padded_rows.py), so padding rows wrote nothing
    and every piece met its attention in order."""
    path = tiny_model(arch)
    eager, w_eager = run(make_llm, path, PROMPTS, piecewise=False)
    pieces, w_piece = run(make_llm, path, PROMPTS, piecewise=True)
    assert pieces == eager
    replays = w_piece.piecewise.replays
    assert set(replays) == {16, 32} and sum(replays.values()) >= 10
    assert w_piece.piecewise.fallbacks.get("larger than the largest bucket", 0) >= 1  # full 40-token steps
    for (k1, v1), (k2, v2) in zip(w_eager.kv_caches, w_piece.kv_caches):
        assert_as_eager(k2, k1)
        assert_as_eager(v2, v1)


def test_piecewise_takes_what_decode_graphs_leave(tiny_model, make_llm):
    """With decode graphs too, decode-only steps replay those and the mixed
    steps and prefills come here."""
    path = tiny_model("llama")
    eager, _ = run(make_llm, path, PROMPTS[:3], piecewise=False, max_num_batched_tokens=64)
    both, worker = run(make_llm, path, PROMPTS[:3], piecewise=True, decode_graphs=True, max_num_batched_tokens=64)
    assert both == eager
    assert sum(worker.graphs.replays.values()) >= 5  # the decode steps
    assert sum(worker.piecewise.replays.values()) >= 2  # the prefill chunks
    assert "not decode-only" in worker.graphs.fallbacks


def test_the_capture_path_over_the_cpu_stand_in(tiny_model, make_llm):
    """The capture loop both kinds of graph share (``capture_largest_first``)
    over the CPU runtime, whose capture records nothing and replays the run
    itself: the pieces it leaves give eager's tokens. (The decode buckets'
    turn is on the Triton lane, test_gpu_path_on_cpu.py: the CPU kernels
    read host lengths a captured bucket cannot hold.)"""
    path = tiny_model("llama")
    eager, _ = run(make_llm, path, PROMPTS[:3], piecewise=False, max_num_batched_tokens=64)
    llm = make_llm(path, num_kv_blocks=96, block_size=8, max_model_len=256, max_num_batched_tokens=64)
    worker = llm.engine.executor.worker
    worker.piecewise = worker.piecewise_graphs(capture=False)
    worker.piecewise._pieces.clear()
    worker.piecewise._capture_all()  # what capture=True runs on CUDA
    assert sorted(worker.piecewise._pieces) == list(worker.piecewise.sizes)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == eager
    assert sum(worker.piecewise.replays.values()) >= 10


def test_ineligible_steps_and_families(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), num_kv_blocks=96, block_size=8, max_model_len=256,
                   max_num_batched_tokens=40)
    worker = llm.engine.executor.worker
    graphs = worker.piecewise_graphs(capture=False)
    step = ModelInput(input_ids=[1, 2, 3], positions=[0, 1, 2], slot_mapping=[8, 9, 10], query_start_loc=[0, 3],
                      seq_lens=[3], block_tables=[[1]], sample_indices=[2])
    assert graphs.ineligible(step) is None
    step.preemptible = True  # its safepoints sit between layers
    assert graphs.ineligible(step) == "preemptible"
    assert graphs.ineligible(ModelInput()) == "no tokens"
    big = ModelInput(input_ids=[1] * 33, positions=list(range(33)), slot_mapping=list(range(8, 41)),
                     query_start_loc=[0, 33], seq_lens=[33], block_tables=[[1, 2, 3, 4, 5]], sample_indices=[32])
    assert graphs.ineligible(big) == "larger than the largest bucket"
    opt = make_llm(tiny_model("opt"), num_kv_blocks=96, block_size=8, max_model_len=256)
    opt_worker = opt.engine.executor.worker
    assert not supports(opt_worker.model)
    with pytest.raises(ValueError, match="pieces"):
        PiecewiseGraphs(opt_worker.model, opt_worker.runner, opt_worker.device, opt_worker.kv_caches, (16,),
                        capture=False)


def test_the_flag_needs_decode_graphs_and_a_llama(tiny_model, make_llm, caplog):
    """On the CPU kernels (no decode graphs) or for OPT the flag warns and
    every step runs eagerly."""
    for arch in ("llama", "opt"):
        with caplog.at_level("WARNING"):
            llm = make_llm(tiny_model(arch), num_kv_blocks=96, block_size=8, max_model_len=256,
                           piecewise_graphs=True)
        assert llm.engine.executor.worker.piecewise is None
        assert "--piecewise-graphs needs decode graphs" in caplog.text
        caplog.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_pieces_give_eager_tokens(tiny_model, make_llm):
    """Real graphs, captured at start-up beside the decode graphs: the
    greedy tokens of prefill chunks and mixed steps replayed piecewise are
    the eager path's. Budget 32, the largest bucket: decode graphs take the
    decode-only steps, and every other step fits a bucket (on the CPU over
    the static buffers, 9 steps replay and none falls back)."""
    path = tiny_model("llama")
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=96, block_size=8, max_model_len=256,
                  max_num_batched_tokens=32, async_scheduling=False)
    eager_llm = make_llm(path, enforce_eager=True, **kwargs)
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(PROMPTS, GREEDY)]
    llm = make_llm(path, enforce_eager=False, piecewise_graphs=True, **kwargs)
    worker = llm.engine.executor.worker
    assert worker.piecewise is not None and worker.graphs is not None
    captured = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert captured == eager
    assert sum(worker.piecewise.replays.values()) >= 5 and not worker.piecewise.fallbacks


def test_mixed_steps_benchmark_runs_and_reports(tmp_path):
    """benchmarks/mixed_steps.py, gpu_check.sh's mixed-steps step, on the
    CPU: every shape runs every path to the same hidden states, and the
    GPU check's summary reads the record."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "mixed_steps.py"), "--device", "cpu",
                           "--preset", "tiny", "--reps", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (record_path,) = tmp_path.glob("mixed_steps_*.json")
    record = json.loads(record_path.read_text())
    assert len(record["rows"]) == 7 and all(r["max_abs_diff"] <= max_padded_diff() for r in record["rows"])
    assert all(r["modules_abs_diff"] == 0 for r in record["rows"])  # the same step through the modules
    assert sum(record["piecewise_replays"].values()) >= 7 * 5  # warm-ups, timed runs and the check
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from gpu_check_report import reader_for
    finally:
        sys.path.pop(0)
    text, figures = reader_for(record_path)(record)
    assert "448+64: eager" in text and "eager_over_piecewise_448_64" in figures
    assert "x eager" in text and "modules_over_eager_448_64" in figures


def test_async_fed_rows_through_the_pieces(tiny_model, make_llm):
    """With async scheduling the queued decode steps' input ids are fed on
    the device from the last step's tokens; without decode graphs those
    steps come here, and the fed ids must reach the static buffers: tokens
    equal synchronous eager steps'."""
    path = tiny_model("llama")
    kwargs = dict(num_kv_blocks=96, block_size=8, max_model_len=256)
    sync = make_llm(path, async_scheduling=False, **kwargs).generate(PROMPTS, GREEDY)
    llm = make_llm(path, async_scheduling=True, **kwargs)
    worker = llm.engine.executor.worker
    worker.piecewise = worker.piecewise_graphs(capture=False)
    ahead = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in ahead] == [o.outputs[0].token_ids for o in sync]
    assert llm.engine.stats().num_steps_launched_ahead >= 5
    assert sum(worker.piecewise.replays.values()) >= 10
