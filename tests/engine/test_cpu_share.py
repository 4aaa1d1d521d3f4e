"""--yield-busy-cores (engine/cpu_share.py): a CPU step computes on fewer
threads while this process's threads wait for cores other work holds (the
kernel's per-thread run-queue delay) and a trial of steps on both counts
finds the smaller team faster; on all of them again once the neighbour
leaves or a probe's trial finds the larger team faster."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from fluidserve.engine import LLM, SamplingParams
from fluidserve.engine.async_engine import AsyncEngine, EngineThread
from fluidserve.engine.config import EngineConfig
from fluidserve.engine.engine import LLMEngine
from fluidserve.engine.cpu_share import (FEWER_WINS, HOLD_S, LEFT_FROM, SETTLE, TRIAL_IDLE_S, TRIAL_MAX_STEPS,
                                         TRIAL_PAIRS, WAIT_FROM, WINDOW_S, CpuSample, CpuShare, ThreadWaits, _Trial,
                                         read_sample)

linux_proc = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux's /proc")


@dataclass(frozen=True)
class Beside:
    """What a load does to a team of each size: other processes' busy
    cores, this process's, its threads' waiting (cores' worth), and the
    seconds a step takes."""

    others: dict[int, float]
    ours: dict[int, float]
    waiting: dict[int, float]
    step_s: dict[int, float]


# SmolLM2-like decode steps on two cores (benchmarks/core_waits.md): alone,
# two threads beat one; beside a spinning process, one beats two by 3x.
ALONE = Beside({2: 0.0, 1: 0.0}, {2: 2.0, 1: 1.0}, {2: 0.02, 1: 0.0}, {2: 0.021, 1: 0.024})
SPINNER = Beside({2: 0.8, 1: 1.0}, {2: 1.2, 1: 1.0}, {2: 0.7, 1: 0.0}, {2: 0.070, 1: 0.022})
# A load generator on the same cores: its bursts make the team wait past
# WAIT_FROM, but a thread is worth more to the step than the waits cost.
CLIENT = Beside({2: 0.3, 1: 0.3}, {2: 1.7, 1: 1.0}, {2: 0.45, 1: 0.05}, {2: 0.025, 1: 0.034})
# The team's own threads waiting (nobody else busy), where one thread is faster.
OWN_WAITS = Beside({2: 0.0, 1: 0.0}, {2: 2.0, 1: 1.0}, {2: 0.6, 1: 0.0}, {2: 0.040, 1: 0.024})


class Watch:
    """A CpuShare on a clock of its own, fed CpuSamples of the load
    around it: ``steps`` runs the engine's steps (tick, step, step_done),
    ``idle`` ticks with no step."""

    def __init__(self, ceiling: int = 2) -> None:
        self.at = self.busy = self.ours = self.waited = 0.0
        self.set_to: list[int] = []
        self.set_at: list[float] = []  # when each set was made
        self.trial_at: list[float] = []  # when each trial began
        self.trial_step: list[int] = []  # and at which step (an index into ``on``)
        self.on: list[int] = []  # the team of each step run
        self.share = CpuShare(ceiling, self.set_threads, self.sample, clock=lambda: self.at)

    def set_threads(self, n: int) -> None:
        self.set_to.append(n)
        self.set_at.append(self.at)

    def sample(self) -> CpuSample:
        return CpuSample(self.at, self.busy, self.ours, self.waited)

    def _advance(self, seconds: float, others: float, ours: float, waiting: float) -> None:
        self.at += seconds
        self.busy += (others + ours) * seconds
        self.ours += ours * seconds
        self.waited += waiting * seconds

    def _tick(self) -> int:
        trials = self.share.trials
        threads = self.share.tick()
        if self.share.trials > trials:
            self.trial_at.append(self.at)
            self.trial_step.append(len(self.on))
        return threads

    def steps(self, load: Beside, seconds: float, tokens: int = 1) -> int:
        end = self.at + seconds
        while self.at < end:
            n = self._tick()
            self.on.append(n)
            self._advance(load.step_s[n], load.others[n], load.ours[n], load.waiting[n])
            self.share.step_done(tokens, load.step_s[n])
        return self.share.threads

    def idle(self, seconds: float, others: float = 0.0) -> int:
        end = self.at + seconds
        while self.at < end:
            self._advance(WINDOW_S / 4, others, 0.05, 0.0)
            self._tick()
        return self.share.threads


def test_a_team_that_steps_faster_on_fewer_threads_beside_a_neighbour_loses_one_until_it_leaves():
    w = Watch()
    assert w.steps(ALONE, 3.0) == 2 and w.share.trials == 0  # its own waits stay under the line
    assert w.steps(SPINNER, 1.0) == 1  # the team waited; a trial found one thread 3x faster
    assert w.share.trials == 1 and w.share.changes == 1
    assert w.on[-5:] == [1] * 5  # the trial over, every step on one thread
    assert w.steps(ALONE, 1.0) == 2  # it left: the load beside the team fell from 1.0 to 0, no probe needed
    assert w.share.changes == 2 and w.share.trials == 1


def test_bursts_of_waits_that_a_thread_is_worth_keep_it_and_are_tried_ever_more_rarely():
    assert CLIENT.waiting[2] > WAIT_FROM
    w = Watch()
    assert w.steps(CLIENT, 100.0) == 2
    assert w.share.changes == 0  # every trial found two threads faster
    gaps = [b - a for a, b in zip(w.trial_at, w.trial_at[1:])]
    # The waits come back at once; the next trial only after the hold, doubling to its cap.
    holds = [min(HOLD_S[0] * 2 ** k, HOLD_S[1]) for k in range(len(gaps))]
    assert len(w.trial_at) >= 4 and holds[-1] == HOLD_S[1]
    assert gaps == pytest.approx(holds, abs=SETTLE * WINDOW_S + 0.5)  # + settling windows and the trial's steps
    assert w.on.count(1) / len(w.on) < 0.02  # the trials' steps on one thread: a small share of the load


def test_a_new_neighbour_beside_a_load_whose_trials_kept_the_threads_is_tried_before_the_hold_ends():
    w = Watch()
    w.steps(CLIENT, 40.0)
    assert w.share.changes == 0 and w.share._drop_hold_s == HOLD_S[1]  # trials lost: the hold is long
    # A process spinning on a core joins the load generator: its load is new.
    both = Beside({2: CLIENT.others[2] + 0.8, 1: CLIENT.others[1] + 1.0}, SPINNER.ours, SPINNER.waiting,
                  SPINNER.step_s)
    assert w.steps(both, 2.0) == 1 and w.share.changes == 1
    assert w.trial_at[-1] - 40.0 < 1.0


def test_one_windows_blip_starts_no_trial():
    w = Watch()
    w.steps(ALONE, 1.0)
    blip = Beside(ALONE.others, ALONE.ours, {2: 0.5, 1: 0.0}, ALONE.step_s)
    w.steps(blip, WINDOW_S)  # averaged with the quiet windows before it: under the line
    assert w.steps(ALONE, 1.0) == 2 and w.share.trials == 0
    w.steps(SPINNER, SETTLE * WINDOW_S + 0.1)
    assert w.share.trials == 1  # a run of windows well over it


def test_a_probe_that_meets_the_neighbour_waits_twice_as_long_for_the_next():
    w = Watch()
    assert w.steps(SPINNER, 80.0) == 1
    probes = w.trial_at[1:]  # the first trial was the drop
    assert w.share.changes == 1 and len(probes) == 5
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    holds = [min(HOLD_S[0] * 2 ** k, HOLD_S[1]) for k in range(1, 5)]
    assert holds[-1] == HOLD_S[1]  # doubled to the cap
    assert gaps == pytest.approx(holds, abs=WINDOW_S + 0.5)  # + the trial's steps
    # Three clear pairs decide, the smaller team first: each trial ran two steps on two threads.
    assert w.on[w.trial_step[0]:].count(2) == 2 * (1 + len(probes))


def test_no_probe_while_no_step_runs():
    w = Watch()
    assert w.steps(SPINNER, 1.0) == 1
    assert w.idle(10.0, others=1.0) == 1 and w.share.trials == 1  # idle beside it: nothing to judge a probe by
    w.steps(SPINNER, 2 * WINDOW_S + 0.01)
    assert w.share.trials == 2  # steps run: the probe, overdue, begins once a window of them is seen
    assert w.steps(SPINNER, 1.0) == 1


def test_a_trial_the_engine_leaves_idle_ends_where_it_began():
    w = Watch()
    w.steps(SPINNER, SETTLE * WINDOW_S + 0.05)
    assert w.share.trials == 1 and w.share._trial is not None  # begun, undecided
    assert w.idle(TRIAL_IDLE_S + WINDOW_S, others=1.0) == 2
    assert w.share._trial is None and w.share.changes == 0


def test_waits_with_nobody_else_busy_come_back_only_by_a_probe_that_finds_two_threads_faster():
    w = Watch()
    assert w.steps(OWN_WAITS, 1.0) == 1
    # The load beside it is under LEFT_FROM: its halving is noise, not a neighbour leaving.
    assert OWN_WAITS.others[1] < LEFT_FROM
    first = w.trial_at[-1]
    assert w.steps(ALONE, HOLD_S[0] - 0.3) == 1 and len(w.trial_at) == 1
    assert w.steps(ALONE, 1.0) == 2  # the probe, after HOLD_S[0]: two threads are faster again
    assert w.trial_at[-1] - first == pytest.approx(HOLD_S[0], abs=0.5)
    # A new neighbour after that: the hold before its first probe is HOLD_S[0] again.
    assert w.steps(SPINNER, 1.0) == 1
    dropped = w.trial_at[-1]
    w.steps(SPINNER, HOLD_S[0] + 1.0)
    assert w.trial_at[-1] - dropped == pytest.approx(HOLD_S[0], abs=0.7)  # + the trial's steps


def test_a_trial_compares_neighbouring_steps_of_like_work_only():
    trial = _Trial(more=2, start=2, probe=False, last_at=0.0)
    # (threads, tokens, seconds): a prefill chunk beside decodes pairs with nothing.
    trial.steps = [(1, 1, 0.03), (2, 1, 0.04), (1, 512, 0.5), (2, 1, 0.04), (1, 1, 0.03)]
    assert trial.ratios() == pytest.approx([0.75, 0.75])
    assert trial.winner() is None  # too few pairs to say
    trial.steps = [(1, 1, 0.02), (2, 1, 0.16), (1, 1, 0.02)]
    assert trial.winner() is None  # two pairs, but one step on two threads: a burst may have slowed it
    trial.steps.append((2, 1, 0.15))
    assert trial.winner() == 1  # two steps on each count, each pair twice as fast, or more
    trial.steps = [(1, 1, 0.08), (2, 1, 0.02), (1, 1, 0.08), (2, 1, 0.03)]
    assert trial.winner() == 2
    trial.steps = [(1, 1, 0.02), (2, 1, 0.16), (1, 1, 0.02), (2, 1, 0.03)]
    assert trial.winner() is None  # one pair of three is not clear
    trial.steps = [(1 + i % 2, 1 + 100 * i, 0.02) for i in range(TRIAL_MAX_STEPS)]
    assert trial.winner() == 2  # no two like steps in all its steps: the count it began with
    trial.steps = [(1 + i % 2, 8, 0.02 if i % 2 else 0.02 * FEWER_WINS) for i in range(TRIAL_PAIRS + 1)]
    assert trial.winner() == 1  # at FEWER_WINS the smaller team wins
    trial.steps = [(1 + i % 2, 8, 0.02) for i in range(TRIAL_PAIRS + 1)]
    assert trial.winner() == 2  # a tie keeps the threads


def test_a_trials_steps_alternate_and_torch_is_told_only_on_a_change():
    w = Watch()
    w.steps(CLIENT, SETTLE * WINDOW_S + 0.5)
    assert w.share.trials == 1 and w.share.changes == 0
    trial_steps = w.on[-TRIAL_PAIRS - 5:]
    assert 1 in trial_steps
    assert w.set_to == [1, 2] * (len(w.set_to) // 2)  # alternating, ending on the winner
    assert w.share.threads == 2


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


def trial_medians(log_text: str) -> list[float]:
    """Each ended trial's median of fewer threads' step time over more's, as
    CpuShare logs it (a trial with no like steps has none)."""
    return [float(m) for m in re.findall(r"median ([0-9.]+)\)", log_text)]


@linux_proc
@pytest.mark.alone  # the machine's other load is the neighbour it watches
def test_a_real_neighbour_takes_a_thread_from_the_engine(caplog):
    """A tiny model's engine with --yield-busy-cores, stepped beside a
    process spinning on each core: its threads' real waits begin a trial,
    the trial's steps on both counts give the greedy tokens, and the count
    the trial measured faster is the one it steps on, in its stats.

    Which count is faster is the machine's to say (here, beside a spinner,
    one thread's steps take 0.2-0.6 of two's); the engine must follow what
    its trials measured, and on a machine where one of them found one
    thread faster it must have dropped it."""
    threads = torch.get_num_threads()
    cpus = len(os.sched_getaffinity(0))
    spinners = cpus  # every core shared: the team waits whether its idle threads spin or sleep
    if threads < 2 or spinners > 4:
        pytest.skip(f"{threads} torch threads on {cpus} CPUs")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(None, device="cpu", yield_busy_cores=True, seed=0)
    share = llm.engine._cpu_share
    try:
        alone = llm.generate("a quiet machine", params)[0].outputs[0].token_ids
        assert llm.engine.stats().cpu_threads == threads
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
        besides = []
        try:
            with caplog.at_level(logging.DEBUG, logger="fluidserve.engine.cpu_share"):
                # The load is averaged over windows; a trial the larger team
                # wins (a burst of noise) holds the next back 2 s, then 4 s.
                deadline = time.monotonic() + 100 * WINDOW_S
                while llm.engine.stats().cpu_threads == threads and time.monotonic() < deadline:
                    besides.append(llm.generate("a quiet machine", params)[0].outputs[0].token_ids)
                    time.sleep(WINDOW_S / 2)
                besides.append(llm.generate("a quiet machine", params)[0].outputs[0].token_ids)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        stats = llm.engine.stats()
        medians = trial_medians(caplog.text)
        seen = (f"waiting {share.waiting:.2f} cores' worth, others busy {share.others_busy:.2f}; "
                f"{stats.num_cpu_thread_trials} trials, medians {medians}")
        assert stats.num_cpu_thread_trials >= 1, f"the waits began no trial: {seen}"
        assert len(medians) >= 1, f"no trial ended: {seen}"
        if any(m <= FEWER_WINS for m in medians):
            assert stats.num_cpu_thread_changes >= 1 and stats.cpu_threads < threads, seen
        else:  # every trial found the larger team as fast: it keeps its threads
            assert stats.num_cpu_thread_changes == 0 and stats.cpu_threads == threads, seen
        assert all(tokens == alone for tokens in besides)  # each step's count, a trial's alternation too
    finally:
        torch.set_num_threads(threads)


@linux_proc
@pytest.mark.alone  # the machine's other load is the neighbour it watches
def test_an_idle_server_engine_keeps_the_smaller_team_and_grows_back_when_the_neighbour_leaves(caplog):
    """The server's loop looks at the cores while no request runs too: a
    team made smaller by a neighbour stays so while idle beside it (no
    probe without steps), and grows back once the neighbour leaves, before
    the next request's first step. It needs a trial that found one thread
    faster: where every trial beside the spinners found two as fast, there
    is no smaller team to watch (the real-neighbour test checks that the
    engine kept its threads then)."""
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
        with caplog.at_level(logging.DEBUG, logger="fluidserve.engine.cpu_share"):
            busy, idle_beside, quiet = asyncio.run(watch())
        medians = trial_medians(caplog.text)
        if busy == threads and medians and min(medians) > FEWER_WINS:
            pytest.skip(f"every trial beside the spinners found {threads} threads as fast as fewer: {medians}")
        assert 1 <= busy < threads and idle_beside == busy and quiet == threads, medians
    finally:
        torch.set_num_threads(threads)


def test_llm_leaves_torch_threads_alone_by_default():
    llm = LLM(None, device="cpu")
    llm.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))
    assert llm.engine._cpu_share is None and llm.engine.stats().cpu_threads == 0
