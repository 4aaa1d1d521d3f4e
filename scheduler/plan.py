"""StepPlan: the one object that crosses from the scheduler to the engine.

For each scheduled request, how many of its uncomputed tokens run this step (a
prefill chunk, a whole prompt, or one decode token). KV movement decisions
travel as plain block maps; only the worker's cache engine copies memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSeq:
    request_id: str
    num_tokens: int  # tokens computed this step
    # True when this step computes the request's last uncomputed token, so a
    # new token is sampled for it (a middle prefill chunk samples nothing).
    samples: bool


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # KV released this step (recompute)
    swap_out: dict[int, int] = field(default_factory=dict)  # device block -> host block
    swap_in: dict[int, int] = field(default_factory=dict)  # host block -> device block
    checkpoint: dict[int, int] = field(default_factory=dict)  # device block -> host block
    preemptible: bool = False  # only offline work: may be abandoned at a layer safepoint

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
