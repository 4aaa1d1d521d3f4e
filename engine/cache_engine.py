"""CacheEngine: one worker's KV tensors, device pool and host pool, and the
only code that moves KV between them (FastServe §4.2, the proactive KV
manager's hands; the decisions are the scheduler's, as block maps).

Layout, per layer, for K and for V::

    device  [num_blocks,      block_size, num_kv_heads, head_dim]
    host    [num_host_blocks, block_size, num_kv_heads, head_dim]   pinned on CUDA

Under tensor parallelism every rank holds its own head shard in both pools
and applies the same block maps, so no rank talks to another to swap.

Ordering on CUDA (copies run on a side stream and overlap the forward):

    step N:  compute waits for the copies of step N-1  (a block a swap-out freed
                                                        is reused only once it
                                                        has left; prefetched KV
                                                        has landed)
             copy stream waits for compute so far      (KV written by earlier
                                                        steps is complete)
             copy stream: swap-outs, then swap-ins; event E(N)
             compute waits for E(N) only if the step runs a request swapped in
             by this very step (a reactive swap-in: the swap stall)

A copy moves a run of blocks adjacent on both sides; device blocks that
churn has scattered are first gathered into a staging tensor (or scattered
from one) on the copy stream, so that only the host side's runs cross the
bus (``_copy``).

On CPU the same calls run as synchronous copies before the forward. Each
layer's K and V move with one gather and one scatter for all of a step's
blocks: a copy per block run and layer costs ~15 us of dispatch, 60 ms for a
hundred scattered blocks of a 16-layer model. (Copies on a thread beside
the forward, as the copy stream runs them on CUDA, are not used: torch's CPU
ops on two threads at interpreter exit can crash the process.) The CPU tests
exercise the maps and the ordering of swap-outs before swap-ins.
"""

from __future__ import annotations

import time

import torch

from fluidserve.engine.runtime import runtime_for
from fluidserve.kernels.cache_dtype import byte_view

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (K, V)


def runs(keys: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], int, int]]:
    """``(first key, index of the first, length)`` of each run of ``keys``
    (in their order) whose every component goes up by one from key to key."""
    out: list[tuple[tuple[int, ...], int, int]] = []
    for i, key in enumerate(keys):
        if out:
            first, at, n = out[-1]
            if all(k == f + n for k, f in zip(key, first)):
                out[-1] = (first, at, n + 1)
                continue
        out.append((key, i, 1))
    return out


