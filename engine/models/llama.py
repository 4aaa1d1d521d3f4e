"""The Llama family over the flat token batch: Llama 2/3, Mistral, Qwen2 (bias
on q/k/v), Qwen3 (RMSNorm on q and k per head), Phi-3 and Phi-4-mini (q/k/v
and gate/up fused in their checkpoints; LongRoPE; a partial rope), Granite
(multipliers on the embedding, the attention scores, each residual branch
and the logits), SmolLM3 (every fourth layer without rope) and ERNIE 4.5
(GPT-J's interleaved rope, reordered into ours at load), and their
mixture-of-experts kin, Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5 (a
partial rope, biases on q/k/v) and Granite 3 MoE, whose decoder layers route each token to a
few experts in place of the MLP (engine/models/moe.py). Parameter names
mirror the Hugging Face checkpoints so weights load by name.

Under tensor parallelism (engine/parallel.py) each rank holds its share of
the attention heads and of the MLP's intermediate features; the KV heads are
split the same way, or, when there are fewer KV heads than ranks, each rank
holds the one KV head its query heads read (replicated across ranks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...kernels import ops
from .moe import SparseMoeBlock, is_moe_layer, shared_expert_size
from ..layers import (AttentionMetadata, KVCache, PagedAttention, QKNorm, RMSNorm, Rope, RotaryEmbedding,
                      StepLaunches, interleaved_to_halves, layer_type_ropes)
from ..preemption import LayerLoop
from ..parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:  # the Triton kernels are imported where a row or batch step first needs them
    from ...kernels.activation import StepSiluAndMul
    from ...kernels.fused_norm import StepNorm
    from ...kernels.gemv import PreparedGemv
    from ...kernels.reference import PackedLinear


# Granite 3 and its mixture-of-experts kin: the four multipliers.
GRANITE = ("granite", "granitemoe", "granitemoeshared")


def _sliding_window(config, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"):
        if not getattr(config, "use_sliding_window", False):
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and layer_types[layer] != "sliding_attention":
            return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.num_heads = tp.divide(total_heads, "num_attention_heads")  # this rank's query heads
        kv_shards, kv_index = _kv_sharding(total_kv_heads, tp)
        self.num_kv_heads = total_kv_heads // kv_shards
        qwen2 = config.model_type in ("qwen2", "qwen2_moe")
        glm = config.model_type == "glm4_moe"  # biases on q/k/v, none on o
        # ERNIE 4.5's use_bias: on every linear.
        attention_bias = bool(getattr(config, "attention_bias", False) or getattr(config, "use_bias", False))
        qkv_bias = (qwen2 and bool(getattr(config, "qkv_bias", True))) or attention_bias
        o_bias = attention_bias and not qwen2 and not glm
        # q, k and v in one product; the checkpoint's q_proj/k_proj/v_proj load into its rows.
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            Part("q_proj", total_heads * self.head_dim),
            Part("k_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
            Part("v_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
        ], qkv_bias, tp)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, o_bias, tp)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe") or (glm and bool(config.use_qk_norm))
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        scale = config.attention_multiplier if config.model_type in GRANITE else self.head_dim**-0.5
        # SmolLM3 leaves every fourth layer unrotated (NoPE): ``no_rope_layers[i]`` is 1 where layer i rotates.
        self.use_rope = bool(config.no_rope_layers[layer]) if config.model_type == "smollm3" else True
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                   _sliding_window(config, layer))

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(rope, self.qkv_proj(x), kv_cache, meta))  # [T, hidden], all-reduced

    def _views(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq / tp, D], k and v [T, Hk / tp, D]: views of the projected rows."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))  # fmt: skip

    def norms(self) -> QKNorm | None:
        """The per-head q and k norms' weights and eps (Qwen3), or None."""
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else None

    def step_launches(self, qkv: torch.Tensor, rope: Rope, kv_cache: KVCache,
                      meta: AttentionMetadata) -> StepLaunches | None:  # fmt: skip
        """``attend``'s launches for a step whose every layer projects into
        ``qkv`` (one buffer of the step's), worked out once
        (``PagedAttention.step_launches``); None where they cannot be."""
        if not self.use_rope:
            return None
        return self.attn.step_launches(*self._views(qkv), kv_cache, meta, rope, self.norms())

    def attend(self, rope: Rope, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """[T, (Hq + 2 Hk) D / tp] projected rows -> [T, Hq D / tp]: the KV
        write and the attention, the part of a layer whose work depends on
        every sequence's length (piecewise graphs run it between graphs)."""
        # rope rotates q and k in place (Qwen3's per-head norms first), in the launch that writes the cache
        return self.attn(*self._views(qkv), kv_cache, meta, rope if self.use_rope else None, self.norms())


def _kv_sharding(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(number of KV-head shards, the one this rank holds).

    Query heads are split contiguously, ``Hq / tp`` per rank, and query head
    h reads KV head ``h // (Hq / Hk)``. With ``Hk >= tp`` the KV heads split
    the same way. With fewer KV heads than ranks, ``tp / Hk`` consecutive ranks
    share one KV head, so each holds a whole (replicated) head::

        Hq=8, Hk=2, tp=4:  rank 0 1 | 2 3     query heads 0-1 | 2-3 | 4-5 | 6-7
                           KV head  0 0 | 1 1
    """
    if num_kv_heads % tp.size == 0:
        return tp.size, tp.rank
    if tp.size % num_kv_heads == 0:
        return num_kv_heads, tp.rank // (tp.size // num_kv_heads)
    raise ValueError(
        f"tensor_parallel_size={tp.size} must divide, or be a multiple of, num_key_value_heads ({num_kv_heads})"
    )


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallel, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        tp.divide(inter, "intermediate_size")
        # gate and up in one product (checkpoint names gate_proj/up_proj)
        bias = bool(getattr(config, "mlp_bias", False) or getattr(config, "use_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [Part("gate_proj", inter), Part("up_proj", inter)],
                                                       bias, tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                path: ops.KernelPath | None = None) -> torch.Tensor:
        # [T, hidden] -> [T, 2 * inter / tp] -> [T, inter / tp] -> [T, hidden] (all-reduced
        # in down_proj, which adds the residual, in place over it, in its own GEMM)
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, path), residual, path)


@dataclass(frozen=True, slots=True)
class _RowWeights:
    """What a decoder layer's batch-1 row path launches its four GEMVs with,
    read off the modules once per load (``LlamaDecoderLayer.prepack``).
    Each weight dense, or a quantized checkpoint's codes (``PackedLinear``,
    ``--quantized-weights packed``), which the GEMV reads as they are."""

    qkv: torch.Tensor | PackedLinear
    qkv_bias: torch.Tensor | None
    input_norm: tuple[torch.Tensor, float]  # (weight, eps)
    o: torch.Tensor | PackedLinear
    gate_up: torch.Tensor | PackedLinear
    post_norm: tuple[torch.Tensor, float]
    down: torch.Tensor | PackedLinear
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # q's and k's per-head norm weights (Qwen3)
    row: torch.Tensor  # [1, hidden]: a row of the dtype and device the step's rows have
    # Layers of one key share a step's row buffers and launches (_RowStep):
    # the QKV weight's shape (output, hidden), the gated output's width,
    # their dtype and device, the attention's window, the q/k norms' eps
    # (None: no such norms).
    step_key: tuple
    _gemvs: dict = field(default_factory=dict)  # launch mode -> the four GEMVs prepared (gemvs)

    def gemvs(self, mode: str) -> tuple[PreparedGemv, PreparedGemv, PreparedGemv, PreparedGemv]:
        """The QKV (input norm first), o (adding the residual, rounded
        before it as the modules' separate add is), gate/up (post norm
        first, SiLU-mul after) and down (adding the residual) GEMVs,
        prepared once per launch mode (``gemv.dependent_launch``)."""
        prepared = self._gemvs.get(mode)
        if prepared is None:
            from ...kernels.gemv import PreparedGemv

            dtype = self.row.dtype
            prepared = self._gemvs[mode] = (
                PreparedGemv(self.qkv, self.qkv_bias, norm=self.input_norm, mode=mode, dtype=dtype),
                PreparedGemv(self.o, residual=True, round_before_residual=True, mode=mode, dtype=dtype),
                PreparedGemv(self.gate_up, gated=True, norm=self.post_norm, mode=mode, dtype=dtype),
                PreparedGemv(self.down, residual=True, mode=mode, dtype=dtype))  # fmt: skip
        return prepared


_UNBUILT = object()  # a step key no layer of the step has asked for yet


def _shared_step(meta: AttentionMetadata, key: object, build: Callable[..., object], *args: object) -> object:
    """The step's buffers and launches under ``key`` (a ``_RowStep``, a
    ``_BatchStep``, or None where the layers run through the modules), made
    by ``build(*args)`` for the first layer that asks and kept in the step's
    metadata for the rest."""
    steps = meta._row_steps
    step = steps.get(key, _UNBUILT)
    if step is _UNBUILT:
        step = steps[key] = build(*args)
    return step


@dataclass(frozen=True, slots=True)
class _RowStep:
    """One step's batch-1 row buffers and attention launches, shared by
    every layer of one ``_RowWeights.step_key``. A layer's launches read
    each buffer before the next layer's launches write it, in stream
    order: the reuse torch's caching allocator makes of per-layer tensors,
    without a layer's allocations, split, views and attention checks."""

    qkv: torch.Tensor  # [1, (Hq + 2 Hk) D]: every layer's QKV GEMV writes it
    attend: StepLaunches  # (Qwen3's q/k norms,) rope, KV write, attention from qkv's views -> [1, Hq D]
    act: torch.Tensor  # [1, I]: every layer's gate/up GEMV writes it
    mode: str  # how the step's GEMVs launch (gemv.dependent_launch), asked once a step
    # [1, hidden] x 2: a layer's output is whichever its input is not (_output_for).
    hidden: tuple[torch.Tensor, torch.Tensor]


