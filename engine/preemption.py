"""Layer-wise preemption (ConServe §4.3): the one decoder-layer loop every
model runs, its safepoints, the interrupt flag they read, and the engine-side
rule for when an online arrival interrupts a running step.

A step the scheduler marked preemptible (offline work only) checks, every
``k`` decoder layers, whether the engine asked to interrupt *that* step. If
so the forward stops there (``StepAbandoned``) and the worker returns a
StepResult with no tokens: nothing is sampled, so no sampler state moves, and
the scheduler counts none of the step's tokens as computed. The KV the
finished layers wrote sits in slots past every sequence's computed length;
the retried step overwrites it before anything reads it::

    layers     0   1 | 2   3 | 4   5 | head       k = 2, 6 layers
    safepoint  ^       ^       ^       ^          checked before layers 0, 2, 4 and the head
    interrupt            *                        arrives while layer 2 runs
    stop                       ^ layer 4          layers 0-3 wrote KV nobody reads yet
    resume                     ^ layer 4          from the kept input of layer 4

The last safepoint, whatever ``k``, is after the last layer: the head (final
norm, LM head, sampling) of a decode-heavy step is as long as several layers.

``k`` may be a multiple of a half: safepoints then also fall between a
layer's attention and its MLP, each layer's two halves (``attend`` and
``feed_forward``). Positions count halves (2 * layer, + 1 before the MLP),
so with ``k = 0.5`` the wait for the next safepoint is the longer half of a
layer instead of a whole one. A decoder layer's output is a function of the
hidden state between its halves alone, so a stop there keeps one tensor, as
at a layer boundary. Whole-layer intervals keep calling the layer as one
module, so the models' hot path is unchanged.

The stop is a pause, not a loss: the exception carries the hidden state
that entered the stopping layer, and the worker keeps it (``PausedForward``).
The engine later sends the same step again, marked as resuming it, and the
loop starts at that layer from the kept state: layers already run are not run
again, and the result is the one the uninterrupted step would have given (the
same operations on the same values). The scheduler runs nothing else of the
paused step's requests, and keeps their blocks, until it resumes; a worker
that kept nothing (another step came first) runs the step from layer 0, which
is also correct, only slower.

The flag is a host-side integer: the id of the step to interrupt (an id,
not a boolean, so a request meant for one step can never stop the next).
Reading it costs no device work. On CUDA the host runs ahead of the device,
so each safepoint first waits for the device to reach the previous safepoint
(an event recorded there): the host is then at most ``k`` layers ahead, and an
interrupt stops the device within about ``k`` layers without draining it.

Under tensor parallelism every layer all-reduces, so a rank that stopped
alone would leave the others waiting forever. The ranks agree at each
safepoint: one all-reduce (MAX) of a one-element CPU tensor over a gloo
group, so every rank stops at the same layer or none does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fluidserve.engine.parallel import TensorParallel
from fluidserve.engine.runtime import runtime_for
from fluidserve.scheduler.budget import safepoint_attention_share as attention_share
from fluidserve.scheduler.budget import safepoint_interval_share as interval_share
from fluidserve.scheduler.cost_model import ModelShape

NO_STEP = -1


class StepAbandoned(Exception):
    """Raised by the layer loop at the safepoint where the step stops, with
    the hidden state the next half-layer would have read (None: not kept).
    ``position`` counts half-layers (``2 * layer``, + 1 between a layer's
    attention and its MLP)."""

    def __init__(self, position: int, hidden: torch.Tensor | None = None) -> None:
        super().__init__(f"step abandoned before layer {position / 2:g}")
        self.position = position
        self.hidden = hidden

    @property
    def layer(self) -> float:
        """The layer it stopped before; x.5: before layer x's MLP."""
        return self.position / 2


@dataclass
class PausedForward:
    """A worker's stopped forward: the step it belongs to, the half-layer
    position it stopped before, and that position's input."""

    step_id: int
    position: int
    hidden: torch.Tensor


