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
neighbours, 0.05-0.10 with a client streaming chats at 1-4 req/s from the
same cores. Between steps, once a window has passed, ``CpuShare`` reads it,
and from ``WAIT_FROM`` on the team loses a thread. On fewer threads the
team no longer waits, so the wait cannot say when the neighbour leaves; a
thread comes back when other processes' load (``/proc/stat`` less this
process's own time) halves from what it was after the drop, or when a
probe, taken only while steps run, finds the cores free. The hold before a
probe doubles each time one meets the neighbour again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
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


class CpuShare:
    """Call ``tick()`` on the thread that steps the engine (OpenMP's team
    size belongs to the calling thread), before each step and while idle."""

    def __init__(self, ceiling: int, set_threads: Callable[[int], None], sample: Callable[[], CpuSample]) -> None:
        self.ceiling = ceiling
        self.threads = ceiling
        self.changes = 0  # how often the thread count moved
        self.waiting = 0.0  # cores' worth of this process's threads waiting, averaged since the last change
        self.others_busy = 0.0  # cores' worth other processes kept busy, averaged since the last change
        self._set_threads = set_threads
        self._sample = sample
        self._last = sample()
        self._windows = 0  # windows seen at the present count
        self._others_after_drop: float | None = None  # the load beside the smaller team, once settled
        self._hold_s = HOLD_S[0]
        self._probe_at = 0.0
        self._probing = False  # the last change was a probe

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
        """The thread count for the next step; changed only once a window
        has passed since the last look."""
        if time.monotonic() - self._last.at < WINDOW_S:
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
        if self._windows < (1 if self._probing else SETTLE):  # a probe is judged on its first window
            return self.threads
        if self.threads > 1 and self.waiting >= WAIT_FROM:
            # A probe that meets the neighbour again waits twice as long for the next.
            self._hold_s = min(2 * self._hold_s, HOLD_S[1]) if self._probing else HOLD_S[0]
            self._probe_at = now.at + self._hold_s
            self._change(self.threads - 1, probing=False,
                         why=f"its threads waited {self.waiting:.2f} cores' worth for a core")
            return self.threads
        self._probing = False  # settled without waiting: a probe that found the cores free
        if self.threads == self.ceiling:
            return self.threads
        if self._others_after_drop is None:
            self._others_after_drop = self.others_busy
        if self._others_after_drop >= LEFT_FROM and self.others_busy <= self._others_after_drop / 2:
            self._hold_s = HOLD_S[0]
            self._change(self.threads + 1, probing=False,
                         why=f"other processes' load fell to {self.others_busy:.2f} cores")
        elif now.at >= self._probe_at and ours / elapsed >= STEPPING * self.threads:
            self._change(self.threads + 1, probing=True, why="a probe")
        return self.threads

    def _change(self, threads: int, probing: bool, why: str) -> None:
        self._set_threads(threads)
        self.threads = threads
        self.changes += 1
        self._windows = 0
        self._others_after_drop = None
        self._probing = probing
        log.debug("%s: stepping on %d of %d threads", why, threads, self.ceiling)
