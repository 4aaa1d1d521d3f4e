"""The decoder layer's fused kernels (residual add + RMSNorm, rope + KV
write, SiLU-mul) against the Hugging Face reference's arithmetic written
out here in torch, and the torch paths of ``ops`` against the same: fp32 in
the interpreter, fp16/bf16 too on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from fluidserve.kernels import activation, fused_norm, ops, reference, rope_cache

DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if torch.cuda.is_available() else [])


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def hf_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """transformers' default rope and apply_rotary_pos_emb on one of q/k: [T, H, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = positions.float().cpu()[:, None] * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    rotated = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), dim=-1)
    return x * cos + rotated * sin


def tables(positions: torch.Tensor, base: float, head_dim: int, dtype: torch.dtype):
    """The rope tables engine/layers.RotaryEmbedding builds for a step."""
    from fluidserve.engine.layers import RotaryEmbedding

    return RotaryEmbedding(SimpleNamespace(rope_theta=base), head_dim).to(positions.device)(positions, dtype)


def close(dtype: torch.dtype) -> dict[str, float]:
    # fp32: a few ulps of reduction order; half types: one rounding of the
    # output either way (the kernels round once where torch rounds twice).
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,dim", [(1, 64), (7, 1024), (5, 80)])
def test_rms_norm_with_and_without_residual(device, dtype, tokens, dim):
    gen = torch.Generator().manual_seed(tokens * dim)
    x = (3 * torch.randn(tokens, dim, generator=gen)).to(device, dtype)
    residual = torch.randn(tokens, dim, generator=gen).to(device, dtype)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(device, dtype)
    expected_sum = x + residual

    out, same = fused_norm.rms_norm(x.clone(), weight, 1e-6)
    torch.testing.assert_close(out, hf_rms_norm(x, weight, 1e-6), **close(dtype))
    assert torch.equal(same, x)  # no residual: nothing written

    owned = x.clone()
    out, total = fused_norm.rms_norm(owned, weight, 1e-6, residual)
    assert total.data_ptr() == owned.data_ptr()  # the sum is written over x
    assert torch.equal(total, expected_sum)  # rounded as the dtype's add rounds
    torch.testing.assert_close(out, hf_rms_norm(expected_sum, weight, 1e-6), **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_torch_path_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(6, 96, generator=gen).to(dtype), torch.randn(6, 96, generator=gen).to(dtype)
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    out, total = ops.rms_norm(x.clone(), weight, 1e-5, residual, path="reference")
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, hf_rms_norm(x + residual, weight, 1e-5), **close(dtype))
    per_head = ops.rms_norm(x.view(6, 3, 32), weight[:32], 1e-5, path="triton")[0]  # 3-D: the torch path
    torch.testing.assert_close(per_head, hf_rms_norm(x.view(6, 3, 32), weight[:32], 1e-5), **close(dtype))