class InterruptFlag:
    """The step the engine asked to interrupt; written by one thread (the
    engine's event loop, or the Ray actor's control thread), read by the
    layer loop. A single int store and load: atomic under the GIL."""

    def __init__(self) -> None:
        self.step_id = NO_STEP

    def request(self, step_id: int) -> None:
        self.step_id = step_id

    def is_set_for(self, step_id: int) -> bool:
        return self.step_id == step_id


class Safepoints:
    """One worker's safepoint checks: armed for one preemptible step at a
    time. Built on every rank at the same point of startup (the gloo group
    it may create is a collective call)."""

    def __init__(self, every_layers: float, tp: TensorParallel, device: torch.device) -> None:
        if every_layers < 0 or not float(2 * every_layers).is_integer():
            raise ValueError(f"safepoints come every whole or half number of layers, got {every_layers}")
        self.every = int(2 * every_layers)  # in half-layers; 0: never checked
        self.flag = InterruptFlag()
        self.tp = tp
        self.runtime = runtime_for(device)
        self.step_id = NO_STEP
        self._group = None
        self._vote = torch.zeros(1, dtype=torch.int32)
        self._last_event: Any = None
        if tp.size > 1 and self.every > 0:
            # The model's collectives may run on NCCL; the vote stays on the
            # host, so it never waits for the device stream.
            gloo = dist.get_backend(tp.group) == "gloo"
            self._group = tp.group if gloo else dist.new_group(backend="gloo")
        self.checks = 0  # safepoints passed since startup (benchmarks read it)

    def arm(self, step_id: int) -> None:
        self.step_id = step_id
        self._last_event = None

    def disarm(self) -> None:
        self.step_id = NO_STEP
        self._last_event = None

    @property
    def armed(self) -> bool:
        return self.step_id != NO_STEP and self.every > 0

    @property
    def splits_layers(self) -> bool:
        """Whether some safepoints fall between a layer's two halves."""
        return self.every % 2 == 1

    def stop_before(self, position: int) -> bool:
        """Whether the armed step stops before half-layer ``position`` (every
        rank gets the same answer)."""
        if position % self.every:
            return False
        return self._check()

    def stop_before_head(self) -> bool:
        """Whether the armed step stops after its last layer, before the
        head: checked whatever the interval (every rank gets the same answer)."""
        return self._check()

    def _check(self) -> bool:
        self.checks += 1
        self._pace()
        stop = self.flag.is_set_for(self.step_id)
        if self._group is not None:
            self._vote[0] = int(stop)
            dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self._group)
            stop = bool(self._vote[0])
        return stop

    def _pace(self) -> None:
        # Keeps the host at most one safepoint interval ahead of the device
        # (an event's synchronize waits for that event only, not for later
        # work); on the CPU the events are done when recorded.
        previous, self._last_event = self._last_event, self.runtime.event()
        self._last_event.record()
        if previous is not None:
            previous.synchronize()


