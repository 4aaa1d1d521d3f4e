"""Embeddings (``runner="pooling"``) against Hugging Face ``transformers``:
the engine's pooled vectors equal the pooling of HF's ``last_hidden_state``
of the same tiny random-weight model within 1e-5 (both fp32 on CPU),
whether a prompt ran whole or in chunks of a 16-token step budget, took
prefix-cache hits, or was recomputed after a preemption. Also what the
served model decides (its checkpoint's pooling, ``--pooler-config``, a
checkpoint of the base model alone) and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from fluidserve.engine import PoolingParams, SamplingParams
from fluidserve.engine.pooling import finish, model_pooling, pool_range
from fluidserve.engine.tiny_model import build_tiny_model

TOL = 1e-5
PROMPT_IDS = list(b"The quick brown fox jumps over the dogs.")  # 40 byte tokens
SHORT_IDS = list(b"Hello!!")


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_hidden(model_dir):
    """token ids -> [len, hidden] fp32 last_hidden_state of HF's base model."""
    hf = transformers.AutoModel.from_pretrained(model_dir).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids])).last_hidden_state[0].float()

    return run


def reference(hidden: torch.Tensor, kind: str, normalize: bool = True) -> torch.Tensor:
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def close(got: list[float], want: torch.Tensor) -> bool:
    return (torch.tensor(got) - want).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers_across_chunks(model_dir, make_llm, hf_hidden, kind):
    llm = make_llm(model_dir, runner="pooling", max_num_batched_tokens=16, max_model_len=64)
    # The checkpoint's own LM head is neither read nor held: the head shares the embedding's weight.
    model = llm.engine.executor.worker.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompts = [PROMPT_IDS, SHORT_IDS, PROMPT_IDS[5:30]]
    for normalize in (True, False):
        outs = llm.embed(prompts, PoolingParams(kind, normalize=normalize))
        for ids, out in zip(prompts, outs):
            assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
            assert close(out.embedding, reference(hf_hidden(ids), kind, normalize)), (kind, normalize, len(ids))


def test_last_token_pooling_takes_prefix_cache_hits_mean_does_not(model_dir, make_llm, hf_hidden):
    llm = make_llm(model_dir, runner="pooling", block_size=8)
    first, again = llm.embed(PROMPT_IDS), llm.embed(PROMPT_IDS)
    assert again[0].num_cached_tokens >= 32  # whole blocks of the 40 tokens came from the cache
    assert close(again[0].embedding, reference(hf_hidden(PROMPT_IDS), "last"))
    assert close(first[0].embedding, torch.tensor(again[0].embedding))
    mean = llm.embed(PROMPT_IDS, PoolingParams("mean"))
    assert mean[0].num_cached_tokens == 0  # every position must be computed to enter the mean
    assert close(mean[0].embedding, reference(hf_hidden(PROMPT_IDS), "mean"))


def test_a_recomputed_chunk_pools_only_positions_not_yet_pooled():
    """A prompt preempted with 10 positions in its mean recomputes from
    position 0: the step pools only positions 10.., and the chunk that ends
    the prompt completes the vector."""
    from fluidserve.engine.batch import ModelInput
    from fluidserve.engine.engine import LLMEngine
    from fluidserve.engine.request import Request
    from fluidserve.scheduler.request_state import RequestClass

    req = Request("r", None, PROMPT_IDS, SamplingParams(pooling=PoolingParams("mean")), RequestClass.ONLINE, 0.0, 1)
    req.pool_count = 10
    inp = ModelInput()
    LLMEngine._pool_rows(req, 0, 16, 5, inp)  # recompute chunk [0, 16) at flat index 5
    LLMEngine._pool_rows(req, 0, 8, 0, inp)  # a chunk wholly pooled before: no rows
    LLMEngine._pool_rows(req, 16, 40, 2, inp)  # the prompt's last chunk
    assert [(s.first_index, s.count, s.final) for s in inp.pooling] == [(15, 6, False), (2, 24, True)]


