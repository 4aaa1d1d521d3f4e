"""Executors run a ModelInput on the workers: in-process (local) or on Ray
actors, one per GPU (ray). The engine only sees the ``Executor`` interface."""

from __future__ import annotations

from fluidserve.engine.executor.base import Executor, ExecutorError


def make_executor(config, model_dir: str) -> Executor:
    if config.executor == "ray":
        from fluidserve.engine.executor.ray import RayExecutor

        return RayExecutor(config, model_dir)
    from fluidserve.engine.executor.local import LocalExecutor

    return LocalExecutor(config, model_dir)


__all__ = ["Executor", "ExecutorError", "make_executor"]
