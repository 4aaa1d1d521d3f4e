"""--yield-busy-cores (engine/cpu_share.py): a CPU step computes on fewer
threads while this process's threads wait for cores other work holds (the
kernel's per-thread run-queue delay), and on all of them again once the
neighbour leaves or a probe finds the cores free."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.async_engine import AsyncEngine, EngineThread
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.cpu_share import (HOLD_S, LEFT_FROM, SETTLE, WAIT_FROM, WINDOW_S, CpuSample, CpuShare,
                                         ThreadWaits, read_sample)

linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")


class Watch:
    """CpuSamples for a CpuShare: each ``window(...)`` is WINDOW_S of wall
    time in which other processes kept ``others`` cores busy, this process
    ``ours`` cores, and its threads waited ``waiting`` cores' worth."""

    def __init__(self, ceiling: int = 2) -> None:
        self.at = self.busy = self.ours = self.waited = 0.0
        self.set_to: list[int] = []
        self.set_at: list[float] = []  # when each change was made
        self.share = CpuShare(ceiling, self.set_threads, self.sample)

    def set_threads(self, n: int) -> None:
        self.set_to.append(n)
        self.set_at.append(self.at)

    def sample(self) -> CpuSample:
        return CpuSample(self.at, self.busy, self.ours, self.waited)

    def window(self, others: float = 0.0, ours: float = 2.0, waiting: float = 0.0, seconds: float = WINDOW_S) -> int:
        self.at += seconds
        self.busy += (others + ours) * seconds
        self.ours += ours * seconds
        self.waited += waiting * seconds
        return self.share.tick()

    def windows(self, n: int, **load: float) -> list[int]:
        return [self.window(**load) for _ in range(n)]


def test_a_waiting_team_loses_a_thread_and_gets_it_back_when_the_neighbour_leaves():
    w = Watch()
    assert w.windows(10, others=0.1, waiting=0.10) == [2] * 10  # a client streaming: its waits stay under the line
    assert w.window(others=0.8, ours=1.2, waiting=0.7) == 1  # a neighbour holds a core: the team stood waiting
    # Beside the smaller team it is seen whole, and nothing waits.
    assert w.windows(3, others=1.0, ours=1.0) == [1] * 3
    assert w.window(others=0.0, ours=1.0) == 2  # it left: its load halved, before any probe was due
    assert w.set_to == [1, 2]  # torch told only on a change
    assert w.share.changes == 2


def test_one_windows_blip_moves_no_thread():
    w = Watch()
    assert w.windows(4, waiting=0.05) == [2] * 4
    assert w.window(waiting=0.5) == 2  # averaged with the quiet windows before it: under the line
    assert w.windows(4, waiting=0.05) == [2] * 4
    assert w.windows(2, waiting=WAIT_FROM + 0.1) == [2, 1]  # two in a row well over it are not a blip
    assert w.share.changes == 1


BESIDE_TWO = dict(others=0.8, ours=1.2, waiting=0.7)  # a neighbour holding a core beside a team of two
BESIDE_ONE = dict(others=1.0, ours=1.0)  # the same beside one thread: seen whole, nothing waits


def test_a_probe_that_meets_the_neighbour_waits_twice_as_long_for_the_next():
    w = Watch()
    assert w.windows(SETTLE, **BESIDE_TWO)[-1] == 1
    on_two = []
    for n in range(400):  # 80 s beside a neighbour that never leaves
        if w.window(**(BESIDE_TWO if w.share.threads == 2 else BESIDE_ONE)) == 2:
            on_two.append(n)
    probes = [n for n in on_two if n - 1 not in on_two]
    assert len(on_two) == len(probes) == 5  # a probe is judged on its first window
    holds = [min(HOLD_S[0] * 2 ** k, HOLD_S[1]) for k in range(1, 5)]
    assert holds[-1] == HOLD_S[1]  # doubled to the cap
    gaps = [(b - a) * WINDOW_S for a, b in zip(probes, probes[1:])]
    assert gaps == pytest.approx([WINDOW_S + h for h in holds], abs=WINDOW_S + 0.01)


def test_no_probe_while_no_step_runs():
    w = Watch()
    assert w.windows(SETTLE, **BESIDE_TWO)[-1] == 1
    assert w.windows(50, others=1.0, ours=0.1) == [1] * 50  # idle for 10 s: nothing to measure a probe by
    assert w.window(**BESIDE_ONE) == 2  # steps run: the probe, overdue, is taken


def test_waits_with_nobody_else_busy_come_back_only_by_probe():
    w = Watch()
    assert w.windows(SETTLE, others=0.0, ours=2.0, waiting=0.6)[-1] == 1  # this process's own threads
    # The load beside it is under LEFT_FROM: its halving is noise, not a neighbour leaving.
    looks = w.windows(3, others=LEFT_FROM / 2, ours=1.0) + w.windows(3, others=0.0, ours=1.0)
    assert looks == [1] * 6
    hold = int(HOLD_S[0] / WINDOW_S)
    assert 2 in w.windows(hold, others=0.0, ours=1.0)  # the probe, after HOLD_S[0]