def test_llm_score_pairs_the_sides_by_cosine(model_dir, make_llm, hf_hidden):
    """vLLM's ``LLM.score``: 1:N scores the one text against each of the
    others, N:N pairwise, each the cosine of HF's vectors; other shapes are refused."""
    llm = make_llm(model_dir, runner="pooling", max_model_len=64)
    docs = [SHORT_IDS, PROMPT_IDS[5:30], PROMPT_IDS]

    def cos(a: list[int], b: list[int]) -> float:
        u, v = reference(hf_hidden(a), "last"), reference(hf_hidden(b), "last")
        return torch.nn.functional.cosine_similarity(u, v, dim=0).item()

    outs = llm.score(PROMPT_IDS, docs)
    assert [round(o.outputs.score - cos(PROMPT_IDS, d), 5) for o, d in zip(outs, docs)] == [0.0] * 3
    assert outs[0].prompt_token_ids == PROMPT_IDS + SHORT_IDS
    firsts = [SHORT_IDS, PROMPT_IDS, SHORT_IDS]
    outs = llm.score(firsts, docs)
    assert [round(o.outputs.score - cos(a, b), 5) for o, a, b in zip(outs, firsts, docs)] == [0.0] * 3
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score([SHORT_IDS, SHORT_IDS], docs)


def test_pool_range_skips_positions_already_pooled():
    mean, last, cls = PoolingParams("mean"), PoolingParams("last"), PoolingParams("cls")
    assert pool_range(mean, 0, 16, 40, 0) == (0, 16)
    assert pool_range(mean, 0, 16, 40, 10) == (10, 16)  # a recompute of [0, 16) after 10 were pooled
    assert pool_range(mean, 0, 8, 40, 10) == (10, 10)  # nothing new
    assert pool_range(last, 16, 32, 40, 0) == (32, 32) and pool_range(last, 32, 40, 40, 0) == (39, 40)
    assert pool_range(cls, 0, 16, 40, 0) == (0, 1) and pool_range(cls, 0, 16, 40, 1) == (16, 16)


def test_finish_keeps_the_first_dimensions_then_normalizes():
    vec = finish(PoolingParams("mean", normalize=True, dimensions=2), [6.0, 8.0, 100.0], 2)
    assert vec == pytest.approx([0.6, 0.8])
    assert finish(PoolingParams("mean", normalize=False), [6.0, 8.0], 2) == [3.0, 4.0]
    assert finish(PoolingParams("last", normalize=True), [0.0, 0.0], 1) == [0.0, 0.0]  # no division by zero


def test_dimensions_only_on_a_matryoshka_model(tmp_path, make_llm, hf_hidden):
    plain = build_tiny_model(tmp_path / "plain", "llama")
    llm = make_llm(str(plain), runner="pooling")
    with pytest.raises(ValueError, match="^dimensions: the model does not support Matryoshka"):
        llm.embed(SHORT_IDS, PoolingParams(dimensions=8))
    cut = build_tiny_model(tmp_path / "cut", "llama", matryoshka_dimensions=[8, 16])
    llm = make_llm(str(cut), runner="pooling")
    (out,) = llm.embed(SHORT_IDS, PoolingParams(dimensions=8))
    full = transformers.AutoModel.from_pretrained(cut).eval()
    with torch.no_grad():
        hidden = full(torch.tensor([SHORT_IDS])).last_hidden_state[0, -1, :8].float()
    assert len(out.embedding) == 8 and close(out.embedding, torch.nn.functional.normalize(hidden, dim=0))
    with pytest.raises(ValueError, match=r"^dimensions: the model supports only \[8, 16\], got 12"):
        llm.embed(SHORT_IDS, PoolingParams(dimensions=12))


