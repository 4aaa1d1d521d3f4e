"""EngineConfig: every knob of an engine, frozen, constructible without a model
on disk. The CLI builds one from flags; ``LLM(...)`` from keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from fluidserve.scheduler.options import DEFAULT_SAFEPOINT_LAYERS

# Decode CUDA graphs unless --enforce-eager, as vLLM does: False until the
# graph tests (tests/test_cuda_graphs.py -m gpu) have passed on a GPU, since
# only a GPU run can confirm a captured graph leaves eager's tokens and KV.
CUDA_GRAPHS_BY_DEFAULT = False


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF directory or hub id; None = built-in tiny model
    tokenizer: str | None = None  # defaults to the model's
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    load_format: str = "auto"  # auto | dummy (random weights from the config)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's context length
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # request cap of one step
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory-fraction sizing
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # KV pool size on CPU when num_kv_blocks is unset
    enable_chunked_prefill: bool = True
    # Host KV tier (FastServe §4.2): GiB per worker (None: default_swap_space_gb),
    # or an exact block count (tests); 0 turns swapping off.
    swap_space: float | None = None
    num_host_blocks: int | None = None
    preemption_mode: str = "swap"  # swap | recompute (vLLM's behaviour, a baseline)
    proactive_swap: bool = True  # prefetch swapped KV and keep free blocks for arrivals
    enable_prefix_caching: bool = True  # share the KV of equal prompt prefixes
    online_tpot_slo_ms: float | None = None  # offline work may not push online steps past this
    # An online arrival interrupts an offline-only step when waiting for it
    # would miss this (None: any online arrival interrupts one).
    online_ttft_slo_ms: float | None = None
    # Layers between interrupt checks, a whole or half number (0.5: also
    # between a layer's attention and MLP); 0: never.
    preemption_safepoint_layers: float = DEFAULT_SAFEPOINT_LAYERS
    # Device-KV usage past which offline requests are checkpointed to the host
    # as they run (ConServe §4.4); None: never.
    kv_checkpoint_threshold: float | None = 0.5
    scheduling_policy: str = "skip-join-mlfq"  # fcfs | mlfq | fixed-priority | skip-join-mlfq
    policy_options: dict = field(default_factory=dict)  # per-policy knobs (MLFQ quanta, ...)
    profile_path: str | None = None  # measured cost model (fluidserve profile -o ...)
    # Without a profile the scheduler's cost model learns from the steps run
    # (scheduler/calibration.py); None: when an online SLO needs the model.
    calibrate_cost_model: bool | None = None
    executor: str = "local"  # local | ray
    tensor_parallel_size: int = 1
    ray_address: str | None = None
    # vLLM's flag. False captures decode-only steps in batch-size buckets as
    # CUDA graphs (engine/cuda_graphs.py; eager elsewhere).
    enforce_eager: bool = not CUDA_GRAPHS_BY_DEFAULT
    cuda_graph_sizes: tuple[int, ...] | None = None  # buckets (default cuda_graphs.DEFAULT_CAPTURE_SIZES)

    def __post_init__(self) -> None:
        checks = [
            ("dtype", self.dtype in ("auto", "float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "half", "float")),
            ("load_format", self.load_format in ("auto", "dummy")),
            ("device", self.device in ("auto", "cpu", "cuda")),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("block_size", self.block_size in (8, 16, 32, 64)),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1),
            ("swap_space", self.swap_space is None or self.swap_space >= 0),
            ("num_host_blocks", self.num_host_blocks is None or self.num_host_blocks >= 0),
            ("preemption_mode", self.preemption_mode in ("swap", "recompute")),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0),
            ("executor", self.executor in ("local", "ray")),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1),
            ("online_ttft_slo_ms", self.online_ttft_slo_ms is None or self.online_ttft_slo_ms > 0),
            ("preemption_safepoint_layers", self.preemption_safepoint_layers >= 0
             and float(2 * self.preemption_safepoint_layers).is_integer()),
            ("cuda_graph_sizes", self.cuda_graph_sizes is None or (len(self.cuda_graph_sizes) > 0 and all(
                isinstance(n, int) and n >= 1 for n in self.cuda_graph_sizes))),
            ("kv_checkpoint_threshold",
             self.kv_checkpoint_threshold is None or 0.0 <= self.kv_checkpoint_threshold <= 1.0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}: invalid value {getattr(self, name)!r}")
