"""How many of torch's threads a CPU step computes on: all it started with,
less the cores other processes keep busy.

OpenMP splits each op evenly over its team, and the op ends when the last
thread does. Where another process keeps one of the cores busy, the thread
that shares that core gets part of it, and every op waits for that thread,
while its teammates spin on cores the neighbour could have had (the server
lets idle threads spin, ``serve/cli.py`` ``set_openmp_waiting``). SmolLM2 on
two cores, batch-1 decode: 24.3 ms a step alone, 106.2 ms beside one
process that spins on a core, 31.2 ms there when the step yields that core
(``benchmarks/omp_teams.py``). So between steps, once a window has passed,
``CpuShare`` reads how busy this process's CPUs were (``/proc/stat``), takes
off what this process used (``/proc/self/stat``), and gives torch the cores
left over: never more threads than it started with, never fewer than one.
The load it acts on is averaged over windows, so one window's blip (a
client's burst, the kernel's tick falling unevenly) moves no thread.
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
# Other processes' load takes a core from the team from 0.6 of a core on.
# Below that the neighbour sleeps often (an HTTP client streaming tokens,
# the kernel's threads): the thread beside it loses less than the team
# would on one thread fewer. Served at 1 req/s, SmolLM2's load generator
# keeps 0.3-0.5 of a core busy, and with a line at half a core the server
# stepped on one thread through whole loads, slower than on two
# (benchmarks/busy_neighbour.py, alone). A process that spins gets 2/3 of a
# core beside two threads that compute (a fair share of two cores among
# three), and all of one beside one: from 0.6 on, it is seen either way.
BUSY_FROM = 0.6
# Weight of the latest window in the load acted on; the rest is the past's.
LATEST = 0.75

log = logging.getLogger(__name__)

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class CpuSample:
    at: float  # monotonic seconds
    busy_s: float  # CPU seconds spent busy on the watched CPUs, by anyone
    ours_s: float  # CPU seconds this process used


def read_sample(cpus: frozenset[int], proc: Path = Path("/proc")) -> CpuSample:
    """Busy time of ``cpus`` (user, nice, system, irq, softirq: not idle,
    iowait or time the hypervisor stole) and this process's own time."""
    busy = 0
    for line in (proc / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name == "cpu" or not name.startswith("cpu") or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
        busy += user + nice + system + irq + softirq
    own = (proc / "self" / "stat").read_text()
    utime, stime = map(int, own[own.rindex(")") + 2:].split()[11:13])
    return CpuSample(time.monotonic(), busy * _TICK_S, (utime + stime) * _TICK_S)


def threads_left(cpus: int, others_busy: float, ceiling: int) -> int:
    """Threads for a team on ``cpus`` cores of which other processes keep
    ``others_busy`` cores' worth busy: the cores they leave, each core of
    theirs counted from ``BUSY_FROM`` of one."""
    taken = int(others_busy + 1 - BUSY_FROM)
    return max(1, min(ceiling, cpus - taken))


class CpuShare:
    """Call ``tick()`` on the thread that steps the engine (OpenMP's team
    size belongs to the calling thread), before each step."""

    def __init__(self, ceiling: int, cpus: frozenset[int], set_threads: Callable[[int], None],
                 sample: Callable[[], CpuSample]) -> None:
        self.ceiling = ceiling
        self.cpus = cpus
        self.threads = ceiling
        self.changes = 0  # how often other processes' load moved the thread count
        self._set_threads = set_threads
        self._sample = sample
        self._last = sample()
        self.others_busy = 0.0  # cores' worth other processes kept busy, averaged over windows

    @classmethod
    def for_this_thread(cls) -> CpuShare | None:
        """Watching the CPUs this process may run on, with torch's present
        thread count as the ceiling; None where ``/proc`` does not say (not
        Linux) or torch computes on one thread anyway."""
        import torch

        ceiling = torch.get_num_threads()
        if ceiling < 2 or not hasattr(os, "sched_getaffinity"):
            return None
        cpus = frozenset(os.sched_getaffinity(0))
        try:
            return cls(ceiling, cpus, torch.set_num_threads, lambda: read_sample(cpus))
        except (OSError, ValueError, IndexError):
            return None

    def tick(self) -> int:
        """The thread count for the next step; changed only once a window
        has passed since the last look."""
        if time.monotonic() - self._last.at < WINDOW_S:
            return self.threads
        now = self._sample()
        elapsed = now.at - self._last.at
        others = max(0.0, (now.busy_s - self._last.busy_s) - (now.ours_s - self._last.ours_s)) / elapsed
        self._last = now
        self.others_busy = LATEST * others + (1 - LATEST) * self.others_busy
        want = threads_left(len(self.cpus), self.others_busy, self.ceiling)
        if want != self.threads:
            self._set_threads(want)
            self.threads = want
            self.changes += 1
            log.debug("other processes keep %.2f cores busy: stepping on %d of %d threads",
                      self.others_busy, want, self.ceiling)
        return self.threads
