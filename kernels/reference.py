"""Plain-torch reference implementations of the attention and cache kernels.

This module owns the *semantics* of paged attention in fluidserve. It is the
attention path of the engine on CPU and the oracle every Triton kernel test
compares against, so it favours clarity over speed. Its last sections own
the MoE experts', the weight-only integer linears' and the float8 linears'
semantics alike, and those of linears and MoE experts kept as a quantized
checkpoint stores them (``PackedLinear``, ``PackedExperts``).

KV cache layout (one pair of tensors per layer)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block_id * block_size + offset``. A request's block table
row lists the physical block ids of its logical blocks in order; rows are padded
with any value (the kernels never read past ``ceil(seq_len / block_size)``).

A flat ragged batch of S sequences is described by::

    query:           [num_tokens, num_q_heads, head_dim]
    query_start_loc: [S + 1] int32, cumulative query counts (cu_seqlens)
    seq_lens:        [S] int32, KV length of each sequence *after* this step
    block_tables:    [S, max_blocks_per_seq] int32

Sequence i contributes ``q_len = query_start_loc[i+1] - query_start_loc[i]``
queries: the last ``q_len`` positions of its ``seq_len`` tokens (a prefill
chunk, a whole prompt, or one decode token). Their K/V are already in the
cache. Query j sits at position ``p = seq_len - q_len + j`` and attends to KV
positions ``[max(0, p - window + 1), p]``::

    positions  0 1 2 3 4 5 6 7      seq_len = 8, q_len = 3
    cached     x x x x x            (prefix from earlier steps)
    queries              q q q      positions 5, 6, 7; causal among themselves
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fluidserve.kernels.cache_dtype import round_to_cache


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
) -> None:
    """Write each token's K/V into its slot of the paged cache."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = round_to_cache(key[valid], key_cache.dtype)
    value_cache[blocks, offsets] = round_to_cache(value[valid], value_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq]
    seq_len: int,
) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one sequence, contiguous:
    [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [nb, bs, h, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [S]
    query_start_loc: torch.Tensor,  # [S + 1]
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flat ragged batch over the paged KV cache.

    Returns ``[num_tokens, num_q_heads, head_dim]`` in ``query.dtype``; the
    softmax is computed in fp32. Decode rows are batched, prefill chunks handled
    one at a time: this is the oracle and the CPU path, not the fast path.
    ``softcap`` (Gemma 2): scores capped as ``attention`` caps them.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decodes = sorted((i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1), key=lens.__getitem__)
    # Padding every decode row to the longest context wastes work when
    # lengths vary: bucket rows so a bucket's longest is at most twice its shortest.
    while decodes:
        cut = next((j for j, i in enumerate(decodes) if lens[i] > 2 * lens[decodes[0]]), len(decodes))
        _decode_attention(out, query, key_cache, value_cache, block_tables, starts, lens, decodes[:cut],
                          scale, sliding_window, softcap)
        decodes = decodes[cut:]
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len <= 1:
            continue
        q = query[q_lo:q_hi].float().transpose(0, 1)  # [hq, q_len, d]
        k = gather_kv(key_cache, block_tables[i], seq_len).float().transpose(0, 1)  # [hk, L, d]
        v = gather_kv(value_cache, block_tables[i], seq_len).float().transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)  # [q_len, 1]
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)  # [1, L]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        o = attention(q, k, v, mask, scale, softcap)
        out[q_lo:q_hi] = o.transpose(0, 1).to(query.dtype)
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              softcap: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` of q [..., Hq, Lq, d] over k, v
    [..., Hk, L, d] under a boolean mask, each KV head shared by its group
    of query heads. With ``softcap`` each scaled score becomes
    ``softcap * tanh(score / softcap)`` before the mask, as transformers'
    Gemma 2 caps them."""
    if softcap is None:
        # enable_gqa lets each group of query heads share its KV head without copies.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * scale / softcap) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def _decode_attention(out, query, key_cache, value_cache, block_tables, starts, lens, rows,
                      scale, sliding_window, softcap=None) -> None:
    """All single-token (decode) sequences at once: their blocks gathered into
    one padded [D, L_max] batch, the padding masked out."""
    block_size = key_cache.shape[1]
    dev = query.device
    idx = torch.tensor(rows, device=dev)
    q_idx = torch.tensor([starts[i] for i in rows], device=dev)
    seq = torch.tensor([lens[i] for i in rows], device=dev)  # [D]
    nblocks = -(-max(lens[i] for i in rows) // block_size)
    tables = block_tables[idx, :nblocks].long()  # [D, nb]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [D, hk, nb * bs, d]
        rows_of_blocks = cache.view(cache.shape[0], -1).index_select(0, tables.flatten())
        g = rows_of_blocks.view(len(rows), -1, *cache.shape[2:]).float()  # [D, nb * bs, hk, d]
        return g.transpose(1, 2)

    k_pos = torch.arange(nblocks * block_size, device=dev).unsqueeze(0)  # [1, L]
    mask = k_pos < seq.unsqueeze(1)  # [D, L]: the query sits at position seq - 1
    if sliding_window is not None:
        mask &= k_pos > seq.unsqueeze(1) - 1 - sliding_window
    q = query[q_idx].float().unsqueeze(2)  # [D, hq, 1, d]
    o = attention(q, gather(key_cache), gather(value_cache), mask[:, None, None, :], scale, softcap)
    out[q_idx] = o.squeeze(2).to(query.dtype)


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> torch.Tensor:
    """Copy the listed blocks into a contiguous staging buffer [n, ...]."""
    return cache[block_ids.long()].clone()


def scatter_blocks(
    staging: torch.Tensor,  # [n, ...]
    cache: torch.Tensor,  # [num_blocks, ...]
    block_ids: torch.Tensor,  # [n]
) -> None:
    """Write staged blocks back into the listed cache blocks."""
    cache[block_ids.long()] = staging.to(cache.dtype)


# -- mixture of experts ------------------------------------------------------------------


def pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The (token, slot) pairs sorted by expert, stably: each pair's index
    ``j * T + t`` (slot, then token, the order transformers' ``where`` over
    an expert's [k, T] mask lists them), the pairs of each expert (one host
    sync), and each sorted pair's token."""
    tokens = topk_ids.shape[0]
    flat = topk_ids.t().reshape(-1)  # pair j * T + t
    order = torch.argsort(flat, stable=True)
    return order, torch.bincount(flat, minlength=num_experts).tolist(), order % tokens


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | PackedExperts,  # [E, 2N, H]: gate_proj rows, then up_proj rows
    w2: torch.Tensor | PackedExperts,  # [E, H, N]: down_proj
    topk_ids: torch.Tensor,  # [T, k] int
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) *
    up_e(x[t]))`` with ``e = topk_ids[t, j]``: [T, H] of x's dtype.

    Rounded as transformers' eager MoE experts (Qwen3MoeExperts.forward)
    round: each expert's rows through two ``F.linear`` in x's dtype, the
    routing weight multiplied by torch's promotion rules, then added into a
    zeroed output in x's dtype, expert after expert in increasing id. One
    stable sort and one host sync (the counts) stand in for its
    ``where`` per expert; each expert's rows come in the order that
    ``where`` over its [k, T] mask lists them (slot, then token), so every
    GEMM sees the same rows in the same order. Also the CPU serving path.

    ``w13`` and ``w2`` may each be dense (of x's dtype) or ``PackedExperts``,
    of which only the experts hit are dequantized, to x's dtype, each
    exactly as the stack dequantized whole: the same bits as the dense
    call on that stack."""
    out = torch.zeros_like(x)
    if not topk_ids.numel():
        return out
    order, counts, tokens_of = pairs_by_expert(topk_ids, w13.shape[0])
    weights = topk_weights.t().reshape(-1)
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        pairs = order[start:start + n]
        tok = tokens_of[start:start + n]
        start += n
        gate, up = F.linear(x[tok], _expert(w13, expert, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _expert(w2, expert, x.dtype)) * weights[pairs, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _expert(w: torch.Tensor | PackedExperts, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert``'s [N, K] weight: a dense stack's slice, or a packed
    one's dequantized to ``dtype``."""
    return w.expert(expert, dtype) if isinstance(w, PackedExperts) else w[expert]


# -- weight-only integer linears (GPTQ/AWQ-style, packed on the device) --------------------
#
# codes [N, K / per_word] int32, per_word = 32 // bits: input feature k of row n
# is the field (k % per_word) of word k // per_word, lowest bits first. scales
# float32 and zeros uint8 [N, G]; g_idx int32 [K], each input feature's group.


def int_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes [N, K] (any integer dtype, values
    0..2^bits - 1, checked with one device sync) packed along K into int32
    words [N, K / per_word], the lowest bits first. The top field lands in
    the sign bit: the word is built in int64 and wrapped into int32."""
    per_word = 32 // bits
    n, k = codes.shape
    if bits not in (4, 8) or k % per_word:
        raise ValueError(f"int_pack: {bits}-bit codes of {k} features (bits 4 or 8, K a multiple of {per_word})")
    wide = codes.to(torch.int64)
    if bool(((wide < 0) | (wide >= 1 << bits)).any()):
        raise ValueError(f"int_pack: codes outside 0..{(1 << bits) - 1}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (wide.view(n, k // per_word, per_word) << shifts).sum(-1)  # [N, K / per_word], 0..2^32 - 1
    return (words - (words >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32)


def int_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``int_pack``'s inverse: the codes [N, K] as int32 (an arithmetic
    shift, then the mask, so a word's sign bit never reaches a field)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [N, K / per_word, per_word]
    return fields.reshape(packed.shape[0], -1)


def int_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
                   dtype: torch.dtype, group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] the packed linear stands for: ``(code - zero)`` in
    fp32 times the scale of the feature's group (``g_idx``), rounded once
    to ``dtype``. ``group_size`` (``plain_group_size`` of g_idx): the same
    values, each group's scale broadcast over its run of features instead
    of gathered per feature (3x faster on a CPU, where the engine
    dequantizes on every call)."""
    q = int_unpack(codes, bits)  # [N, K] int32
    n, k = q.shape
    if group_size is not None and k % group_size == 0 and scales.shape[1] == k // group_size:
        runs = q.view(n, -1, group_size) - zeros.to(torch.int32)[:, :, None]
        return (runs.to(torch.float32) * scales[:, :, None]).view(n, k).to(dtype)
    group = g_idx.long()
    q = q - zeros.to(torch.int32)[:, group]
    return (q.to(torch.float32) * scales[:, group]).to(dtype)


def int_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               bits: int, bias: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` for the packed weight: [M, K] -> [M, N] in x's dtype,
    the weight dequantized to x's dtype first."""
    return F.linear(x, int_dequantize(codes, scales, zeros, g_idx, bits, x.dtype, group_size), bias)


