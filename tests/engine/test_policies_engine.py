"""With the real engine on CPU: scheduling never changes what a request
generates. Greedy outputs are identical under every policy, with a token
budget and KV pool small enough that the policies really reorder, chunk and
preempt."""

from __future__ import annotations

from pathlib import Path

import pytest

from fluidserve.scheduler.policies import POLICIES

ENGINE = Path(__file__).resolve().parents[2] / "engine" / "llm.py"
pytestmark = pytest.mark.skipif(not ENGINE.exists(), reason="engine/llm.py has not landed yet")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fluidserve.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


PROMPTS = [
    "a" * 70,  # long prompt: chunked, skip-joins a low queue
    "hello",
    "the quick brown fox",
    "z" * 33,
    "x",
    "scheduling never changes what a request generates",
]


def generate(model: str, policy: str, **opts) -> list[list[int]]:
    from fluidserve.engine.llm import LLM
    from fluidserve.engine.sampling_params import SamplingParams

    llm = LLM(model=model, device="cpu", scheduling_policy=policy, max_num_batched_tokens=24,
              max_num_seqs=3, num_kv_blocks=24, block_size=8, max_model_len=160, policy_options=opts)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
def test_greedy_outputs_identical_under_every_policy(tiny_model):
    reference = generate(tiny_model, "fcfs")
    assert all(len(t) == 8 for t in reference)
    for policy in sorted(POLICIES):
        if policy != "fcfs":
            assert generate(tiny_model, policy) == reference, policy
    # a tiny starve limit makes the MLFQ promote and reorder constantly
    assert generate(tiny_model, "skip-join-mlfq", starve_limit_ms=0.001, base_quantum_ms=0.01) == reference
