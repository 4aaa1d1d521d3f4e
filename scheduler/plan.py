"""StepPlan and StepOutcome: what crosses between the scheduler and the engine.

``StepPlan`` (scheduler -> engine): for each scheduled request, how many of its
uncomputed tokens run this step (a prefill chunk, a whole prompt, or one
decode token) and the device blocks the engine has not been told of yet. KV
moves travel as plain lists of block pairs; only the worker's cache engine copies
memory. Order on the worker: swap-outs, then swap-ins, then the forward, which
waits only for the swap-ins of requests it runs.

``StepOutcome`` (engine -> scheduler): what the engine learnt from running the
plan; ``Scheduler.update_from_output`` is its one reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)  # one per request per step: cheap to make
class ScheduledSeq:
    request_id: str
    num_tokens: int  # tokens computed this step
    # True when this step computes the request's last uncomputed token, so a
    # new token is sampled for it (a middle prefill chunk samples nothing).
    samples: bool
    # Of num_tokens, draft tokens verified after a decode's one (speculative
    # decoding): each position samples, and the engine reports how many of
    # them stood (``StepOutcome.rejected``).
    drafts: int = 0


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # KV discarded this step (recompute)
    swapped_out: list[str] = field(default_factory=list)  # requests whose KV leaves the device
    swapped_in: list[str] = field(default_factory=list)  # requests whose KV comes back
    # (source, destination) block pairs. Lists, not maps: a block shared by
    # two requests (prefix caching) may leave for two host blocks in one step.
    # swap_out also carries demotions and checkpoints: every device -> host copy.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Only offline work: the worker may abandon the forward at a layer
    # safepoint when an online arrival needs the device (ConServe §4.3).
    preemptible: bool = False
    # (prefill tokens, decode requests, context, prefill attention pairs), as
    # the cost model reads a step; set when the scheduler records shapes.
    shape: tuple[int, int, int, int] | None = None
    # The step runs an online prompt's tokens (the SLO budget learns from
    # how long such steps really take).
    prefills_online: bool = False
    # This plan continues a paused one (the same requests and tokens): the
    # engine sends the paused step's input again and the worker resumes it.
    resumes: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def has_copies(self) -> bool:
        return bool(self.swap_out or self.swap_in)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy."""
        return not self.scheduled and not self.has_copies


@dataclass
class StepOutcome:
    """What the engine reports after running a plan."""

    step_time: float  # seconds the step took (measured, or the simulator's cost)
    now: float  # when the step started
    # Requests that stopped on the token sampled this step (EOS, stop string,
    # length): the scheduler releases them.
    finished: list[str] = field(default_factory=list)
    # The worker abandoned the forward at a safepoint: no token was computed
    # (the KV it wrote is recomputed and overwritten next time); the plan's
    # KV copies, done before the forward, did happen.
    abandoned: bool = False
    # Abandoned, but the worker kept its state: the scheduler holds the
    # plan's requests (runs nothing else of theirs, keeps their KV) and
    # resumes the plan when no online work is left.
    paused: bool = False
    # The engine's input of a paused step, kept with it to be run again
    # (opaque here: a ModelInput).
    paused_input: Any = None
    # Speculative decoding: request id -> the drafts of its item that did not
    # stand (their KV is not the sequence's; it is overwritten later). A
    # request with drafts missing here kept none.
    rejected: dict[str, int] = field(default_factory=dict)


@dataclass
class PausedStep:
    """A step layer-wise preemption stopped at a safepoint, the worker
    keeping its state: everything about it lives here, in one place. Its
    plan runs again from where it stopped (``resume``); its requests are
    held (run nothing else, keep their KV) until then or until it is given
    up; ``input`` is the engine's input of it, sent again as it was."""

    plan: StepPlan
    held: frozenset[str]
    input: Any = None
    steps_waited: int = 0  # steps run while it waited for online work to drain

    def resume(self) -> StepPlan:
        """The plan again, to run from where it stopped: the same requests
        and tokens, no copies (those were done before it stopped)."""
        p = self.plan
        return StepPlan(scheduled=p.scheduled, preemptible=True, shape=p.shape, resumes=True)
