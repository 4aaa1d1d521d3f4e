"""Building blocks shared by the model families: the per-step attention
metadata, RMSNorm, rotary embeddings and the paged attention layer.

Every model runs over one flat ragged batch ``[num_tokens, hidden]``: prefill
chunks and decode tokens of many requests concatenated, no padding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels import cpu_attention, ops


@dataclass
class AttentionMetadata:
    """How the flat batch maps onto sequences and KV slots (see
    kernels/reference.py for the exact semantics)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    # Host copies of the lengths: the Triton kernel's work plan is built from
    # them once per step (per sliding window), never read back from the GPU.
    host_q_lens: list[int] = field(default_factory=list)
    host_seq_lens: list[int] = field(default_factory=list)
    # Which kernels run the step (ops.kernel_path), resolved once by whoever
    # builds the metadata rather than by every layer; None: ask per call.
    kernels: str | None = None
    # The step's rows grouped by LoRA adapter (engine/lora.py), None where
    # every row runs the base model: with adapter rows, every layer runs
    # through its modules, whose linears add the adapters' products.
    lora: object | None = None
    _plans: dict = field(default_factory=dict, repr=False)
    _cpu_plans: dict = field(default_factory=dict, repr=False)
    # Sliding windows whose attention variants a layer of this step has
    # checked are compiled (``_compile_variants_once``): every layer of a
    # step attends with the same query and cache layout, so the first asks.
    _compiled: set = field(default_factory=set, repr=False)
    # A model's batch-1 row layers' buffers and launches (models/llama.py),
    # per layer shape and window: built by the step's first such layer and
    # shared by the rest.
    _row_steps: dict = field(default_factory=dict, repr=False)

    def work_plan(self, query: torch.Tensor, key_cache: torch.Tensor, sliding_window: int | None):
        """The packed attention work list of this step for the Triton kernels;
        None where other kernels run (they need none)."""
        if (self.kernels or ops.kernel_path(query.device)) != "triton" or not self.host_q_lens:
            return None
        if sliding_window not in self._plans:
            from ..kernels.paged_attention import plan_for

            self._plans[sliding_window] = plan_for(query, key_cache, self.host_q_lens, self.host_seq_lens,
                                                   sliding_window)
        return self._plans[sliding_window]

    def cpu_plan(self, key_cache: torch.Tensor, sliding_window: int | None) -> cpu_attention.CpuAttentionPlan:
        """The CPU attention plan of this step, built by the first layer and
        shared by the rest (per sliding window)."""
        if sliding_window not in self._cpu_plans:
            q_lens, seq_lens = self.host_q_lens, self.host_seq_lens
            if not q_lens:  # built without host copies: read them back once
                loc = self.query_start_loc.tolist()
                q_lens, seq_lens = [b - a for a, b in zip(loc, loc[1:])], self.seq_lens.tolist()
            self._cpu_plans[sliding_window] = cpu_attention.build_plan(
                q_lens, seq_lens, self.block_tables, self.slot_mapping, key_cache.shape[1], sliding_window,
                key_cache.shape[2] * key_cache.shape[3])
        return self._cpu_plans[sliding_window]


class RMSNorm(nn.Module):
    """RMSNorm with the reference's rounding (kernels/ops.rms_norm), and the
    residual add before it fused in (``add_forward``): one launch each on the
    Triton lane."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, path: ops.KernelPath | None = None) -> torch.Tensor:
        # [..., D] -> [..., D]; x is left as it is
        return ops.rms_norm(x, self.weight, self.eps, path=path)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    path: ops.KernelPath | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, the sum written over ``x``
        (which the caller must own, e.g. a layer's fresh output)."""
        return ops.rms_norm(x, self.weight, self.eps, residual, path)


