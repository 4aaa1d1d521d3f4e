"""OPT (the model the FastServe and FluidInfer papers serve) over the flat
token batch. Learned positions are offset by 2, as in the original release;
parameter names mirror the Hugging Face checkpoints.

Under tensor parallelism (engine/parallel.py) each rank holds its share of
the heads and of fc1's features; the learned positions, the optional
project_in/out and the layer norms are small and replicated."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..layers import AttentionMetadata, PagedAttention
from ..preemption import LayerLoop
from ..parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)

POSITION_OFFSET = 2
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class OPTAttention(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.num_heads = tp.divide(config.num_attention_heads, "num_attention_heads")  # this rank's heads
        bias = getattr(config, "enable_bias", True)
        # q, k and v in one product; the checkpoint's q_proj/k_proj/v_proj load into its rows.
        self.qkv_proj = MergedColumnParallelLinear(
            hidden, [Part("q_proj", hidden), Part("k_proj", hidden), Part("v_proj", hidden)], bias, tp)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x, kv_cache, meta):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H / tp, D] each
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        bias = getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.pre_norm = config.do_layer_norm_before
        self.act = ACTIVATIONS[config.activation_function]
        self.self_attn = OPTAttention(config, tp)
        self.self_attn_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        tp.divide(config.ffn_dim, "ffn_dim")
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias, tp)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias, tp)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)

    def forward(self, x, kv_cache, meta):
        return self.feed_forward(self.attend(x, kv_cache, meta))

    # The two halves a safepoint may fall between (engine/preemption.py).
    def attend(self, x, kv_cache, meta):
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        return x

    def feed_forward(self, x):
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTDecoder(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        proj_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, tp)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        projected = proj_dim != config.hidden_size
        self.project_in = nn.Linear(proj_dim, config.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(config.hidden_size, proj_dim, bias=False) if projected else None
        has_final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine) if has_final else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.layer_loop = LayerLoop()  # safepoints of preemptible steps (engine/preemption.py)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        x = self.layer_loop.run(self.layers, kv_caches, x, lambda layer, x, kv: layer(x, kv, meta),
                                lambda layer, x, kv: layer.attend(x, kv, meta))
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class _OPTModel(nn.Module):
    def __init__(self, config, tp: TensorParallel) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, tp)


class OPTForCausalLM(nn.Module):
    # Original OPT checkpoints store "decoder.*"; transformers' own save "model.decoder.*".
    checkpoint_prefixes = {"decoder.": "model.decoder."}

    def __init__(self, config, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = config
        self.model = _OPTModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim, tp)
        self.lm_head.weight = self.model.decoder.embed_tokens.weight  # OPT always ties

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        attn = self.model.decoder.layers[0].self_attn
        return len(self.model.decoder.layers), attn.num_heads, attn.head_dim

    @property
    def layer_loop(self) -> LayerLoop:
        return self.model.decoder.layer_loop

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        return self.model.decoder(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab] on rank 0; None on the other ranks."""
        return self.lm_head(hidden)
