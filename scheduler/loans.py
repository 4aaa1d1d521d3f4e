"""KVLoans: which requests may take device KV from streaming requests, and
which streams may lend it (``--swap-loan-tokens N``, 32 by default; a
negative N turns them off).

A request that has streamed its first token keeps its place. A request with
no token out yet takes only device blocks that are free, not owed to streams
away on the host (they come back first) and not the next block of each
resident request that needs one within a few decodes (scheduler.py
``GROWTH_STEPS``: their growth then evicts no one). It takes owed blocks
only to backfill (``Backfill``; EASY backfilling, Lifka 1995;
``--no-swap-backfill`` turns it off): when its own ``max_new_tokens`` ends
its stay (``steps_left``) before the requests on the device, by theirs,
could free enough blocks for any stream owed them, and its blocks to that
cap fit beside what those residents grow meanwhile. Then it has left before
any of them could have come back, and no stream waits longer for it. The
exception is a *borrower*: a request whose ``max_new_tokens`` cap is at most
``N``. Its stay on the device is bounded before it starts (its prefill steps
and at most ``N`` decodes), so the streams it evicts are away for a known
number of steps and come back when it ends. A stream lends only while the steps it
has been away in loans, this one's included, stay within ``LEND_SHARE`` of
the tokens it has streamed: its TPOT stays within ``1 + LEND_SHARE`` times
its own pace (one token a step). The same holds for streams parked to keep
the arrival reserve free.

Without eviction a long prompt can starve while shorter ones take each
block that frees: a request with no bound on its stay that has waited
``STARVING_WAITS`` times the mean wait of recent admissions (or of the
policy's starve limit, if longer) keeps the blocks it needs from the
requests ranked below it that have no bound either.

Loans protect what a user watches stream. Offline requests (co-serving)
are outside them: they keep no place, are owed no blocks and borrow none;
among themselves they evict by priority as without loans, and an online
request takes their KV as ever (ConServe: online work never waits on
offline KV).

The cap is the client's: a request that states a tight ``max_tokens``
(scoring, classification, short completions) passes a queue of long
streams; one with a loose cap waits for free memory, as under FCFS.

The scheduler asks at admission (who may evict, and what is owed), in the
victim search (who may lend) and in the proactive moves (which stream may
be parked; swapped streams come back into any free block and evict no one).
Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fluidserve.scheduler.request_state import RequestClass, SeqState

INF = float("inf")
# Share of its own streamed tokens a stream may spend away from the device
# in loans: 0.25 holds its TPOT within 1.25x of running every step.
LEND_SHARE = 0.25
# Steps a loan's round trip adds to the borrower's stay: the step the
# victim's copy out overlaps, the one its copy back overlaps, the one that
# runs it again.
ROUND_TRIP_STEPS = 3
# A request without a bound that has waited this many times the mean wait
# of recent admissions keeps its blocks from those ranked below it. Skip-join
# admits short prompts within a few steps, so the mean is short, and at 2
# the long prompts that FCFS would have served long ago stop waiting behind
# every short one (benchmarks/swapping.py --starving-sweep: OPT-13B's P99
# TTFT is 0.82x FCFS's at 6 and 1.08x at 2).
STARVING_WAITS = 2.0
_WAIT_MEAN_WEIGHT = 0.05  # of each admission's wait in the running mean


@dataclass
class KVLoans:
    """``max_tokens``: the largest ``max_new_tokens`` cap of a borrower;
    ``step_tokens``: the token budget of one step (a prefill's steps);
    ``min_wait``: a floor under the mean wait when starvation is judged
    (the policy's own starve limit, where it has one)."""

    max_tokens: int
    step_tokens: int
    min_wait: float = 0.0
    share: float = LEND_SHARE
    lent: dict[str, float] = field(default_factory=dict)  # request id -> steps away in loans so far
    mean_wait: float = 0.0  # seconds from arrival to admission, running mean

    def stay(self, seq: SeqState) -> float:
        """Steps a request with no token out holds the device at most, if it
        borrows (inf: it does not): its prefill in chunks of a step's budget,
        then one step per output token after the first (which the last
        prefill step samples)."""
        if seq.max_new_tokens > self.max_tokens:
            return INF
        return float(self.steps_left(seq))

    def steps_left(self, seq: SeqState) -> int:
        """Steps until ``seq`` leaves the device at its ``max_new_tokens``
        cap, run every step: its uncomputed tokens in chunks of a step's
        budget (the last samples a token), then one step per token after it."""
        chunks = max(1, math.ceil((seq.num_tokens - seq.num_computed_tokens) / self.step_tokens))
        return chunks + seq.max_new_tokens - seq.num_output_tokens - 1

    def can_lend(self, seq: SeqState, away: float) -> bool:
        """Whether ``seq`` may be evicted for a request that keeps it
        ``away`` steps beyond the round trip. An offline request always may;
        one with no token out only while it has computed nothing (waiting
        costs it no TPOT, and no copy is wasted)."""
        if seq.klass is RequestClass.OFFLINE:
            return True
        n = seq.num_output_tokens
        if not n:
            return not seq.num_computed_tokens
        return self.lent.get(seq.request_id, 0.0) + ROUND_TRIP_STEPS + away <= self.share * n

    def note_lent(self, seq: SeqState, away: float) -> None:
        """``seq`` was evicted for a request that keeps it ``away`` steps."""
        if seq.num_output_tokens and seq.klass is not RequestClass.OFFLINE:
            rid = seq.request_id
            self.lent[rid] = self.lent.get(rid, 0.0) + ROUND_TRIP_STEPS + away

    def note_admitted(self, seq: SeqState, now: float) -> None:
        self.mean_wait += _WAIT_MEAN_WEIGHT * (now - seq.arrival_time - self.mean_wait)

    def starving(self, seq: SeqState, now: float) -> bool:
        return now - seq.arrival_time > STARVING_WAITS * max(self.mean_wait, self.min_wait)

    def forget(self, request_id: str) -> None:
        self.lent.pop(request_id, None)


@dataclass
class Backfill:
    """What backfilling reads of the requests on the device, for as long as
    no admission or eviction changes them (``free``, ``key``): ``shadow``, the fewest
    steps after which those leaving by their caps free enough blocks for
    the smallest claim on owed blocks (inf: never), and each resident's
    tokens, blocks and steps left, for its growth through a stay. A request
    backfills when its stay ends by the shadow and ``fits``."""

    key: tuple  # what else it was read under (the scheduler's: requests moved this step, blocks owed)
    free: int  # free blocks, those a backfill would take included
    shadow: float
    residents: list[tuple[int, int, int]]  # (tokens, blocks, steps left)
    block_size: int
    grown: dict[int, int] = field(default_factory=dict)  # stay -> blocks the residents grow through it
    no_room: float | None = None  # the shortest stay through which they grow into every free block

    @classmethod
    def of(cls, key: tuple, residents: list[tuple[int, int, int]], free: int, claim: int,
           block_size: int) -> Backfill:
        """``claim``: the smallest claim on owed blocks, with the blocks
        kept free beside it; it is met once the free blocks and those of
        the residents leaving, the first to leave first, cover it."""
        residents = sorted(residents, key=lambda r: r[2])
        short = free - claim
        shadow = 0.0 if short >= 0 else INF  # inf: no claim fits even with every resident gone
        for _, held, steps in residents if short < 0 else ():
            short += held
            if short >= 0:
                shadow = steps
                break
        return cls(key, free, shadow, residents, block_size)

    def growth(self, stay: int) -> int:
        grown = self.grown.get(stay)
        if grown is None:
            bs = self.block_size
            grown = self.grown[stay] = sum(max(0, -(-(tokens + min(stay, steps)) // bs) - held)
                                           for tokens, held, steps in self.residents)
        return grown

    def fits(self, blocks: int, stay: int) -> bool:
        """Whether ``blocks`` (one at least) fit in the free blocks beside
        the residents' growth through ``stay`` steps. Growth only rises with the
        stay: the shortest stay that leaves no block is found once, by
        bisection, so each request asking after it costs nothing (a long
        queue asks each step)."""
        free = self.free
        if self.no_room is None:
            lo, hi = 0, max((steps for _, _, steps in self.residents), default=0) + 1
            while lo < hi:  # the first stay whose growth takes every free block
                mid = (lo + hi) // 2
                if self.growth(mid) >= free:
                    hi = mid
                else:
                    lo = mid + 1
            self.no_room = lo if self.growth(lo) >= free else INF
        return stay < self.no_room and blocks + self.growth(stay) <= free