def block_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Coalesce ``(src, dst)`` block pairs into ``(src, dst, length)`` runs of
    consecutive blocks on both sides, so a request whose blocks are adjacent
    moves in one copy per layer instead of one per block."""
    return [(s, d, n) for (s, d), _, n in runs(sorted(pairs))]


class CacheEngine:
    def __init__(
        self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        device: torch.device, num_blocks: int, num_host_blocks: int = 0,
    ) -> None:
        self.device = device
        self.runtime = runtime_for(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.device_caches: KVCaches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.host_caches: KVCaches = []
        if num_host_blocks:
            host_shape = (num_host_blocks, block_size, num_kv_heads, head_dim)
            pin = self.runtime.pin_memory
            try:
                self.host_caches = [
                    (torch.empty(host_shape, dtype=dtype, pin_memory=pin),
                     torch.empty(host_shape, dtype=dtype, pin_memory=pin))
                    for _ in range(num_layers)
                ]
            except RuntimeError as e:
                gib = 2 * num_layers * torch.empty(host_shape, dtype=dtype, device="meta").nbytes / 2**30
                raise ValueError(f"swap_space: cannot {'pin' if pin else 'allocate'} {gib:.2f} GiB of host "
                                 f"memory for {num_host_blocks} host KV blocks ({e}); lower --swap-space") from e
        if self.host_caches and not pin:
            # Write the host blocks a first copy will land in now, not in a
            # step: the host allocator hands out never-used blocks in id order,
            # and a copy into untouched memory pays its page faults (0.16 ms a
            # 256 KiB block against 0.04 once touched, on two x86 cores: a
            # 174-block swap-out held an online arrival 28 ms).
            # As many as the device pool has: the host tier's first working
            # set; blocks beyond fault in as they are first used.
            warm = min(num_host_blocks, num_blocks)
            for k, v in self.host_caches:
                k[:warm].zero_()
                v[:warm].zero_()
        # Block moves copy bits, not values: an fp8 cache moves as bytes
        # (torch's CPU index copies take no fp8).
        self._device_bytes: KVCaches = [(byte_view(k), byte_view(v)) for k, v in self.device_caches]
        self._host_bytes: KVCaches = [(byte_view(k), byte_view(v)) for k, v in self.host_caches]
        self._copy_stream = self.runtime.side_stream()  # None: copies run in line
        self._last_copies = None  # the event of the last step's copies

    @property
    def num_host_blocks(self) -> int:
        return self.host_caches[0][0].shape[0] if self.host_caches else 0

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], wait: bool) -> float:
        """Issue one step's moves: ``swap_out`` (device block, host block)
        pairs, then ``swap_in`` (host block, device block) pairs. ``wait``:
        the coming forward reads blocks that ``swap_in`` fills. Returns the
        seconds the caller was held up by copies (the swap stall)."""
        if (swap_out or swap_in) and not self.host_caches:
            raise ValueError("a swap was planned but this worker has no host KV pool")
        if self._copy_stream is None:
            t0 = time.perf_counter()
            self._gather_scatter(swap_out, self._device_bytes, self._host_bytes)
            self._gather_scatter(swap_in, self._host_bytes, self._device_bytes)
            return time.perf_counter() - t0
        compute = self.runtime.current_stream()
        if self._last_copies is not None:
            compute.wait_event(self._last_copies)
            self._last_copies = None
        if not (swap_out or swap_in):
            return 0.0
        self._copy_stream.wait_stream(compute)
        with self.runtime.on_stream(self._copy_stream):
            self._copy(swap_out, self._device_bytes, self._host_bytes, host_is_src=False)
            self._copy(swap_in, self._host_bytes, self._device_bytes, host_is_src=True)
            done = self.runtime.event()
            done.record(self._copy_stream)
        self._last_copies = done
        if not wait:
            return 0.0
        # The forward reads what the swap-ins bring: it cannot start before they land.
        t0 = time.perf_counter()
        done.synchronize()
        return time.perf_counter() - t0

    @staticmethod
    def _gather_scatter(pairs: list[tuple[int, int]], src: KVCaches, dst: KVCaches) -> None:
        if not pairs:
            return
        si = torch.tensor([s for s, _ in pairs])
        di = torch.tensor([d for _, d in pairs])
        for (sk, sv), (dk, dv) in zip(src, dst):
            dk.index_copy_(0, di, sk.index_select(0, si))
            dv.index_copy_(0, di, sv.index_select(0, si))

    def _copy(self, pairs: list[tuple[int, int]], src: KVCaches, dst: KVCaches, host_is_src: bool) -> None:
        """Queue one direction's moves on the current (copy) stream.

        A host-device copy costs about 10 us however small: blocks that are
        adjacent on both sides (``block_runs``) move in one copy per layer
        each, but a device pool fragmented by churn leaves runs of one
        block, and 32 KiB copies reached 6% of a pinned copy's bandwidth on
        an H200 (swap_copy_nvidia_h200.md). Where that takes more copies
        than the host side's own runs, the device side is gathered into a
        contiguous staging tensor (or scattered from one) by one kernel per
        layer and tensor, and only the host side's runs cross the bus."""
        if not pairs:
            return
        direct = block_runs(pairs)
        host_of = (lambda p: p[0]) if host_is_src else (lambda p: p[1])
        order = sorted(pairs, key=host_of)
        if len(direct) <= len(runs([(host_of(p),) for p in order])) + 1:
            for s, d, n in direct:
                for (sk, sv), (dk, dv) in zip(src, dst):
                    dk[d:d + n].copy_(sk[s:s + n], non_blocking=True)
                    dv[d:d + n].copy_(sv[s:s + n], non_blocking=True)
            return
        per_chunk = max(1, STAGING_BYTES // src[0][0][0].nbytes)  # bounds the staging tensors' memory
        for lo in range(0, len(order), per_chunk):
            chunk = order[lo:lo + per_chunk]
            device_ids = torch.tensor([p[1] if host_is_src else p[0] for p in chunk], dtype=torch.int64,
                                      pin_memory=self.runtime.pin_memory).to(self.device, non_blocking=True)
            host_runs = [(h, at, n) for (h,), at, n in runs([(host_of(p),) for p in chunk])]
            for layer_src, layer_dst in zip(src, dst):
                for s_cache, d_cache in zip(layer_src, layer_dst):
                    if host_is_src:  # host runs -> staging -> scattered device blocks
                        staging = torch.empty((len(chunk), *d_cache.shape[1:]), dtype=d_cache.dtype,
                                              device=d_cache.device)
                        for h, at, n in host_runs:
                            staging[at:at + n].copy_(s_cache[h:h + n], non_blocking=True)
                        d_cache.index_copy_(0, device_ids, staging)
                    else:  # scattered device blocks -> staging -> host runs
                        staging = s_cache.index_select(0, device_ids)
                        for h, at, n in host_runs:
                            d_cache[h:h + n].copy_(staging[at:at + n], non_blocking=True)


# Device memory the staged copies may hold at once, per tensor (one layer's
# K or V of a chunk of blocks).
STAGING_BYTES = 64 * 2**20