class LayerLoop:
    """The decoder-layer loop of a model. Each model family holds one (a plain
    attribute, not a module: the checkpoint's parameter names stay) and
    exposes it as ``layer_loop``; the worker arms its safepoints for a
    preemptible step."""

    def __init__(self) -> None:
        self.safepoints: Safepoints | None = None
        self._resume: PausedForward | None = None

    def resume_next(self, paused: PausedForward | None) -> None:
        """Make the next ``run`` start at ``paused.position`` from its kept
        input, whatever input the model passes (the worker calls this just
        before the forward of the step it resumes; None clears it, so a
        forward that failed before its layers cannot pass it on)."""
        self._resume = paused

    @property
    def resuming(self) -> bool:
        """Whether the next ``run`` starts part-way, from a paused step."""
        return self._resume is not None

    def run(self, layers: Iterable[Any], kv_caches: Iterable[Any], x: torch.Tensor,
            call: Callable[[Any, torch.Tensor, Any], torch.Tensor],
            attend: Callable[[Any, torch.Tensor, Any], torch.Tensor]) -> torch.Tensor:
        """``x = call(layer, x, kv)`` for each layer and its KV cache (where a
        safepoint splits a layer: ``attend(layer, x, kv)``, then
        ``layer.feed_forward``); raises StepAbandoned, with the stopping
        position's input, at a safepoint where the armed step is interrupted."""
        sp, start = self.safepoints, 0
        if self._resume is not None:
            start, x = self._resume.position, self._resume.hidden
            self._resume = None
        armed = sp is not None and sp.armed
        if not armed and not start:
            for layer, kv in zip(layers, kv_caches):
                x = call(layer, x, kv)
            return x
        split = armed and sp.splits_layers
        end = 0
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            at = end = 2 * i
            if at + 1 < start:
                continue
            if at < start:  # resumed between this layer's halves
                x = layer.feed_forward(x)
                continue
            if armed and sp.stop_before(at):
                raise StepAbandoned(at, x)
            if not split:
                x = call(layer, x, kv)
                continue
            x = attend(layer, x, kv)
            if sp.stop_before(at + 1):
                raise StepAbandoned(at + 1, x)
            x = layer.feed_forward(x)
        # The last safepoint: before the head (final norm, LM head, draw).
        # The head of a decode-heavy step is a long stretch of its own (a row
        # of the vocabulary-wide projection per sequence, about two layers'
        # weights on Llama-3-8B, most of a small model's step).
        end += 2
        if armed and start < end and sp.stop_before_head():
            raise StepAbandoned(end, x)
        return x


# -- the engine side ----------------------------------------------------------


def feed_forward_share(hf_config: Any) -> float:
    """The MLP's share of a decoder layer's weights, from the model config:
    the share of a prompt token's compute after the attention safepoint
    (the attention scores' own compute, which grows with context, is left
    out: a safepoint interval is planned for prompt-heavy offline steps).
    The roofline's reading of the config (``ModelShape``: a MoE token's own
    experts, OPT's two-matrix MLP); 0.5 where the config does not say."""
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    cfg.setdefault("vocab_size", 0)  # the share reads no vocabulary
    try:
        return ModelShape.from_hf_config(cfg).feed_forward_share
    except (KeyError, TypeError, ZeroDivisionError):
        return 0.5


def safepoint_shares(every_layers: float, hf_config: Any) -> tuple[float | None, float | None]:
    """``budget.safepoint_interval_share`` and ``budget.safepoint_attention_share``
    of this model, as the scheduler takes them (None: no safepoints)."""
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    return (interval_share(every_layers, layers, feed_forward_share(hf_config)),
            attention_share(every_layers, layers))


class PreemptionPolicy:
    """When an online arrival interrupts the running step (ConServe
    Algorithm 2's PreemptRunning): the first online arrival during a
    preemptible step stops it at its next safepoint, with or without a TTFT
    SLO. ConServe stops a step only where waiting for its predicted end
    would make the arrival miss its TTFT SLO, because a stopped step's work
    is redone; ours pauses and resumes where it stopped, so stopping costs a
    resume, while waiting costs the arrival the step's remaining time, which
    the cost model predicts least well (decode-heavy offline steps on a CPU
    ran up to 1.9x their prediction; through the server, arrivals that let such a
    step run on waited past 100 ms under a 70 ms TTFT SLO). The engine loop
    reports each step's start and end; the event loop reports online
    arrivals."""

    def __init__(self, interrupt: Callable[[int], None]) -> None:
        self._interrupt = interrupt
        self._lock = threading.Lock()
        self._running = NO_STEP  # the preemptible step running now
        self._requested = NO_STEP
        self.num_requests = 0  # interrupts sent (a step may end before it reads one)

    def step_started(self, step_id: int) -> None:
        """A preemptible step is running (only those are announced)."""
        with self._lock:
            self._running = step_id

    def step_ended(self) -> None:
        with self._lock:
            self._running = NO_STEP

    def on_online_arrival(self) -> bool:
        """Interrupt the running (preemptible) step for an online arrival;
        True when one was sent (one per step)."""
        with self._lock:
            step_id = self._running
            if step_id == NO_STEP or self._requested == step_id:
                return False
            self._requested = step_id
            self.num_requests += 1
        self._interrupt(step_id)
        return True
