"""The engine: request state, the step loop, models, workers and executors.

``from fluidserve.engine import LLM, SamplingParams`` is the offline API. The
heavy names load lazily so pure-Python users (the scheduler, the simulator)
can import ``fluidserve.engine.sampling_params`` without torch.
"""

from __future__ import annotations

from fluidserve.engine.sampling_params import PoolingParams, SamplingParams

# OpenMP's wait policy is left as torch has it: idle compute threads spin a
# while before they sleep, which a batch job on a machine of its own wants
# (a 16-layer decode step: 14 ms spinning against 24 ms with sleeping
# threads, which pay a wake-up on every op; offline against vLLM's CPU build,
# benchmarks/vs_vllm.py). ``fluidserve serve`` makes them sleep instead: its
# event loop shares the cores (serve/cli.py).

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "LoRARequest"]


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
    if name == "LoRARequest":
        from fluidserve.engine.lora import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from fluidserve.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
