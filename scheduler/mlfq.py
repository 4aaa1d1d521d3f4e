"""Multi-level feedback queues: FastServe's skip-join MLFQ (§4.1, Algorithm 1)
and the naive MLFQ it improves on.

Queues Q1..Qn (levels 0..n-1 here) with quanta q1 = the minimum iteration
time and q(k+1) = 2·q(k). Lower level = higher priority; FCFS (arrival order)
inside a level. The Scheduler offers requests level by level, so a job that
does not fit the step is preempted for that iteration.

* Join: naive MLFQ puts every arrival in Q1; skip-join puts it in the highest
  queue whose quantum is ≥ its predicted prefill time t_init (cost model).
* Service: each step a job is charged the time its own work in that step
  would take alone (a prefill chunk or one decode iteration, by the cost
  model), i.e. the iteration time FastServe compares quanta with; batching
  does not make jobs age faster or slower.
* Demotion: once the service attained in its level reaches the level's
  quantum the job moves down one level; skip-join keeps moving it down while
  its *next* iteration time exceeds that level's quantum. Attained service
  restarts at 0 in the new level. The last level never demotes.
* Starvation: a job not scheduled for longer than the starve limit α is
  promoted to Q1 (attained service reset), which bounds any job's wait.
* First-token guard (skip-join's default, ``first_token_slack`` tokens): each
  online prompt gets a deadline in prefill tokens, the online prompt tokens
  queued ahead of it at arrival plus its own plus the slack, the point where
  first-come-first-served would have given it its first token. While no
  online request is held off the device (swapped out, or waiting after a
  recompute), a prompt whose deadline is a step away runs in Q1, in arrival
  order, until its first token. Skip-join's mean TTFT gain and its P99 TTFT
  loss where memory does not bind are one trade (benchmarks/ttft_tail.py):
  with slack 0 a prompt passes an older one only where the older one has
  slack to give. While memory binds, skip-join's ranking decides (which
  request may evict which is the KV rules' business).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from fluidserve.scheduler.cost_model import CostModel
from fluidserve.scheduler.policy_base import Policy
from fluidserve.scheduler.request_state import RequestClass, SeqState, SeqStatus

# FastServe's default α (300 ms) was 10 iterations of its model (its SLO, 10x
# an iteration). Without a flag the starve limit is 10 iterations of this
# model, an iteration being a full step of the default token budget: with a
# flat batch every decode rides in such steps while prefills queue.
_STARVE_ITERATIONS = 10.0
_REFERENCE_STEP_TOKENS = 2048
_DECODE_SPAN = 16
_CLASS_DEFAULT = object()  # ``first_token_slack`` not given: the class's own (None is "off")


class _FirstToken:
    """A prompt's first-token deadline: online prompt tokens computed (the
    policy's ``prefilled``) by which FCFS would have given it its first token."""

    __slots__ = ("deadline", "left", "urgent")

    def __init__(self, deadline: int, left: int) -> None:
        self.deadline, self.left, self.urgent = deadline, left, False


class _MLFQEntry:
    __slots__ = ("level", "earned", "attained", "last_served", "promotions", "decode_cost", "decode_span",
                 "settled")

    def __init__(self, level: int, now: float) -> None:
        self.level = level
        # The level its service has earned: starvation lifts ``level``, not
        # this, so a starved job jumps the queue but evicts no one's KV.
        self.earned = level
        self.attained = 0.0  # seconds of service in the current level
        self.last_served = now  # arrival, or end of the last step it ran in
        self.promotions = 0
        # One decode iteration's cost, reused while the context stays in the
        # same span of _DECODE_SPAN tokens: a step's charge changes by a
        # fraction of a percent within it, and the cost model is not called
        # per request per step.
        self.decode_cost = 0.0
        self.decode_span = -1
        # num_computed_tokens when ``attained`` was last brought up to date.
        # Later one-token steps in the same span that cannot reach the
        # quantum are not reported (``SeqState.policy_due``); each would add
        # ``decode_cost``, so they are added, one by one as before, when the
        # job is next looked at. A thousand decodes then cost the scheduler a
        # comparison each instead of a call.
        self.settled = 0


def _last_served(seq: SeqState, e: _MLFQEntry) -> float:
    """When the job last ran, or its wait in Q1 restarted: the scheduler
    stamps every step it runs in, reported to the policy or not."""
    t = seq.last_scheduled_time
    return e.last_served if t is None or t < e.last_served else t