# cos and sin of a step's positions, [T, head_dim] each, in the model's dtype;
# the sine carries rotate_half's sign (kernels/rope_cache.py draws the layout).
Rope = tuple[torch.Tensor, torch.Tensor]
KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (key cache, value cache)
# q's and k's per-head RMSNorm weights ([D] each) and its eps (Qwen3).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout). The inverse frequencies
    come from transformers' own initialisers, so every rope type a config can
    name (llama3, yarn, linear, ...) matches the reference implementation."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        # LongRoPE (Phi-3): the long factors where the server's context
        # (``served_max_model_len``, set by the worker) passes the pretraining
        # length, the short ones otherwise, for every position, as vLLM
        # reads it. One set for the whole sequence keeps relative positions
        # whole and cached keys valid; transformers switches to the long set
        # once a sequence passes the length and recomputes it, so the tokens
        # agree within the length under a context within it, and past it
        # under a longer one.
        # A partial rope (Phi-4-mini: 0.75) rotates each head's first
        # ``rotary_dim`` features and passes the rest through; transformers'
        # initialisers size their frequencies by it too.
        partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        self.rotary_dim = int(head_dim * partial)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor={partial} gives {self.rotary_dim} rotated features of a "
                             f"{head_dim}-wide head: rope needs an even number, at most the head")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = self.rotary_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, self.scaling = init(config, None)
            if rope_type == "longrope":
                original = int(params["original_max_position_embeddings"])
                served = getattr(config, "served_max_model_len", None) or config.max_position_embeddings
                if served > original:
                    inv_freq, _ = init(config, None, seq_len=original + 1)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin of this step's positions, [T, rotary_dim] each:
        computed once per step by the model and shared by every layer. The
        values are the reference's (``cat(freqs, freqs).cos() * scaling``,
        cast to dtype)."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, rotary_dim / 2]
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.cat((cos, cos, -sin, sin), dim=-1)  # [T, 2D]: cos | signed sin
        if self.scaling != 1.0:
            table = table * self.scaling
        table = table.to(dtype)
        half = table.shape[-1] // 2
        return table[:, :half], table[:, half:]


def interleaved_to_halves(heads: int, head_dim: int, rotated: int) -> torch.Tensor:
    """The row order taking each head's rotated features from interleaved
    pairs (2i, 2i+1), GPT-J's rope layout (GLM-4, ERNIE 4.5), to halves
    (i, i + rotated / 2), ours, the rest in place: a model whose q and k
    rows are reordered so turns each pair by the same frequency, and its
    scores are unchanged (q and k reordered alike):
    ``new_rows = old_rows[order]`` over ``heads`` heads of ``head_dim``. On
    the CPU, where checkpoint and adapter tensors are read, whatever device
    the model is built on (the meta device, for checking adapters)."""
    cpu = torch.device("cpu")
    within = torch.cat((torch.arange(0, rotated, 2, device=cpu), torch.arange(1, rotated, 2, device=cpu),
                        torch.arange(rotated, head_dim, device=cpu)))
    return (torch.arange(heads, device=cpu)[:, None] * head_dim + within).flatten()


class LayerRopeConfig:
    """One layer type's view of a config whose ``rope_parameters`` are keyed
    by layer type (Gemma 3, OLMo 3), as ``RotaryEmbedding`` reads a config."""

    def __init__(self, config, layer_type: str) -> None:
        self._config, self.rope_parameters = config, config.rope_parameters[layer_type]

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def layer_type_ropes(config, head_dim: int) -> nn.ModuleList:
    """(full attention's rope, sliding attention's) of a config whose
    ``rope_parameters`` are keyed by layer type (Gemma 3, OLMo 3), or its
    one rope (Gemma 2, OLMo 2): a layer reads ``ropes[sliding and len(ropes) > 1]``."""
    if "sliding_attention" not in (getattr(config, "rope_parameters", None) or {}):
        return nn.ModuleList([RotaryEmbedding(config, head_dim)])
    return nn.ModuleList(RotaryEmbedding(LayerRopeConfig(config, kind), head_dim)
                         for kind in ("full_attention", "sliding_attention"))  # fmt: skip


# A step's attention launches for a layer: its caches and (Qwen3) its q and k
# norm weights -> [T, Hq * D] (``PagedAttention.step_launches``).
StepLaunches = Callable[[KVCache, tuple[torch.Tensor, torch.Tensor] | None], torch.Tensor]


