"""An fp8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``,
kernels/cache_dtype.py): every write path stores exactly what torch's
rounding stores (nearest even, saturated), bit for bit; every read path
attends over K and V as stored, against the reference over the same bytes
widened to fp32.

Tolerances: the kernels widen the stored values to the query's dtype
exactly, so the attention comparisons are the fp32 ones of the other
kernel tests (conftest.TOLERANCES); bf16 queries on a GPU take bf16's. The
rounding itself is checked bit for bit (``view(torch.uint8)``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fluidserve.kernels import cache_ops, cpu_attention, ops, reference
from fluidserve.kernels import paged_attention as pa
from fluidserve.kernels.cache_dtype import KV_CACHE_DTYPES, as_stored, cache_dtype, round_to_cache, widen
from fluidserve.kvcache.config import KV_CACHE_DTYPES as KV_CACHE_DTYPE_NAMES

from test_cpu_attention import kv_width, step_slots

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
IDS = ["e4m3", "e5m2"]
ATOL, RTOL = 1e-4, 2e-4  # fp32: conftest.TOLERANCES[torch.float32]


def edge_values() -> torch.Tensor:
    """Random values over many binades, and the cases a rounding gets wrong:
    ties (to even), a round-up that carries into the exponent, values past
    the largest finite one, subnormals, signed zeros."""
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 448.0, 449.0, 464.0, 480.0, -1000.0, 1e6, 57344.0, 6e4, -1e9, 15.9, 31.7, 240.0, 248.0,
               3 * 2.0**-10, 5 * 2.0**-10, 2.0**-7, 2.0**-17, -(2.0**-16), 1e-30, 0.5 + 2.0**-5, 0.5 + 3 * 2.0**-5]
    return torch.cat([torch.randn(480, generator=gen) * 30, torch.randn(256, generator=gen) * 1e-3,
                      torch.randn(256, generator=gen) * 1e-5, torch.tensor(special)])


def test_rounding_is_torchs_nearest_even_and_saturates():
    """round_to_cache: torch's cast of the clamped value; e5m2's overflow
    saturates too (torch's own cast would give an infinity)."""
    x = edge_values()
    for dtype in FP8:
        big = torch.finfo(dtype).max
        stored = round_to_cache(x, dtype).float()
        assert stored.isfinite().all() and stored.abs().max() == big
        assert torch.equal(stored, x.clamp(-big, big).to(dtype).float())
    assert round_to_cache(torch.tensor([464.0]), torch.float8_e4m3fn).item() == 448.0
    assert round_to_cache(torch.tensor([6e4]), torch.float8_e5m2).item() == 57344.0
    assert round_to_cache(torch.tensor([3 * 2.0**-10]), torch.float8_e4m3fn).item() == 2 * 2.0**-9  # a tie, to even
    x = torch.randn(64)
    assert as_stored(x, torch.float32) is x
    assert torch.equal(as_stored(x, torch.float8_e4m3fn), x.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16, torch.float16])
