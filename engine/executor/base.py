"""The Executor contract between the engine and its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..batch import ModelInput


class ExecutorError(RuntimeError):
    """A worker died, hung or failed a step; in-flight requests cannot finish."""


class Executor(ABC):
    num_kv_blocks: int  # device KV blocks every worker allocated
    eos_token_id: int | None

    @abstractmethod
    def execute(self, inp: ModelInput) -> list:
        """Run one step; returns the SampledToken of each sampling row, in order.
        Raises ExecutorError when a worker cannot complete it."""

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is dead."""

    def shutdown(self) -> None:
        """Release workers and device memory."""
