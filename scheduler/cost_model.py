"""Cost models: how long a step takes, as the scheduler and the simulator see it.

Pure Python (no torch). ``CostModel`` is the protocol the skip-join MLFQ
consults (prefill time of one prompt to pick its queue, the minimum iteration
time for the first quantum, a job's next iteration time for demotion) and the
simulator's virtual clock runs on. Two implementations:

* ``RooflineCostModel``: analytic, from the model's shape (``ModelShape``) and
  the device's figures (``DeviceSpec``): a step takes the longer of its
  compute time (matmul + attention FLOPs at a sustained fraction of peak) and
  its memory time (weights + KV read/written at a sustained fraction of HBM
  bandwidth), plus a fixed per-step overhead.
* ``LinearCostModel``: coefficients fitted to measured steps
  (``fluidserve profile -o profile.json``, see ``engine/profiler.py``).

``cost_model_for_engine`` picks the engine's (a measured profile if given,
else the roofline of its model on its device); ``load_profile`` reads one.

Step shape, the numbers a step's time is predicted from:

    num_prefill_tokens  tokens of prefill chunks in the step
    num_decode_seqs     requests decoding one token
    total_context       KV tokens the step's attention reads (all requests)
    prefill_attn_pairs  query-key pairs of the prefill chunks: a chunk of n
                        tokens after c cached ones attends n*c + n*(n+1)/2
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, runtime_checkable

from fluidserve.scheduler.request_state import RequestClass


@runtime_checkable
class CostModel(Protocol):
    def step_time(
        self, num_prefill_tokens: int, num_decode_seqs: int, total_context: int,
        prefill_attn_pairs: int | None = None,
    ) -> float:
        """Seconds one step of this shape takes."""

    def prefill_time(self, num_tokens: int, context: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` of one request after ``context``
        cached tokens, alone in a step."""

    def decode_time(self, num_seqs: int, total_context: int) -> float:
        """Seconds of one decode step of ``num_seqs`` requests reading
        ``total_context`` KV tokens in all."""


def attn_pairs(num_tokens: int, context: int) -> int:
    """Query-key pairs of a causal chunk of ``num_tokens`` after ``context``."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


class _StepShapeMixin:
    """prefill_time and decode_time in terms of step_time."""

    def prefill_time(self, num_tokens: int, context: int = 0) -> float:
        return self.step_time(num_tokens, 0, context + num_tokens, attn_pairs(num_tokens, context))

    def decode_time(self, num_seqs: int, total_context: int) -> float:
        return self.step_time(0, num_seqs, total_context, 0)

    def min_iteration_time(self) -> float:
        """The cheapest step there is: one request decoding at tiny context.
        FastServe's first quantum."""
        return self.decode_time(1, 1)