def plain_group_size(g_idx: torch.Tensor) -> int | None:
    """The group size of a plain checkpoint's ``g_idx`` (``k // group_size``
    for every feature k; one group of all K gives K), else None (act-order,
    or groups that are not runs of one size). Device syncs: for the loader,
    once per weight, never per step."""
    size = int((g_idx == 0).sum())
    plain = torch.arange(g_idx.numel(), device=g_idx.device) // max(size, 1)
    return size if size and torch.equal(g_idx.to(plain.dtype), plain) else None


# -- float8 weights (block-, channel- or tensor-scaled, kept in float8 on the device) ----------
#
# weight float8 [N, K] (e4m3fn or e5m2); scales float32 [N, G], a block grid's
# scale repeated on each row of its block (G = 1: per tensor or per row);
# g_idx int32 [K], each input feature's group.


def fp8_dequantize(weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, dtype: torch.dtype,
                   group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """The weight [N, K] the float8 linear stands for: each float8 value in
    fp32 (exact) times the scale of its row and group (``g_idx``), one fp32
    product, rounded once to ``dtype``. ``group_size`` (``plain_group_size``
    of g_idx): the same values, each group's scale broadcast over its run of
    features instead of gathered per feature (the CPU engine dequantizes on
    every call)."""
    n, k = weight.shape
    groups = scales.shape[1]
    if group_size is not None and groups == -(-k // group_size):
        # The last group may be short (K no multiple of a block): the runs
        # are laid out whole and the overhang cut off after the product.
        w = weight.new_zeros((n, groups * group_size), dtype=torch.float32)
        w[:, :k] = weight
        w.view(n, groups, group_size).mul_(scales[:, :, None])
        return w[:, :k].to(dtype)
    w = weight.to(torch.float32, copy=True)  # [N, K], its own: scaled in place below
    w.mul_(scales[:, g_idx.long()])
    return w.to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
               bias: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` for the float8 weight: [M, K] -> [M, N] in x's dtype,
    the weight dequantized to x's dtype first."""
    return F.linear(x, fp8_dequantize(weight, scales, g_idx, x.dtype, group_size), bias)


# -- linears and MoE experts kept as a quantized checkpoint stores them ----------------------------

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, eq=False)  # eq=False: fields are tensors, compared by identity
class _Packed:
    """A weight held as a quantized checkpoint stores it, in the format of a
    packed linear (the sections above): GPTQ/AWQ integers as
    ``int_dequantize`` reads them, or float8 as ``fp8_dequantize`` does. All
    tensors contiguous, on one device; ``PackedExperts``' with a leading
    expert dimension."""

    codes: torch.Tensor  # int: [..., N, K / (32 // bits)] int32 (int_linear's words); float8: [..., N, K]
    scales: torch.Tensor  # [..., N, G] float32
    zeros: torch.Tensor | None  # [..., N, G] uint8 for int; None for float8
    g_idx: torch.Tensor  # [..., K] int32: each input feature's group
    bits: int  # 4 or 8 (int); 8 for float8
    group_size: int | None = None  # the caller vouches g_idx is k // group_size (plain checkpoint)

    @property
    def float8(self) -> bool:
        """Whether the codes are float8 values (else packed integer codes)."""
        return self.codes.dtype in FLOAT8_DTYPES

    @property
    def shape(self) -> tuple[int, ...]:
        """([E,] N, K) of the weight the codes stand for."""
        *lead, width = self.codes.shape
        return (*lead, width if self.float8 else width * (32 // self.bits))

    def layout_problem(self, device: torch.device) -> str | None:
        """What a packed kernel cannot read in this layout on ``device``
        (None: nothing), in words: the format (int32 words of 4 or 8 bits
        with uint8 zeros, or float8 codes and no zeros), float32 scales and
        int32 ``g_idx`` of the codes' leading shape, every tensor contiguous
        on ``device``, and a float8 weight's ``group_size`` matching its
        scales. Whether the device converts the float8 kind, and what x
        must be, are the kernel's own tests."""
        codes, scales, zeros, g_idx = self.codes, self.scales, self.zeros, self.g_idx
        lead = "E, " * (self.CODES_DIM - 2)
        if codes.dim() != self.CODES_DIM:
            return f"codes [{lead}N, K / (32 // bits)] int32 or [{lead}N, K] float8"
        if self.float8:
            if self.bits != 8 or zeros is not None:
                return "bits 8 and no zeros with float8 codes"
        elif codes.dtype != torch.int32 or self.bits not in (4, 8):
            return "int32 codes of 4 or 8 bits, or float8 codes"
        elif zeros is None or zeros.dtype != torch.uint8 or zeros.shape != scales.shape or not zeros.is_contiguous():
            return f"contiguous uint8 zeros of the scales' shape [{lead}N, G]"
        *rows, k = self.shape
        if scales.dtype != torch.float32 or scales.dim() != codes.dim() or tuple(scales.shape[:-1]) != tuple(rows):
            return f"float32 scales [{lead}N, G] with {lead}N = {tuple(rows)}"
        if g_idx.dtype != torch.int32 or tuple(g_idx.shape) != (*rows[:-1], k):
            return f"int32 g_idx [{lead}K] = {(*rows[:-1], k)}"
        if not (codes.is_contiguous() and scales.is_contiguous() and g_idx.is_contiguous()):
            return "contiguous codes, scales and g_idx"
        if not all(t.device == device for t in (codes, scales, g_idx) + (() if zeros is None else (zeros,))):
            return "every tensor on x's device"
        if self.group_size is not None and (
                self.group_size <= 0 or (self.float8 and scales.shape[-1] != -(-k // self.group_size))):
            return "a positive group_size (float8: G = ceil(K / group_size) groups)"
        return None


@dataclass(frozen=True, eq=False)
class PackedLinear(_Packed):
    """One linear's weight [N, K] held as stored: what ``ops.linear`` and
    the decoder layer's fused ops take in place of a dense weight
    (``ops.packed_linear`` is its bare product)."""

    CODES_DIM = 2  # the codes' dimensions: [N, K']; PackedExperts' [E, N, K']

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in ``dtype``: ``fp8_dequantize`` or ``int_dequantize``."""
        if self.float8:
            return fp8_dequantize(self.codes, self.scales, self.g_idx, dtype, self.group_size)
        return int_dequantize(self.codes, self.scales, self.zeros, self.g_idx, self.bits, dtype, self.group_size)


@dataclass(frozen=True, eq=False)
class PackedExperts(_Packed):
    """Every expert's weight [E, N, K] held as stored, each with its own
    groups (act-order permutes each expert's features its own way):
    ``g_idx`` is [E, K], and ``group_size`` vouches for every expert's. A
    stacked ``w13`` holds each expert's gate rows [0, N / 2), then its up
    rows; ``w2`` its down rows."""

    CODES_DIM = 3

    def linear(self, e: int) -> PackedLinear:
        """Expert ``e``'s weight as one packed linear: views of its slices."""
        return PackedLinear(self.codes[e], self.scales[e], None if self.zeros is None else self.zeros[e],
                            self.g_idx[e], self.bits, self.group_size)  # fmt: skip

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s weight [N, K] in ``dtype``: bit for bit
        ``fp8_dequantize`` or ``int_dequantize`` of its slices."""
        return self.linear(e).dequantize(dtype)