def _output_for(hidden: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Of a step's two hidden-state buffers, the one a layer whose input is
    ``x`` writes its output to: whichever ``x`` is not. An output so holds
    until the layer after next; only the next layer reads it, as its input."""
    first, second = hidden
    return second if x.data_ptr() == first.data_ptr() else first


@dataclass(frozen=True, slots=True)
class _BatchWeights:
    """What a decoder layer's batch path (a step of several rows on the
    Triton kernels) launches with, read off the modules once per load
    (``LlamaDecoderLayer.prepack``): the linears' weights transposed as
    ``torch.mm`` takes them (the product ``F.linear`` makes, bit for bit,
    into a buffer of the step's) and the norms."""

    qkv_t: torch.Tensor  # [hidden, (Hq + 2 Hk) D]
    qkv_bias: torch.Tensor | None
    input_norm: torch.Tensor
    o_t: torch.Tensor  # [Hq D, hidden]
    gate_up_t: torch.Tensor  # [hidden, 2 I]
    post_norm: torch.Tensor
    down_t: torch.Tensor  # [I, hidden]
    eps: tuple[float, float]  # the input and post-attention norms'
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # q's and k's per-head norm weights (Qwen3)
    # Layers of one key share a step's buffers and launches (_BatchStep):
    # the QKV weight's shape, the gated width, dtype and device, the
    # attention's window, the two norms' eps and the q/k norms'.
    step_key: tuple


@dataclass(frozen=True, slots=True)
class _BatchStep:
    """One step's buffers and launches for the layers of one
    ``_BatchWeights.step_key`` when the step has several rows (a prefill
    chunk, a mixed step, an eager decode batch): what the modules do per
    layer (allocate every output, split and view the QKV rows, check and
    lay out each Triton launch, dispatch through eight modules) done once.
    Every layer's launches read each buffer before the next layer's write
    it, in stream order, as with the batch-1 ``_RowStep``."""

    normed: torch.Tensor  # [T, hidden]: each norm's output, read by the product after it
    qkv: torch.Tensor  # [T, (Hq + 2 Hk) D]
    attend: StepLaunches  # (Qwen3's q/k norms,) rope, KV write, attention from qkv's views -> [T, Hq D]
    gate_up: torch.Tensor  # [T, 2 I]
    act: torch.Tensor  # [T, I]
    norm: StepNorm  # the input norm's launch
    add_norm: StepNorm  # the residual add and post-attention norm's launch
    silu_and_mul: StepSiluAndMul  # gate_up -> act
    hidden: tuple[torch.Tensor, torch.Tensor]  # [T, hidden] x 2: the layers' outputs (_output_for)

    def run(self, w: _BatchWeights, x: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """One layer over its weights and caches, x [T, hidden] left as it
        is: the modules' nine launches with their arithmetic, in their order."""
        normed = self.norm(x, w.input_norm, self.normed)
        if w.qkv_bias is None:
            torch.mm(normed, w.qkv_t, out=self.qkv)
        else:
            torch.addmm(w.qkv_bias, normed, w.qkv_t, out=self.qkv)
        h = _output_for(self.hidden, x)
        torch.mm(self.attend(kv_cache, w.qk_norm), w.o_t, out=h)
        self.add_norm(h, w.post_norm, normed, x)  # h = attention + x, then its norm
        torch.mm(normed, w.gate_up_t, out=self.gate_up)
        self.silu_and_mul()
        return h.addmm_(self.act, w.down_t)  # h + MLP, over h


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, tp)
        # A MoE layer's block routes each row to its experts; it runs through
        # the modules (no row or batch path of fused launches).
        self.moe = is_moe_layer(config, layer)
        # Granite scales each branch before its residual add, which the fused
        # row and batch paths (adding in their GEMMs) have no place for.
        self.residual_multiplier = float(config.residual_multiplier) if config.model_type in GRANITE else 1.0
        # A NoPE layer (SmolLM3) has no rope launch for the paths' shared attention launches to make.
        self.modules_only = self.moe or self.residual_multiplier != 1.0 or not self.self_attn.use_rope
        if self.moe:
            shared = shared_expert_size(config)
            self.mlp = SparseMoeBlock(config, tp, LlamaMLP(config, tp, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._row: _RowWeights | None = None  # until the weights are loaded
        self._batch: _BatchWeights | None = None

    def prepack(self) -> None:
        """Read the row and batch paths' weights off the modules: the loader
        calls this after the last write of the weights, once the linears have
        packed theirs (parallel.prepack_linears). The batch path's: None on
        several ranks, with an o or down bias, a weight oneDNN reordered or
        held as a quantized checkpoint's codes, or q/k norms whose weights
        are of another dtype than the heads (which the step's rope launch,
        norming them, does not take). The row path's: None on several ranks,
        with an o or down bias or such q/k norms too, and where one of the
        four linears would not take the GEMV with the norm, bias and residual
        it fuses (a weight oneDNN reordered, one the kernel does not take);
        codes it takes (``_fused_weight``): there the modules decide per
        call. Checked on rows of the weights' own dtype and device, which is
        what a step's row is (``LlamaModel.forward`` checks) and every GEMV
        writes."""
        from ...kernels import gemv

        if self.modules_only:
            self._row = self._batch = None
            return
        attn, mlp = self.self_attn, self.mlp
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        norms = self.input_layernorm, self.post_attention_layernorm

        def row_of(weight: torch.Tensor) -> torch.Tensor:  # a row of the width a weight reads
            return weight.new_empty((1, weight.shape[1]))

        x = row_of(qkv.weight)
        qk_norm = attn.norms()
        # Qwen3's q/k norms go into the step's rope launch, which takes weights of the heads' dtype.
        one_rank = (o.tp.size == 1 and down.tp.size == 1 and o.bias is None and down.bias is None
                    and gate_up.bias is None and len(gate_up.sizes) == 2 and gate_up.sizes[0] == gate_up.sizes[1]
                    and (qk_norm is None or qk_norm[0].dtype == qk_norm[1].dtype == qkv.weight.dtype))  # fmt: skip
        plain = one_rank and all(m._packed is None and m.quantized_weight is None for m in (qkv, o, gate_up, down))
        # The row path's GEMVs read a dense weight or a quantized one's codes.
        weights = [m._fused_weight() for m in (qkv, o, gate_up, down)]
        qk_weights, qk_eps = (None, None) if qk_norm is None else (qk_norm[:2], qk_norm[2])
        # The batch path: the same modules, one rank, plain products.
        self._batch = _BatchWeights(
            qkv.weight.t(), qkv.bias, norms[0].weight, o.weight.t(), gate_up.weight.t(), norms[1].weight,
            down.weight.t(), (norms[0].eps, norms[1].eps), qk_weights,
            (*qkv.weight.shape, gate_up.weight.shape[0], qkv.weight.dtype, qkv.weight.device,
             attn.attn.sliding_window, norms[0].eps, norms[1].eps, qk_eps),
        ) if plain else None  # fmt: skip
        w_qkv, w_o, w_gate_up, w_down = weights
        ok = (one_rank and all(w is not None for w in weights) and gemv.supports(x, w_qkv, qkv.bias, None)
              and gemv.supports_norm(x, norms[0].weight) and gemv.supports(row_of(o.weight), w_o, None, x)
              and gemv.supports_gated(x, w_gate_up) and gemv.supports_norm(x, norms[1].weight)
              and gemv.supports(row_of(down.weight), w_down, None, x))  # fmt: skip
        step_key = (*qkv.weight.shape, gate_up.weight.shape[0], qkv.weight.dtype, qkv.weight.device,
                    attn.attn.sliding_window, qk_eps)  # fmt: skip
        self._row = _RowWeights(w_qkv, qkv.bias, (norms[0].weight, norms[0].eps), w_o, w_gate_up,
                                (norms[1].weight, norms[1].eps), w_down, qk_weights, x,
                                step_key) if ok else None  # fmt: skip

    def _row_step(self, w: _RowWeights, rope: Rope, kv_cache: KVCache, meta: AttentionMetadata) -> _RowStep | None:
        """A step's row buffers and launches for layers of ``w``'s key
        (``_shared_step`` keeps them for the rest; None: the layers launch
        as the modules lay out, per layer)."""
        from ...kernels import gemv

        qkv = w.row.new_empty((1, w.qkv.shape[0]))
        attend = self.self_attn.step_launches(qkv, rope, kv_cache, meta)
        if attend is None:
            return None
        hidden = tuple(torch.empty_like(w.row) for _ in range(2))  # each 16-byte aligned
        return _RowStep(qkv, attend, w.row.new_empty((1, w.gate_up.shape[0] // 2)), gemv.dependent_launch(qkv),
                        hidden)  # fmt: skip

    def _batch_step(self, w: _BatchWeights, rope: Rope, x: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata) -> _BatchStep | None:  # fmt: skip
        """A step's buffers and launches for layers of ``w``'s key when the
        step has several rows, made from its first layer's input ``x``
        (``_shared_step`` keeps them for the rest; None: the layers run
        through the modules)."""
        from ...kernels.activation import StepSiluAndMul
        from ...kernels.fused_norm import StepNorm

        t = x.shape[0]
        qkv = x.new_empty((t, w.qkv_t.shape[1]))
        attend = self.self_attn.step_launches(qkv, rope, kv_cache, meta)
        if attend is None:
            return None
        width = w.gate_up_t.shape[1]
        gate_up, act = x.new_empty((t, width)), x.new_empty((t, width // 2))
        return _BatchStep(x.new_empty(x.shape), qkv, attend, gate_up, act,
                          StepNorm(x, w.input_norm, w.eps[0], residual=False),
                          StepNorm(x, w.post_norm, w.eps[1], residual=True), StepSiluAndMul(gate_up, act),
                          (x.new_empty(x.shape), x.new_empty(x.shape)))  # fmt: skip

    def forward(self, rope, x, kv_cache, meta, *, row: bool = False, batch: bool = False):
        # x: [T, hidden], left as it is (on the row and batch paths the
        # output is one of the step's two hidden-state buffers, which the
        # layer after next writes over: only the next layer reads it).
        # Nine launches on the Triton lane:
        # norm, qkv GEMM, rope + KV write, attention, o_proj GEMM, residual
        # add + norm, gate/up GEMM, SiLU-mul, down GEMM adding the residual.
        path = meta.kernels
        attn = self.self_attn
        if row and not self.modules_only:
            # One row where the batch-1 GEMV runs (``ops.gemv_row``, asked
            # once per step by the model; eager and in decode graphs): six. The norms run
            # in the GEMVs' prologues, the SiLU-mul in the gate/up GEMV's
            # epilogue, the residual adds in the o and down GEMVs, each
            # rounded where the nine round.
            w = self._row
            if w is not None:
                # The launches the modules below make, prepared once from
                # the weights read once, into buffers and through attention
                # launches the step's first layer sets up for the rest
                # (Qwen3's q/k norms in its rope launch): an eager step's host work
                # is most of its time, and the modules' dispatch and checks
                # repeat per layer what the first settled (op_counts.py --host-timing).
                step = _shared_step(meta, w.step_key, self._row_step, w, rope, kv_cache, meta)
                if step is not None:
                    qkv, o, gate_up, down = w.gemvs(step.mode)
                    qkv(x, step.qkv)
                    attended, act, h = step.attend(kv_cache, w.qk_norm), step.act, _output_for(step.hidden, x)
                else:
                    from ...kernels import gemv

                    qkv, o, gate_up, down = w.gemvs(gemv.dependent_launch(x))
                    attended = attn.attend(rope, qkv(x, x.new_empty((1, qkv.n))), kv_cache, meta)
                    act, h = x.new_empty((1, gate_up.n)), torch.empty_like(x)
                o(attended, h, x)  # x + attention
                return down(gate_up(h, act), h, h)  # h + MLP, over h
            qkv = attn.qkv_proj.forward_normed(x, self.input_layernorm, path=path)
            h = attn.o_proj.forward_add(attn.attend(rope, qkv, kv_cache, meta), x, path)  # x + attention
            act = self.mlp.gate_up_proj.forward_normed(h, self.post_attention_layernorm, gated=True, path=path)
            return self.mlp.down_proj(act, h, path)  # h + MLP, over h
        if batch and self._batch is not None:
            # Several rows where ``LlamaModel.forward`` found the batch path
            # open: the nine launches below, from the step's buffers and
            # launches its first layer made (an eager step's host work per
            # layer, for a prefill chunk or a mixed step as for batch 1).
            w = self._batch
            step = _shared_step(meta, ("batch", w.step_key), self._batch_step, w, rope, x, kv_cache, meta)
            if step is not None:
                return step.run(w, x, kv_cache)
        return self._after_attention(attn(rope, self.input_layernorm(x, path), kv_cache, meta), x, path)

    def _after_attention(self, attn, x, path):
        m = self.residual_multiplier
        h, x = self.post_attention_layernorm.add_forward(attn if m == 1.0 else attn.mul_(m), x, path)  # x += attn
        if m != 1.0:
            return self.mlp(h, None, path).mul_(m).add_(x)
        return self.mlp(h, x, path)

    # The two halves a safepoint may fall between (engine/preemption.py):
    # forward's arithmetic, the residual add and the norm after it in two
    # steps, which round as the fused kernel does.
    def attend(self, rope, x, kv_cache, meta):
        attn = self.self_attn(rope, self.input_layernorm(x, meta.kernels), kv_cache, meta)
        return (attn if self.residual_multiplier == 1.0 else attn.mul_(self.residual_multiplier)).add_(x)

    def feed_forward(self, x):
        if self.residual_multiplier != 1.0:
            return self.mlp(self.post_attention_layernorm(x)).mul_(self.residual_multiplier).add_(x)
        return self.mlp(self.post_attention_layernorm(x), x)

    # forward's stretches around attention, which piecewise graphs
    # (engine/piecewise.py) capture: project, [attention], finish. forward
    # itself calls the attention module whole (its hooks run there).
    def project(self, x, path):
        return self.self_attn.qkv_proj(self.input_layernorm(x, path))

    def finish(self, attended, x, path):
        return self._after_attention(self.self_attn.o_proj(attended), x, path)


class LlamaModel(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        attn = self.layers[0].self_attn
        self.rotary = RotaryEmbedding(config, attn.head_dim)
        self.embedding_multiplier = float(config.embedding_multiplier) if config.model_type in GRANITE else 1.0
        self.layer_loop = LayerLoop()  # safepoints of preemptible steps (engine/preemption.py)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self._embed(input_ids)  # [T, hidden]
        rope = self.rotary(positions, x.dtype)  # once per step, shared by every layer
        # The layers' shared buffers and launches hold this forward's rope
        # tables: a metadata run again (a graph's stand-in replaying its
        # capture off CUDA) builds them again.
        meta._row_steps.clear()
        # Every layer's batch-1 fusions or none: the same answer for the whole step.
        # A row of the weights' dtype, contiguous, as the layers' row paths
        # read it (every GEMV writes such a row for the next).
        w = self.layers[0].self_attn.qkv_proj.weight if self.layers else None
        fits = w is not None and x.dtype == w.dtype and x.is_contiguous() and meta.lora is None
        row = fits and ops.gemv_row(x, w)
        # Several rows on the Triton kernels: the layers' batch path (one
        # row where the row kernels are off stays with the modules, as the
        # benchmarks' comparison of the two means).
        batch = (fits and not row and x.shape[0] > 1 and ops.batch_steps()
                 and (meta.kernels or ops.kernel_path(x.device)) == "triton")  # fmt: skip
        x = self.layer_loop.run(self.layers, kv_caches, x,
                                lambda layer, x, kv: layer(rope, x, kv, meta, row=row, batch=batch),
                                lambda layer, x, kv: layer.attend(rope, x, kv, meta))  # fmt: skip
        return self.norm(x, meta.kernels)

    # Piecewise graphs (engine/piecewise.py): forward cut at every attention,
    # the same arithmetic in the same order. A piece returns what the next
    # needs; attention runs between pieces on the step's real rows.
    def piece_first(self, input_ids, positions, path):
        """Embedding, the step's rope table, layer 0's norm and QKV: (x, cos, sin, qkv)."""
        x = self._embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        return x, cos, sin, self.layers[0].project(x, path)

    def piece_between(self, i, attended, x, path):
        """Layer ``i - 1`` after its attention, then layer ``i``'s norm and QKV: (x, qkv)."""
        x = self.layers[i - 1].finish(attended, x, path)
        return x, self.layers[i].project(x, path)

    def piece_last(self, attended, x, path):
        """The last layer after its attention, and the final norm: [T, hidden]."""
        return self.norm(self.layers[-1].finish(attended, x, path), path)


GRANITE_MOE_RENAMES = ((".block_sparse_moe.router.layer.", ".mlp.gate."),
                       (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
                       (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."))
MIXTRAL_RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                   (".w2.", ".down_proj."))


class ModuleDecoder(nn.Module):
    """The decoder of a family whose layers run through their modules, each
    called as ``layer(ropes, x, kv_cache, meta)`` with the step's rope
    tables (one per layer type, ``layer_type_ropes``): the embedding
    (``embed``, which a family may scale), the layers, the final norm."""

    def __init__(self, config, tp: TensorParallel, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = layer_type_ropes(config, self.layers[0].self_attn.head_dim)
        self.layer_loop = LayerLoop()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed(input_ids)
        ropes = tuple(rotary(positions, x.dtype) for rotary in self.rotary)
        x = self.layer_loop.run(self.layers, kv_caches, x,
                                lambda layer, x, kv: layer(ropes, x, kv, meta),
                                lambda layer, x, kv: layer.attend(ropes, x, kv, meta))  # fmt: skip
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    """What the engine reads of a decoder-only model (``model``: the layers
    over a ``layer_loop``, ``lm_head``), shared by the families here."""

    def __init__(self, config, model: nn.Module, tp: TensorParallel, tie_by_default: bool = False) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if getattr(config, "tie_word_embeddings", tie_by_default):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of this rank's KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    @property
    def layer_loop(self) -> LayerLoop:
        return self.model.layer_loop

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab] on rank 0; None on the other ranks."""
        return self.lm_head(hidden)


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        super().__init__(config, LlamaModel(config, tp), tp)
        self.logits_scaling = float(config.logits_scaling) if config.model_type in GRANITE else 1.0
        if config.model_type == "mixtral":  # its checkpoints' names for the MoE block and the experts' linears
            self.checkpoint_renames = MIXTRAL_RENAMES
        if config.model_type == "ernie4_5":  # its rope pairs neighbouring features: reordered into our halves
            attn = self.model.layers[0].self_attn
            self.checkpoint_row_orders = {
                ".self_attn.q_proj.": interleaved_to_halves(config.num_attention_heads, attn.head_dim, attn.head_dim),
                ".self_attn.k_proj.": interleaved_to_halves(config.num_key_value_heads, attn.head_dim, attn.head_dim),
            }
        if config.model_type == "glm4_moe":  # its shared expert's name
            self.checkpoint_renames = ((".mlp.shared_experts.", ".mlp.shared_expert."),)
        if config.model_type in ("granitemoe", "granitemoeshared"):
            # Every expert's gate/up and down stacked in one tensor each, the
            # shared expert's gate/up fused: cut into our per-expert names and parts.
            inter, shared = config.intermediate_size, getattr(config, "shared_intermediate_size", 0)
            self.checkpoint_renames = GRANITE_MOE_RENAMES
            self.checkpoint_unstacks = {
                ".block_sparse_moe.input_linear.weight": (("gate_proj", inter), ("up_proj", inter)),
                ".block_sparse_moe.output_linear.weight": (("down_proj", config.hidden_size),),
            }
            self.checkpoint_splits = {".mlp.shared_expert.gate_up_proj.": ((".mlp.shared_expert.gate_proj.", shared),
                                                                           (".mlp.shared_expert.up_proj.", shared))}
        if config.model_type == "phi3":  # its checkpoints keep q/k/v and gate/up fused, as our linears do
            attn = self.model.layers[0].self_attn
            q, kv = config.num_attention_heads * attn.head_dim, config.num_key_value_heads * attn.head_dim
            self.checkpoint_splits = {
                ".self_attn.qkv_proj.": ((".self_attn.q_proj.", q), (".self_attn.k_proj.", kv),
                                         (".self_attn.v_proj.", kv)),
                ".mlp.gate_up_proj.": ((".mlp.gate_proj.", config.intermediate_size),
                                       (".mlp.up_proj.", config.intermediate_size)),
            }  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab] on rank 0 (Granite's divided by its
        ``logits_scaling``); None on the other ranks."""
        logits = self.lm_head(hidden)
        if logits is None or self.logits_scaling == 1.0:
            return logits
        return logits / self.logits_scaling
