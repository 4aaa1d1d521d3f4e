"""Sparse mixture-of-experts feed-forward blocks over the flat token batch:
Qwen3-MoE, Qwen2-MoE (with its gated shared expert), Mixtral, GLM-4.5
(sigmoid scores with a learned correction bias picking the experts within
the best groups, DeepSeek-V3's routing, and an ungated shared expert) and
Granite 3 MoE (a softmax over the chosen experts' logits; its checkpoints
stack every expert in one tensor, which the loader cuts per expert).

A router scores every token against every expert; each token goes to its
``num_experts_per_tok`` best, and the block's output is their outputs
weighted by the router's probabilities. The experts' weights are stacked,
``[E, 2N, H]`` (gate | up) and ``[E, H, N]`` (down), so one grouped kernel
runs every expert of a step (``ops.fused_experts``: the torch reference on
the CPU, the Triton kernel on a GPU, which has no host sync and so runs in
decode and piecewise CUDA graphs). Checkpoints keep one tensor per expert
(``mlp.experts.3.gate_proj.weight``); the loader writes each into its
expert's rows (``Piece.expert``).

Under tensor parallelism each rank holds every expert's share of the
intermediate features, as the dense MLP splits them, and one all-reduce
sums the experts' partial outputs. The router is replicated."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...kernels import cpu_moe, ops
from ..parallel import ColumnParallelLinear, HeldWeights, Piece, ShardSpec, TensorParallel, can_prepack, stacked_param


def num_experts(config) -> int:
    """The routed experts of a layer (0: a dense model)."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


