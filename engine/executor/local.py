"""LocalExecutor: one Worker in the engine's own process."""

from __future__ import annotations

from fluidserve.engine.batch import ModelInput, StepResult
from fluidserve.engine.executor.base import Executor
from fluidserve.engine.worker import PendingStep, Worker


class LocalExecutor(Executor):
    def __init__(self, config, model_dir: str) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs executor='ray'")
        self.worker = Worker(config, str(model_dir))
        self.num_kv_blocks = self.worker.available_kv_blocks()
        self.num_host_blocks = self.worker.available_host_blocks()
        self.bytes_per_block = self.worker.bytes_per_block()
        self.worker.init_cache(self.num_kv_blocks, self.num_host_blocks)
        self.worker.warm_up()  # on CUDA this compiles the attention variants before serving
        self.eos_token_id = self.worker.eos_token_id

    can_launch = True

    def execute(self, inp: ModelInput) -> StepResult:
        return self.worker.execute(inp)

    def launch(self, inp: ModelInput) -> PendingStep:
        return self.worker.launch(inp)

    def interrupt(self, step_id: int) -> None:
        self.worker.interrupt(step_id)  # a host-side flag the layer loop reads

    def shutdown(self) -> None:
        self.worker.cache = None
