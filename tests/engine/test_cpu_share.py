"""--yield-busy-cores (engine/cpu_share.py): a CPU step computes on the cores
other processes leave free, read from /proc, and on all its threads again
once they go quiet."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
import torch

from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.async_engine import AsyncEngine, EngineThread
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.cpu_share import WINDOW_S, CpuSample, CpuShare, read_sample, threads_left

linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")


@pytest.mark.parametrize("cpus, others, ceiling, want", [
    (2, 0.0, 2, 2),
    (2, 0.5, 2, 2),  # a neighbour that often sleeps: its core's thread still gets much of it
    (2, 0.65, 2, 1),  # a spinner's fair share beside two busy threads
    (2, 5.0, 2, 1),  # never fewer than one
    (4, 1.0, 4, 3),
    (4, 1.9, 4, 2),
    (16, 3.0, 8, 8),  # never more than torch started with: 13 free cores
    (8, 6.5, 8, 2),
    (8, 6.7, 8, 1),
])
def test_threads_are_the_free_cores(cpus, others, ceiling, want):
    assert threads_left(cpus, others, ceiling) == want


def test_the_team_shrinks_while_a_neighbour_is_busy_and_grows_back():
    # (wall s, busy CPU s of the watched cores, this process's CPU s), one per look.
    looks = iter([(0.0, 0.0, 0.0), (1.0, 1.7, 1.0), (2.0, 2.7, 2.0), (3.0, 4.4, 3.0), (4.0, 6.4, 4.0),
                  (5.0, 7.7, 5.0)])
    set_to: list[int] = []
    share = CpuShare(2, frozenset({0, 1}), set_to.append, lambda: CpuSample(*next(looks)))
    assert share.tick() == 2  # others 0.7 for one window: a blip, averaged to 0.53
    assert share.tick() == 2  # others 0.0
    assert share.tick() == 2  # a spinner's share beside two threads, 0.7: averaged 0.56
    assert share.tick() == 1  # all of a core: 0.89, one thread
    assert share.tick() == 2  # it stopped, 0.3 left: both again
    assert set_to == [1, 2]  # torch told only on a change


def test_no_look_inside_a_window():
    looks = 0

    def sample() -> CpuSample:
        nonlocal looks
        looks += 1
        return CpuSample(time.monotonic(), 0.0, 0.0)

    share = CpuShare(2, frozenset({0, 1}), lambda n: None, sample)
    for _ in range(100):
        share.tick()
    assert looks == 1  # the first, at construction: steps microseconds apart read /proc once a window


def test_proc_is_read_for_the_watched_cpus_only(tmp_path):
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    (tmp_path / "self").mkdir()
    # user nice system idle iowait irq softirq steal guest guest_nice
    (tmp_path / "stat").write_text(
        "cpu  999 0 999 999 0 0 0 0 0 0\n"
        "cpu0 100 10 20 5000 70 3 2 50 0 0\n"
        "cpu1 200 0 30 5000 0 0 0 0 0 0\n"
        "cpu2 400 0 0 5000 0 0 0 0 0 0\n"
        "intr 12345\nctxt 678\n")
    # A name with spaces and a parenthesis: fields count from the last ')'.
    (tmp_path / "self" / "stat").write_text("4242 (py (x) y) R 1 4242 4242 0 -1 4194304 100 0 0 0 "
                                            "40 9 0 0 20 0 3 0 100 1000 100\n")
    s = read_sample(frozenset({0, 1}), tmp_path)
    # idle, iowait and stolen time are not busy; cpu2 is not watched.
    assert s.busy_s == pytest.approx((100 + 10 + 20 + 3 + 2 + 200 + 30) * tick)
    assert s.ours_s == pytest.approx((40 + 9) * tick)


@linux_proc
def test_a_real_neighbour_takes_a_thread_from_the_engine():
    """A tiny model's engine with --yield-busy-cores, stepped beside as many
    processes that spin as leave it one core fewer than its threads: its
    steps compute on fewer threads, the tokens stay the greedy ones, and
    the count is in its stats."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    spinners = cpus - threads + 1
    if threads < 2 or spinners > 4:
        pytest.skip(f"{threads} torch threads on {cpus} CPUs")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(None, device="cpu", yield_busy_cores=True, seed=0)
    try:
        alone = llm.generate("a quiet machine", params)[0].outputs[0].token_ids
        assert llm.engine.stats().cpu_threads == threads
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
        try:
            deadline = time.monotonic() + 40 * WINDOW_S  # the load is averaged over windows: a few steps
            while llm.engine.stats().cpu_threads == threads and time.monotonic() < deadline:
                beside = llm.generate("a quiet machine", params)[0].outputs[0].token_ids
                time.sleep(WINDOW_S / 2)
            assert llm.engine.stats().cpu_threads < threads
            beside = llm.generate("a quiet machine", params)[0].outputs[0].token_ids
        finally:
            for p in procs:
                p.kill()
                p.wait()
        assert llm.engine.stats().num_cpu_thread_changes >= 1
        assert beside == alone
    finally:
        torch.set_num_threads(threads)


@linux_proc
def test_an_idle_server_engine_follows_the_load_between_requests():
    """The server's loop looks at the cores while no request runs too, so
    the first step of the next one computes on the cores free around it."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    spinners = cpus - threads + 1
    if threads < 2 or spinners > 4:
        pytest.skip(f"{threads} torch threads on {cpus} CPUs")
    host = EngineThread()
    engine = host.build(LLMEngine, EngineConfig.create(device="cpu", yield_busy_cores=True))
    front = AsyncEngine(engine, thread=host)

    async def threads_now() -> int:  # as /metrics reads it, through the engine's thread
        return (await front.get_stats()).cpu_threads

    async def watch() -> tuple[int, int]:
        front.start()
        try:
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
            try:
                deadline = time.monotonic() + 40 * WINDOW_S
                while await threads_now() in (0, threads) and time.monotonic() < deadline:
                    await asyncio.sleep(WINDOW_S / 2)
                busy = await threads_now()
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            deadline = time.monotonic() + 40 * WINDOW_S
            while await threads_now() != threads and time.monotonic() < deadline:
                await asyncio.sleep(WINDOW_S / 2)
            return busy, await threads_now()
        finally:
            await front.shutdown()

    try:
        busy, quiet = asyncio.run(watch())
        assert engine.stats_.num_steps == 0  # no request ran
        assert 1 <= busy < threads and quiet == threads
    finally:
        torch.set_num_threads(threads)


def test_llm_leaves_torch_threads_alone_by_default():
    llm = LLM(None, device="cpu")
    llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.engine._cpu_share is None and llm.engine.stats().cpu_threads == 0