class PagedAttention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over it."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # Gemma 2: scores capped as softcap * tanh(score / softcap)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: Rope | None = None, qk_norm: QKNorm | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hk, D] -> [T, Hq * D]. With ``rope``, q
        and k are rotated first, in place (the caller's projection output):
        on the Triton lane in the same launch that writes the cache, which
        also norms each of their heads first where ``qk_norm`` is given."""
        key_cache, value_cache = kv_cache
        path = meta.kernels or ops.kernel_path(q.device)
        # The rope launch norms whole heads before a whole-head rotation
        # only: a partial rope's q/k norms run first.
        partial = rope is not None and rope[0].shape[-1] != self.head_dim
        if qk_norm is not None and (path == "cpu" or rope is None or partial):
            q_weight, k_weight, eps = qk_norm
            q, k = ops.rms_norm(q, q_weight, eps, path=path)[0], ops.rms_norm(k, k_weight, eps, path=path)[0]
            qk_norm = None
        if path == "cpu":
            if rope is not None:
                ops.rope_torch(q, *rope)
                ops.rope_torch(k, *rope)
            plan = meta.cpu_plan(key_cache, self.sliding_window)
            cpu_attention.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, plan.slots_all_valid)
            out = cpu_attention.paged_attention(q, key_cache, value_cache, plan, self.scale, k, v, self.softcap)
            return out.reshape(out.shape[0], -1)
        self._compile_variants(q, key_cache, meta)
        if rope is not None:
            ops.rope_and_cache(q, k, v, *rope, key_cache, value_cache, meta.slot_mapping, path=path, qk_norm=qk_norm)
        else:
            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, path=path)
        out = ops.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, self.sliding_window, work=meta.work_plan(q, key_cache, self.sliding_window), path=path,
            softcap=self.softcap,
        )
        return out.reshape(out.shape[0], -1)

    def _compile_variants(self, q: torch.Tensor, key_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        key = (self.sliding_window, self.softcap)
        if key not in meta._compiled:
            _compile_variants_once(q, key_cache, self.sliding_window, self.softcap)
            meta._compiled.add(key)

    def step_launches(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                      meta: AttentionMetadata, rope: Rope, qk_norm: QKNorm | None = None) -> StepLaunches | None:
        """``forward``'s Triton launches for a step whose every layer of
        this attention's shape and window rotates, writes and attends from
        these q, k, v (views of one buffer every layer's QKV projection
        writes: the batch-1 row layer's), worked out once: a callable
        taking a layer's caches (and, where ``qk_norm`` is given, the
        layer's q and k norm weights; its eps is the step's) and returning
        [T, Hq * D], one buffer every layer writes. The checks, strides and
        dispatch ``forward`` repeats per layer are most of an eager layer's
        host time beside its launches. None off the Triton kernels,
        without a work plan, and for q/k norms with a partial rope."""
        key_cache, value_cache = kv_cache
        if (meta.kernels or ops.kernel_path(q.device)) != "triton":
            return None
        if qk_norm is not None and rope[0].shape[-1] != self.head_dim:
            return None  # q/k norms with a partial rope: ``forward`` norms them first
        plan = meta.work_plan(q, key_cache, self.sliding_window)
        if plan is None:
            return None
        from ..kernels.launch import aligned, cache_layout
        from ..kernels.paged_attention import StepAttention
        from ..kernels.rope_cache import StepRopeAndCache

        self._compile_variants(q, key_cache, meta)
        write = StepRopeAndCache(q, k, v, *rope, key_cache, value_cache, meta.slot_mapping, qk_norm)
        attend = StepAttention(q, key_cache, value_cache, meta.block_tables, self.scale, plan, self.softcap)
        out, layout = attend.out.view(q.shape[0], -1), cache_layout(key_cache, value_cache)

        def launches(kv: KVCache, norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
            # Both launches read the caches' layout: asked once for the two.
            if cache_layout(*kv) == layout:
                usual = aligned(*kv)
                # A layer's norm weights are its model's dtype, as the first layer's were checked to be.
                write.launch(*kv, usual and (norm_weights is None or aligned(*norm_weights)), norm_weights)
                attend.launch(*kv, usual)
            else:  # laid out otherwise: each takes its checked path
                write(*kv, norm_weights)
                attend(*kv)
            return out

        return launches


# Layouts whose Triton variants are compiled (see _compile_variants_once).
_COMPILED: set[tuple] = set()


def _compile_variants_once(q: torch.Tensor, key_cache: torch.Tensor, sliding_window: int | None,
                           softcap: float | None = None) -> None:  # fmt: skip
    """Compile every attention variant this layout will launch (decode-only,
    mixed, the split merge) the first time a layer sees it on CUDA: the
    worker's warm-up step at start-up (Worker.warm_up) does, so no variant
    compiles in the middle of serving. The query's strides are part of a
    variant, so the real query is the template."""
    if not q.is_cuda:
        return
    key = (q.device, q.dtype, tuple(q.shape[1:]), q.stride(), tuple(key_cache.shape[1:]), key_cache.stride(),
           sliding_window, bool(softcap))
    if key in _COMPILED:
        return
    from ..kernels.paged_attention import warmup

    warmup(q, key_cache, sliding_window, softcap=softcap)
    _COMPILED.add(key)
