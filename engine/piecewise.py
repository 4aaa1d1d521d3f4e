"""Piecewise CUDA graphs: the steps decode graphs cannot hold (a prefill
chunk beside decodes, a prefill alone, a decode batch past the largest decode
bucket) with every stretch between two attention calls replayed as a graph.

A decoder layer's attention reads every sequence's length and block table,
so a graph of a whole mixed step would hold one batch's shape; the rest of
the layer (norms, projections, the MLP) reads only the number of tokens. So,
as vLLM's piecewise graphs do, a step of T tokens pads to the smallest token
bucket P >= T and runs, for an L-layer model::

    graph  embedding, rope table, layer 0's norm and QKV        [P rows]
    eager  layer 0's KV write and attention                     [T rows]
    graph  layer 0's o_proj and MLP, layer 1's norm and QKV     [P rows]
    ...
    graph  layer L-1's o_proj and MLP, the final norm           [P rows]

L + 1 graphs and L eager attention calls a step instead of nine launches a
layer from the host. Rows past T are padding: every graph operation is
row-wise, so they never reach a real row, and attention reads only the
first T.

Every bucket's pieces read and write one set of static buffers sized for
the largest bucket (a bucket uses their first P rows): one bucket runs at a
time. ``capture=False`` runs the pieces eagerly over the same buffers (CPU,
tests): the copy-pad-run-slice path the graphs replay.

Owned here: the buckets, the static buffers, the capture and the replay.
The model family supplies the pieces (``piece_first``, ``piece_between``,
``piece_last`` and each layer's ``self_attn.attend``: engine/models/llama.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.cuda_graphs import capture_largest_first
from fluidserve.engine.layers import AttentionMetadata
from fluidserve.engine.runtime import runtime_for
from fluidserve.kernels import ops

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# Token buckets. Past 512 tokens a step's GEMMs take long enough that the
# host's launches hide behind them; below, padding to the next bucket costs
# at most a third of the rows.
DEFAULT_TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The buckets a step of at most ``max_num_batched_tokens`` can use."""
    sizes = tuple(n for n in DEFAULT_TOKEN_SIZES if n <= max_num_batched_tokens)
    return sizes or (max_num_batched_tokens,)


def supports(model: nn.Module) -> bool:
    """Whether the model family cuts its forward into pieces."""
    inner = getattr(model, "model", None)
    return all(hasattr(inner, name) for name in ("piece_first", "piece_between", "piece_last"))


