"""The engine: request state, the step loop, models, workers and executors.

``from fluidserve.engine import LLM, SamplingParams`` is the offline API. The
heavy names load lazily so pure-Python users (the scheduler, the simulator)
can import ``fluidserve.engine.sampling_params`` without torch.
"""

from __future__ import annotations

import os
import sys

from fluidserve.engine.sampling_params import SamplingParams

if "torch" not in sys.modules:
    # Read once, when torch loads OpenMP: idle compute threads sleep instead
    # of spinning, as ``fluidserve serve`` sets them. Where other work shares
    # the cores (the event loop, a neighbour's job) two spinning threads burn
    # their time slices waiting for each other: a decode step of a 16-layer
    # model took 153 ms instead of 26 ms on a loaded 2-core machine. A value
    # the user set wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from fluidserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from fluidserve.engine.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from fluidserve.engine.config import EngineConfig

        return EngineConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from fluidserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
