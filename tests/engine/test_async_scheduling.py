"""Async scheduling (``--async-scheduling``): a decode-only step is queued
before the previous step's tokens are read, its input ids fed on the device.

On CPU nothing overlaps (the forward runs as it is issued), but every piece
of the pipeline runs: the scheduler's blind continuation, the fed input rows
(eager and through the decode buckets), the tokens read a step late, the
token a sequence that stopped on its last read runs and drops. The
end-to-end tests run on CUDA too (marked gpu), where the queued step does
overlap the read. Each test compares with synchronous steps token for
token; ``make_llm`` checks at teardown that every KV block came back."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams
from fluidserve.kvcache.config import CacheConfig
from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.plan import StepOutcome
from fluidserve.scheduler.request_state import SeqState
from fluidserve.scheduler.scheduler import Scheduler

PROMPTS = ["Hello there", "The quick brown fox jumps over", "a", "Long prompt " * 6, "xyz", "one two three"]
KWARGS = dict(num_kv_blocks=96, block_size=8, max_model_len=256)
# On CUDA the queued step really runs while the host reads the last one's
# tokens: the Triton kernels, captured decode graphs, the copy stream.
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def run(make_llm, path, prompts, params, async_scheduling: bool, graphs: bool = False, device: str = "cpu"):
    if device == "cuda":  # graphs captured as the engine does by default
        llm = make_llm(path, async_scheduling=async_scheduling, device=device, enforce_eager=not graphs, **KWARGS)
    else:
        llm = make_llm(path, async_scheduling=async_scheduling, **KWARGS)
    if graphs and device == "cpu":  # the decode buckets, run eagerly over their static buffers
        worker = llm.engine.executor.worker
        worker.graphs = worker.decode_graphs(capture=False)
    outs = llm.generate(prompts, params)
    return outs, llm.engine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
def test_greedy_tokens_equal_synchronous_steps(tiny_model, make_llm, graphs, device):
    """Lengths from 3 to 40 tokens, n=2, and stop tokens taken from the
    synchronous run's own outputs, so some sequences stop on a token only
    the read reveals (their extra token in the step already queued is
    dropped): every token and finish reason equals synchronous steps'."""
    path = tiny_model("llama")
    lengths = [3, 40, 17, 25, 9, 31]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, n=2 if i == 1 else 1)
              for i, n in enumerate(lengths)]
    sync, _ = run(make_llm, path, PROMPTS, params, False, device=device)
    # A token from the middle of two outputs stops those sequences there.
    for i in (3, 5):
        out = sync[i].outputs[0].token_ids
        params[i] = SamplingParams(temperature=0, max_tokens=lengths[i], stop_token_ids=[out[len(out) // 2]])
    sync, _ = run(make_llm, path, PROMPTS, params, False, graphs, device)
    ahead, engine = run(make_llm, path, PROMPTS, params, True, graphs, device)
    assert tokens(ahead) == tokens(sync)
    assert [[c.finish_reason for c in o.outputs] for o in ahead] == [[c.finish_reason for c in o.outputs]
                                                                     for o in sync]
    assert any(o.outputs[0].finish_reason == "stop" for o in ahead)
    assert engine.stats().num_steps_launched_ahead >= 30  # most decode steps were queued ahead
    if graphs:
        assert engine.executor.worker.graphs.replays  # the fed rows went through the buckets


@pytest.mark.parametrize("device", DEVICES)
def test_arrivals_and_aborts_between_steps(tiny_model, make_llm, device):
    """Requests arriving mid-decode (the continuation stops so they are
    planned), one aborted while a step it is in is queued: the same tokens
    per request as synchronous steps, nothing for the aborted one after its
    abort, and every block back (make_llm)."""
    path = tiny_model("llama")
    lengths = [12, 30, 5, 22, 17]

    def drive(async_scheduling: bool):
        llm = make_llm(path, async_scheduling=async_scheduling, device=device, **KWARGS)
        engine, done, after_abort = llm.engine, {}, []
        for step in range(300):
            if step < len(lengths) * 4 and step % 4 == 0:
                i = step // 4
                engine.add_request(str(i), PROMPTS[i], SamplingParams(temperature=0, max_tokens=lengths[i],
                                                                      ignore_eos=True))
            if step == 10:
                engine.abort("1")
            for out in engine.step():
                if step >= 10 and out.request_id == "1":
                    after_abort.append(out)
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests() and step > len(lengths) * 4:
                break
        return done, after_abort, engine

    sync, _, _ = drive(False)
    ahead, after_abort, engine = drive(True)
    assert ahead == sync and "1" not in ahead
    assert after_abort == []
    assert engine.stats().num_steps_launched_ahead > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_gives_synchronous_tokens(tiny_model, make_llm, seed, device):
    """Random arrivals, lengths, stop tokens, n=2 and aborts, step by step:
    every request that was not aborted ends with the tokens synchronous
    steps give it, and an aborted one yields nothing after its abort."""
    import random

    path = tiny_model("llama")
    rng = random.Random(seed)
    plan = []  # per step: (arrivals, aborts)
    names = []
    for step in range(40):
        arrivals = []
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            name = f"r{len(names)}"
            names.append(name)
            prompt = [rng.randrange(1, 250) for _ in range(rng.randint(1, 30))]
            stop = [rng.randrange(1, 250) for _ in range(rng.randint(0, 3))]
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), stop_token_ids=stop,
                                    n=rng.choice([1, 1, 2]))
            arrivals.append((name, prompt, params))
        aborts = [rng.choice(names)] if names and rng.random() < 0.1 else []
        plan.append((arrivals, aborts))

    def drive(async_scheduling: bool):
        llm = make_llm(path, async_scheduling=async_scheduling, device=device, **KWARGS)
        engine, done, aborted, late = llm.engine, {}, set(), []
        for step in range(400):
            arrivals, aborts = plan[step] if step < len(plan) else ([], [])
            for name, prompt, params in arrivals:
                engine.add_request(name, prompt, params)
            for name in aborts:
                engine.abort(name)
                aborted.add(name)
            for out in engine.step():
                if out.request_id in aborted:
                    late.append(out.request_id)
                if out.finished:
                    done[out.request_id] = [c.token_ids for c in out.outputs]
            if step >= len(plan) and not engine.has_unfinished_requests():
                break
        return {k: v for k, v in done.items() if k not in aborted}, late, engine

    sync, _, _ = drive(False)
    ahead, late, engine = drive(True)
    assert ahead == sync and late == []
    assert engine.kv.num_used_blocks == 0 and engine.stats().num_steps_launched_ahead > 0


@pytest.mark.parametrize("device", DEVICES)
def test_launched_steps_among_swaps_keep_the_copy_order(tiny_model, make_llm, device):
    """A device pool too small for the running set: requests swap out and
    back between launched decode steps. Every step, launched ones too,
    passes through the cache engine first (where the forward waits for the
    last step's copies, whose freed blocks it may write), and the tokens are
    the synchronous steps'."""
    path = tiny_model("llama")
    # FCFS and swaps on demand: MLFQ's demotions and proactive moves follow
    # measured step times, and on a slow run they can put copies in every
    # step, leaving none for a continuation to launch.
    pool = dict(num_kv_blocks=10, block_size=8, max_model_len=64, num_host_blocks=64,
                scheduling_policy="fcfs", proactive_swap=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [p[:20] for p in PROMPTS] * 2

    def run(async_scheduling: bool):
        llm = make_llm(path, async_scheduling=async_scheduling, device=device, **pool)
        worker = llm.engine.executor.worker
        calls = {"swap": 0, "step": 0}
        swap, execute, launch = worker.cache.swap, worker.execute, worker.launch

        def counted(fn, key):
            def wrapper(*args, **kwargs):
                calls[key] += 1
                return fn(*args, **kwargs)
            return wrapper

        worker.cache.swap = counted(swap, "swap")
        worker.execute, worker.launch = counted(execute, "step"), counted(launch, "step")
        outs = llm.generate(prompts, params)
        return tokens(outs), calls, llm.engine.stats()

    sync, _, _ = run(False)
    ahead, calls, stats = run(True)
    assert ahead == sync
    assert stats.num_swaps > 0 and stats.num_steps_launched_ahead > 0
    assert calls["swap"] == calls["step"]


def test_only_plain_rows_are_launched(tiny_model, make_llm):
    """Rows whose token needs the host (a seed, logprobs, a penalty) run
    synchronously; plain random draws are launched."""
    path = tiny_model("llama")
    plain = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs, engine = run(make_llm, path, PROMPTS[:3], plain, True)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert engine.stats().num_steps_launched_ahead > 0
    for params in (SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0, logprobs=2, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True)):
        sync, _ = run(make_llm, path, PROMPTS[:3], params, False)
        outs, engine = run(make_llm, path, PROMPTS[:3], params, True)
        assert engine.stats().num_steps_launched_ahead == 0
        assert tokens(outs) == tokens(sync)


@pytest.mark.parametrize("device", DEVICES)
def test_on_by_default_with_cuda_and_off_on_the_cpu(tiny_model, make_llm, device):
    """Left unset, async scheduling follows the device: on with CUDA (where
    the host's work per step is what batch-1 decode waits on), off on the
    CPU (where nothing overlaps); either way a flag overrides it."""
    path = tiny_model("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make_llm(path, device=device, **KWARGS)
    assert llm.engine.config.async_scheduling is None
    llm.generate(PROMPTS[:2], params)
    assert (llm.engine.stats().num_steps_launched_ahead > 0) == (device == "cuda")
    flipped = make_llm(path, device=device, async_scheduling=device != "cuda", **KWARGS)
    flipped.generate(PROMPTS[:2], params)
    assert (flipped.engine.stats().num_steps_launched_ahead > 0) == (device != "cuda")


# -- the scheduler's blind continuation ---------------------------------------------


def decoding_scheduler(num_blocks: int, prompts: list[int], block_size: int = 4):
    config = SchedulerConfig(scheduling_policy="fcfs", kv_watermark=0.0)
    sched = Scheduler.create(config, CacheConfig(block_size=block_size), num_blocks)
    for i, n in enumerate(prompts):
        sched.add(SeqState(f"r{i}", n, 100, 0.0), 0.0)
    plan = sched.schedule(0.0)  # the prompts
    sched.update_from_output(plan, StepOutcome(0.01, 0.0))
    return sched, sched.schedule(0.1)  # their first decode, not yet read


def test_continuation_allocates_the_block_the_token_after_needs():
    """Prompts of 3 and 6 tokens, blocks of 4: the decode in flight writes
    positions 3 and 6; the one after it writes 4 and 7, and the first needs
    a new block, allocated now."""
    sched, plan = decoding_scheduler(16, [3, 6])
    assert [(s.request_id, s.num_tokens) for s in plan.scheduled] == [("r0", 1), ("r1", 1)]
    before = len(sched.kv.block_tables["r0"]), len(sched.kv.block_tables["r1"])
    nxt = sched.continue_decodes(plan, ["r0", "r1"])
    assert [(s.request_id, s.num_tokens, s.samples) for s in nxt.scheduled] == [("r0", 1, True), ("r1", 1, True)]
    assert (len(sched.kv.block_tables["r0"]), len(sched.kv.block_tables["r1"])) == (before[0] + 1, before[1])
    sched.update_from_output(plan, StepOutcome(0.01, 0.1))
    sched.update_from_output(nxt, StepOutcome(0.01, 0.11))
    assert [sched.seqs[r].num_computed_tokens for r in ("r0", "r1")] == [5, 8]


def test_continuation_leaves_the_step_to_schedule_when_anything_else_waits():
    sched, plan = decoding_scheduler(16, [3, 6])
    sched.add(SeqState("late", 5, 10, 0.1), 0.1)  # an arrival must be planned by schedule
    assert sched.continue_decodes(plan, ["r0", "r1"]) is None
    sched, plan = decoding_scheduler(16, [3, 6])
    assert sched.continue_decodes(plan, []) is None
    # The token after needs a block and none is free.
    sched, plan = decoding_scheduler(3, [3, 6])
    free = sched.kv.num_free_blocks
    assert free == 0 and sched.continue_decodes(plan, ["r0", "r1"]) is None
    assert sched.kv.num_free_blocks == free  # nothing was allocated on the way


def test_continuation_cost_benchmark_plans_every_request():
    """benchmarks/continuation_cost.py times both planners on a state where
    the blind plan is taken for every request (it raises otherwise)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from continuation_cost import measure

    row = measure(16, 3)
    assert row["requests"] == 16 and row["schedule_ms"] > 0 and row["continue_decodes_ms"] > 0
