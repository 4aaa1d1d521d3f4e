"""The Llama family over the flat token batch: Llama 2/3, Mistral, Qwen2 (bias
on q/k/v) and Qwen3 (RMSNorm on q and k per head). Parameter names mirror the
Hugging Face checkpoints so weights load by name."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..layers import AttentionMetadata, PagedAttention, RMSNorm, RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


def _sliding_window(config, layer: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type in ("qwen2", "qwen3"):
        if not getattr(config, "use_sliding_window", False):
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and layer_types[layer] != "sliding_attention":
            return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, self.head_dim)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5, _sliding_window(config, layer))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache."""
        attn = self.model.layers[0].self_attn
        return len(self.model.layers), attn.num_kv_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """[T] token ids -> [T, hidden] final hidden states."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
