"""The engine's attention path on CPU: the semantics of ``reference.py``, built
for speed over a whole step.

``reference.paged_attention`` stays the readable oracle; this module owns what
makes the CPU path scale with the number of requests:

* **One plan per step.** Which rows decode, how decodes are bucketed, the
  block ids each bucket gathers and its key mask are worked out once from the
  host lengths (``CpuAttentionPlan``) and reused by every layer.
* **No dtype casts of the cache.** K/V are read in the cache's dtype and
  torch's fused CPU attention (``scaled_dot_product_attention``, flash kernel)
  accumulates in fp32 itself; the reference's fp32 copies of every gathered
  context are what made it slow. An fp8 cache (``--kv-cache-dtype``) is the
  exception: what a call gathers is widened to the query's dtype once, and
  a step's fresh K/V are rounded as the cache stores them, so every read
  sees K and V as stored (kernels/cache_dtype.py).
* **Fresh prompts read no cache.** A prompt with no cached prefix attends to
  this step's own K/V (views into the flat batch) with ``is_causal``, so the
  flash kernel skips the masked half; only chunks over a cached prefix gather.
  Every call passes 4-D tensors: torch sends 3-D ones (as the reference's
  prefill does) to its unfused path, which materialises the scores.
* **A chunk over a cached prefix in two unmasked calls.** The chunk's
  queries attend the gathered prefix with no mask (every prefix key is
  visible to every query) and the chunk's own keys with ``is_causal``; the
  two merge by their log-sum-exp. One call with an explicit [chunk, context]
  mask reads the mask and computes the masked corner too: up to 1.3x slower
  for long chunks in fp32 on two x86 cores, the same for a short chunk over
  a long prefix (benchmarks/cpu_chunked_prefill.py).
* **Decodes batched, GQA folded.** All single-token rows of a length bucket go
  through one attention call. The ``g = Hq / Hk`` query heads that share a KV
  head become ``g`` queries of that head::

      q [D, Hq, d] -> [D, Hk, g, d]    k, v [D, Hk, L, d]    (no KV repeat)

* **Short rows batched like decodes.** A row of a few queries (a speculative
  step's token and its drafts, a prompt's last few tokens) is a decode of
  ``Q`` queries: rows of 2 to ``MAX_FOLDED_QUERIES`` queries bucket apart
  from single-token rows, each padded to its bucket's ``Q`` (the padding
  repeats the row's last query and is not written out), under a mask that is
  causal over the row's own keys::

      q [D, Q, Hq, d] -> [D, Hk, Q * g, d]    mask [D, 1, Q * g, L]

  Attended one by one as chunks, 12 rows of 5 queries over about 300 keys
  took 3.6 times what the rows take as 12 decodes; bucketed, 1.6 times, and
  a verifying step of a 16-layer model ran 1.48x faster (fp32, one thread;
  benchmarks/cpu_short_rows.py). Past 16 queries the two are about even.

* **A shared prefix read once.** When every row of a decode bucket starts
  with the same blocks (a common system prompt held once by the prefix
  cache), those blocks are attended by all the bucket's queries in one call
  and only each row's own suffix is gathered per row; the two parts merge by
  their log-sum-exp. Without this every step copies the shared context once
  per row.
* **Gathers into a reused workspace, a few rows at a time.** The blocks of a
  bucket are copied with ``index_select`` into a per-thread buffer that only
  grows: a fresh allocation of tens of MB per layer is returned to the OS and
  page-faulted back in every step, which cost more than the copy itself. A
  big bucket is gathered and attended in groups of rows
  (``DECODE_GROUP_ELEMENTS``), so attention reads what is still in cache.

* **Soft-capped scores (Gemma 2) explicitly.** torch's fused kernels take no
  cap: with one, every call above is the reference's explicit arithmetic in
  fp32 (``_sdpa``), a chunk over a prefix is one call over both key sets
  under a mask, and a shared prefix is not split out.

Writes into the cache are one ``index_copy_`` over the flat slot index.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from fluidserve.kernels import reference
from fluidserve.kernels.cache_dtype import as_stored, byte_view, is_fp8, round_to_cache, widen

# A decode bucket's longest context is at most this many times its shortest:
# padding costs attention work, each bucket costs one call.
BUCKET_RATIO = 2.0
# Rows x padded length of one decode bucket: bigger buckets are split by rows
# so the masks and tables a plan holds stay bounded, as does the workspace of
# a shared-prefix bucket, which gathers its rows' own parts all at once
# (32 MiB per tensor with 2 KV heads of 64 in fp32; other buckets gather
# DECODE_GROUP_ELEMENTS at a time).
MAX_GATHER_TOKENS = 1 << 16
# Leading blocks a decode bucket's rows must share before the shared part is
# attended once for all of them (below this the extra call costs more).
MIN_SHARED_BLOCKS = 2
# K elements per layer that rows sharing a prefix must save, (rows - 1) x
# shared tokens x KV heads x head dim, before they get a bucket of their own.
# A bucket costs about 0.15 ms a layer whatever its size (two attention calls,
# a merge, its gathers); copying a token's K and V for a 2 x 64 fp32 head
# costs about 0.14 us, on two x86 cores
# (benchmarks/shared_prefix_decode.py): families of 2-64 rows broke even at
# 1,000-2,000 saved tokens of that width, and 128 families of 2 rows sharing
# 2 blocks made a step of 256 decodes 17x slower than one bucket.
MIN_SHARED_SAVING = 2048 * 128
# K elements (rows x padded length x KV heads x head dim) a decode bucket
# gathers per attention call. The flash kernel reads K/V gathered into a
# buffer of many MB at about a quarter of the memory bandwidth, and several
# times faster when the gather has just left them in cache: a couple of MB at
# a time made decode attention 1.4-1.8x faster per layer in fp32 at 12-1024
# rows, and neutral where one row alone is bigger than this
# (benchmarks/cpu_decode_groups.py, 2-core CPU).
DECODE_GROUP_ELEMENTS = 1 << 19
# Rows of up to this many queries are attended in buckets like decodes (the
# chunk path, one row at a time, costs a few calls per row whatever its size).
MAX_FOLDED_QUERIES = 16


@dataclass
class DecodeBucket:
    """Rows of ``queries`` queries or fewer (single-token ones, or short ones)
    and of similar context length, attended in one call."""

    q_rows: torch.Tensor  # [D * Q] int64: token index of each query in the flat batch, a row's last repeated
    block_ids: torch.Tensor  # [D * nb] int64: the rows' blocks, padded with block 0
    key_mask: torch.Tensor  # [D, 1, Q, nb * block_size] bool: keys each query may read
    num_blocks: int  # nb, blocks gathered per row
    # Leading blocks every row shares (attended once for all rows), or None;
    # block_ids, key_mask and num_blocks then cover only what follows them.
    shared_ids: torch.Tensor | None = None
    queries: int = 1  # Q, the queries of the bucket's longest row
    keep: torch.Tensor | None = None  # [D * Q] bool: the queries that are not padding (None: all are)
    _masks: dict = field(default_factory=dict)  # key_mask per (query heads per KV head, dtype): folded, additive


@dataclass
class PrefillItem:
    """One sequence running more than one query this step."""

    q_lo: int
    q_hi: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool (a sliding window); None: causal after the prefix


@dataclass
class CpuAttentionPlan:
    decodes: list[DecodeBucket]
    prefills: list[PrefillItem]
    slots_all_valid: bool  # no -1 in the slot mapping: the write needs no filter


def build_plan(
    q_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [S, max_blocks] int
    slot_mapping: torch.Tensor,  # [num_tokens] int
    block_size: int,
    sliding_window: int | None,
    kv_width: int,  # KV heads x head dim of the cache
) -> CpuAttentionPlan:
    """Everything about a step's attention that does not depend on the layer."""
    dev = block_tables.device
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    valid = bool((slot_mapping >= 0).all()) if slot_mapping.numel() else True
    # A short row reads its own keys from the cache, so only where every
    # token's K/V was written there.
    fold = MAX_FOLDED_QUERIES if valid else 1
    by_length = sorted(range(len(q_lens)), key=seq_lens.__getitem__)
    decodes = []
    for rows in ([i for i in by_length if q_lens[i] == 1], [i for i in by_length if 1 < q_lens[i] <= fold]):
        families = (_families(rows, q_lens, block_tables, seq_lens, block_size, kv_width)
                    if sliding_window is None else [rows])
        decodes += [_decode_bucket(bucket, starts, q_lens, seq_lens, block_tables, block_size, sliding_window)
                    for group in families for bucket in _buckets(group, seq_lens, block_size)]
    prefills = []
    for i, q_len in enumerate(q_lens):
        if q_len <= fold:
            continue
        seq_len = seq_lens[i]
        block_ids = block_tables[i, : -(-seq_len // block_size)].long()
        mask = None  # plain causal, after the prefix when there is one
        if sliding_window is not None:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=dev).unsqueeze(1)  # [q_len, 1]
            k_pos = torch.arange(seq_len, device=dev).unsqueeze(0)  # [1, seq_len]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)
        prefills.append(PrefillItem(starts[i], starts[i + 1], seq_len, block_ids, mask))
    return CpuAttentionPlan(decodes, prefills, valid)


def _families(rows: list[int], q_lens: list[int], block_tables: torch.Tensor, seq_lens: list[int],
              block_size: int, kv_width: int) -> list[list[int]]:
    """Rows that start at the same physical block (a prefix the cache shares)
    bucket apart from the rest when reading that prefix once saves more than
    the bucket costs (MIN_SHARED_SAVING), so a bucket's rows can share leading
    blocks; all other rows stay together. Each list keeps ``rows``' order."""
    if len(rows) < 2:
        return [rows]
    first = block_tables[:, 0].tolist()
    families: dict[int, list[int]] = {}
    for i in rows:
        families.setdefault(first[i], []).append(i)
    apart: list[list[int]] = []
    for f in families.values():
        if len(f) < 2:
            continue
        # Whole blocks every row reads in full, short of its own queries: at
        # most the shortest row's; checked against the tables only when that
        # bound would pay, since most families are a few rows sharing little.
        most = min(seq_lens[i] - q_lens[i] for i in f) // block_size
        if (len(f) - 1) * most * block_size * kv_width < MIN_SHARED_SAVING:
            continue
        tables = block_tables[torch.tensor(f, device=block_tables.device), :most]
        run = int((tables == tables[0]).all(0).long().cumprod(0).sum())
        if (len(f) - 1) * run * block_size * kv_width >= MIN_SHARED_SAVING:
            apart.append(f)
    if not apart:
        return [rows]
    taken = {i for f in apart for i in f}
    rest = [i for i in rows if i not in taken]
    return apart + ([rest] if rest else [])


def _buckets(rows: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Split rows sorted by length: a new bucket when the length passes
    BUCKET_RATIO times the bucket's first, or when its padded gather would
    pass MAX_GATHER_TOKENS."""
    out: list[list[int]] = []
    cur: list[int] = []
    for i in rows:
        padded = -(-seq_lens[i] // block_size) * block_size
        too_long = cur and seq_lens[i] > BUCKET_RATIO * seq_lens[cur[0]]
        too_big = cur and (len(cur) + 1) * padded > MAX_GATHER_TOKENS
        if too_long or too_big:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def _decode_bucket(rows, starts, q_lens, seq_lens, block_tables, block_size, sliding_window) -> DecodeBucket:
    dev = block_tables.device
    lens = torch.tensor([seq_lens[i] for i in rows], device=dev)  # [D]
    counts = [q_lens[i] for i in rows]
    queries = max(counts)
    nb = -(-max(seq_lens[i] for i in rows) // block_size)
    tables = block_tables[torch.tensor(rows, device=dev), :nb].long()  # [D, nb]
    # Entries past a row's last block are padding (any value): point them at
    # block 0 so the gather never reads out of range; the mask hides them.
    need = (lens + block_size - 1) // block_size
    tables = torch.where(torch.arange(nb, device=dev) < need.unsqueeze(1), tables, 0)
    # A row's j-th query sits at position len - q + j; its padding repeats its last.
    last = torch.tensor(counts, device=dev).unsqueeze(1) - 1  # [D, 1]
    q_pos = lens.unsqueeze(1) - 1 - last + torch.minimum(torch.arange(queries, device=dev), last)  # [D, Q]
    k_pos = torch.arange(nb * block_size, device=dev)  # [L]
    mask = k_pos <= q_pos.unsqueeze(2)  # [D, Q, L]
    if sliding_window is not None:
        mask &= k_pos > q_pos.unsqueeze(2) - sliding_window
    mask = mask.unsqueeze(1)  # [D, 1, Q, L]
    q_rows = torch.tensor([starts[i] + min(j, q - 1) for i, q in zip(rows, counts) for j in range(queries)],
                          device=dev)
    keep = None
    if min(counts) < queries:
        keep = torch.tensor([j < q for q in counts for j in range(queries)], device=dev)
    shared = 0
    if sliding_window is None and len(rows) > 1:
        run = int((tables == tables[0]).all(0).long().cumprod(0).sum())
        # Whole blocks every row reads in full, short of each row's own queries.
        shared = min(run, min(seq_lens[i] - q_lens[i] for i in rows) // block_size)
    if shared < MIN_SHARED_BLOCKS:
        return DecodeBucket(q_rows, tables.flatten(), mask, nb, None, queries, keep)
    return DecodeBucket(q_rows, tables[:, shared:].flatten(), mask[..., shared * block_size:], nb - shared,
                        tables[0, :shared].contiguous(), queries, keep)


# -- the kernels ------------------------------------------------------------------

_local = threading.local()


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat scratch buffer of at least ``numel`` elements, kept per thread."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    # A buffer made under inference mode cannot be written outside it.
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        buf = bufs[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = do not write
    all_valid: bool | None = None,
) -> None:
    """``reference.reshape_and_cache`` as one indexed copy per tensor."""
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if not all_valid:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    # [num_blocks * block_size, Hk, d] is a view: a slot is its row.
    for x, cache in ((key, key_cache), (value, value_cache)):
        byte_view(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, byte_view(round_to_cache(x, cache.dtype)))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    plan: CpuAttentionPlan,
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: this step's K
    value: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``reference.paged_attention`` over a step described by ``plan``.

    ``key``/``value`` are this step's new K/V (already written into the
    cache); when given, whole prompts attend to them instead of the cache.
    ``softcap`` (Gemma 2): the scores capped, in ``_sdpa``'s explicit
    attention, which torch's fused CPU kernels do not do.
    Returns ``[num_tokens, num_q_heads, head_dim]`` in ``query.dtype``.
    """
    out = torch.empty_like(query)
    if key is not None and is_fp8(key_cache.dtype):
        key, value = as_stored(key, key_cache.dtype), as_stored(value, value_cache.dtype)
    for bucket in plan.decodes:
        _decode(out, query, key_cache, value_cache, bucket, scale, softcap)
    for item in plan.prefills:
        _prefill(out, query, key_cache, value_cache, item, scale, key, value, softcap)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """torch's fused CPU attention (query heads sharing KV heads), or, with
    ``softcap``, the reference's explicit arithmetic in fp32 (``mask``: the
    keys each query may read; ``is_causal`` builds it)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)  # fmt: skip
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril_()
    return reference.attention(q.float(), k.float(), v.float(), mask, scale, softcap).to(q.dtype)


def _decode(out, query, key_cache, value_cache, b: DecodeBucket, scale: float, softcap: float | None) -> None:
    num_kv, head_dim = key_cache.shape[2], key_cache.shape[3]
    rows, n = b.key_mask.shape[0], b.queries
    length = b.num_blocks * key_cache.shape[1]

    def gather(cache: torch.Tensor, name: str, lo: int = 0, hi: int = rows) -> torch.Tensor:
        # rows [lo, hi) -> [hi - lo, Hk, L, d], a strided view
        flat = cache.view(cache.shape[0], -1)
        ids = b.block_ids[lo * b.num_blocks:hi * b.num_blocks]
        buf = _workspace(name, ids.numel() * flat.shape[1], cache.dtype, cache.device)
        torch.index_select(flat, 0, ids, out=buf.view(ids.numel(), flat.shape[1]))
        if cache.dtype != query.dtype:  # an fp8 cache: widened once, in a workspace of its own
            wide = _workspace(name + " wide", buf.numel(), query.dtype, cache.device)
            buf = widen(buf, query.dtype, out=wide, scratch=lambda what, n, dt: _workspace(what, n, dt, cache.device))
        return buf.view(hi - lo, length, num_kv, head_dim).transpose(1, 2)

    def write(o: torch.Tensor, lo: int, hi: int) -> None:  # o [hi - lo, Hk, Q * g, d]
        if n > 1:  # back to token order: [D', Q, Hk, g, d]
            o = o.view(hi - lo, num_kv, n, group, head_dim).transpose(1, 2)
        o = o.reshape((hi - lo) * n, -1, head_dim)
        at = b.q_rows[lo * n:hi * n]
        if b.keep is not None:
            real = b.keep[lo * n:hi * n]
            o, at = o[real], at[real]
        out.index_copy_(0, at, o)

    group = query.shape[1] // num_kv
    q = query.index_select(0, b.q_rows)  # [D * Q, Hq, d]
    if n == 1:
        q = q.view(rows, num_kv, group, head_dim)  # [D, Hk, g, d]
    else:  # a KV head's query heads and a row's queries, all queries of that head: [D, Hk, Q * g, d]
        q = q.view(rows, n, num_kv, group, head_dim).transpose(1, 2).reshape(rows, num_kv, n * group, head_dim)
    mask = _mask(b, group, None if softcap is not None else q.dtype)
    if b.shared_ids is not None and softcap is None:  # the shared keys' flash call has no cap
        write(_decode_shared(q, key_cache, value_cache, b, scale, gather(key_cache, "k"), gather(value_cache, "v"),
                             mask), 0, rows)
        return
    # A few rows at a time, so that what one call gathers is still in cache
    # when attention reads it.
    step = max(1, DECODE_GROUP_ELEMENTS // (length * num_kv * head_dim))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        write(_sdpa(q[lo:hi], gather(key_cache, "k", lo, hi), gather(value_cache, "v", lo, hi), mask[lo:hi],
                    scale, softcap), lo, hi)


def _mask(b: DecodeBucket, group: int, dtype: torch.dtype | None) -> torch.Tensor:
    """The bucket's key mask for queries folded as ``_decode`` folds them
    ([D, 1, Q * g, L]; a single query's broadcasts over its heads), as
    booleans or, given a dtype, additive (what the flash kernel takes)."""
    key = (group, dtype)
    mask = b._masks.get(key)
    if mask is None:
        mask = b.key_mask
        if b.queries > 1:  # query j of a row repeated for each of its g heads
            rows, _, n, length = mask.shape
            mask = mask.unsqueeze(3).expand(rows, 1, n, group, length).reshape(rows, 1, n * group, length)
        if dtype is not None:
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -torch.inf)
        b._masks[key] = mask
    return mask


_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _decode_shared(q, key_cache, value_cache, b: DecodeBucket, scale: float, k_own, v_own, bias) -> torch.Tensor:
    """Attention of a bucket whose rows share their leading blocks: every
    query of the bucket against the shared blocks in one call, each row
    against its own blocks (``bias``: their additive mask), merged by
    log-sum-exp (the softmax over the union of the keys)."""
    rows, num_kv, group, head_dim = q.shape
    num_blocks = b.shared_ids.numel() * key_cache.shape[1]

    def shared(cache: torch.Tensor) -> torch.Tensor:  # -> [1, Hk, Ls, d]
        blocks = _widened(cache.index_select(0, b.shared_ids), q.dtype)
        return blocks.view(1, num_blocks, num_kv, head_dim).transpose(1, 2)

    q_all = q.transpose(0, 1).reshape(1, num_kv, rows * group, head_dim)
    o_shared, lse_shared = _attention_with_lse(q_all, shared(key_cache), shared(value_cache), scale=scale)
    o_shared = o_shared.reshape(num_kv, rows, group, head_dim).transpose(0, 1)  # [D, Hk, Q * g, d]
    lse_shared = lse_shared.reshape(num_kv, rows, group).transpose(0, 1)  # [D, Hk, Q * g]
    o_own, lse_own = _attention_with_lse(q, k_own, v_own, attn_mask=bias, scale=scale)
    return _merged(o_shared, lse_shared, o_own, lse_own, q.dtype)


def _merged(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """Two attention outputs over disjoint key sets, each with its
    log-sum-exp, as one over their union (weighted in fp32)."""
    top = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - top).exp_().unsqueeze(-1)
    w_b = (lse_b - top).exp_().unsqueeze(-1)
    return ((o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)).to(dtype)


def _prefill(out, query, key_cache, value_cache, item: PrefillItem, scale: float, key, value,
             softcap: float | None = None) -> None:  # fmt: skip
    # Inputs go in as 4-D [1, H, len, d]: torch dispatches 3-D ones to its
    # unfused "math" attention, which materialises the scores.
    q_len = item.q_hi - item.q_lo
    prefix = item.seq_len - q_len
    q = query[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, d]
    if key is not None and item.mask is None:  # the chunk's own K/V, as written this step
        k_own = key[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)  # [1, Hk, q_len, d]
        v_own = value[item.q_lo:item.q_hi].transpose(0, 1).unsqueeze(0)
        read = prefix
    else:
        read = item.seq_len
    if read:
        bs = key_cache.shape[1]
        ids = item.block_ids[: -(-read // bs)]
        k = _gathered(key_cache, ids, read, q.dtype)  # [1, Hk, read, d]
        v = _gathered(value_cache, ids, read, q.dtype)
    if item.mask is not None:
        o = _sdpa(q, k, v, item.mask, scale, softcap)
    else:
        if read > prefix:  # no step K/V given: the chunk's own keys come from the cache too
            k, k_own = k[:, :, :prefix], k[:, :, prefix:]
            v, v_own = v[:, :, :prefix], v[:, :, prefix:]
        if not prefix:
            o = _sdpa(q, k_own, v_own, None, scale, softcap, is_causal=True)
        elif softcap is not None:  # the two flash calls have no cap: one explicit call over both key sets
            mask = torch.ones(q_len, prefix + q_len, dtype=torch.bool, device=q.device)
            mask[:, prefix:].tril_()
            o = _sdpa(q, torch.cat((k, k_own), dim=2), torch.cat((v, v_own), dim=2), mask, scale, softcap)
        else:
            o = _prefix_then_causal(q, k, v, k_own, v_own, scale)
    out[item.q_lo:item.q_hi] = o[0].transpose(0, 1)


def _gathered(cache: torch.Tensor, ids: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``length`` tokens of the blocks ``ids`` as [1, Hk, length, d]
    of ``dtype``."""
    return _widened(cache[ids], dtype).view(-1, *cache.shape[2:])[:length].transpose(0, 1).unsqueeze(0)


def _widened(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered blocks in the query's dtype (only an fp8 cache's differ)."""
    return blocks if blocks.dtype == dtype else widen(blocks, dtype)


def _prefix_then_causal(q, k_pre, v_pre, k_own, v_own, scale: float) -> torch.Tensor:
    """Attention of a chunk's queries [1, Hq, L, d] over a prefix every query
    sees and then the chunk's own keys, causally: two flash calls merged by
    their log-sum-exp (the softmax over the union of the keys)."""
    _, num_q, length, head_dim = q.shape
    num_kv = k_pre.shape[1]
    group = num_q // num_kv
    # The prefix call takes a KV head's query heads as more queries of it (no
    # mask, so their order does not matter); the causal one needs the
    # positions, so it repeats the chunk's few K/V instead.
    q_folded = q.reshape(1, num_kv, group * length, head_dim)
    o_pre, lse_pre = _attention_with_lse(q_folded, k_pre, v_pre, scale=scale)
    o_pre = o_pre.reshape(1, num_q, length, head_dim)
    lse_pre = lse_pre.reshape(1, num_q, length)
    if group > 1:
        k_own = k_own.repeat_interleave(group, dim=1)
        v_own = v_own.repeat_interleave(group, dim=1)
    o_own, lse_own = _attention_with_lse(q, k_own, v_own, is_causal=True, scale=scale)
    return _merged(o_pre, lse_pre, o_own, lse_own, q.dtype)
