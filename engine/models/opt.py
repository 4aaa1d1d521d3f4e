"""OPT (the model the FastServe and FluidInfer papers serve) over the flat
token batch. Learned positions are offset by 2, as in the original release;
parameter names mirror the Hugging Face checkpoints."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..layers import AttentionMetadata, PagedAttention

POSITION_OFFSET = 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class OPTAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        bias = getattr(config, "enable_bias", True)
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x, kv_cache, meta):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_heads, self.head_dim)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.pre_norm = config.do_layer_norm_before
        self.act = ACTIVATIONS[config.activation_function]
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(config.hidden_size, config.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(config.ffn_dim, config.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)

    def forward(self, x, kv_cache, meta):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        proj_dim = config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, proj_dim)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        self.project_in = nn.Linear(proj_dim, config.hidden_size, bias=False) if proj_dim != config.hidden_size else None
        self.project_out = nn.Linear(config.hidden_size, proj_dim, bias=False) if proj_dim != config.hidden_size else None
        has_final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine) if has_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class _OPTModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    # Original OPT checkpoints store "decoder.*"; transformers' own save "model.decoder.*".
    checkpoint_prefixes = {"decoder.": "model.decoder."}

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = _OPTModel(config)
        self.lm_head = nn.Linear(config.word_embed_proj_dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight  # OPT always ties

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        attn = self.model.decoder.layers[0].self_attn
        return len(self.model.decoder.layers), attn.num_heads, attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        return self.model.decoder(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
