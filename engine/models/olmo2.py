"""OLMo 2, OLMo 3 and EXAONE 4 over the flat token batch
(``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``, ``Exaone4ForCausalLM``).

Where they differ from the Llama family: no norm before attention or the
MLP; instead each branch's output is normed before its residual add
(``post_attention_layernorm``, ``post_feedforward_layernorm``), and q and k
are RMS-normed before rope. OLMo norms them over the whole projection
(every head at once), and every OLMo norm multiplies by its weight in
float32 and rounds once (``OlmoRMSNorm``, transformers' Olmo2RMSNorm).
EXAONE 4 norms q and k per head, with the Llama family's norm, and in its
hybrid checkpoints (``sliding_window`` set) its full-attention layers take
no rope. OLMo 3 and EXAONE 4 have sliding-window layers beside
full-attention ones (``layer_types``); OLMo 3 gives each type its own rope
parameters, so a step computes a rope table per type as Gemma 3's does.
Parameter names mirror the Hugging Face checkpoints.

Under tensor parallelism each rank holds its heads' share of OLMo's q and
k norms' weights; their mean square spans every rank's heads, so each layer
sums its rows' squares across ranks (one all-reduce of two numbers a row
for q and k together). Where there are fewer KV heads than ranks, each rank
counts its replicated KV head once, and the sum over ranks counts every head
equally often, so dividing by the features summed gives the same mean.

The layers run through their modules: the Llama family's fused row and batch
paths and piecewise graphs are not built for this layout (decode CUDA
graphs capture it as they capture any forward)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import AttentionMetadata, KVCache, PagedAttention, RMSNorm, Rope
from ..parallel import (
    MergedColumnParallelLinear,
    Part,
    RowParallelLinear,
    ShardSpec,
    TensorParallel,
    new_param,
)
from .llama import DecoderForCausalLM, LlamaMLP, ModuleDecoder, _kv_sharding

SLIDING = "sliding_attention"


class OlmoRMSNorm(nn.Module):
    """``weight * rms_norm(x)`` in float32, rounded once to x's dtype. With
    ``spec``, the weight is one rank's slice of the norm's features."""

    def __init__(self, dim: int, eps: float, spec: ShardSpec | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param((dim,), spec)

    def forward(self, x: torch.Tensor, mean_square: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, dim]; ``mean_square`` ([T, 1], float32): the mean square
        of each row's whole feature vector, where this rank holds a slice."""
        xf = x.float()
        if mean_square is None:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * (xf * torch.rsqrt(mean_square + self.eps))).to(x.dtype)


class Olmo2Attention(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.num_heads = tp.divide(total_heads, "num_attention_heads")
        kv_shards, kv_index = _kv_sharding(total_kv_heads, tp)
        self.num_kv_heads = total_kv_heads // kv_shards
        bias = bool(getattr(config, "attention_bias", False))
        q_width, kv_width = total_heads * self.head_dim, total_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            Part("q_proj", q_width),
            Part("k_proj", kv_width, kv_shards, kv_index),
            Part("v_proj", kv_width, kv_shards, kv_index),
        ], bias, tp)
        self.o_proj = RowParallelLinear(q_width, hidden, bias, tp)
        self.per_head = config.model_type == "exaone4"  # q/k norms per head (EXAONE 4), not over the projection
        if self.per_head:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        else:
            q_local, kv_local = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.q_norm = OlmoRMSNorm(q_local, eps, ShardSpec(0, tp.rank, q_local, q_width) if tp.size > 1 else None)
            self.k_norm = OlmoRMSNorm(kv_local, eps,
                                      ShardSpec(0, kv_index, kv_local, kv_width) if kv_shards > 1 else None)
        self.tp = tp
        layer_types = getattr(config, "layer_types", None)
        self.sliding = layer_types is not None and layer_types[layer] == SLIDING
        window = config.sliding_window if self.sliding else None
        # EXAONE 4's hybrid attention: rope on the sliding layers only.
        self.use_rope = not (self.per_head and config.sliding_window is not None and not self.sliding)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, window)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        rope = rope if self.use_rope else None
        if self.per_head:
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope))
        q_ms = k_ms = None
        if self.tp.size > 1:
            # Both norms' sums of squares in one all-reduce; each rank holds
            # as many features as the next, so the total count is the local
            # width times the ranks (module docstring).
            sums = torch.stack((q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)), dim=-1)  # [T, 2]
            self.tp.all_reduce(sums)
            q_ms = sums[:, :1] / (q.shape[-1] * self.tp.size)
            k_ms = sums[:, 1:] / (k.shape[-1] * self.tp.size)
        # The norms make new tensors, which the attention rotates in place.
        q = self.q_norm(q, q_ms).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k, k_ms).view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope))  # [T, hidden], all-reduced


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, layer, tp)
        self.mlp = LlamaMLP(config, tp)
        norm = RMSNorm if config.model_type == "exaone4" else OlmoRMSNorm
        self.post_attention_layernorm = norm(hidden, eps)
        self.post_feedforward_layernorm = norm(hidden, eps)

    def forward(self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        return self.feed_forward(self.attend(ropes, x, kv_cache, meta))

    # The two halves a safepoint may fall between (engine/preemption.py).
    def attend(self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        rope = ropes[self.self_attn.sliding and len(ropes) > 1]
        return x + self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(ModuleDecoder):  # OLMo 3: a rope per layer type
    def __init__(self, config, tp: TensorParallel) -> None:
        norm = RMSNorm if config.model_type == "exaone4" else OlmoRMSNorm
        super().__init__(config, tp, [Olmo2DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)],
                         norm(config.hidden_size, config.rms_norm_eps))


class Olmo2ForCausalLM(DecoderForCausalLM):
    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        super().__init__(config, Olmo2Model(config, tp), tp)