class PiecewiseGraphs:
    """Steps of up to the largest bucket's tokens, attention eager between
    graphed pieces. ``forward`` returns the step's hidden states, or None for
    a step it does not take (the caller runs it eagerly)."""

    def __init__(self, model: nn.Module, runner, device: torch.device, kv_caches: KVCaches,
                 sizes: tuple[int, ...], *, capture: bool) -> None:
        if not supports(model):
            raise ValueError(f"{type(model).__name__} does not cut its forward into pieces")
        self.runtime = runtime_for(device)
        if capture and not self.runtime.can_capture_graphs:
            raise ValueError("CUDA graphs need a CUDA device")
        self.inner, self.runner = model.model, runner
        self.layer_loop = getattr(model, "layer_loop", None)  # a paused step resumes there
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        self.path = ops.kernel_path(device)
        self.replays: dict[int, int] = {}  # steps run in each bucket
        self.fallbacks: dict[str, int] = {}  # steps left to the eager path, by reason
        n = self.sizes[-1]
        layer = self.inner.layers[0]
        attn = layer.self_attn
        dtype = layer.input_layernorm.weight.dtype
        ids = dict(device=device, dtype=torch.int64)
        act = dict(device=device, dtype=dtype)
        self.input_ids = torch.zeros(n, **ids)
        self.positions = torch.zeros(n, **ids)
        # What crosses from one piece to the next, [P, ...] rows of the step
        # in flight: the residual stream, the rope table, the QKV rows the
        # eager attention reads (and rotates in place), and the attention
        # output it writes for the next piece. Pieces copy their results in,
        # so no piece's own outputs stay alive between steps.
        self.x = torch.zeros(n, self.inner.embed_tokens.weight.shape[1], **act)
        rope_width = 2 * self.inner.rotary.inv_freq.numel()  # the rotated dims of a head
        self.cos = torch.zeros(n, rope_width, **act)
        self.sin = torch.zeros(n, rope_width, **act)
        self.qkv = torch.zeros(n, sum(attn.qkv_proj.sizes), **act)
        self.attended = torch.zeros(n, attn.num_heads * attn.head_dim, **act)
        self._pieces: dict[int, list[Callable[[], torch.Tensor]]] = {}
        if capture:
            self._capture_all()
        else:
            for p in self.sizes:
                self._pieces[p] = self._build(p, record=None)

    # -- pieces -------------------------------------------------------------
    def _build(self, p: int, record) -> list[Callable[[], torch.Tensor]]:
        """The bucket's pieces over the first ``p`` rows of the static
        buffers, the last returning the step's hidden states. ``record(run)``
        turns a piece into its replay (a CUDA graph of it); None runs the
        piece itself each time."""
        inner, path = self.inner, self.path
        ids, pos = self.input_ids[:p], self.positions[:p]
        x, cos, sin, qkv, att = self.x[:p], self.cos[:p], self.sin[:p], self.qkv[:p], self.attended[:p]

        def first():
            new_x, new_cos, new_sin, new_qkv = inner.piece_first(ids, pos, path)
            for buf, val in ((x, new_x), (cos, new_cos), (sin, new_sin), (qkv, new_qkv)):
                buf.copy_(val)
            return qkv

        def between(i):
            def run():
                new_x, new_qkv = inner.piece_between(i, att, x, path)
                x.copy_(new_x)
                qkv.copy_(new_qkv)
                return qkv
            return run

        def last():
            return inner.piece_last(att, x, path)

        runs = [first] + [between(i) for i in range(1, len(inner.layers))] + [last]
        return runs if record is None else [record(run) for run in runs]

    def _capture_all(self) -> None:
        capture_largest_first(self.runtime, self.sizes, self._capture_bucket,
                              f"piecewise CUDA graphs ({len(self.inner.layers) + 1} a bucket) for token buckets")

    def _capture_bucket(self, p: int, pool) -> None:
        self._pieces[p] = self._build(p, lambda run: self.runtime.capture(run, pool))

    # -- steps --------------------------------------------------------------
    def ineligible(self, inp: ModelInput) -> str | None:
        """Why a step runs eagerly, or None."""
        if not inp.input_ids:
            return "no tokens"
        if len(inp.input_ids) > self.sizes[-1]:
            return "larger than the largest bucket"
        if inp.preemptible:  # safepoints sit between layers: the layer loop runs them
            return "preemptible"
        if self.layer_loop is not None and self.layer_loop.resuming:
            return "resumed"
        return None

    def forward(self, inp: ModelInput, feed: Callable[[torch.Tensor], None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hidden states ``[T, hidden]`` and sample indices of a step run in
        its bucket, or None: run it eagerly. The hidden states are a view of
        the bucket's output, valid until the next piecewise step."""
        why = self.ineligible(inp)
        if why is not None:
            self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
            return None
        t = len(inp.input_ids)
        p = next(n for n in self.sizes if n >= t)
        input_ids, positions, meta, sample_idx = self.runner.prepare(inp, self.kv_caches)
        if feed is not None:
            feed(input_ids)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if t < p:  # padding rows: token 0 at position 0, written nowhere
            self.input_ids[t:p].zero_()
            self.positions[t:p].zero_()
        pieces = self._pieces[p]
        for i, piece in enumerate(pieces[:-1]):
            piece()
            self._attend(i, t, meta)
        hidden = pieces[-1]()
        self.replays[p] = self.replays.get(p, 0) + 1
        return hidden[:t], sample_idx

    def _attend(self, i: int, t: int, meta: AttentionMetadata) -> None:
        """Layer ``i``'s KV write and attention over the step's real rows."""
        rope = (self.cos[:t], self.sin[:t])
        attended = self.inner.layers[i].self_attn.attend(rope, self.qkv[:t], self.kv_caches[i], meta)
        self.attended[:t].copy_(attended)
