"""The Executor contract between the engine and its workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from fluidserve.engine.batch import ModelInput, StepResult


class ExecutorError(RuntimeError):
    """A worker died, hung or failed a step; in-flight requests cannot finish."""


class Executor(ABC):
    num_kv_blocks: int  # device KV blocks every worker allocated
    num_host_blocks: int  # host KV blocks every worker allocated (0: no swapping)
    bytes_per_block: int  # one KV block, all ranks together (what a swap moves)
    eos_token_id: int | None

    @abstractmethod
    def execute(self, inp: ModelInput) -> StepResult:
        """Run one step (its KV moves, then the forward); returns the sampled
        token of each sampling row keyed by request id. Raises ExecutorError
        when a worker cannot complete it."""

    # Async scheduling: whether ``launch`` queues a step and returns before
    # its tokens are read (one in-process worker).
    can_launch: bool = False

    def launch(self, inp: ModelInput):
        """Queue a plain decode step (``Worker.launch``); returns a handle
        whose ``result()`` is the step's StepResult. Only where ``can_launch``."""
        raise NotImplementedError(f"{type(self).__name__} runs steps synchronously")

    def interrupt(self, step_id: int) -> None:
        """Ask the workers to abandon step ``step_id`` at its next layer
        safepoint (a preemptible step only; one that has ended ignores it).
        Called from another thread while ``execute`` runs; never blocks on
        the step."""

    def check_health(self) -> None:
        """Raise ExecutorError if a worker is dead."""

    def shutdown(self) -> None:
        """Release workers and device memory."""