def test_a_probe_that_finds_the_cores_free_resets_the_hold():
    w = Watch()

    def hold() -> float:  # from the last drop to the probe that follows
        while w.window(**BESIDE_ONE) == 1:
            pass
        return w.set_at[-1] - w.set_at[-2]

    assert w.windows(SETTLE, **BESIDE_TWO)[-1] == 1
    first = hold()
    assert first == pytest.approx(HOLD_S[0], abs=WINDOW_S + 0.01)
    assert w.windows(SETTLE, **BESIDE_TWO)[-1] == 1  # the neighbour is still there
    assert hold() == pytest.approx(2 * first, abs=WINDOW_S + 0.01)
    assert w.windows(4, others=0.0, ours=2.0) == [2] * 4  # it had left: the probe found the cores free
    assert w.windows(SETTLE, **BESIDE_TWO)[-1] == 1  # a new neighbour
    assert hold() == pytest.approx(first, abs=WINDOW_S + 0.01)  # back to HOLD_S[0]


def test_no_look_inside_a_window():
    looks = 0

    def sample() -> CpuSample:
        nonlocal looks
        looks += 1
        return CpuSample(time.monotonic(), 0.0, 0.0, 0.0)

    share = CpuShare(2, lambda n: None, sample)
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
    # Each thread's time on a CPU, time runnable but waiting (ns), and slices run.
    for tid, stat in ((4242, "900000000 250000000 77\n"), (4243, "5 1500000 3\n")):
        (tmp_path / "self" / "task" / str(tid)).mkdir(parents=True)
        (tmp_path / "self" / "task" / str(tid) / "schedstat").write_text(stat)
    (tmp_path / "self" / "task" / "4244").mkdir()  # a thread that ended between the listing and the read
    waits = ThreadWaits(tmp_path / "self")
    s = read_sample(frozenset({0, 1}), waits, tmp_path)
    # idle, iowait and stolen time are not busy; cpu2 is not watched.
    assert s.busy_s == pytest.approx((100 + 10 + 20 + 3 + 2 + 200 + 30) * tick)
    assert s.ours_s == pytest.approx((40 + 9) * tick)
    assert s.waited_s == pytest.approx(0.2515)
    (tmp_path / "self" / "task" / "4243" / "schedstat").write_text("9 2500000 4\n")  # read again, kept open
    shutil.rmtree(tmp_path / "self" / "task" / "4242")  # ended: its count goes with it
    assert waits.read() == pytest.approx(0.0025)
    assert list(waits._fds) == ["4243"]
    waits.close()


@linux_proc
def test_a_thread_that_waits_for_a_core_is_counted():
    """The real counter: a thread kept off the CPU it is pinned to by a
    process spinning there waits for most of the time both want it."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    cpu = min(os.sched_getaffinity(0))
    pinned_spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", pinned_spin])
    waited = []

    def pinned_work() -> None:
        os.sched_setaffinity(0, {cpu})
        waits = ThreadWaits()
        before, t0 = waits.read(), time.monotonic()
        while time.monotonic() < t0 + 0.5:
            pass
        waited.append((waits.read() - before) / (time.monotonic() - t0))
        waits.close()

    try:
        time.sleep(0.2)
        worker = threading.Thread(target=pinned_work)
        worker.start()
        worker.join()
    finally:
        spinner.kill()
        spinner.wait()
    # A fair share of one core between two: about half the time waiting.
    assert waited[0] > 0.2


@linux_proc
def test_a_real_neighbour_takes_a_thread_from_the_engine():
    """A tiny model's engine with --yield-busy-cores, stepped beside a
    process spinning on each core: its steps compute on fewer threads, the
    tokens stay the greedy ones, and the count is in its stats."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    spinners = cpus  # every core shared: the team waits whether its idle threads spin or sleep
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
def test_an_idle_server_engine_keeps_the_smaller_team_and_grows_back_when_the_neighbour_leaves():
    """The server's loop looks at the cores while no request runs too: a
    team made smaller by a neighbour stays so while idle beside it (no
    probe without steps), and grows back once the neighbour leaves, before
    the next request's first step."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    spinners = cpus  # every core shared: the team waits whether its idle threads spin or sleep
    if threads < 2 or spinners > 4:
        pytest.skip(f"{threads} torch threads on {cpus} CPUs")
    host = EngineThread()
    engine = host.build(LLMEngine, EngineConfig.create(device="cpu", yield_busy_cores=True))
    front = AsyncEngine(engine, thread=host)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def threads_now() -> int:  # as /metrics reads it, through the engine's thread
        return (await front.get_stats()).cpu_threads

    async def watch() -> tuple[int, int, int]:
        front.start()
        try:
            procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
            try:
                deadline = time.monotonic() + 100 * WINDOW_S
                n = 0
                while await threads_now() in (0, threads) and time.monotonic() < deadline:
                    n += 1
                    async for _ in await front.add_request(f"r{n}", "a busy machine", params):
                        pass
                busy = await threads_now()
                await asyncio.sleep(HOLD_S[0] + 5 * WINDOW_S)  # past the hold: a probe would have come
                idle_beside = await threads_now()
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            deadline = time.monotonic() + 40 * WINDOW_S
            while await threads_now() != threads and time.monotonic() < deadline:
                await asyncio.sleep(WINDOW_S / 2)
            return busy, idle_beside, await threads_now()
        finally:
            await front.shutdown()

    try:
        busy, idle_beside, quiet = asyncio.run(watch())
        assert 1 <= busy < threads and idle_beside == busy and quiet == threads
    finally:
        torch.set_num_threads(threads)


def test_llm_leaves_torch_threads_alone_by_default():
    llm = LLM(None, device="cpu")
    llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.engine._cpu_share is None and llm.engine.stats().cpu_threads == 0