def is_moe_layer(config, layer: int) -> bool:
    """Whether decoder layer ``layer`` routes to experts: Qwen's MoE configs
    may keep some layers dense (``mlp_only_layers``, ``decoder_sparse_step``),
    GLM-4.5's its first ones (``first_k_dense_replace``)."""
    if not num_experts(config) or layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    if layer < (getattr(config, "first_k_dense_replace", None) or 0):
        return False
    return (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def shared_expert_size(config) -> int | None:
    """The intermediate features of the dense expert every token also
    takes: Qwen2-MoE's ``shared_expert_intermediate_size``, Granite MoE
    Shared's ``shared_intermediate_size``, GLM-4.5's ``n_shared_experts``
    experts' worth; None without one."""
    for key in ("shared_expert_intermediate_size", "shared_intermediate_size"):  # Qwen2-MoE's, Granite's
        if getattr(config, key, None):
            return int(getattr(config, key))
    shared = getattr(config, "n_shared_experts", None)
    return int(shared) * expert_intermediate_size(config) if shared else None


def expert_intermediate_size(config) -> int:
    """One expert's intermediate features: Qwen's ``moe_intermediate_size``,
    Mixtral's ``intermediate_size``."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


class Experts(HeldWeights):
    """Every expert's gate/up and down weights, stacked. Rank r of a
    tensor-parallel group holds features ``[r * N / tp, (r + 1) * N / tp)``
    of each: rows of gate and of up, columns of down. A quantized
    checkpoint's may stay as stored (``--quantized-weights packed``): each
    stack is then a ``QuantizedWeight`` of E experts (``gate_up_codes``,
    ``down_codes``), which the grouped kernel reads as it is."""

    code_params = {"gate_up_proj": "gate_up_codes", "down_proj": "down_codes"}

    def __init__(self, count: int, hidden: int, inter: int, tp: TensorParallel) -> None:
        super().__init__()
        local = tp.divide(inter, "moe_intermediate_size")
        rows = ShardSpec(0, tp.rank, local, inter) if tp.size > 1 else None
        cols = ShardSpec(1, tp.rank, local, inter) if tp.size > 1 else None
        self.gate_up_proj = stacked_param((count, 2 * local, hidden), tuple(
            Piece(name, offset, local, rows, e, f"{e}.{name}.weight")
            for e in range(count) for name, offset in (("gate_proj", 0), ("up_proj", local))))  # fmt: skip
        self.down_proj = stacked_param((count, hidden, local), tuple(
            Piece("down_proj", 0, hidden, cols, e, f"{e}.down_proj.weight") for e in range(count)))  # fmt: skip
        self.packed: cpu_moe.PackedExperts | None = None  # what the stacked weights were given up for

    def dense_values(self) -> dict[str, torch.Tensor]:
        if not self.dense_dropped:
            return super().dense_values()
        n, h = self.down_proj.shape[2], self.down_proj.shape[1]
        return dict(zip(self.code_params, cpu_moe.stacked(self.packed, n, h), strict=True))


class SparseMoeBlock(nn.Module):
    """The feed-forward half of a MoE decoder layer, called as the dense
    MLP is: ``forward(x, residual)`` is ``residual + moe(x)``."""

    def __init__(self, config, tp: TensorParallel, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.tp = tp
        hidden, count = config.hidden_size, num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        if not 0 < self.top_k <= count:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {count}] (the experts)")
        mixtral = config.model_type == "mixtral"
        # GLM-4.5 (DeepSeek-V3's routing): sigmoid scores in float32, the
        # experts picked by score plus a learned bias within the best groups.
        self.grouped = config.model_type == "glm4_moe"
        # Granite MoE: a softmax over the chosen experts' logits only.
        self.softmax_of_chosen = config.model_type in ("granitemoe", "granitemoeshared")
        # Mixtral always renormalizes the chosen experts' probabilities, the
        # others where the config says (norm_topk_prob); Mixtral and GLM-4.5
        # weigh the experts' outputs in float32, Qwen rounds the weights to
        # the model's dtype, as Hugging Face's implementations do (greedy
        # tokens are compared).
        self.renormalize = mixtral or bool(getattr(config, "norm_topk_prob", False))
        self.float_weights = mixtral or self.grouped
        self.gate = ColumnParallelLinear(hidden, count, False, tp, num_shards=1, index=0)  # the router, replicated
        self.gate.takes_quantized_weight = False  # its scores read the dense weight (grouped routing: in fp32)
        if self.grouped:
            self.groups, self.topk_group = int(config.n_group), int(config.topk_group)
            if count % self.groups or not 0 < self.topk_group <= self.groups:
                raise ValueError(f"n_group={self.groups}, topk_group={self.topk_group}: the {count} experts must "
                                 "split into n_group groups, of which topk_group are kept")
            self.scaling = float(getattr(config, "routed_scaling_factor", 1.0))
            # Float32 as transformers keeps it: its values sit close together.
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(count, dtype=torch.float32))
        self.experts = Experts(count, hidden, expert_intermediate_size(config), tp)
        # One dense expert every token takes: Qwen2-MoE's scaled by a sigmoid gate, GLM-4.5's and Granite's as it is.
        self.shared_expert = shared_expert
        self.shared_expert_gate = (ColumnParallelLinear(hidden, 1, False, tp, num_shards=1, index=0)
                                   if config.model_type == "qwen2_moe" and shared_expert is not None
                                   else None)  # fmt: skip

    _packed: cpu_moe.PackedExperts | None = None

    def prepack(self) -> None:
        """On the CPU, the experts' weights laid out for kernels/cpu_moe.py
        once the loader has written them, as the linears pack theirs; the
        Triton lane keeps the stacked weights it reads, and weights held as
        the checkpoint's codes stay so."""
        experts = self.experts
        if experts.dense_dropped:
            return  # packed already, from values the stand-ins no longer hold
        self._packed = None
        held = experts.held_codes()
        for codes in held.values():
            codes.settle()
        if held:
            return
        if can_prepack(experts.gate_up_proj) and ops.kernel_path(experts.gate_up_proj.device) != "triton":
            packed = cpu_moe.pack(experts.gate_up_proj, experts.down_proj)
            # The stacked weights given up where no expert's product reads
            # them (fp32, or oneDNN's copies made), as a packed linear gives up its own.
            if not cpu_moe.reads_stacked(packed, experts.gate_up_proj.dtype):
                experts.drop_dense()
                packed = dataclasses.replace(packed, gate_up=experts.gate_up_proj, down=experts.down_proj)
                experts.packed = packed
            self._packed = packed

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] -> each token's experts [T, k] and their weights [T, k]."""
        if self.grouped:
            return self._route_grouped(x)
        if self.softmax_of_chosen:  # transformers' GraniteMoeTopKRouter
            logits, ids = self.gate(x).float().topk(self.top_k, dim=-1)
            return ids, torch.softmax(logits, dim=-1).to(x.dtype)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.float_weights else weights.to(x.dtype)

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' Glm4MoeTopkRouter, in float32: each group scored by
        its two best biased scores, the experts chosen by biased score within
        the ``topk_group`` best groups, weighted by their unbiased scores
        (renormalized where the config says, then scaled)."""
        gate = self.gate
        scores = torch.sigmoid(torch.nn.functional.linear(x.float(), gate.weight.float()))  # [T, E]
        choice = scores + gate.e_score_correction_bias
        if self.topk_group < self.groups:
            t, count = choice.shape
            best = choice.view(t, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            kept = torch.zeros_like(best).scatter_(1, best.topk(self.topk_group, dim=-1)[1], 1.0).bool()
            choice = choice.masked_fill(~kept.repeat_interleave(count // self.groups, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                path: ops.KernelPath | None = None) -> torch.Tensor:  # fmt: skip
        ids, weights = self.route(x)
        experts = self.experts
        dtype = experts.gate_up_proj.dtype
        if self._packed is not None and x.device.type == "cpu" and (x.dtype == dtype or experts.dense_dropped):
            # Rows of another dtype (none the models send) take the packed
            # weights': the stacked ones that would take them are gone.
            rows = x if x.dtype == dtype else x.to(dtype)
            y = cpu_moe.fused_experts(rows, self._packed, ids, weights)
            y = y if y.dtype == x.dtype else y.to(x.dtype)
        elif experts.gate_up_codes is not None:
            y = ops.fused_experts(x, experts.gate_up_codes.packed(), experts.down_codes.packed(), ids, weights, path)
        else:
            y = ops.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, path)
        if self.tp.size > 1:
            y = self.tp.all_reduce(y)
        if self.shared_expert_gate is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            y = y + self.shared_expert(x)
        return y if residual is None else y.add_(residual)
