"""Rotary position embedding and the KV-cache write in one kernel: for each
token, q and k rotated in place, and the rotated k and the v written into
their slot of the paged cache. On the decode path that is one launch where
the torch expression takes about a dozen ops and the cache write another.

The rope tables are built once per step (``engine/layers.RotaryEmbedding``),
``[T, D]`` each, in the model's dtype as the Hugging Face reference casts
them, with the sign of ``rotate_half`` folded into the sine::

    cos = [ cos(f) | cos(f) ]       sin = [ -sin(f) | sin(f) ]      f: [T, D/2]
    rope(x) = x * cos + swap_halves(x) * sin
            = [ x1 cos - x2 sin | x2 cos + x1 sin ]     (x = [ x1 | x2 ])

which is the reference's ``x * cos + rotate_half(x) * sin`` term for term.
The kernel computes it in fp32 and rounds once; off the Triton lane
``ops.rope_torch`` rounds as torch's in-place ops do.
Cache semantics are ``reference.reshape_and_cache``'s (slot -1: not written).

A partial rope (Phi-4-mini rotates 96 of a head's 128 features) comes as
tables ``[T, R]`` narrower than the head: the first R features of each head
are rotated as above (halves of R/2), the rest left as projected and copied
into the cache beside them.

With ``qk_norm`` (Qwen3: RMSNorm over each head of q and k before rope) the
same launch norms each head first, rounded where the reference's per-head
RMSNorm rounds (``ops.rms_norm``: the normalised head to the dtype, then
the weight's product to it again), so q and k reach the rotation with the
values the separate norm would have written: the norms' eight torch ops a
layer and their two new tensors become part of a launch the layer makes
anyway, and the rotated heads go back into the projection's own buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fluidserve.kernels.cache_dtype import to_cache
from fluidserve.kernels.launch import Relaunch, Site, aligned, cache_layout, cdiv, next_power_of_2, row_tiling

# q's and k's per-head norm weights ([D] each, the heads' dtype) and its eps.
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


@triton.jit
def _rotate(x, cos1, sin1, cos2, sin2, mask, norm_w, dmask, eps, HALF: tl.constexpr, NORM: tl.constexpr,
            AXIS: tl.constexpr):  # fmt: skip
    """Rotate in place the first halves of heads at pointers ``x`` ([H, D/2],
    or [T, H, D/2] for several tokens; ``AXIS`` the features' axis) and the
    second halves HALF further on; returns the rotated halves (fp32). Each
    element's two halves are loaded and stored by the same program lanes, so
    the in-place write races with no read. ``NORM``: each head RMS-normed
    first, by the weight halves at ``norm_w`` and ``norm_w + HALF``."""
    x_hi = x + HALF
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_hi, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        dtype = x.dtype.element_ty
        # Masked lanes load 0 and add nothing to a head's sum of squares.
        inv = tl.expand_dims(tl.rsqrt((tl.sum(x1 * x1, AXIS) + tl.sum(x2 * x2, AXIS)) / (2 * HALF) + eps), AXIS)
        w1 = tl.load(norm_w, mask=dmask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w + HALF, mask=dmask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1 = x1 * cos1 + x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    tl.store(x, y1.to(x.dtype.element_ty), mask=mask)
    tl.store(x_hi, y2.to(x.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _rope_and_cache_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hk, D]
    v_ptr,  # [T, Hk, D]
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D], sign folded
    key_cache_ptr,  # [num_blocks, block_size, Hk, D]
    value_cache_ptr,
    slot_ptr,  # [T] int, -1 = do not write
    q_norm_ptr,  # [D]: q's per-head norm weight (read only if QK_NORM)
    k_norm_ptr,  # [D]: k's
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    eps,
    num_tokens,  # read only with BLOCK_T > 1
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    BLOCK_T: tl.constexpr,  # tokens a program (``launch.row_tiling``)
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
    ROT_HALF: tl.constexpr,  # half the rotated features: HALF, or fewer for a partial rope
):
    # Each address is formed once and offset by ROT_HALF for the second
    # half: the compiled kernel is the same either way, and Triton's
    # interpreter, which runs every program of the grid op by op, runs fewer ops.
    if BLOCK_T == 1:  # a GPU's launch: tiles [heads, half a head] of the program's token
        tok = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_HALF)[None, :]
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        hk = tl.arange(0, BLOCK_HK)[:, None]
        rmask = d < ROT_HALF
    else:  # tiles [tokens, heads, half a head]; tokens past the last masked
        tok = (tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T))[:, None, None]
        d = tl.arange(0, BLOCK_HALF)[None, None, :]
        hq = tl.arange(0, BLOCK_HQ)[None, :, None]
        hk = tl.arange(0, BLOCK_HK)[None, :, None]
        rmask = (d < ROT_HALF) & (tok < num_tokens)
    AXIS: tl.constexpr = 1 if BLOCK_T == 1 else 2
    dmask = d < HALF
    cos_row = cos_ptr + tok * stride_ct + d
    sin_row = sin_ptr + tok * stride_st + d
    cos1 = tl.load(cos_row, mask=rmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + ROT_HALF, mask=rmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row, mask=rmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + ROT_HALF, mask=rmask, other=0.0).to(tl.float32)

    _rotate(q_ptr + tok * stride_qt + hq * stride_qh + d, cos1, sin1, cos2, sin2, (hq < NUM_Q_HEADS) & rmask,
            q_norm_ptr + d, dmask, eps, ROT_HALF, QK_NORM, AXIS)
    heads = hk < NUM_KV_HEADS
    k_row = k_ptr + tok * stride_kt + hk * stride_kh
    k1, k2 = _rotate(k_row + d, cos1, sin1, cos2, sin2, heads & rmask, k_norm_ptr + d, dmask, eps, ROT_HALF,
                     QK_NORM, AXIS)

    if BLOCK_T == 1:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    else:
        slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)  # past the last: not written
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    # Padding slots (-1) mask the stores; the slot is broadcast to the heads
    # first (a scalar mask term trips the interpreter).
    written = heads & (hk * 0 + slot >= 0)
    keep = written & dmask
    kc_row = key_cache_ptr + blk * stride_kcb + off * stride_kcs + hk * stride_kch
    kc = kc_row + d
    tl.store(kc, to_cache(k1, key_cache_ptr), mask=written & rmask)
    tl.store(kc + ROT_HALF, to_cache(k2, key_cache_ptr), mask=written & rmask)
    if ROT_HALF < HALF:  # a partial rope: the features past the rotated ones, as projected
        for start in tl.static_range(2 * ROT_HALF, 2 * HALF, BLOCK_HALF):
            e = d + start
            passed = written & (e < 2 * HALF)
            tl.store(kc_row + e, to_cache(tl.load(k_row + e, mask=passed), key_cache_ptr), mask=passed)
    v = v_ptr + tok * stride_vt + hk * stride_vh + d
    vc = value_cache_ptr + blk * stride_vcb + off * stride_vcs + hk * stride_vch + d
    tl.store(vc, to_cache(tl.load(v, mask=keep), value_cache_ptr), mask=keep)
    tl.store(vc + HALF, to_cache(tl.load(v + HALF, mask=keep), value_cache_ptr), mask=keep)


_ROPE_AND_CACHE = Relaunch(_rope_and_cache_kernel)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
           qk_norm: QKNorm | None = None) -> None:  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [num_tokens, heads, head_dim] with contiguous head_dim")
    t, _, d = q.shape
    if d % 2 or k.shape[2] != d or k.shape != v.shape or k.shape[0] != t:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: one even head_dim, "
                         "k and v alike")
    r = cos.shape[-1]  # the rotated features: the head, or its first r (a partial rope)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, r) or r % 2 or not 0 < r <= d or table.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(table.shape)} must be [{t}, R] for an even R of at most {d}, "
                             "with contiguous rows, as cos is")
    if qk_norm is not None and r != d:
        raise ValueError(f"q/k norms with a partial rope ({r} of {d} features) are not fused: norm first")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != k.shape[1:]:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim] as k is")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("caches must have contiguous head_dim")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must hold one slot per token ({t})")
    if qk_norm is not None:
        _check_norm_weights(q, qk_norm[:2])


def _check_norm_weights(q: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> None:
    for name, w in zip(("q", "k"), weights):
        if w.shape != (q.shape[2],) or w.stride(0) != 1 or w.dtype != q.dtype or w.device != q.device:
            raise ValueError(f"{name}'s norm weight {tuple(w.shape)} {w.dtype} must be [{q.shape[2]}], "
                             f"contiguous, {q.dtype} on q's device")


def _launch_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 eps: float | None) -> tuple[tuple[int, ...], tuple[int | float, ...], dict[str, int]]:  # fmt: skip
    """The launch's grid, the kernel's scalars after its tensors, and its
    constexprs (``eps`` None: no norm)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_t, num_tokens = row_tiling(q)
    scalars = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
               sin.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
               0.0 if eps is None else float(eps), num_tokens)  # fmt: skip
    constexprs = dict(NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=k.shape[1], HALF=head_dim // 2, BLOCK_T=block_t,
                      BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(k.shape[1]),
                      BLOCK_HALF=next_power_of_2(head_dim // 2), BLOCK_SIZE=key_cache.shape[1],
                      QK_NORM=eps is not None, ROT_HALF=cos.shape[1] // 2)  # fmt: skip
    return (cdiv(q.shape[0], block_t),), scalars, constexprs


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   qk_norm: QKNorm | None = None) -> None:  # fmt: skip
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (their first R
    features, for tables [T, R]), and write k and v [T, Hk, D] into their
    slots of the caches [blocks, block_size, Hk, D]; with ``qk_norm`` (q's
    and k's weights, eps; whole-head tables only) each head of q and k is
    RMS-normed before its rotation."""
    _check(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, qk_norm)
    if q.shape[0] == 0:
        return
    grid, scalars, constexprs = _launch_args(q, k, v, cos, sin, key_cache, value_cache,
                                             None if qk_norm is None else qk_norm[2])
    norms = qk_norm[:2] if qk_norm is not None else (q, q)  # not read without the norm
    _ROPE_AND_CACHE[grid](q, k, v, cos, sin, key_cache, value_cache, slot_mapping, *norms, *scalars, **constexprs)


class StepRopeAndCache:
    """``rope_and_cache`` for every layer of a step that rotates the same q
    and k tensors (the batch-1 row layer's views of one buffer every
    layer's QKV GEMV writes) by the same tables into the same slots, each
    layer into its own caches and, with a ``qk_norm``, by its own norm
    weights: checked and laid out once, then a layer passes only those.
    Caches laid out otherwise than the first layer's take
    ``rope_and_cache``'s checked path."""

    __slots__ = ("_tensors", "_slots", "_grid", "_scalars", "_constexprs", "_layout", "_eps", "_site")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 qk_norm: QKNorm | None = None) -> None:  # fmt: skip
        _check(q, k, v, cos, sin, key_cache, value_cache, slot_mapping, qk_norm)
        self._tensors, self._slots = (q, k, v, cos, sin), slot_mapping
        self._eps = None if qk_norm is None else qk_norm[2]
        self._grid, self._scalars, self._constexprs = _launch_args(q, k, v, cos, sin, key_cache, value_cache,
                                                                   self._eps)
        self._layout = cache_layout(key_cache, value_cache)
        # Only the caches (and norm weights) change, of one layout: on a GPU, aligned ones launch without a key.
        self._site = Site(_ROPE_AND_CACHE, self._grid, self._constexprs)

    def __call__(self, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
        """One layer's launch: its caches and, where the step norms q and k,
        its q and k norm weights (refused otherwise)."""
        if (norm_weights is None) is not (self._eps is None):
            raise ValueError(f"a step rope prepared {'without' if self._eps is None else 'with'} q/k norms")
        if cache_layout(key_cache, value_cache) != self._layout:
            qk_norm = None if norm_weights is None else (*norm_weights, self._eps)
            rope_and_cache(*self._tensors, key_cache, value_cache, self._slots, qk_norm)
            return
        if norm_weights is None:
            self.launch(key_cache, value_cache, aligned(key_cache, value_cache))
        else:
            _check_norm_weights(self._tensors[0], norm_weights)
            self.launch(key_cache, value_cache, aligned(key_cache, value_cache, *norm_weights), norm_weights)

    def launch(self, key_cache: torch.Tensor, value_cache: torch.Tensor, usual: bool,
               norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
        """``__call__`` for caches the caller has found of the first
        layer's layout and norm weights of the first layer's (``usual``:
        every one of them 16-byte aligned)."""
        if self._grid[0]:
            norms = norm_weights or self._tensors[:1] * 2  # not read without the norm
            self._site((*self._tensors, key_cache, value_cache, self._slots, *norms, *self._scalars), usual)