def test_one_runner_per_engine(model_dir, make_llm):
    gen = make_llm(model_dir)
    with pytest.raises(ValueError, match="embeddings need --runner pooling"):
        gen.embed(SHORT_IDS)
    pool = make_llm(model_dir, runner="pooling")
    with pytest.raises(ValueError, match=r"serves embeddings \(--runner pooling\), not generation"):
        pool.generate(SHORT_IDS, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^input: 65 tokens exceed max_model_len=64"):
        make_llm(model_dir, runner="pooling", max_model_len=64).embed([70] * 65)
    with pytest.raises(ValueError, match="^n does not apply to an embedding request"):
        SamplingParams(n=2, pooling=PoolingParams())


def test_a_base_model_checkpoint_serves_embeddings(tmp_path, model_dir, make_llm, hf_hidden):
    """A checkpoint of ``LlamaModel`` alone (how sentence-transformers saves
    a decoder embedder: no LM head, no ``model.`` prefix) loads as an
    embedding model without --runner, with its declared mean pooling."""
    base = tmp_path / "base"
    transformers.AutoModel.from_pretrained(model_dir).save_pretrained(base)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(base)
    (base / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (base / "1_Pooling").mkdir()
    (base / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert json.loads((base / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = make_llm(str(base))
    assert llm.engine.runner == "pooling" and llm.engine.pooling.pooling_type == "mean"
    (out,) = llm.embed(PROMPT_IDS)
    assert close(out.embedding, reference(hf_hidden(PROMPT_IDS), "mean"))


def test_pooler_config_overrides_the_checkpoint(model_dir, make_llm, hf_hidden):
    llm = make_llm(model_dir, runner="pooling", pooler_config='{"pooling_type": "MEAN", "use_activation": false}')
    (out,) = llm.embed(SHORT_IDS)
    assert close(out.embedding, reference(hf_hidden(SHORT_IDS), "mean", normalize=False))
    for bad, message in (('{"normalize": true}', "normalize is vLLM's removed key; use use_activation"),
                         ('{"pooling_type": "ALL"}', "pooling_type 'ALL' is not served"),
                         ('{"max_embed_len": 4}', "max_embed_len is not supported"),
                         ("[1]", "not a JSON object")):
        with pytest.raises(ValueError, match=f"^pooler_config: {message}"):
            model_pooling(model_dir, bad)


def test_an_embedding_crosses_from_a_replica_whole():
    """Data parallelism: a replica's finished output crosses to the front
    (engine/output_wire.py) with its vector."""
    from fluidserve.engine.output_wire import OutputSender, rebuild
    from fluidserve.engine.outputs import CompletionOutput, RequestOutput

    out = RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, finish_reason="stop")], True,
                        embedding=[0.6, 0.8])
    (tail,) = OutputSender().wire([out])
    assert rebuild(None, tail).embedding == [0.6, 0.8]


def test_an_adapter_embeds_as_peft_computes(model_dir, make_llm, tmp_path):
    """A LoRA adapter's request pools the adapted model's hidden states:
    PEFT's ``last_hidden_state`` with the adapter, not the base model's."""
    from peft import PeftModel

    from fluidserve.engine.lora import LoRARequest
    from lora_utils import make_adapter

    adapter = make_adapter(model_dir, tmp_path / "a1", seed=1)
    peft = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    with torch.no_grad():
        # The adapted LlamaModel inside PEFT's wrapper: its final, normed hidden states.
        hidden = peft.base_model.model.model(input_ids=torch.tensor([PROMPT_IDS])).last_hidden_state[0]
    llm = make_llm(model_dir, runner="pooling", enable_lora=True, max_lora_rank=8)
    (out,) = llm.embed(PROMPT_IDS, lora_request=LoRARequest("a1", 1, adapter))
    (base,) = llm.embed(PROMPT_IDS)
    want = reference(hidden.float(), "last")
    assert close(out.embedding, want) and not close(base.embedding, want)
