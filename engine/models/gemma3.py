"""Gemma 2 and Gemma 3's text model over the flat token batch
(``Gemma2ForCausalLM``; ``Gemma3ForCausalLM``: Gemma 3 1B, and the
text-only checkpoints of its family).

Where they differ from the Llama family: the embedding is scaled by
sqrt(hidden); every RMSNorm multiplies by ``1 + weight`` in float32 before
rounding (``GemmaRMSNorm``); each layer norms its attention and MLP outputs
as well as their inputs (four norms a layer, the residual added after the
output norms); the MLP's activation is GELU (tanh); the attention scale is
``query_pre_attn_scalar ** -0.5``; and the layers alternate between
sliding-window attention (``sliding_attention``) and full attention
(``full_attention``, ``layer_types``). Gemma 3 norms q and k per head and
gives each layer type its own rope base, so a step computes two rope tables
and each layer reads its own. Gemma 2 has one rope, and soft-caps the
attention scores (``attn_logit_softcapping``: ``cap * tanh(score / cap)``,
in the attention kernels) and the logits (``final_logit_softcapping``).
Parameter names mirror the Hugging Face checkpoints.

The layers run through their modules: the Llama family's fused row and
batch paths and piecewise graphs are not built for this layout (decode
CUDA graphs capture it as they capture any forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import AttentionMetadata, KVCache, PagedAttention, Rope
from ..parallel import (
    MergedColumnParallelLinear,
    Part,
    RowParallelLinear,
    TensorParallel,
)
from .llama import DecoderForCausalLM, ModuleDecoder, _kv_sharding

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """``rms_norm(x) * (1 + weight)`` in float32, rounded once to x's dtype
    (transformers' Gemma3RMSNorm). ``1 + weight`` is taken once the loader
    has written the weight (``prepack``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._scale: torch.Tensor | None = None

    def prepack(self) -> None:
        with torch.no_grad():
            self._scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self._scale if self._scale is not None else 1.0 + self.weight.float()
        return (torch.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * scale).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.num_heads = tp.divide(total_heads, "num_attention_heads")
        kv_shards, kv_index = _kv_sharding(total_kv_heads, tp)
        self.num_kv_heads = total_kv_heads // kv_shards
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            Part("q_proj", total_heads * self.head_dim),
            Part("k_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
            Part("v_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
        ], bias, tp)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias, tp)
        self.qk_norm = config.model_type != "gemma2"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.sliding = config.layer_types[layer] == SLIDING
        window = config.sliding_window if self.sliding else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   config.query_pre_attn_scalar**-0.5, window,
                                   softcap=getattr(config, "attn_logit_softcapping", None))  # fmt: skip

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # the per-head norms make new tensors, which the attention rotates in place
            q, k = self.q_norm(q), self.k_norm(k)
        attended = self.attn(q, k, v.view(t, self.num_kv_heads, self.head_dim), kv_cache, meta, rope)
        return self.o_proj(attended)  # [T, hidden], all-reduced


class Gemma3MLP(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        inter = config.intermediate_size
        tp.divide(inter, "intermediate_size")
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r}: only gelu_pytorch_tanh is supported for Gemma 3")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [Part("gate_proj", inter),
                                                                            Part("up_proj", inter)], False, tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer, tp)
        self.mlp = Gemma3MLP(config, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, ropes: tuple[Rope, Rope], x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        return self.feed_forward(self.attend(ropes, x, kv_cache, meta))

    # The two halves a safepoint may fall between (engine/preemption.py).
    def attend(self, ropes: tuple[Rope, Rope], x: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        rope = ropes[self.self_attn.sliding and len(ropes) > 1]
        return x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), kv_cache, meta))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(ModuleDecoder):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__(config, tp, [Gemma3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)],
                         GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        self.embed_scale = config.hidden_size**0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)  # the scale rounded to the dtype, as transformers


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3's text model, and Gemma 2 (registered under both names)."""

    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        super().__init__(config, Gemma3Model(config, tp), tp, tie_by_default=True)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab] on rank 0 (Gemma 2's soft-capped as
        transformers caps them: divided, tanh, multiplied); None on the
        other ranks."""
        logits = self.lm_head(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