def test_widening_every_stored_code_is_torchs_cast(dtype, target):
    """widen (the CPU path's e4m3 through float16 bits) gives torch's cast of
    every code a cache can hold (all but e4m3's two NaN codes, which
    round_to_cache never stores), into a new tensor or a given one."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    stored = codes[~codes.float().isnan()]
    assert stored.numel() == (254 if dtype == torch.float8_e4m3fn else 250)
    expected = stored.to(target)
    assert torch.equal(widen(stored, target), expected)
    out = torch.empty(stored.shape, dtype=target)
    assert widen(stored, target, out=out) is out and torch.equal(out, expected)
    lent: dict = {}

    def scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:  # a workspace bigger than asked
        return lent.setdefault(name, torch.full((numel + 7,), -1, dtype=dtype))[:numel]

    for _ in range(2):  # the second time over the lent buffers' leftovers
        assert torch.equal(widen(stored, target, out=out, scratch=scratch), expected)
    assert len(lent) == (2 if dtype == torch.float8_e4m3fn else 0)
    zeros = codes[[0, 128]]
    assert widen(zeros, target).signbit().tolist() == [False, True]


def test_names_agree_with_the_config():
    assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES
    assert cache_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert cache_dtype("fp8", torch.bfloat16) is cache_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_inc"):
        cache_dtype("fp8_inc", torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_triton_cache_write_stores_torchs_bits(device, dtype, source):
    """The Triton write (cache_ops.reshape_and_cache) rounds in fp32 before
    its cast: the cache holds round_to_cache's bits exactly, padding slots
    untouched."""
    values = edge_values()
    heads, head_dim = 2, 16
    tokens = values.numel() // (heads * head_dim)
    key = values[:tokens * heads * head_dim].view(tokens, heads, head_dim).to(source)
    value = key.flip(0) * 0.5
    num_blocks = -(-tokens // 16) + 2
    slots = torch.randperm(num_blocks * 16, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[[2, 5]] = -1
    ours = [torch.zeros((num_blocks, 16, heads, head_dim), dtype=dtype, device=device) for _ in range(2)]
    cache_ops.reshape_and_cache(key.to(device), value.to(device), *ours, slots.to(device))
    ref = [torch.zeros((num_blocks, 16, heads, head_dim), dtype=dtype) for _ in range(2)]
    reference.reshape_and_cache(key, value, *ref, slots)
    for got, want in zip(ours, ref):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert ref[0].view(torch.uint8).count_nonzero() > 0.5 * (tokens - 2) * heads * head_dim  # tiny values round to 0


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_rope_launch_writes_the_rotated_key_as_the_torch_path_stores_it(device, dtype):
    """The fused rope + KV write into an fp8 cache against the torch path
    (ops.rope_torch, then reference.reshape_and_cache): the rotated q equal,
    the cached K and V within one step of the format (the two paths' fp32
    rotations may differ in the last bit, which can move a value across a
    rounding boundary; nearly all are bit for bit)."""
    gen = torch.Generator().manual_seed(2)
    t, hq, hk, d = 5, 4, 2, 32
    q, k, v = (torch.randn(t, h, d, generator=gen) * 4 for h in (hq, hk, hk))
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.arange(d // 2)[None, :] * 0.1
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    slots = torch.tensor([3, 17, 18, 40, 63])
    caches = {name: [torch.zeros((4, 16, hk, d), dtype=dtype, device=device) for _ in range(2)]
              for name in ("triton", "torch")}
    rotated = {}
    for path, cache in caches.items():
        qq, kk = q.clone().to(device), k.clone().to(device)
        ops.rope_and_cache(qq, kk, v.to(device), cos.to(device), sin.to(device), *cache, slots.to(device), path=path)
        rotated[path] = qq.cpu()
    torch.testing.assert_close(rotated["triton"], rotated["torch"], atol=1e-5, rtol=1e-5)
    step = {torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}[dtype]
    for got, want in zip(caches["triton"], caches["torch"]):
        got, want = got.cpu(), want.cpu()
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=step)
        assert (got.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.98
    assert torch.equal(caches["triton"][1].cpu().view(torch.uint8), caches["torch"][1].cpu().view(torch.uint8))


def fp8_batch(batch, dtype):
    """The batch with its caches stored in ``dtype`` (the oracle reads them
    back widened to fp32)."""
    return dataclasses.replace(batch, key_cache=round_to_cache(batch.key_cache, dtype),
                               value_cache=round_to_cache(batch.value_cache, dtype))


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    b = block_size
    return [(1, 1), (1, b + 1), (1, 300), (b + 1, b + 1), (40, 200), (b - 1, 2 * b + 3)]


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_triton_attention_reads_the_cache_as_stored(device, make_batch, oracle, dtype):
    """Decode and prefill tiles, split keys merged, a window: the kernel over
    fp8 caches equals the reference over the same bytes; the result is not
    the full-precision cache's (so the test sees the rounding)."""
    specs = mixed_specs(16)
    full = make_batch(specs, num_kv_heads=2, group=2, head_dim=64, block_size=16, device=device, seed=21)
    batch = fp8_batch(full, dtype)
    expected = oracle(batch)
    got = pa.paged_attention(*batch.args).float().cpu()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    plan = pa.plan_for(batch.query, batch.key_cache, [q for q, _ in specs], [s for _, s in specs], num_units=3,
                       tokens_per_tile=8, kv_chunk=16)  # fmt: skip
    torch.testing.assert_close(pa.paged_attention(*batch.args, work=plan).float().cpu(), expected,
                               atol=ATOL, rtol=RTOL)
    windowed = pa.paged_attention(*batch.args, sliding_window=37).float().cpu()
    torch.testing.assert_close(windowed, oracle(batch, 37), atol=ATOL, rtol=RTOL)
    assert (expected - oracle(full)).abs().max() > 1e-3