def paged_cache(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype, device):
    gen = torch.Generator().manual_seed(11)
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 16), (8, 1, 128), (3, 3, 80)])
def test_rope_and_cache_rotates_in_place_and_writes_the_slots(device, dtype, q_heads, kv_heads, head_dim):
    """q and k views of one fused qkv row, rotated as the reference rotates;
    rotated k and raw v land in their (shuffled) slots, a -1 slot nowhere."""
    tokens, block_size, num_blocks = 9, 16, 6
    gen = torch.Generator().manual_seed(q_heads * head_dim)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    positions = torch.tensor([0, 1, 2, 40, 41, 7, 300, 5, 6], device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[4] = -1
    slots = slots.to(device)
    key_cache, value_cache = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    ref_q, ref_k = hf_rope(q, positions, 10000.0), hf_rope(k, positions, 10000.0)
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(ref_k, v, ref_kc, ref_vc, slots)

    rope_cache.rope_and_cache(q, k, v, *tables(positions, 10000.0, head_dim, dtype), key_cache, value_cache, slots)
    torch.testing.assert_close(q, ref_q, **close(dtype))
    torch.testing.assert_close(k, ref_k, **close(dtype))
    torch.testing.assert_close(key_cache, ref_kc, **close(dtype))
    assert torch.equal(value_cache, ref_vc)  # v is only moved
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)[0]
    assert torch.equal(key_cache.view(-1, kv_heads, head_dim)[~written.to(device)],
                       untouched.view(-1, kv_heads, head_dim)[~written.to(device)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_rope_and_cache_gives_every_layer_the_checked_launchs_bits(device, dtype):
    """``StepRopeAndCache``: the batch-1 row layers' rope and KV write, laid
    out once for a step's q/k/v views of one buffer and launched per layer
    with only that layer's caches. Over three layers, each with new values
    in the buffer (as its QKV GEMV writes them), q, k and both caches equal
    ``rope_and_cache``'s bit for bit; a layer whose caches are laid out
    otherwise (more blocks) takes the checked path and is right too, and
    caches of the wrong head count are refused there, not launched on
    the first layer's strides."""
    q_heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    gen = torch.Generator().manual_seed(3)
    qkv = torch.empty(1, (q_heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype)
    q, k, v = (t.view(1, -1, head_dim) for t in qkv.split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    rope = tables(torch.tensor([37], device=device), 10000.0, head_dim, dtype)
    slots = torch.tensor([21], device=device)
    layers = [paged_cache(4, block_size, kv_heads, head_dim, dtype, device),
              paged_cache(4, block_size, kv_heads, head_dim, dtype, device),
              paged_cache(7, block_size, kv_heads, head_dim, dtype, device)]  # fmt: skip
    step = rope_cache.StepRopeAndCache(q, k, v, *rope, *layers[0], slots)
    for key_cache, value_cache in layers:
        qkv.copy_(torch.randn(qkv.shape, generator=gen).to(device, dtype))
        ref_qkv, ref_kc, ref_vc = qkv.clone(), key_cache.clone(), value_cache.clone()
        rq, rk, rv = (t.view(1, -1, head_dim) for t in ref_qkv.split(
            [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        rope_cache.rope_and_cache(rq, rk, rv, *rope, ref_kc, ref_vc, slots)
        step(key_cache, value_cache)
        assert torch.equal(qkv, ref_qkv)  # q and k rotated in place, v as it was
        assert torch.equal(key_cache, ref_kc) and torch.equal(value_cache, ref_vc)
        assert torch.equal(value_cache.view(-1, kv_heads, head_dim)[21], v[0])  # the slot was written
    wrong = paged_cache(4, block_size, kv_heads + 1, head_dim, dtype, device)
    with pytest.raises(ValueError, match="caches must be"):
        step(*wrong)


def qkv_views(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype, device, gen):
    """q, k, v as views of one projected qkv buffer (the engine's layout), and the buffer."""
    qkv = (2 * torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen)).to(device, dtype)
    return (*(t.view(tokens, -1, head_dim) for t in qkv.split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)), qkv)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 2, 16), (3, 3, 80)])
def test_rope_and_cache_norms_each_head_first_where_asked(device, dtype, q_heads, kv_heads, head_dim):
    """Qwen3's per-head RMSNorm of q and k, in the rope launch: q and k in
    place equal transformers' order of ops (the norm on each head, then
    rope) within the dtype's rounding, the cache holds k normed and rotated
    and v as it was, a -1 slot is not written; the torch path (``ops``,
    off the Triton lane) agrees. A head_dim of 80 pads each half to 64
    lanes, which must add nothing to a head's sum of squares."""
    tokens, block_size, num_blocks, eps = 6, 16, 4, 1e-6
    gen = torch.Generator().manual_seed(q_heads + head_dim)
    q, k, v, qkv = qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, device, gen)
    q_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype)
    k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype)
    positions = torch.tensor([0, 3, 17, 40, 41, 900], device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[2] = -1
    slots = slots.to(device)
    rope = tables(positions, 10000.0, head_dim, dtype)
    key_cache, value_cache = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    ref_q = hf_rope(hf_rms_norm(q, q_weight, eps), positions, 10000.0)
    ref_k = hf_rope(hf_rms_norm(k, k_weight, eps), positions, 10000.0)
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(ref_k, v, ref_kc, ref_vc, slots)
    torch_q, torch_k, torch_v, _ = (t.clone() for t in (q, k, v, qkv))
    torch_kc = key_cache.clone()

    rope_cache.rope_and_cache(q, k, v, *rope, key_cache, value_cache, slots, (q_weight, k_weight, eps))
    torch.testing.assert_close(q, ref_q, **close(dtype))
    torch.testing.assert_close(k, ref_k, **close(dtype))
    torch.testing.assert_close(key_cache, ref_kc, **close(dtype))
    assert torch.equal(value_cache, ref_vc)  # v only moved, the -1 slot nowhere
    ops.rope_and_cache(torch_q, torch_k, torch_v, *rope, torch_kc, value_cache.clone(), slots, path="reference",
                       qk_norm=(q_weight, k_weight, eps))  # fmt: skip
    torch.testing.assert_close(torch_q, ref_q, **close(dtype))
    torch.testing.assert_close(torch_kc, ref_kc, **close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_rope_and_cache_norms_with_each_layers_weights(device, dtype):
    """A step's rope launch prepared with q/k norms (a Qwen3's row or
    batch step) norms every layer's q and k by that layer's weights: over
    three layers, each with new rows and its own weights (one of them a
    view one element into a larger buffer, off Triton's 16-byte
    specialisation), q, k and the caches equal the checked launch's bit
    for bit, as on caches laid out otherwise; a layer without weights, or
    weights for a step prepared without norms, is refused, and so is a
    weight of another width."""
    q_heads, kv_heads, head_dim, tokens, eps = 4, 2, 32, 3, 1e-6
    gen = torch.Generator().manual_seed(7)
    q, k, v, qkv = qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, device, gen)

    def weight(offset: int = 0) -> torch.Tensor:
        return (torch.rand(head_dim + offset, generator=gen) + 0.5).to(device, dtype)[offset:]

    rope = tables(torch.tensor([5, 6, 30], device=device), 10000.0, head_dim, dtype)
    slots = torch.tensor([3, 40, 17], device=device)
    layers = [(paged_cache(4, 16, kv_heads, head_dim, dtype, device), (weight(), weight())),
              (paged_cache(4, 16, kv_heads, head_dim, dtype, device), (weight(1), weight())),
              (paged_cache(6, 16, kv_heads, head_dim, dtype, device), (weight(), weight()))]  # fmt: skip
    step = rope_cache.StepRopeAndCache(q, k, v, *rope, *layers[0][0], slots, (*layers[0][1], eps))
    for (key_cache, value_cache), norms in layers:
        qkv.copy_(torch.randn(qkv.shape, generator=gen).to(device, dtype))
        ref_qkv, ref_kc, ref_vc = qkv.clone(), key_cache.clone(), value_cache.clone()
        rq, rk, rv = (t.view(tokens, -1, head_dim) for t in ref_qkv.split(
            [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        rope_cache.rope_and_cache(rq, rk, rv, *rope, ref_kc, ref_vc, slots, (*norms, eps))
        step(key_cache, value_cache, norms)
        assert torch.equal(qkv, ref_qkv) and torch.equal(key_cache, ref_kc) and torch.equal(value_cache, ref_vc)
    with pytest.raises(ValueError, match="prepared with q/k norms"):
        step(*layers[0][0])
    with pytest.raises(ValueError, match="norm weight"):
        step(*layers[0][0], (weight(), torch.ones(head_dim + 2, device=device, dtype=dtype)))
    plain = rope_cache.StepRopeAndCache(q, k, v, *rope, *layers[0][0], slots)
    with pytest.raises(ValueError, match="prepared without q/k norms"):
        plain(*layers[0][0], layers[0][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, rotated", [(16, 12), (128, 96), (80, 32)],
                         ids=["12-of-16", "96-of-128", "32-of-80"])
def test_a_partial_rope_rotates_the_first_features_and_writes_whole_heads(device, dtype, head_dim, rotated):
    """Tables narrower than the head (Phi-4-mini: 96 of 128): the first
    features of q and k rotated as transformers rotates them, the rest left
    as projected, and whole heads of k and v in the cache; the torch path
    (``ops.rope_and_cache``) gives the same. 32 of 80: more features pass
    through (48) than are rotated, in a head of no power-of-two width."""
    tokens, q_heads, kv_heads, block_size, num_blocks = 5, 4, 2, 16, 4
    gen = torch.Generator().manual_seed(head_dim + rotated)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(
        [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    positions = torch.tensor([0, 3, 40, 300, 7], device=device)
    slots = torch.tensor([5, 17, -1, 40, 2], device=device)
    key_cache, value_cache = paged_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device)
    ref_q, ref_k = q.clone(), k.clone()
    ref_q[..., :rotated] = hf_rope(q[..., :rotated], positions, 10000.0)
    ref_k[..., :rotated] = hf_rope(k[..., :rotated], positions, 10000.0)
    ref_kc, ref_vc = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(ref_k, v, ref_kc, ref_vc, slots)
    rope = tables(positions, 10000.0, rotated, dtype)
    assert rope[0].shape == (tokens, rotated)
    torch_q, torch_k, torch_kc, torch_vc = q.clone(), k.clone(), key_cache.clone(), value_cache.clone()

    rope_cache.rope_and_cache(q, k, v, *rope, key_cache, value_cache, slots)
    torch.testing.assert_close(q, ref_q, **close(dtype))
    torch.testing.assert_close(k, ref_k, **close(dtype))
    assert torch.equal(q[..., rotated:], ref_q[..., rotated:])  # passed through untouched
    torch.testing.assert_close(key_cache, ref_kc, **close(dtype))
    assert torch.equal(key_cache[..., rotated:], ref_kc[..., rotated:])
    assert torch.equal(value_cache, ref_vc)
    ops.rope_and_cache(torch_q, torch_k, v, *rope, torch_kc, torch_vc, slots, path="reference")
    torch.testing.assert_close(torch_q, ref_q, **close(dtype))
    torch.testing.assert_close(torch_kc, ref_kc, **close(dtype))
    with pytest.raises(ValueError, match="partial rope"):
        weights = torch.ones(head_dim, device=device, dtype=dtype)
        rope_cache.rope_and_cache(q, k, v, *rope, key_cache, value_cache, slots, (weights, weights, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["whole", "qk-norm", "partial"])
def test_rope_and_cache_gives_the_same_bits_at_any_tokens_per_program(device, dtype, variant, monkeypatch):
    """A program rotates and writes one token on a GPU and up to sixteen in
    Triton's interpreter (``launch.row_tiling``). Over 9 tokens, 4 a
    program (the last program with one) and 16 (one program, seven tokens
    masked) give q, k and both caches bit for bit as one a program does, for
    whole-head tables, q/k norms, and a partial rope; a -1 slot and every
    slot of no token stay unwritten."""
    tokens, q_heads, kv_heads, head_dim, eps = 9, 4, 2, 32, 1e-6
    rotated = 24 if variant == "partial" else head_dim
    gen = torch.Generator().manual_seed(len(variant))
    q, k, v, qkv = qkv_views(tokens, q_heads, kv_heads, head_dim, dtype, device, gen)
    norms = None
    if variant == "qk-norm":
        norms = tuple((torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype) for _ in "qk") + (eps,)
    rope = tables(torch.tensor([0, 1, 2, 40, 41, 7, 300, 5, 6], device=device), 10000.0, rotated, dtype)
    slots = torch.randperm(64, generator=gen)[:tokens]
    slots[4] = -1
    slots = slots.to(device)
    caches = paged_cache(4, 16, kv_heads, head_dim, dtype, device)
    runs = {}
    for n in (1, 4, 16):
        monkeypatch.setattr(rope_cache, "row_tiling", lambda q, n=n: (n, q.shape[0] if n > 1 else 0))
        rows, kc, vc = qkv.clone(), caches[0].clone(), caches[1].clone()
        rq, rk, rv = (t.view(tokens, -1, head_dim) for t in rows.split(
            [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
        rope_cache.rope_and_cache(rq, rk, rv, *rope, kc, vc, slots, norms)
        runs[n] = rows, kc, vc
    for n in (4, 16):
        assert all(torch.equal(a, b) for a, b in zip(runs[n], runs[1])), n
    written = torch.zeros(64, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    for before, after in zip(caches, runs[16][1:]):
        assert torch.equal(after.view(64, -1)[~written], before.view(64, -1)[~written])
        assert not torch.equal(after.view(64, -1)[written], before.view(64, -1)[written])
    assert not torch.equal(runs[1][0], qkv)  # q and k were rotated


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_silu_mul_give_the_same_bits_at_any_rows_per_program(device, dtype, monkeypatch):
    """RMSNorm (with and without the residual add) and SiLU-mul take one row
    a program on a GPU and up to sixteen in Triton's interpreter
    (``launch.row_tiling``): over 9 rows of a width no power of two
    (1500 columns: two SiLU-mul column blocks, the last part empty), 4 and
    16 rows a program give every output bit for bit as one does, through
    the checked launches and a step's prepared ones; no row past the last
    is written."""
    gen = torch.Generator().manual_seed(13)
    x = (3 * torch.randn(9, 1500, generator=gen)).to(device, dtype)
    residual = torch.randn(9, 1500, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(1500, generator=gen)).to(device, dtype)
    gate_up = (2 * torch.randn(9, 3000, generator=gen)).to(device, dtype)
    runs = {}
    for n in (1, 4, 16):
        for module in (fused_norm, activation):
            monkeypatch.setattr(module, "row_tiling", lambda t, n=n: (n, t.shape[0] if n > 1 else 0))
        step_sum, step_out = torch.cat([x.clone(), x[:1]]), torch.full((10, 1500), 7.0, device=device, dtype=dtype)
        fused_norm.StepNorm(step_sum[:9], weight, 1e-5, residual=True)(step_sum[:9], weight, step_out[:9], residual)
        silu_out = torch.full((10, 1500), 7.0, device=device, dtype=dtype)
        activation.StepSiluAndMul(gate_up, silu_out[:9])()
        runs[n] = (*fused_norm.rms_norm(x.clone(), weight, 1e-5),
                   *fused_norm.rms_norm(x.clone(), weight, 1e-5, residual),
                   activation.silu_and_mul(gate_up), step_sum, step_out, silu_out)  # fmt: skip
    for n in (4, 16):
        assert all(torch.equal(a, b) for a, b in zip(runs[n], runs[1])), n
    for written in runs[16][-2:]:
        assert torch.all(written[9] == 7.0)  # the row past the last is left as it was
    assert torch.equal(runs[16][-3][9], x[0])


def test_rope_torch_path_matches_the_reference():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, 64, generator=gen)
    positions = torch.tensor([3, 0, 9, 1000, 2, 17])
    expected = hf_rope(x, positions, 500000.0)
    strided = torch.cat([x, x], dim=-1)[..., :64]  # a view with a row stride, as q of a qkv row
    ops.rope_torch(strided, *tables(positions, 500000.0, 64, torch.float32))
    torch.testing.assert_close(strided, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 1500), (3, 2048)])
def test_silu_and_mul(device, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (2 * torch.randn(tokens, 2 * inter, generator=gen)).to(device, dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    torch.testing.assert_close(activation.silu_and_mul(x), expected, **close(dtype))
    torch.testing.assert_close(ops.silu_and_mul(x, path="reference"), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steps_norms_and_silu_mul_give_every_layer_the_checked_launchs_bits(device, dtype):
    """``StepNorm`` and ``StepSiluAndMul``: a step of several rows' norms
    (with and without the residual add) and SiLU-mul, laid out once and
    launched per layer into the step's buffers. Over three layers, each
    with its own weight and new rows, the outputs and the residual sum
    written over x equal ``rms_norm``'s and ``silu_and_mul``'s bit for bit
    (a weight one element into a larger buffer, off Triton's 16-byte
    specialisation, too); a residual where none was prepared, or none
    where one was, is refused."""
    tokens, dim, inter, eps = 5, 96, 80, 1e-5
    gen = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    rows, out = rand(tokens, dim), torch.empty(tokens, dim, device=device, dtype=dtype)
    norm = fused_norm.StepNorm(rows, rand(dim), eps, residual=False)
    add_norm = fused_norm.StepNorm(rows, rand(dim), eps, residual=True)
    gate_up, act = rand(tokens, 2 * inter), torch.empty(tokens, inter, device=device, dtype=dtype)
    silu_and_mul = activation.StepSiluAndMul(gate_up, act)
    weights = [rand(dim), rand(dim), rand(dim + 1)[1:]]
    for weight in weights:
        x, residual = rand(tokens, dim), rand(tokens, dim)
        expected, _ = fused_norm.rms_norm(x.clone(), weight, eps)
        assert norm(x, weight, out) is out and torch.equal(out, expected)
        summed = x.clone()
        expected, _ = fused_norm.rms_norm(summed, weight, eps, residual)
        add_norm(x, weight, out, residual)
        assert torch.equal(out, expected) and torch.equal(x, summed)  # the sum written over x
        gate_up.copy_(rand(tokens, 2 * inter))
        silu_and_mul()
        assert torch.equal(act, activation.silu_and_mul(gate_up))
    with pytest.raises(ValueError, match="without a residual"):
        norm(x, weights[0], out, residual)
    with pytest.raises(ValueError, match="with a residual"):
        add_norm(x, weights[0], out)


def test_layouts_are_refused(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(ValueError, match="weight"):
        fused_norm.rms_norm(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_norm.rms_norm(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match="2 \\* intermediate"):
        activation.silu_and_mul(torch.randn(4, 63, device=device))
    q = torch.randn(2, 2, 16, device=device)
    cache = torch.zeros(2, 16, 2, 16, device=device)
    cos = torch.ones(2, 16, device=device)
    with pytest.raises(ValueError, match="one slot per token"):
        rope_cache.rope_and_cache(q, q.clone(), q.clone(), cos, cos, cache, cache.clone(),
                                  torch.zeros(3, dtype=torch.long, device=device))
