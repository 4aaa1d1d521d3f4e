"""GLM-4 over the flat token batch (``Glm4ForCausalLM``: GLM-4-9B-0414,
GLM-4-32B-0414, GLM-Z1).

Where it differs from the Llama family: each layer norms its attention's
and MLP's outputs before their residual adds as well as their inputs (four
norms a layer); q, k and v carry biases, the output projection none;
gate/up are fused in its checkpoints (cut into our parts as Phi-3's are);
and rope turns half of each head (``partial_rotary_factor`` 0.5) in the
interleaved layout: neighbouring features (2i, 2i+1) are a pair.

Our rope kernels rotate halves (feature i with i + R/2). The loader
permutes each head's rotated rows of q_proj and k_proj (weights, biases,
and LoRA adapters' B) so that pair (2i, 2i+1) lands on (i, i + R/2)
(``checkpoint_row_orders``): each pair then turns by the same frequency
in our layout as in the reference's. q and k are permuted alike, so every
score q.k is the reference's; v is untouched, and the permuted k in the
cache is read by nothing but these scores. The layers run through their
modules (the fused row and batch paths add a residual in the GEMM, which
the output norms come before)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import AttentionMetadata, KVCache, PagedAttention, RMSNorm, Rope, interleaved_to_halves
from ..parallel import MergedColumnParallelLinear, Part, RowParallelLinear, TensorParallel
from .llama import DecoderForCausalLM, LlamaMLP, ModuleDecoder, _kv_sharding


class Glm4Attention(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.num_heads = tp.divide(total_heads, "num_attention_heads")
        kv_shards, kv_index = _kv_sharding(total_kv_heads, tp)
        self.num_kv_heads = total_kv_heads // kv_shards
        self.qkv_proj = MergedColumnParallelLinear(hidden, [
            Part("q_proj", total_heads * self.head_dim),
            Part("k_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
            Part("v_proj", total_kv_heads * self.head_dim, kv_shards, kv_index),
        ], bool(getattr(config, "attention_bias", True)), tp)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, False, tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, rope: Rope, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q, k, v = (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                   v.view(t, self.num_kv_heads, self.head_dim))  # fmt: skip
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope))  # [T, hidden], all-reduced


class Glm4DecoderLayer(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Glm4Attention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps)

    def forward(self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        return self.feed_forward(self.attend(ropes, x, kv_cache, meta))

    # The two halves a safepoint may fall between (engine/preemption.py).
    def attend(self, ropes: tuple[Rope, ...], x: torch.Tensor, kv_cache: KVCache,
               meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        return x + self.post_self_attn_layernorm(self.self_attn(ropes[0], self.input_layernorm(x), kv_cache, meta))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4Model(ModuleDecoder):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__(config, tp, [Glm4DecoderLayer(config, tp) for _ in range(config.num_hidden_layers)],
                         RMSNorm(config.hidden_size, config.rms_norm_eps))


class Glm4ForCausalLM(DecoderForCausalLM):
    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        tp = tp or TensorParallel()
        super().__init__(config, Glm4Model(config, tp), tp)
        head_dim, rotated = self.model.layers[0].self_attn.head_dim, self.model.rotary[0].rotary_dim
        inter = config.intermediate_size
        self.checkpoint_splits = {".mlp.gate_up_proj.": ((".mlp.gate_proj.", inter), (".mlp.up_proj.", inter))}
        self.checkpoint_row_orders = {
            ".self_attn.q_proj.": interleaved_to_halves(config.num_attention_heads, head_dim, rotated),
            ".self_attn.k_proj.": interleaved_to_halves(config.num_key_value_heads, head_dim, rotated),
        }
