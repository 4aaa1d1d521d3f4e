"""``--kv-cache-dtype fp8`` / ``fp8_e5m2`` end to end on tiny random
checkpoints: greedy tokens equal transformers' when its attention reads K
and V rounded as our cache stores them (an attention function registered
with transformers that rounds them, then runs its SDPA), through whole and
chunked prefills, prefix-cache hits and swaps to the host pool and back;
the pool holds as many more blocks as the bytes an element saved.

The oracle's rounding changes the tokens at these weights (checked), so a
path that attends over unrounded K/V somewhere fails here."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fluidserve.engine import SamplingParams
from fluidserve.kernels.cache_dtype import as_stored
from token_paths import PROMPTS, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
STORED = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _register(name: str, dtype: torch.dtype) -> str:
    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, as_stored(key, dtype), as_stored(value, dtype), *args, **kwargs)

    AttentionInterface.register(name, attention)
    return name


ORACLES = {kv: _register(f"sdpa_kv_{kv}", dtype) for kv, dtype in STORED.items()}


def hf_greedy_stored(model_dir: str, prompts, kv: str, max_new_tokens: int = 16) -> list[list[int]]:
    """hf_greedy with every attention reading K/V as a ``kv`` cache stores them."""
    return hf_greedy(model_dir, prompts, max_new_tokens, attn_implementation=ORACLES[kv])


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kv", list(STORED))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers_over_the_stored_kv(tiny_model, make_llm, kv, arch):
    path = tiny_model(arch)
    expected = hf_greedy_stored(path, PROMPTS, kv)
    assert expected != hf_greedy(path, PROMPTS)  # the rounding moves tokens: the test can tell
    llm = make_llm(path, kv_cache_dtype=kv)
    assert llm.engine.executor.worker.kv_caches[0][0].dtype == STORED[kv]
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_chunks_prefix_hits_and_swaps_read_what_was_stored(tiny_model, make_llm):
    """Chunked prefills (5 tokens a step), prompts sharing a cached prefix,
    and a device pool too small for the running set, so requests swap out
    to the host pool and back as bytes: the tokens stay the oracle's."""
    path = tiny_model("llama")
    shared = "The quick brown fox jumps over the lazy dog. "
    prompts = [shared + p for p in PROMPTS[:3]] + [p[:20] for p in PROMPTS]
    expected = hf_greedy_stored(path, prompts, "fp8", max_new_tokens=40)
    llm = make_llm(path, kv_cache_dtype="fp8", num_kv_blocks=20, block_size=8, max_model_len=160, num_host_blocks=64,
                   max_num_batched_tokens=16, scheduling_policy="fcfs", proactive_swap=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40)
    assert tokens(llm.generate(prompts, params)) == expected
    stats = llm.engine.stats()
    assert stats.num_swaps > 0
    assert stats.cache_config["kv_cache_dtype"] == "fp8" and stats.cache_config["cache_dtype"] == "fp8"


def test_the_pool_holds_the_blocks_the_bytes_allow(tiny_model, make_llm):
    """At one cache budget, one byte an element holds four times the blocks
    of a float32 model's cache (two times a bf16 one's)."""
    path = tiny_model("llama")
    sizes = {kv: make_llm(path, num_kv_blocks=None, cpu_kv_cache_gb=0.01, kv_cache_dtype=kv).engine.kv.num_blocks
             for kv in ("auto", "fp8", "fp8_e5m2")}
    assert sizes["fp8"] == sizes["fp8_e5m2"] and sizes["fp8"] in (4 * sizes["auto"], 4 * sizes["auto"] + 1,
                                                                  4 * sizes["auto"] + 2, 4 * sizes["auto"] + 3)
    bf16 = make_llm(path, num_kv_blocks=None, cpu_kv_cache_gb=0.01, dtype="bfloat16", kv_cache_dtype="fp8")
    half = make_llm(path, num_kv_blocks=None, cpu_kv_cache_gb=0.01, dtype="bfloat16")
    assert bf16.engine.kv.num_blocks in (2 * half.engine.kv.num_blocks, 2 * half.engine.kv.num_blocks + 1)


def test_an_unknown_cache_dtype_is_refused_by_name(tiny_model):
    from fluidserve.engine import LLM

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=tiny_model("llama"), device="cpu", kv_cache_dtype="fp8_inc")