def test_attention_refuses_a_cache_of_another_wide_type(device, make_batch):
    batch = make_batch([(1, 9)], num_kv_heads=1, group=1, head_dim=64, block_size=16, device=device)
    wide = dataclasses.replace(batch, key_cache=batch.key_cache.double(), value_cache=batch.value_cache.double())
    with pytest.raises(ValueError, match="fp8"):
        pa.paged_attention(*wide.args)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_step_kv", [True, False])
def test_cpu_path_reads_the_cache_as_stored(make_batch, oracle, dtype, query_dtype, with_step_kv):
    """The CPU path over fp8 caches: decode buckets, whole prompts (which
    attend the step's own K/V, rounded as the cache stores them) and chunks
    over a prefix, against the reference over the stored bytes."""
    bs = 16
    specs = [(1, 1), (1, 17), (1, 3 * bs + 5), (1, 300), (bs + 1, bs + 1), (40, 200), (130, 130)]
    full = make_batch(specs, num_kv_heads=2, group=4, head_dim=64, block_size=bs, dtype=query_dtype, seed=4)
    batch = fp8_batch(full, dtype)
    slots = step_slots(batch, bs)
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables, slots, bs, None,
                                    kv_width(batch))
    key = value = None
    if with_step_kv:  # the step's K/V at full precision: the path rounds them itself
        key = full.key_cache.view(-1, 2, 64)[slots]
        value = full.value_cache.view(-1, 2, 64)[slots]
    got = cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, batch.scale,
                                        key, value).float()
    atol, rtol = (1e-5, 1e-5) if query_dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(got, oracle(batch), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_cpu_path_shared_prefix_reads_the_cache_as_stored(make_batch, oracle, dtype):
    bs, shared = 16, 3
    lens = [shared * bs + 1, shared * bs + 9, shared * bs + 30]
    batch = make_batch([(1, n) for n in lens], num_kv_heads=2, group=4, head_dim=32, block_size=bs, seed=3)
    for i in range(1, len(lens)):
        batch.block_tables[i, :shared] = batch.block_tables[0, :shared]
    batch = fp8_batch(batch, dtype)
    plan = cpu_attention.build_plan(batch.q_lens, batch.seq_len_list, batch.block_tables, step_slots(batch, bs), bs,
                                    None, kv_width(batch))
    (bucket,) = plan.decodes
    assert bucket.shared_ids is not None
    got = cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, plan, batch.scale)
    torch.testing.assert_close(got.float(), oracle(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_cpu_cache_write_stores_torchs_bits(dtype):
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(12 * 16, generator=gen)[:40]
    slots[[3, 17]] = -1
    big = torch.finfo(dtype).max
    key, value = torch.randn(40, 2, 64, generator=gen) * big / 2, torch.randn(40, 2, 64, generator=gen)
    ours = [torch.zeros((12, 16, 2, 64), dtype=dtype) for _ in range(2)]
    ref = [torch.zeros((12, 16, 2, 64), dtype=dtype) for _ in range(2)]
    cpu_attention.reshape_and_cache(key, value, *ours, slots)
    reference.reshape_and_cache(key, value, *ref, slots)
    for got, want in zip(ours, ref):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert ours[0].float().abs().max() == big  # saturated, never an infinity


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FP8, ids=IDS)
def test_gpu_bf16_queries_over_fp8_caches(cuda_only, make_batch, oracle, tol, dtype):
    """Serving's shapes on a GPU: bf16 queries, a Llama-3-8B head, long
    decodes and a prefill chunk, over fp8 caches."""
    specs = mixed_specs(16) + [(1, 4096), (512, 2048), (1, 9000)]
    full = make_batch(specs, num_kv_heads=2, group=4, head_dim=128, block_size=16, dtype=torch.bfloat16,
                      device="cuda")
    batch = fp8_batch(full, dtype)
    torch.testing.assert_close(pa.paged_attention(*batch.args).float().cpu(), oracle(batch), **tol(torch.bfloat16))
