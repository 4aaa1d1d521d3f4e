"""The device runtime: what only the CUDA runtime has, behind one interface
with a CPU stand-in.

Owns picking and selecting the device, streams and events, pinned host
memory, device memory statistics and whether CUDA graphs can be captured.
The rest of the engine asks its ``DeviceRuntime`` (``runtime_for``) and
takes one path on every device: on the CPU an event is complete when it is
recorded, copies run in line on the one stream, host memory is the device's
memory (nothing to pin) and nothing is captured.

Which attention kernels run is a separate choice (``kernels.ops.use_triton``):
with ``FLUIDSERVE_KERNELS=triton`` a CPU engine plans and launches exactly as
a GPU engine does, the Triton kernels running in Triton's interpreter, with
this module's stand-in under it. That is how CI exercises the GPU code path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch


def pick_device(name: str) -> torch.device:
    """The device ``name`` asks for ("auto", "cpu", "cuda", "cuda:N"). A CUDA
    device always carries its index: ``torch.cuda.set_device`` and friends
    refuse a bare "cuda" (torch >= 2.11); under Ray each worker sees its own
    GPU as the current one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} was asked for but no CUDA device is available")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


class _DoneEvent:
    """The CPU stand-in of a CUDA event: the work before it is done when it is recorded."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class DeviceRuntime:
    """The CPU stand-in, and the interface ``CudaRuntime`` implements."""

    is_cuda = False
    pin_memory = False  # whether host buffers that feed the device are pinned

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def name(self) -> str:
        """The accelerator's name as torch reports it ("" on CPU)."""
        return ""

    def select(self) -> None:
        """Make this the current device of the calling thread."""

    def event(self) -> Any:
        return _DoneEvent()

    def side_stream(self) -> Any:
        """A stream for copies beside the compute stream; None where copies
        run in line (the CPU)."""
        return None

    def on_stream(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        """The stream work is queued on now; None on the CPU, where work runs
        when it is issued."""
        return None

    def synchronize(self) -> None:
        pass

    def host_buffer(self, numel: int, dtype: torch.dtype, *, zeroed: bool = False) -> torch.Tensor:
        """A host tensor the device reads from (pinned on CUDA)."""
        make = torch.zeros if zeroed else torch.empty
        return make(numel, dtype=dtype, pin_memory=self.pin_memory)

    def device_mirror(self, host: torch.Tensor, *, zeroed: bool = False) -> torch.Tensor:
        """The device copy of a host staging buffer: the buffer itself on the
        CPU, where no upload is needed."""
        return host

    @property
    def can_capture_graphs(self) -> bool:
        return False

    def graph_pool(self) -> Any:
        """A memory pool graphs captured one after another may share."""
        return None

    def capture(self, run: Callable[[], torch.Tensor], pool: Any) -> Callable[[], torch.Tensor]:
        """``run`` recorded once; the returned replay re-runs what it recorded
        and returns its output tensor. The stand-in records nothing: its
        replay is ``run`` itself, over the same static inputs."""
        return run

    # Device memory: measured on CUDA to size the KV cache; the CPU's is a
    # configured budget (--cpu-kv-cache-gb).
    measures_memory = False

    def free_and_total_memory(self) -> tuple[int, int]:
        raise NotImplementedError("the CPU's memory is budgeted by --cpu-kv-cache-gb, not measured")

    def peak_memory(self, run: Callable[[], object]) -> int:
        """Bytes ``run`` allocates on the device at its peak, beyond what was
        allocated before it."""
        raise NotImplementedError("the CPU's memory is budgeted by --cpu-kv-cache-gb, not measured")

    def release_cached_memory(self) -> None:
        pass


class CudaRuntime(DeviceRuntime):
    is_cuda = True
    pin_memory = True

    @property
    def name(self) -> str:
        return torch.cuda.get_device_name(self.device)

    def select(self) -> None:
        torch.cuda.set_device(self.device)

    def event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def side_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def on_stream(self, stream: torch.cuda.Stream) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def device_mirror(self, host: torch.Tensor, *, zeroed: bool = False) -> torch.Tensor:
        make = torch.zeros if zeroed else torch.empty
        return make(host.shape, dtype=host.dtype, device=self.device)

    @property
    def can_capture_graphs(self) -> bool:
        return True

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], torch.Tensor], pool: Any) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(self.current_stream())
        with torch.cuda.stream(side):  # warm-up runs: lazy initialisation stays out of the graph
            for _ in range(2):
                run()
        self.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    measures_memory = True

    def free_and_total_memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def peak_memory(self, run: Callable[[], object]) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def release_cached_memory(self) -> None:
        torch.cuda.empty_cache()


def runtime_for(device: torch.device) -> DeviceRuntime:
    return CudaRuntime(device) if device.type == "cuda" else DeviceRuntime(device)