def tokens_for_time(cost: CostModel, seconds: float) -> int:
    """The fewest prefill tokens whose chunk alone takes at least ``seconds``."""
    lo, hi = 1, 1 << 16
    while lo < hi:  # prefill time grows with its tokens
        mid = (lo + hi) // 2
        if cost.prefill_time(mid) >= seconds:
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---------------------------------------------------------------------------
# Analytic roofline


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder-only transformer (Llama family).
    A mixture-of-experts model (Mixtral, Qwen-MoE) has ``num_experts`` > 0:
    ``moe_layers`` of its layers route each token to ``experts_per_token``
    experts of ``expert_intermediate_size`` features (plus a shared expert
    every token takes, Qwen2-MoE's), the rest keep the dense MLP. A token's
    compute counts the experts it takes; a step's weight reads count the
    experts its tokens reach."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    dtype_bytes: int = 2
    name: str = "model"
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    ffn_dim: int = 0  # a two-matrix MLP's features (OPT's fc1, fc2); 0: the gated three-matrix MLP
    kv_dtype_bytes: int = 0  # bytes of a cached K or V element (an fp8 cache: 1); 0: dtype_bytes

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.hd, self.num_kv_heads * self.hd
        return h * q + 2 * h * kv + q * h

    @property
    def dense_mlp_params(self) -> int:
        return 2 * self.hidden_size * self.ffn_dim if self.ffn_dim else 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size  # gate, up, down

    def _moe_fixed_params(self) -> int:
        """A MoE layer's feed-forward weights every token reads: the router and the shared expert."""
        return self.hidden_size * self.num_experts + 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def layer_params(self) -> int:
        """A layer's weights, on average over the layers (every expert counted)."""
        dense = (self.num_layers - self.moe_layers) * self.dense_mlp_params
        sparse = self.moe_layers * (self._moe_fixed_params() + self.num_experts * self.expert_params)
        return self.attention_params + (dense + sparse) // self.num_layers

    @property
    def active_layer_params(self) -> int:
        """The weights one token's compute goes through in a layer, on
        average over the layers: its experts only (``layer_params`` for a
        dense model)."""
        dense = (self.num_layers - self.moe_layers) * self.dense_mlp_params
        sparse = self.moe_layers * (self._moe_fixed_params() + self.experts_per_token * self.expert_params)
        return self.attention_params + (dense + sparse) // self.num_layers

    @property
    def feed_forward_share(self) -> float:
        """The feed-forward half's share of a token's layer compute."""
        return 1.0 - self.attention_params / self.active_layer_params

    @property
    def weight_bytes(self) -> int:
        # Layers, the lm_head and the embedding table (read once per step for
        # the lm_head; the embedding gather is negligible and not counted).
        return (self.num_layers * self.layer_params + self.hidden_size * self.vocab_size) * self.dtype_bytes

    def step_weight_bytes(self, tokens: int) -> float:
        """The weights a step of ``tokens`` rows reads: all of a dense
        model's; of a MoE layer's experts, those its tokens are expected to
        reach, each token taking ``experts_per_token`` of ``num_experts`` as
        if at random: ``E (1 - (1 - k / E) ** T)``."""
        if not self.moe_layers:
            return self.weight_bytes
        e, k = self.num_experts, self.experts_per_token
        unreached = (self.num_experts - self.expected_experts(tokens)) * self.moe_layers * self.expert_params
        return self.weight_bytes - unreached * self.dtype_bytes if e and k else self.weight_bytes

    def expected_experts(self, tokens: int) -> float:
        """Distinct experts a MoE layer's step of ``tokens`` rows reaches."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens) if e else 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.hd * (self.kv_dtype_bytes or self.dtype_bytes)

    @classmethod
    def from_hf_config(cls, cfg: dict, dtype_bytes: int = 2) -> "ModelShape":
        """From a Hugging Face ``config.json`` (as a dict)."""
        heads = cfg["num_attention_heads"]
        if "intermediate_size" in cfg:
            inter = cfg["intermediate_size"]
        else:
            # OPT-style two-matrix MLP (fc1, fc2): the gated three-matrix size
            # with the same parameter count.
            inter = (2 * cfg["ffn_dim"]) // 3
        layers = cfg["num_hidden_layers"]
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        step = int(cfg.get("decoder_sparse_step") or 1)
        # Dense by name (Qwen's mlp_only_layers) or as the first ones (GLM-4.5's first_k_dense_replace).
        dense = set(cfg.get("mlp_only_layers") or ()) | set(range(int(cfg.get("first_k_dense_replace") or 0)))
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0) if experts else 0
        expert_inter = int(cfg.get("moe_intermediate_size") or inter) if experts else 0
        shared = int(cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * expert_inter)
        return cls(
            num_layers=layers,
            hidden_size=cfg["hidden_size"],
            intermediate_size=inter,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            vocab_size=cfg["vocab_size"],
            head_dim=cfg.get("head_dim"),
            dtype_bytes=dtype_bytes,
            name=cfg.get("_name_or_path") or cfg.get("model_type", "model"),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            expert_intermediate_size=expert_inter,
            shared_expert_intermediate_size=shared if experts else 0,
            moe_layers=moe_layers,
            ffn_dim=0 if "intermediate_size" in cfg else int(cfg["ffn_dim"]),
        )

    @classmethod
    def llama3_8b(cls) -> "ModelShape":
        return cls(num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                   num_kv_heads=8, vocab_size=128256, name="llama-3-8b")


@dataclass(frozen=True)
class DeviceSpec:
    """Peak figures of one accelerator and the fractions of them a real
    engine sustains (MFU for matmuls, MBU for memory-bound reads)."""

    name: str
    peak_flops: float  # dense fp16/bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    pcie_bandwidth: float  # bytes/s, host <-> device, one direction
    memory_bytes: float = 80e9  # device memory (weights + KV + activations)
    flops_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 1e-3  # launch + scheduling + sampling per step

    @classmethod
    def h100(cls) -> "DeviceSpec":  # SXM5 80 GB
        return cls("h100-sxm", peak_flops=989e12, hbm_bandwidth=3.35e12, pcie_bandwidth=25e9)

    @classmethod
    def h200(cls) -> "DeviceSpec":
        return cls("h200", peak_flops=989e12, hbm_bandwidth=4.8e12, pcie_bandwidth=25e9, memory_bytes=141e9)

    @classmethod
    def a100_40g(cls) -> "DeviceSpec":
        return cls("a100-40g", peak_flops=312e12, hbm_bandwidth=1.55e12, pcie_bandwidth=12.5e9, memory_bytes=40e9)

    @classmethod
    def cpu(cls) -> "DeviceSpec":  # a few cores of a server CPU, fp32 torch
        return cls("cpu", peak_flops=2e11, hbm_bandwidth=2e10, pcie_bandwidth=2e10,
                   memory_bytes=16e9, flops_efficiency=0.3, memory_efficiency=0.5, step_overhead_s=2e-3)

    @classmethod
    def named(cls, name: str) -> "DeviceSpec":
        presets = {"h100": cls.h100, "h200": cls.h200, "a100": cls.a100_40g, "cpu": cls.cpu}
        try:
            return presets[name]()
        except KeyError:
            raise ValueError(f"device must be one of {sorted(presets)}, got {name!r}") from None


class RooflineCostModel(_StepShapeMixin):
    def __init__(self, model: ModelShape, device: DeviceSpec) -> None:
        self.model = model
        self.device = device
        self._flops_per_token = 2 * model.num_layers * model.active_layer_params
        self._lm_head_flops = 2 * model.hidden_size * model.vocab_size
        # QK^T and PV: 2 matmuls x 2 FLOPs per (query, key) pair per head dim.
        self._flops_per_pair = 4 * model.num_layers * model.num_heads * model.hd
        # Properties of the shape, computed once here: step_time runs every step.
        self._weight_bytes = model.weight_bytes
        self._moe = model.moe_layers > 0
        self._kv_bytes_per_token = model.kv_bytes_per_token
        self._compute_rate = device.peak_flops * device.flops_efficiency
        self._memory_rate = device.hbm_bandwidth * device.memory_efficiency

    def step_time(
        self, num_prefill_tokens: int, num_decode_seqs: int, total_context: int,
        prefill_attn_pairs: int | None = None,
    ) -> float:
        tokens = num_prefill_tokens + num_decode_seqs
        if tokens == 0:
            return 0.0
        if prefill_attn_pairs is None:  # one chunk from scratch
            prefill_attn_pairs = attn_pairs(num_prefill_tokens, 0)
        # Decode attention: one query against each context token (the
        # prefill chunks' cached context is in total_context too; counting it
        # twice is noise next to their n*c pairs).
        pairs = prefill_attn_pairs + (total_context if num_decode_seqs else 0)
        # A step samples at most one token per request; prefill chunks that do
        # not end their prompt skip the lm_head, counted as if all sampled.
        samples = num_decode_seqs + (1 if num_prefill_tokens else 0)
        flops = tokens * self._flops_per_token + samples * self._lm_head_flops + pairs * self._flops_per_pair
        weights = self.model.step_weight_bytes(tokens) if self._moe else self._weight_bytes
        bytes_moved = weights + (total_context + tokens) * self._kv_bytes_per_token
        return max(flops / self._compute_rate, bytes_moved / self._memory_rate) + self.device.step_overhead_s

    def num_kv_blocks(self, block_size: int, memory_utilization: float = 0.9,
                      activation_bytes: float = 2e9) -> int:
        """KV blocks that fit beside the weights, as the engine would size them."""
        free = self.device.memory_bytes * memory_utilization - self.model.weight_bytes - activation_bytes
        return max(1, int(free // (block_size * self.model.kv_bytes_per_token)))

    def transfer_time(self, num_bytes: int) -> float:
        """Host <-> device copy of ``num_bytes`` over PCIe (swap, checkpoint)."""
        return num_bytes / self.device.pcie_bandwidth

    def describe(self) -> dict:
        return {"kind": "roofline", "model": asdict(self.model), "device": asdict(self.device)}


# ---------------------------------------------------------------------------
# Measured (fitted) model


@dataclass(frozen=True)
class LinearCoefficients:
    base: float  # seconds per step (weights read, launch overhead)
    per_prefill_token: float
    per_decode_seq: float
    per_context_token: float  # KV read
    per_attn_pair: float  # prefill attention

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise ValueError(f"cost coefficient {name} must be non-negative, got {value}")


class LinearCostModel(_StepShapeMixin):
    """step time = base + a*prefill tokens + b*decode requests + c*context
    + d*prefill attention pairs, fitted to measured steps."""

    def __init__(self, coefficients: LinearCoefficients, meta: dict | None = None) -> None:
        self.c = coefficients
        self.meta = meta or {}

    def step_time(
        self, num_prefill_tokens: int, num_decode_seqs: int, total_context: int,
        prefill_attn_pairs: int | None = None,
    ) -> float:
        if num_prefill_tokens + num_decode_seqs == 0:
            return 0.0
        if prefill_attn_pairs is None:
            prefill_attn_pairs = attn_pairs(num_prefill_tokens, 0)
        c = self.c
        return (c.base + c.per_prefill_token * num_prefill_tokens + c.per_decode_seq * num_decode_seqs
                + c.per_context_token * total_context + c.per_attn_pair * prefill_attn_pairs)

    def to_json(self) -> dict:
        return {"kind": "linear", "coefficients": asdict(self.c), **self.meta}

    @classmethod
    def from_json(cls, data: dict) -> "LinearCostModel":
        if data.get("kind") != "linear":
            raise ValueError(f"not a fitted cost profile (kind={data.get('kind')!r})")
        meta = {k: v for k, v in data.items() if k not in ("kind", "coefficients")}
        return cls(LinearCoefficients(**data["coefficients"]), meta)

    @classmethod
    def load(cls, path: str) -> "LinearCostModel":
        with open(path) as f:
            return cls.from_json(json.load(f))


@dataclass
class StepShape:
    """The numbers a step's time is predicted from, accumulated request by
    request (each read before its tokens count as computed)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    context: int = 0
    pairs: int = 0
    online: bool = False  # the step carries online work
    # Arrival of the longest-waiting online request the step prefills
    # (a TTFT SLO caps the step by it); None: no online prefill.
    first_online_prefill_arrival: float | None = None

    @staticmethod
    def is_decode(seq: Any, n: int) -> bool:
        return n == 1 and seq.num_computed_tokens > 0 and seq.num_output_tokens > 0

    def add(self, seq: Any, n: int) -> None:
        """``seq`` (a SeqState) runs ``n`` tokens this step."""
        done = seq.num_computed_tokens
        self.context += done + n
        if self.is_decode(seq, n):
            self.decode_seqs += 1
        else:
            self.prefill_tokens += n
            self.pairs += attn_pairs(n, done)
            if (seq.klass is RequestClass.ONLINE and seq.num_output_tokens == 0
                    and (self.first_online_prefill_arrival is None
                         or seq.arrival_time < self.first_online_prefill_arrival)):
                self.first_online_prefill_arrival = seq.arrival_time
        self.online |= seq.klass is RequestClass.ONLINE

    def astuple(self) -> tuple[int, int, int, int]:
        """``step_time``'s arguments."""
        return self.prefill_tokens, self.decode_seqs, self.context, self.pairs


def plan_shape(plan, seqs) -> tuple[int, int, int, int]:
    """(prefill tokens, decode requests, total context, prefill attention
    pairs) of a StepPlan, read *before* ``Scheduler.update_from_output``
    counts the step's tokens as computed. ``seqs`` maps request id -> SeqState."""
    shape = StepShape()
    for item in plan.scheduled:
        shape.add(seqs[item.request_id], item.num_tokens)
    return shape.astuple()


def default_cost_model() -> RooflineCostModel:
    """Llama-3-8B on one H100: what a policy uses when it is given no model."""
    return RooflineCostModel(ModelShape.llama3_8b(), DeviceSpec.h100())


# ---------------------------------------------------------------------------
# Choosing and loading

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
               "bfloat16": 2, "bf16": 2}


