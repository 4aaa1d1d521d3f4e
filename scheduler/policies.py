"""Scheduling policies: the order in which requests are offered the step.

A policy only ranks requests and keeps its own bookkeeping; the token budget,
the request cap and KV admission live in ``Scheduler``. Contract: ``order``
returns every request it is given exactly once, highest priority first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from .request_state import SeqState


class Policy(ABC):
    name: str = "policy"

    def on_arrival(self, seq: SeqState, now: float) -> None:
        """A request joined the scheduler."""

    def on_step_done(self, seq: SeqState, num_tokens: int, step_time: float, now: float) -> None:
        """``seq`` ran ``num_tokens`` tokens in a step that took ``step_time``."""

    def on_finish(self, seq: SeqState) -> None:
        """``seq`` finished or was aborted."""

    @abstractmethod
    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        """Rank ``seqs`` (one request class) highest priority first."""


class FCFSPolicy(Policy):
    """Orca/vLLM behaviour: first come, first served, no preemption by age."""

    name = "fcfs"

    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        return sorted(seqs, key=lambda s: s.arrival_time)


POLICIES: dict[str, type[Policy]] = {FCFSPolicy.name: FCFSPolicy}


def make_policy(name: str, **kwargs) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {name!r}") from None
    return cls(**kwargs)