def _held_off(seq: SeqState) -> bool:
    """An online request whose KV is away: swapped to the host, or dropped
    by a recompute (memory binds)."""
    return seq.klass is RequestClass.ONLINE and (
        seq.status is SeqStatus.SWAPPED or seq.status is SeqStatus.SWAPPING_IN
        or (seq.status is SeqStatus.WAITING and seq.num_preemptions > 0))


def _mlfq_key(seq: SeqState) -> tuple[int, float, int]:
    return seq.policy_state["mlfq"].level, seq.arrival_time, seq.arrival_index


class MLFQPolicy(Policy):
    """Naive MLFQ: every job enters Q1, demotion one level at a time."""

    name = "mlfq"
    skip_join = False
    # Levels move by demotion and promotion, each bumping order_epoch.
    sort_key = staticmethod(_mlfq_key)
    OPTIONS = ("num_queues", "base_quantum_ms", "starve_limit_ms", "first_token_slack")
    # Naive MLFQ joins every prompt to Q1 already: no guard unless asked.
    DEFAULT_FIRST_TOKEN_SLACK: int | None = None

    def __init__(
        self,
        cost_model: CostModel | None = None,
        num_queues: int = 8,
        base_quantum_ms: float | None = None,
        starve_limit_ms: float | None = None,
        first_token_slack: int | None | object = _CLASS_DEFAULT,
    ) -> None:
        super().__init__(cost_model)
        if num_queues < 1:
            raise ValueError(f"num_queues must be positive, got {num_queues}")
        if first_token_slack is _CLASS_DEFAULT:
            first_token_slack = self.DEFAULT_FIRST_TOKEN_SLACK
        if first_token_slack is not None and not (isinstance(first_token_slack, int) and first_token_slack >= 0):
            raise ValueError(f"first_token_slack must be >= 0 tokens (or None: off), got {first_token_slack}")
        self.first_token_slack = first_token_slack
        self.prefilled = 0  # online prompt tokens computed toward first tokens
        self.backlog = 0  # online prompt tokens still to compute before first tokens
        # Online prompts before their first token, not yet lifted, with their deadlines.
        self._first: dict[str, tuple[SeqState, _FirstToken]] = {}
        self._held: SeqState | None = None  # the online request last found off the device
        self.num_lifted = 0
        self.step_tokens = _REFERENCE_STEP_TOKENS  # a prompt is lifted a step before its deadline
        q1 = base_quantum_ms / 1e3 if base_quantum_ms is not None else self._min_iteration_time()
        if not q1 > 0:
            raise ValueError(f"base_quantum_ms must be positive, got {base_quantum_ms}")
        self.quanta = [q1 * 2**k for k in range(num_queues)]
        if starve_limit_ms is None:
            alpha = _STARVE_ITERATIONS * max(q1, self.cost.prefill_time(_REFERENCE_STEP_TOKENS, 0))
        else:
            alpha = starve_limit_ms / 1e3
        if not alpha > 0:
            raise ValueError(f"starve_limit_ms must be positive, got {starve_limit_ms}")
        self.starve_limit = alpha
        self.num_promotions = 0
        self.num_demotions = 0
        # No job below Q1 was last served before this, so while the
        # starvation deadline is earlier ``age`` has nothing to look at.
        self._served_floor = float("-inf")

    def _min_iteration_time(self) -> float:
        fn = getattr(self.cost, "min_iteration_time", None)
        return fn() if fn is not None else self.cost.decode_time(1, 1)

    @property
    def num_queues(self) -> int:
        return len(self.quanta)

    def set_step_tokens(self, num_tokens: int) -> None:
        self.step_tokens = num_tokens

    def describe(self) -> dict:
        return {"name": self.name, "quanta_ms": [q * 1e3 for q in self.quanta],
                "starve_limit_ms": self.starve_limit * 1e3, "first_token_slack": self.first_token_slack}

    # -- levels -------------------------------------------------------------
    def level_for_time(self, t: float) -> int:
        """Highest-priority level whose quantum is ≥ ``t`` (the last if none)."""
        for level, quantum in enumerate(self.quanta):
            if quantum >= t:
                return level
        return self.num_queues - 1

    def level(self, seq: SeqState) -> int:
        return seq.policy_state["mlfq"].level

    def queue_label(self, seq: SeqState) -> str:
        return f"q{self.level(seq) + 1}"

    def _join_level(self, seq: SeqState) -> int:
        return 0

    def next_iteration_time(self, seq: SeqState) -> float:
        """Predicted time of ``seq``'s next iteration alone: the rest of its
        (re)prefill, or one decode step at its current context."""
        done = seq.num_computed_tokens
        todo = seq.num_tokens - done
        if todo > 1:
            return self.cost.prefill_time(todo, done)
        return self.cost.decode_time(1, seq.num_tokens)

    def quantum_tokens(self, seq: SeqState) -> int:
        # The quantum of its level over what one decode of it costs alone:
        # MLFQ's own guess of how long the job keeps running (the quantum
        # grows with the service it has had), in steps, since a decode rides
        # in every one.
        step = self.cost.decode_time(1, seq.num_tokens)
        return max(1, math.ceil(self.quanta[seq.policy_state["mlfq"].level] / step)) if step > 0 else 1

    # -- events -------------------------------------------------------------
    def on_arrival(self, seq: SeqState, now: float) -> None:
        seq.policy_state["mlfq"] = _MLFQEntry(self._join_level(seq), now)
        if now < self._served_floor:
            self._served_floor = now
        if self.first_token_slack is not None and seq.klass is RequestClass.ONLINE and not seq.num_output_tokens:
            left = max(1, seq.num_prompt_tokens - seq.num_cached_tokens)
            self.backlog += left
            f = seq.policy_state["first"] = _FirstToken(self.prefilled + self.backlog + self.first_token_slack, left)
            self._first[seq.request_id] = seq, f

    def _prefilled(self, seq: SeqState, f: _FirstToken, num_tokens: int) -> None:
        done = f.left if seq.num_computed_tokens >= seq.num_prompt_tokens else min(f.left, num_tokens)
        f.left -= done
        self.prefilled += done
        self.backlog -= done
        if not f.left:
            f.urgent = False
            self._first.pop(seq.request_id, None)

    def on_finish(self, seq: SeqState) -> None:
        f = seq.policy_state.get("first")
        if f is not None and f.left:
            self.backlog -= f.left
            f.left = 0
            self._first.pop(seq.request_id, None)

    def on_step_done(self, seq: SeqState, num_tokens: int, step_time: float, now: float) -> None:
        # A prompt's steps up to the one that samples its first token are the
        # guard's; decodes skip the lookup.
        f = seq.policy_state.get("first") if seq.num_output_tokens <= 1 else None
        if f is not None and f.left:
            self._prefilled(seq, f, num_tokens)
            if f.urgent:  # no demotion before its first token
                self._step_done(seq, num_tokens, now)
                e = seq.policy_state["mlfq"]
                if e.level:
                    e.level, e.attained = 0, 0.0
                    self.order_epoch += 1
                return
        self._step_done(seq, num_tokens, now)

    def _step_done(self, seq: SeqState, num_tokens: int, now: float) -> None:
        e: _MLFQEntry = seq.policy_state["mlfq"]
        context = seq.num_computed_tokens - num_tokens
        if seq.policy_due:
            self._charge_skipped(e, context)
            seq.policy_due = 0
        e.settled = seq.num_computed_tokens
        if num_tokens == 1 and context > 0:
            span = context // _DECODE_SPAN
            if span != e.decode_span:
                e.decode_span = span
                e.decode_cost = self.cost.decode_time(1, context + 1)
            e.attained += e.decode_cost
            decode = True
        else:
            e.attained += self.cost.prefill_time(num_tokens, context)
            decode = False
        e.last_served = now
        last = len(self.quanta) - 1
        if e.attained < self.quanta[e.level] or e.level == last:
            if decode:
                seq.policy_due = self._decode_due(seq, e, last)
            return
        if now < self._served_floor:
            self._served_floor = now
        self.order_epoch += 1
        e.level += 1
        e.attained = 0.0
        self.num_demotions += 1
        if self.skip_join and e.level < last:
            # Skip the levels whose quantum the next iteration alone would use up.
            e.level = max(e.level, self.level_for_time(self.next_iteration_time(seq)))
        e.earned = max(e.earned, e.level)

    def _decode_due(self, seq: SeqState, e: _MLFQEntry, last: int) -> int:
        """How far the next one-token steps may take num_computed_tokens
        unreported: while they stay in this span (same cost) and leave the
        job short of its quantum (no demotion to make)."""
        quantum = self.quanta[e.level] if e.level < last else float("inf")
        attained, cost = e.attained, e.decode_cost
        done, end = seq.num_computed_tokens, (e.decode_span + 1) * _DECODE_SPAN
        while done < end:  # the step at context ``done``
            attained += cost
            if attained >= quantum:
                break
            done += 1
        return done

    @staticmethod
    def _charge_skipped(e: _MLFQEntry, upto: int) -> None:
        """Add the decodes run since ``e.settled`` unreported, in order, so
        ``attained`` is the float the per-step charges would have made."""
        attained, cost = e.attained, e.decode_cost
        for _ in range(upto - e.settled):
            attained += cost
        e.attained = attained
        e.settled = upto

    def settle(self, seq: SeqState) -> None:
        if seq.policy_due:
            self._charge_skipped(seq.policy_state["mlfq"], seq.num_computed_tokens)

    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        if self._first and seqs and seqs[0].klass is RequestClass.ONLINE:  # one class: the guard is for online
            seqs = self._lift(seqs)
        self._promote_starved(seqs, now)  # ``seqs`` may be one class only: the floor is not for them
        return sorted(seqs, key=_mlfq_key)

    def _lift(self, seqs: Iterable[SeqState]) -> Iterable[SeqState]:
        """Lift to Q1 each prompt whose first-token deadline is a step
        away, unless an online request is held off the device; ``seqs``
        again (as a list, if it had to be read)."""
        limit = self.prefilled + self.step_tokens
        due = [(s, f) for s, f in self._first.values() if f.deadline - f.left <= limit]
        if not due:
            return seqs
        # While memory binds the same request usually stays held step after
        # step: looking at it first spares a scan of every request.
        if self._held is not None and _held_off(self._held):
            return seqs  # memory binds: skip-join's ranking decides
        seqs = list(seqs)
        self._held = next((s for s in seqs if _held_off(s)), None)
        if self._held is not None:
            return seqs
        for s, f in due:
            f.urgent = True
            del self._first[s.request_id]
            self.num_lifted += 1
            e: _MLFQEntry = s.policy_state["mlfq"]
            if e.level:
                e.level, e.attained = 0, 0.0
                self.order_epoch += 1
        return seqs

    def age(self, seqs: Iterable[SeqState], now: float) -> None:
        if self._first:
            seqs = self._lift(seqs)
        if now - self.starve_limit < self._served_floor:
            return  # every job below Q1 was served since: none starves yet
        self._served_floor = self._promote_starved(seqs, now)

    def _promote_starved(self, seqs: Iterable[SeqState], now: float) -> float:
        """Lift every job below Q1 not served for the starve limit to Q1;
        the earliest ``last_served`` of those left below (``now`` if none)."""
        deadline = now - self.starve_limit
        floor = now
        for s in seqs:
            e: _MLFQEntry = s.policy_state["mlfq"]
            if not e.level:
                continue
            served = _last_served(s, e)
            if served < deadline:
                e.level = 0
                e.attained = 0.0
                e.settled = s.num_computed_tokens
                s.policy_due = 0  # what it had not been charged goes with the reset
                e.last_served = now  # its wait restarts in Q1
                e.promotions += 1
                self.num_promotions += 1
                self.order_epoch += 1
            elif served < floor:
                floor = served
        return floor


    def priority(self, seq: SeqState) -> float:
        return float(seq.policy_state["mlfq"].earned)

    def enst(self, ranked: list[SeqState], now: float, batch: int) -> list[float]:
        """FastServe §4.2: ENST(i) = min(T_promote(i), T_execute(i)).
        T_execute sums the service the jobs ranked above i may still take in
        their current queue (quantum minus attained), shared over a batch of
        ``batch`` jobs; T_promote is when starvation lifts i to Q1."""
        out = []
        ahead = 0.0
        for s in ranked:
            e: _MLFQEntry = s.policy_state["mlfq"]
            if s.policy_due:
                self._charge_skipped(e, s.num_computed_tokens)
            t_execute = ahead / batch
            t_promote = _last_served(s, e) + self.starve_limit - now if e.level else t_execute
            out.append(max(0.0, min(t_execute, t_promote)))
            ahead += max(0.0, self.quanta[e.level] - e.attained)
        return out


class SkipJoinMLFQPolicy(MLFQPolicy):
    """FastServe's skip-join MLFQ: an arrival joins the highest queue whose
    quantum covers its predicted prefill time."""

    name = "skip-join-mlfq"
    skip_join = True
    DEFAULT_FIRST_TOKEN_SLACK = 0

    def _join_level(self, seq: SeqState) -> int:
        # What is left to compute: a cached prefix makes a long prompt a short job.
        cached = seq.num_cached_tokens
        return self.level_for_time(self.cost.prefill_time(seq.num_prompt_tokens - cached, cached))
