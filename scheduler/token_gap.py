"""TokenDeadlines: when each streaming online request must emit its next token.

A request streams at its own pace when it runs in every step from its first
token on: its ``n``-th token comes ``n - 1`` steps after the first. Skipped
steps (it waited, or was away on the host) slow it down. ``--swap-tpot-slack
X`` holds each request to ``X`` times its own pace: after ``n`` tokens it
has ``(X - 1) * n`` steps of credit to be skipped for, so a request that has
streamed long may be evicted for a while and one just admitted may not. Where
``--online-tpot-slo-ms`` is set the budget is absolute instead: the next
token by ``t1 + slo * n`` (``t1`` the first token's time).
``--max-token-gap-ms`` adds a hard bound on each gap: the next token by
``last + gap``.
The deadline is the earliest of those that apply; steps convert to seconds
by the running mean of measured step times.

The scheduler reads deadlines three ways (scheduler/scheduler.py):

* eviction: a streaming request is evicted only when its deadline leaves
  room for the time it will be away (its copy out and back, by the host
  link's time per block, and the steps the round trip takes);
* order: a request whose deadline would pass if it were skipped this step
  runs ahead of its policy's order, and may evict requests that have slack;
* step size (the gap bound only): prompt chunks beside decodes are cut so
  the step's predicted time keeps the bound.

Offline requests and requests with no token out yet have no deadline.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.scheduler.config import SchedulerConfig
from fluidserve.scheduler.request_state import RequestClass, SeqState

_STEP_MEAN_WEIGHT = 0.1  # of each new step in the running mean of step times

INF = float("inf")


@dataclass
class TokenDeadlines:
    """``slack``: the multiple of its own pace a request is held to (None:
    none); ``tpot_s``: an absolute TPOT budget (None: none); ``gap_s``: the
    hard bound on one gap (None: none); ``step_time``: the running mean of
    measured step times, seeded with the cost model's shortest step."""

    slack: float | None
    tpot_s: float | None
    gap_s: float | None
    step_time: float
    num_steps: int = 0  # steps that ran requests so far
    # request id -> (time of its first token, num_steps when it came)
    first_token: dict[str, tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: SchedulerConfig, step_time: float) -> TokenDeadlines | None:
        """The deadlines ``config`` asks for; None where it asks for none."""
        tpot, slack, gap = config.online_tpot_slo_ms, config.swap_tpot_slack, config.max_token_gap_ms
        if tpot is not None:  # the user's word replaces the relative budget
            slack = None
        if tpot is None and slack is None and gap is None:
            return None
        return cls(slack, None if tpot is None else tpot / 1e3, None if gap is None else gap / 1e3, step_time)

    def observe(self, step_time: float) -> None:
        """A step that ran requests took ``step_time`` seconds."""
        self.num_steps += 1
        self.step_time += _STEP_MEAN_WEIGHT * (step_time - self.step_time)

    def note_token(self, seq: SeqState, now: float) -> None:
        """``seq`` just emitted a token (its count already includes it), in
        the step ``observe`` just counted."""
        if seq.request_id not in self.first_token:
            self.first_token[seq.request_id] = (now, self.num_steps)

    def forget(self, request_id: str) -> None:
        self.first_token.pop(request_id, None)

    def steps_to_slack(self) -> float:
        """Steps a request admitted now runs before it may be evicted for a
        round trip and a step away (inf: never): streaming requests away from
        the device that are due before then need their blocks kept free."""
        need = 4.0  # the round trip's three steps and one away
        est = self.step_time
        steps = 0.0
        if self.slack is not None:
            steps = need / (self.slack - 1) if self.slack > 1 else INF
        if self.tpot_s is not None:
            steps = need * est / (self.tpot_s - est) if self.tpot_s > est else INF
        if self.gap_s is not None and self.gap_s < need * est:  # a gap bound gives no credit
            steps = INF
        return steps

    def deadline(self, seq: SeqState, now: float) -> float:
        """When ``seq``'s next token is due (inf: no deadline)."""
        first = self.first_token.get(seq.request_id)
        if first is None or seq.klass is RequestClass.OFFLINE:
            return INF
        t1, k1 = first
        n = seq.num_output_tokens
        due = INF
        if self.slack is not None:
            # Its next token is due by step k1 + slack * n; the step being
            # planned is num_steps + 1.
            due = now + (k1 + self.slack * n - self.num_steps) * self.step_time
        if self.tpot_s is not None:
            due = min(due, t1 + self.tpot_s * n)
        if self.gap_s is not None and seq.last_scheduled_time is not None:
            due = min(due, seq.last_scheduled_time + self.gap_s)
        return due
