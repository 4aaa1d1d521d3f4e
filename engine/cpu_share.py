"""How many of torch's threads a CPU step computes on: all it started with,
fewer while this process's threads wait for cores other work holds.

OpenMP splits each op evenly over its team, and the op ends when the last
thread does. Where another process shares a core, the thread on that core
waits for it, and every op waits for that thread while its teammates spin.
The cost is how long the neighbour holds the core at a time, not its share:
SmolLM2 decoding at batch 1 on two cores takes 21.0 ms a token on two
threads alone, 44.6 ms beside a process busy 2 ms in every 5, 69.9 ms
beside one that spins; on one thread, 22-24 ms beside either
(``benchmarks/core_waits.py``).

So the signal is the stall itself: the kernel counts, per thread, the time
it was runnable but not running (``/proc/self/task/*/schedstat``, its
second field). Summed over this process's threads per second of wall time,
it is the share of the step the team stood waiting: 0.37-0.77 beside such
neighbours, 0.05-0.10 on average with a client streaming chats at 1-4 req/s
from the same cores. Between steps, once a window has passed, ``CpuShare``
reads it, and from ``WAIT_FROM`` on a trial begins.

Waiting alone does not say a thread should go: a team that waits a share w
of the time runs about 1/(1-w) slower, so one thread fewer pays only where
that exceeds what the thread is worth to the step (one thread's step time
over two's: 1.13 for SmolLM2 at batch 1, 1.41 at batch 32), and a bursty
neighbour (a load generator on the same cores) crosses the line in bursts
its average stays under. So a trial measures it: the next steps alternate
between the two team sizes, and each two neighbouring steps of like work
give one thread count's time over the other's, beside the same load. The
faster count stays. Waits that lose a trial start another only after a hold
(2 s, doubling to 32 s while trials keep losing), or once other processes'
load has grown by half a core since: a new neighbour.

On fewer threads the team no longer waits, so the wait cannot say when the
neighbour leaves; a thread comes back when other processes' load
(``/proc/stat`` less this process's own time) halves from what it was after
the drop, or when a trial begun after a hold (only while steps run) finds the
larger team faster again. The hold before that probe doubles each time one
meets the neighbour again.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Long enough that the kernel's tick (10 ms on most systems) is a small part
# of it; short enough that a neighbour that starts up costs a step or two.
WINDOW_S = 0.2
# Waiting of this process's threads, in cores' worth, from which a thread
# leaves the team. A streaming client on the same cores keeps it at 0.05
# (1 req/s) to 0.10 (4 req/s) on average; a neighbour that holds a core for
# a third of a millisecond or more at a time, at 0.37 and more.
WAIT_FROM = 0.3
# Windows seen at a thread count before it changes again: one window's blip
# moves no thread, and the load read after a drop is the load beside the
# smaller team.
SETTLE = 2
# Weight of the latest window in the averages acted on.
LATEST = 0.5
# Other processes' load (cores) below which its halving is noise, not a
# neighbour leaving: waits with less beside them came from this process's
# own threads or from what /proc/stat does not see, and only a probe tells.
LEFT_FROM = 0.2
# How long the team stays smaller before a probe, while steps run; doubled
# by each probe that finds the neighbour still there. A probe costs a window
# of slow steps where the neighbour stays, and most neighbours' leaving is
# seen without one (their load halves).
HOLD_S = (2.0, 32.0)
# A team busy for less than this share of its threads' time is not
# stepping enough for a probe to say anything.
STEPPING = 0.5
# A trial is judged on this many pairs of neighbouring steps of like work
# (token counts within SAME_WORK of each other), or on the pairs it has
# after TRIAL_MAX_STEPS steps; a trial with no step for TRIAL_IDLE_S (the
# engine idle) ends where it began. About 10 decode steps of a small model.
TRIAL_PAIRS = 8
TRIAL_MAX_STEPS = 32
SAME_WORK = 1.1
TRIAL_IDLE_S = 1.0
# Pairs enough where each says one team is at least twice as fast as the
# other: beside a spinning neighbour two threads step 8x slower than one,
# and a probe's trial should not run many such steps to see it again.
# Neighbouring pairs share a step: three pairs are two steps on each count,
# so one step a burst of the neighbour slowed cannot decide alone.
CLEAR_PAIRS = 3
CLEAR = 0.5
# Other processes' load (cores) above that beside the last trial the larger
# team won, from which waits begin a trial before the hold ends: a new
# neighbour, not the load that trial judged.
NEW_LOAD = 0.5
# The smaller team wins a trial when its steps take at most this share of
# the larger team's (the median over the pairs): a tie keeps the threads.
FEWER_WINS = 0.95

log = logging.getLogger(__name__)

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class CpuSample:
    at: float  # monotonic seconds
    busy_s: float  # CPU seconds spent busy on the watched CPUs, by anyone
    ours_s: float  # CPU seconds this process used
    waited_s: float  # seconds this process's threads were runnable but not running, summed


class ThreadWaits:
    """Run-queue delay of a process's live threads, summed (seconds), read
    through a descriptor kept open per thread: opening a ``/proc`` file
    costs more than reading it (for 20 threads, about 60-80 us a look against 310 us). A
    thread that ended takes its count with it: callers clamp differences."""

    def __init__(self, process: Path = Path("/proc/self")) -> None:
        self._tasks = process / "task"
        self._fds: dict[str, int] = {}

    def read(self) -> float:
        live = os.listdir(self._tasks)
        total = 0
        for tid in live:
            total += self._delay(tid)
        for tid in self._fds.keys() - set(live):  # ended threads' descriptors
            os.close(self._fds.pop(tid))
        return total / 1e9

    def _delay(self, tid: str) -> int:
        for _ in range(2):  # a kept descriptor of an ended thread whose id came back: open it again
            fd = self._fds.get(tid)
            try:
                if fd is None:
                    fd = self._fds[tid] = os.open(self._tasks / tid / "schedstat", os.O_RDONLY)
                return int(os.pread(fd, 128, 0).split()[1])
            except (OSError, ValueError, IndexError):  # it ended between the listing and the read
                if fd is not None:
                    os.close(self._fds.pop(tid))
        return 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the os module may be gone already
            pass


def read_sample(cpus: frozenset[int], waits: ThreadWaits | None = None, proc: Path = Path("/proc")) -> CpuSample:
    """Busy time of ``cpus`` (user, nice, system, irq, softirq: not idle,
    iowait or time the hypervisor stole), this process's own time and, given
    ``waits``, its threads' waiting (else 0)."""
    busy = 0
    for line in (proc / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name == "cpu" or not name.startswith("cpu") or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
        busy += user + nice + system + irq + softirq
    own = (proc / "self" / "stat").read_text()
    utime, stime = map(int, own[own.rindex(")") + 2:].split()[11:13])
    return CpuSample(time.monotonic(), busy * _TICK_S, (utime + stime) * _TICK_S,
                     waits.read() if waits is not None else 0.0)


@dataclass
class _Trial:
    """Steps alternating between a team of ``more - 1`` threads and one of
    ``more``, beside the load that is there now; the count the team had
    when it began is ``start``."""

    more: int
    start: int
    probe: bool  # begun by the hold ending (the team smaller); else by the team's waits
    last_at: float  # when it began or its last step ended
    beside: float = 0.0  # other processes' load (cores) when it began
    steps: list[tuple[int, int, float]] = field(default_factory=list)  # (threads, tokens, seconds)

    def ratios(self) -> list[float]:
        """Seconds on fewer threads over seconds on more, of each two
        neighbouring steps of like work."""
        out = []
        for (t0, n0, s0), (t1, n1, s1) in zip(self.steps, self.steps[1:]):
            if t0 != t1 and min(s0, s1) > 0 and max(n0, n1) <= SAME_WORK * min(n0, n1):
                out.append(s0 / s1 if t0 < t1 else s1 / s0)
        return out

    def winner(self) -> int | None:
        """The count that computed faster, once the steps say (None: not yet)."""
        ratios = self.ratios()
        clear = len(ratios) >= CLEAR_PAIRS and (max(ratios) <= CLEAR or min(ratios) >= 1 / CLEAR)
        if len(ratios) < TRIAL_PAIRS and len(self.steps) < TRIAL_MAX_STEPS and not clear:
            return None
        if not ratios:  # no two like steps: the start count stands
            return self.start
        # A tie goes to the larger team: it is the faster one on free cores.
        return self.more - 1 if statistics.median(ratios) <= FEWER_WINS else self.more


class CpuShare:
    """Call ``tick()`` on the thread that steps the engine (OpenMP's team
    size belongs to the calling thread), before each step and while idle,
    and ``step_done()`` after each step."""

    def __init__(self, ceiling: int, set_threads: Callable[[int], None], sample: Callable[[], CpuSample],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``sample`` reads the CPUs at ``clock``'s time (monotonic seconds)."""
        self.ceiling = ceiling
        self.threads = ceiling  # for the next step
        self.held = ceiling  # the count steps compute on, a trial's alternating steps aside
        self.changes = 0  # how often the thread count moved, trials' alternation aside
        self.trials = 0  # trials begun
        self.waiting = 0.0  # cores' worth of this process's threads waiting, averaged since the last change
        self.others_busy = 0.0  # cores' worth other processes kept busy, averaged since the last change
        self._set_threads = set_threads
        self._sample = sample
        self._clock = clock
        self._last = sample()
        self._windows = 0  # windows seen at the present count
        self._others_after_drop: float | None = None  # the load beside the smaller team, once settled
        self._hold_s = HOLD_S[0]  # before the next probe
        self._probe_at = 0.0
        self._drop_hold_s = HOLD_S[0]  # before waits may begin another trial, after one the larger team won
        self._drop_at = 0.0
        self._lost_beside: float | None = None  # other processes' load when the larger team last won
        self._trial: _Trial | None = None

    @classmethod
    def for_this_thread(cls) -> CpuShare | None:
        """Watching the CPUs this process may run on, with torch's present
        thread count as the ceiling; None where ``/proc`` does not say (not
        Linux, no per-thread scheduler counts) or torch computes on one
        thread anyway."""
        import torch

        ceiling = torch.get_num_threads()
        if ceiling < 2 or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = frozenset(os.sched_getaffinity(0))
        waits = ThreadWaits()
        try:
            return cls(ceiling, torch.set_num_threads, lambda: read_sample(cpus, waits))
        except (OSError, ValueError, IndexError):
            return None

    def tick(self) -> int:
        """The thread count for the next step; a trial aside, changed only
        once a window has passed since the last look."""
        trial = self._trial
        if trial is not None:
            if self._clock() - trial.last_at >= TRIAL_IDLE_S:  # the engine went idle: nothing to judge by
                self._end_trial(trial.start)
            return self.threads
        if self._clock() - self._last.at < WINDOW_S:
            return self.threads
        now = self._sample()
        last, self._last = self._last, now
        elapsed = now.at - last.at
        ours = max(0.0, now.ours_s - last.ours_s)
        others = max(0.0, (now.busy_s - last.busy_s) - ours) / elapsed
        waiting = max(0.0, now.waited_s - last.waited_s) / elapsed
        if self._windows == 0:
            self.others_busy, self.waiting = others, waiting
        else:
            self.others_busy = LATEST * others + (1 - LATEST) * self.others_busy
            self.waiting = LATEST * waiting + (1 - LATEST) * self.waiting
        self._windows += 1
        if self._windows < SETTLE:
            return self.threads
        if self.threads > 1 and self.waiting >= WAIT_FROM:
            held_back = now.at < self._drop_at
            if held_back and self._lost_beside is not None and self.others_busy >= self._lost_beside + NEW_LOAD:
                held_back = False  # not the load the last trial judged: a new neighbour
            if not held_back:
                self._begin_trial(self.threads, probe=False,
                                  why=f"its threads waited {self.waiting:.2f} cores' worth for a core")
            return self.threads
        if self.threads == self.ceiling:
            return self.threads
        if self._others_after_drop is None:
            self._others_after_drop = self.others_busy
        if self._others_after_drop >= LEFT_FROM and self.others_busy <= self._others_after_drop / 2:
            # The neighbour's leaving seen whole: no trial needed (and none
            # could run while the engine is idle).
            self._hold_s = HOLD_S[0]
            self._change(self.threads + 1, why=f"other processes' load fell to {self.others_busy:.2f} cores")
        elif now.at >= self._probe_at and ours / elapsed >= STEPPING * self.threads:
            self._begin_trial(self.threads + 1, probe=True, why="the hold ended")
        return self.threads

    def step_done(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds`` on the present team:
        during a trial, the next step runs on the other count, or the
        trial ends."""
        trial = self._trial
        if trial is None:
            return
        trial.steps.append((self.threads, tokens, seconds))
        trial.last_at = self._clock()
        winner = trial.winner()
        if winner is not None:
            self._end_trial(winner)
        else:
            self._set(trial.more - 1 if self.threads == trial.more else trial.more)

    def _begin_trial(self, more: int, probe: bool, why: str) -> None:
        # Its first step runs on the smaller team: the three pairs that can
        # decide then cost two steps on the larger, which beside a spinner
        # are 8x slower.
        self.trials += 1
        self._trial = _Trial(more, self.threads, probe, self._clock(), self.others_busy)
        log.debug("%s: a trial of %d against %d threads", why, more, more - 1)
        if self.threads != more - 1:
            self._set(more - 1)

    def _end_trial(self, threads: int) -> None:
        trial, self._trial = self._trial, None
        now = self._clock()
        fewer = threads < trial.more
        if trial.probe:  # a probe that meets the neighbour again waits twice as long for the next
            self._hold_s = min(2 * self._hold_s, HOLD_S[1]) if fewer else HOLD_S[0]
        elif fewer:
            self._hold_s = self._drop_hold_s = HOLD_S[0]
            self._drop_at = now
            self._lost_beside = None
        else:  # the waits were not worth a thread: they need not be tried again at once
            self._drop_at = now + self._drop_hold_s
            self._drop_hold_s = min(2 * self._drop_hold_s, HOLD_S[1])
            self._lost_beside = trial.beside
        if fewer:
            self._probe_at = now + self._hold_s
        ratios = trial.ratios()
        self._change(threads, why=f"a trial of {len(trial.steps)} steps (fewer threads' time over more's: median "
                                  f"{statistics.median(ratios) if ratios else float('nan'):.2f})")

    def _change(self, threads: int, why: str) -> None:
        """The count now holds: averages and the settling start again."""
        if threads != self.threads:
            self._set(threads)
        self._windows = 0
        self._others_after_drop = None
        self._last = self._sample()
        if threads != self.held:
            self.held = threads
            self.changes += 1
            log.debug("%s: stepping on %d of %d threads", why, threads, self.ceiling)
        else:  # a trial that kept the count is logged too, with its median
            log.debug("%s: %d of %d threads stay", why, threads, self.ceiling)

    def _set(self, threads: int) -> None:
        self._set_threads(threads)
        self.threads = threads