def cost_model_from_json(data: dict) -> CostModel:
    kind = data.get("kind")
    if kind == "linear":
        return LinearCostModel.from_json(data)
    if kind == "roofline":
        return RooflineCostModel(ModelShape(**data["model"]), DeviceSpec(**data["device"]))
    raise ValueError(f"unknown cost profile kind {kind!r} (expected 'linear' or 'roofline')")


def load_profile(path: str) -> CostModel:
    with open(path) as f:
        return cost_model_from_json(json.load(f))


def device_spec_for(device: str, gpu_name: str = "") -> DeviceSpec:
    """Figures of the device the engine runs on: ``cpu``, ``cuda`` (from the
    GPU's name: H100/H200/A100, else H100 figures), or a preset name."""
    if device == "cuda":
        name = gpu_name.lower()
        for key in ("h200", "a100", "h100"):
            if key in name:
                return DeviceSpec.named(key)
        return DeviceSpec.h100()
    return DeviceSpec.named(device)


def cost_model_for_engine(config: Any, hf_config: Any, device: str, gpu_name: str = "") -> CostModel:
    """The engine's cost model: ``config.profile_path`` if set (measured),
    else the roofline of ``hf_config`` (a transformers config or a dict) on
    ``device`` ("cpu" or "cuda", named ``gpu_name``) -- which, when
    ``config.calibrate_cost_model`` says so, learns from the steps the engine
    runs (``scheduler/calibration.py``). Unset (None), calibration is on when
    an online SLO or a slowdown cap is set, since the budget is only as good
    as the model."""
    if getattr(config, "profile_path", None):
        return load_profile(config.profile_path)
    cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    dtype = getattr(config, "dtype", "auto")
    dtype_bytes = DTYPE_BYTES.get(dtype, 4 if device == "cpu" else 2)
    shape = ModelShape.from_hf_config(cfg, dtype_bytes)
    if str(getattr(config, "kv_cache_dtype", "auto")).startswith("fp8"):
        shape = replace(shape, kv_dtype_bytes=1)
    model = RooflineCostModel(shape, device_spec_for(device, gpu_name))
    calibrate = getattr(config, "calibrate_cost_model", None)
    if calibrate is None:
        calibrate = any(getattr(config, name, None) is not None
                        for name in ("online_tpot_slo_ms", "online_ttft_slo_ms", "online_slowdown_cap"))
    if calibrate:
        from fluidserve.scheduler.calibration import CalibratingCostModel

        return CalibratingCostModel(model)
    return model
