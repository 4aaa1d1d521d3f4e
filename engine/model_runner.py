"""ModelRunner: turns a ModelInput into the step's tensors and runs the model.

Owns the step's persistent input buffers and builds everything a forward
reads *before* the forward: the attention metadata and the attention work
plan of each sliding window the model uses (so no layer builds anything).

All integer inputs of a step travel in one buffer, one host-to-device copy
(pinned on CUDA), laid out in 32-bit words::

    [ input_ids | positions | slot_mapping | sample_idx ]   int64, T, T, T, S_s
    [ seq_lens | query_start_loc | block_tables (S x W) ]   int32, S, S+1, S*W
    [ work plan of each sliding window (Triton kernels) ]   int32, WorkPlan.num_words

each section starting on a 16-byte boundary, and viewed on the device without
further copies. The boundary matters on a GPU: Triton specialises a kernel on
whether each pointer is 16-byte aligned, so a view whose alignment followed
the batch's size would compile a second variant in the middle of serving.
The buffers grow (never shrink) when a step needs more, so in steady serving
nothing is allocated per step. On CPU the host buffer is the device buffer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from fluidserve.engine.batch import ModelInput
from fluidserve.engine.block_tables import BlockTableMirror
from fluidserve.engine.layers import AttentionMetadata, PagedAttention
from fluidserve.engine.lora import LoRAStep
from fluidserve.engine.runtime import DeviceRuntime, runtime_for
from fluidserve.kernels import ops
from fluidserve.kernels.packing import aligned_words

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 runtime: DeviceRuntime | None = None) -> None:
        self.model = model
        self.device = device
        self.runtime = runtime or runtime_for(device)
        self.kernels = ops.kernel_path(device)  # FLUIDSERVE_KERNELS is read when the engine starts
        attn = [m for m in model.modules() if isinstance(m, PagedAttention)]
        # The planner checks a query's layout against the cache as a launch
        # does, so its stand-in carries the model's dtype.
        self._query_like = (torch.empty((0, attn[0].num_heads, attn[0].head_dim), dtype=dtype, device=device)
                            if attn else None)
        self._windows = sorted({m.sliding_window for m in attn}, key=lambda w: (w is not None, w or 0))
        self.tables = BlockTableMirror()  # decode graphs fill their buckets from it too
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = self._host
        self._copied = None  # the event of the last upload, before the host buffer is rewritten

    def _reserve(self, words: int) -> None:
        if words <= self._host.numel():
            return
        words = max(words, 2 * self._host.numel())
        if self._copied is not None:
            self._copied.synchronize()
        self._host = self.runtime.host_buffer(words, torch.int32)
        self._dev = self.runtime.device_mirror(self._host)

    def prepare(self, inp: ModelInput, kv_caches: KVCaches) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                       torch.Tensor]:
        """(input_ids, positions, metadata with its work plans, sample indices)."""
        t, s, n_samp = len(inp.input_ids), len(inp.seq_lens), len(inp.sample_indices)
        width = self.tables.sync(inp)
        q_lens = [b - a for a, b in zip(inp.query_start_loc, inp.query_start_loc[1:])]
        plans = self._host_plans(q_lens, inp.seq_lens, kv_caches)
        t2 = t + t % 2  # int64 sections start on 16 bytes
        i64 = 3 * t2 + n_samp  # int64 values, at word 0
        sl = aligned_words(2 * i64)  # int32 word offsets: seq_lens, query_start_loc, block tables, plans
        qsl = sl + aligned_words(s)
        bt = qsl + aligned_words(s + 1)
        at = bt + aligned_words(s * width)
        plan_words = {window: plan.num_words() for window, plan in plans.items()}
        words = at + sum(plan_words.values())
        self._reserve(words)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload may still read the host buffer
        host, dev = self._host.numpy(), self._dev
        h64 = host[:2 * i64].view(np.int64)
        h64[:t] = inp.input_ids
        h64[t2:t2 + t] = inp.positions
        h64[2 * t2:2 * t2 + t] = inp.slot_mapping
        h64[3 * t2:] = inp.sample_indices
        host[sl:sl + s] = inp.seq_lens
        host[qsl:qsl + s + 1] = inp.query_start_loc
        self.tables.fill(host[bt:bt + s * width].reshape(s, width))
        for window, plan in plans.items():
            plans[window] = plan.stage(host, dev, at)
            at += plan_words[window]
        if dev is not self._host:
            dev[:words].copy_(self._host[:words], non_blocking=True)
            self._copied = self.runtime.event()
            self._copied.record()
        d64 = dev[:2 * i64].view(torch.int64)
        meta = AttentionMetadata(
            slot_mapping=d64[2 * t2:2 * t2 + t],
            block_tables=dev[bt:bt + s * width].view(s, width),
            seq_lens=dev[sl:sl + s],
            query_start_loc=dev[qsl:qsl + s + 1],
            host_q_lens=q_lens,
            host_seq_lens=inp.seq_lens,
            kernels=self.kernels,
            lora=LoRAStep.build(inp.lora_slots, inp.query_start_loc, self.device) if inp.lora_slots else None,
            _plans=plans,
        )
        if self.kernels != "triton" and self._query_like is not None and kv_caches:
            for window in self._windows:  # built now, so the layers only look them up
                meta.cpu_plan(kv_caches[0][0], window)
        return d64[:t], d64[t2:t2 + t], meta, d64[3 * t2:]

    def _host_plans(self, q_lens: list[int], seq_lens: list[int], kv_caches: KVCaches) -> dict:
        """The Triton kernels' work plan of the step for each sliding window
        the model uses, on the host, for ``prepare`` to upload with the
        inputs; none for the other kernels."""
        if self.kernels != "triton" or self._query_like is None or not kv_caches or not q_lens:
            return {}
        from fluidserve.kernels.paged_attention import plan_for

        key_cache = kv_caches[0][0]
        return {window: plan_for(self._query_like, key_cache, q_lens, seq_lens, window, on_host=True)
                for window in self._windows}

    def forward(self, inp: ModelInput, kv_caches: KVCaches,
                feed: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of the step ``[T, hidden]`` and the sample indices.
        ``feed`` rewrites the uploaded input ids on the device first."""
        input_ids, positions, meta, sample_idx = self.prepare(inp, kv_caches)
        if feed is not None:
            feed(input_ids)
        if meta.lora is None:
            return self.model(input_ids, positions, kv_caches, meta), sample_idx
        state = self.model.lora_slots.state  # what every adapted linear reads, for this forward only
        state.step = meta.lora
        try:
            return self.model(input_ids, positions, kv_caches, meta), sample_idx
        finally:
            state.step = None

