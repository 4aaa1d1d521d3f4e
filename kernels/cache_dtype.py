"""The KV cache's storage type (``--kv-cache-dtype``): the names a user
gives, the torch type each stores, and the one rounding every write path
uses to store a key or value in it.

``auto`` keeps K and V in the model's dtype. ``fp8`` (= ``fp8_e4m3``) and
``fp8_e5m2`` store one byte an element, as vLLM's flags of those names do,
with a scale of 1: a value is rounded to the nearest representable one,
ties to even, and saturates at the format's largest finite value (448 and
57344), so no key or value ever turns into an infinity or NaN. Every read
widens the stored value to the query's dtype before the products, so the
attention arithmetic is the model dtype's, over K and V as stored.

The Triton write launches round in fp32 arithmetic (``to_cache``) before
the cast instead of leaving the rounding to the cast: the value cast is
then exactly representable, so the cast rounds nothing, on a GPU and under
Triton's interpreter alike (whose float-to-fp8 cast neither carries a
rounding into the exponent nor saturates). The result is bit for bit what
``round_to_cache`` (torch, the CPU path and the tests' oracle) stores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

# --kv-cache-dtype (kvcache.config.KV_CACHE_DTYPES): the name -> the storage
# type (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch type a KV cache named ``name`` stores."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8


def round_to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: fp8 rounded to nearest even
    and saturated; any other type as ``Tensor.to`` converts."""
    if dtype in FP8:
        big = torch.finfo(dtype).max
        return x.float().clamp(-big, big).to(dtype)
    return x.to(dtype)


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in its own dtype, rounded as a cache of ``dtype`` would store it
    (unchanged where the cache keeps x's dtype): attention over a step's
    fresh K/V then reads what a later step reads back from the cache."""
    return widen(round_to_cache(x, dtype), x.dtype) if dtype in FP8 else x


def widen(x: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None,
          scratch: Callable[[str, int, torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
    """Stored K/V as ``dtype`` (into ``out`` where given), exactly. On a CPU
    an e4m3 tensor goes through its bits: shifted into a float16 one (the
    exponent rebiased by a multiply by 2^8, subnormals included) in a few
    vectorised integer passes, several times faster than torch's own e4m3
    cast there (``benchmarks/kv_cache_dtype.py``). ``scratch(name, numel,
    dtype)`` lends the passes' two int16 buffers (a caller's reused
    workspace: fresh ones of tens of MB are page-faulted in every call). Its
    NaN codes (never stored: ``round_to_cache`` saturates) would read as
    +-480."""
    if x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
        def buffer(name: str) -> torch.Tensor | None:
            return None if scratch is None else scratch(name, x.numel(), torch.int16).view(x.shape)

        bits, sign = buffer("e4m3 bits"), buffer("e4m3 sign")
        bits = x.view(torch.uint8).to(torch.int16) if bits is None else bits.copy_(x.view(torch.uint8))
        sign = torch.bitwise_and(bits, 0x80, out=sign).bitwise_left_shift_(8)
        x = bits.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign).view(torch.float16).mul_(256)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as bytes, the same shape (torch's CPU index copies take
    no fp8); any other cache as itself. Block moves copy bits, never values."""
    return cache.view(torch.uint8) if cache.dtype in FP8 else cache


@triton.jit
def _round_fp8(x, MANT: tl.constexpr, EMIN: tl.constexpr, MAX: tl.constexpr):
    """fp32 ``x`` rounded to a float of ``MANT`` mantissa bits whose least
    normal exponent is ``EMIN`` (below it, subnormal steps), nearest even,
    saturated at ``MAX``; still fp32."""
    a = tl.minimum(tl.abs(x), MAX)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - MANT): the step at a's exponent
    y = a / ulp  # exact: a power-of-two scaling
    f = tl.floor(y)
    frac = y - f
    up = (frac > 0.5) | ((frac == 0.5) & ((f.to(tl.int32) & 1) == 1))
    r = (f + up.to(tl.float32)) * ulp
    sign = x.to(tl.uint32, bitcast=True) & 0x80000000  # -0.0 keeps its sign, as torch's cast keeps it
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_cache(x, cache_ptr):
    """``x`` converted to the element type of ``cache_ptr``, as
    ``round_to_cache`` converts it; the test is on types, at compile time."""
    ty = cache_ptr.dtype.element_ty
    if ty == tl.float8e4nv:
        x = _round_fp8(x.to(tl.float32), 3, -6, 448.0)
    elif ty == tl.float8e5:
        x = _round_fp8(x.to(tl.float32), 2, -14, 57344.0)
    return x.to(ty)
