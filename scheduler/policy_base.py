"""Policy: the interface every scheduling policy implements (see policies.py
for the registered ones and ``make_policy``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

from fluidserve.scheduler.cost_model import CostModel, default_cost_model
from fluidserve.scheduler.request_state import SeqState


class Policy(ABC):
    name: str = "policy"
    # Set when ``order`` is ``age`` then a stable sort by this key, and a
    # request's key changes only where ``order_epoch`` is bumped: the
    # scheduler then keeps its ranking between steps and sorts it again (in
    # place, nearly sorted) only when the epoch moved.
    sort_key: Callable[[SeqState], Any] | None = None
    order_epoch: int = 0

    def __init__(self, cost_model: CostModel | None = None) -> None:
        self.cost: CostModel = cost_model if cost_model is not None else default_cost_model()

    def set_step_tokens(self, num_tokens: int) -> None:
        """The scheduler's token budget per step, for a policy that counts
        in tokens; the scheduler tells it once, at start."""

    def on_arrival(self, seq: SeqState, now: float) -> None:
        """A request joined the scheduler."""

    def on_step_done(self, seq: SeqState, num_tokens: int, step_time: float, now: float) -> None:
        """``seq`` ran ``num_tokens`` tokens in a step that took ``step_time``;
        ``seq.num_computed_tokens`` already counts them. Not called for a
        one-token step that ends at or below ``seq.policy_due``, which the
        policy sets for the steps it can charge later in one go."""

    def settle(self, seq: SeqState) -> None:
        """Charge the steps skipped under ``seq.policy_due`` now: the
        scheduler is about to rewind ``seq.num_computed_tokens``."""

    def on_finish(self, seq: SeqState) -> None:
        """``seq`` finished or was aborted."""

    @abstractmethod
    def order(self, seqs: list[SeqState], now: float) -> list[SeqState]:
        """Rank ``seqs`` (one request class) highest priority first."""

    def age(self, seqs: Iterable[SeqState], now: float) -> None:
        """Order changes that time alone makes (every unfinished request is
        passed), for a scheduler that keeps its ranking; bump ``order_epoch``
        if any. ``order`` makes them too."""

    def priority(self, seq: SeqState) -> float:
        """Priority of ``seq`` inside its class, lower first, for eviction: a
        waiting or swapped request may push a resident one out to host
        memory only if its priority is strictly better. Ties in ``order``
        (arrival order inside one level) are no reason to move KV, so the
        default (every request equal) never evicts for a newcomer."""
        return 0.0

    def enst(self, ranked: list[SeqState], now: float, batch: int) -> list[float]:
        """Estimated next scheduled time of each of ``ranked`` (this policy's
        order, highest first), in any unit that orders them: the KV manager
        swaps out the largest first and swaps in the smallest first
        (FastServe §4.2). Without a model of time, the number of full batches
        ranked ahead."""
        return [float(i // batch) for i in range(len(ranked))]

    def quantum_tokens(self, seq: SeqState) -> int:
        """Decode steps that make a quantum's worth of service for ``seq``:
        the policy's guess of how long it keeps running once it runs. A
        request swapped in is not evicted again for a higher-priority one
        before it has run them (or the copies there and back bought
        nothing), and a streaming victim must afford to be away as long as
        its requester's. Without quanta, one step."""
        return 1

    def queue_label(self, seq: SeqState) -> str:
        """The queue ``seq`` waits in, for metrics ("all" for single-queue policies)."""
        return "all"

    def describe(self) -> dict:
        """The policy's effective settings (for logs and benchmark output)."""
        return {"name": self.name}
