"""On a CUDA device the engine runs the Triton kernels; their greedy tokens
must equal the CPU reference path's. Skipped without a GPU (CI is CPU-only);
run on a lent device with `python -m pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from fluidserve.engine import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "a", "Long prompt " * 30]


@pytest.mark.parametrize("arch, head_dim", [("llama", 64), ("qwen3", 128), ("opt", None)])
def test_triton_path_greedy_equals_reference_path(tiny_model, make_llm, arch, head_dim):
    overrides = {"head_dim": head_dim, "hidden_size": 4 * head_dim} if head_dim else {"hidden_size": 256}
    path = tiny_model(arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, num_kv_blocks=256)
    ref = make_llm(path, device="cpu", **kwargs).generate(PROMPTS, params)
    gpu = make_llm(path, device="cuda", **kwargs).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in ref]
