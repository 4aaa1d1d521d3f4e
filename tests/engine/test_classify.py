"""Sequence classifiers (``...ForSequenceClassification``: reward models,
sentiment classifiers, decoder rerankers) against Hugging Face
``transformers``: ``LLM.classify`` gives the label probabilities HF's
``AutoModelForSequenceClassification`` computes for the same tiny
random-weight checkpoint (1e-5, fp32 on CPU), across chunked prompts; a
one-label classifier scores text pairs as a cross-encoder; the activation
follows the model's config as vLLM reads it."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from fluidserve.engine import PoolingParams
from fluidserve.engine.pooling import pair_ids
from fluidserve.engine.tiny_model import build_tiny_classifier

TOL = 1e-5
TEXTS = ["The quick brown fox jumps over the lazy dog, then naps.", "Hello!", "bad"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> str:
    return str(build_tiny_classifier(tmp_path_factory.mktemp("classifier"), "llama", labels=("neg", "neu", "pos")))


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> str:
    return str(build_tiny_classifier(tmp_path_factory.mktemp("reranker"), "qwen3", labels=("relevant",)))


def hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def close(got: list[float], want: torch.Tensor) -> bool:
    return (torch.tensor(got) - want).abs().max().item() < TOL


def test_classify_matches_transformers_across_chunks(classifier_dir, make_llm):
    # A 16-token step budget: the long text runs in four chunks.
    llm = make_llm(classifier_dir, max_num_batched_tokens=16, max_model_len=64)
    assert llm.engine.runner == "pooling" and llm.engine.classifier.labels == ("neg", "neu", "pos")
    outs = llm.classify(TEXTS)
    for text, out in zip(TEXTS, outs):
        logits = hf_logits(classifier_dir, list(llm.tokenizer.encode(text)))
        assert close(out.outputs.probs, torch.softmax(logits, -1)), text
    raw = llm.embed(TEXTS[:1], PoolingParams(normalize=False))  # use_activation false: the logits
    assert close(raw[0].embedding, hf_logits(classifier_dir, list(llm.tokenizer.encode(TEXTS[0]))))
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[:1], PoolingParams(dimensions=2))


def test_a_one_label_classifier_scores_pairs_as_a_cross_encoder(reranker_dir, make_llm):
    """vLLM's cross-encoder scoring: each pair one prompt, tokenized as a
    pair, its score the sigmoid of the one logit; 1:N and N:N."""
    llm = make_llm(reranker_dir, max_model_len=128)
    tok = llm.tokenizer
    query, docs = "Where do foxes live?", ["Foxes live in dens.", "Stocks fell.", "A fox naps."]

    def want(a: str, b: str) -> float:
        return torch.sigmoid(hf_logits(reranker_dir, pair_ids(tok, a, b, True))).item()

    outs = llm.score(query, docs)
    assert [abs(o.outputs.score - want(query, d)) < TOL for o, d in zip(outs, docs)] == [True] * 3
    assert outs[1].prompt_token_ids == list(tok(text=query, text_pair=docs[1])["input_ids"])
    firsts = ["Dens?", query, "Markets?"]
    outs = llm.score(firsts, docs)
    assert [abs(o.outputs.score - want(a, b)) < TOL for o, a, b in zip(outs, firsts, docs)] == [True] * 3


def test_a_pair_is_tokenized_as_a_pair_unless_the_config_joins_the_texts(classifier_dir):
    """vLLM's two readings: a cross-encoder's tokenizer puts its own
    separators between the texts; an LLM as reranker (``use_sep_token``
    false) reads the two texts joined."""
    from tokenizers.processors import TemplateProcessing

    tok = transformers.AutoTokenizer.from_pretrained(classifier_dir)
    eos = tok.convert_tokens_to_ids("<|eos|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A <|eos|> $B",
                                                              special_tokens=[("<|eos|>", eos)])
    assert pair_ids(tok, "ab", "cd", True) == [*tok.encode("ab"), eos, *tok.encode("cd")]
    assert pair_ids(tok, "ab", "cd", False) == tok.encode("abcd")


RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["n", "y"],
                      "is_original_qwen3_reranker": True}
SCORE_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<answer>"


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_a_causal_lm_reranker_scores_from_its_lm_head(tiny_model, make_llm, tied):
    """vLLM's recipe for Qwen3-Reranker: ``hf_overrides`` make a causal LM
    a classifier whose one label is the LM head's "yes" row less its "no"
    row, and a score template renders each pair. Its score is HF's
    ``softmax([logit_no, logit_yes])[yes]`` at the last position of the
    rendered pair (1e-5), and the LM head's other rows are never read (a
    tied head's are the embedding's)."""
    path = tiny_model("qwen3", tie_word_embeddings=tied)
    llm = make_llm(path, hf_overrides=json.dumps(RERANKER_OVERRIDES), max_model_len=128)
    assert llm.engine.runner == "pooling" and len(llm.engine.classifier.labels) == 1
    tok = llm.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    no, yes = tok.convert_tokens_to_ids("n"), tok.convert_tokens_to_ids("y")
    query, docs = "Where do foxes live?", ["Foxes live in dens.", "Stocks fell."]
    for template in (None, SCORE_TEMPLATE):
        outs = llm.score(query, docs, chat_template=template)
        for out, doc in zip(outs, docs):
            ids = pair_ids(tok, query, doc, True, template)
            assert out.prompt_token_ids == ids
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0, -1].float()
            assert abs(out.outputs.score - torch.softmax(logits[[no, yes]], -1)[1].item()) < TOL
    assert pair_ids(tok, query, docs[0], True, SCORE_TEMPLATE) == tok.encode(
        f"<query>{query}<document>{docs[0]}<answer>")
    with pytest.raises(ValueError, match="not a token"):
        make_llm(path, hf_overrides=json.dumps({**RERANKER_OVERRIDES, "classifier_from_token": ["nope", "y"]}))


@pytest.mark.parametrize("config,want", [
    ({"problem_type": "regression"}, "identity"),
    ({"problem_type": "multi_label_classification"}, "sigmoid"),
    ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "identity"),
    ({}, "softmax"),
])
def test_the_activation_is_read_from_the_config(classifier_dir, tmp_path, make_llm, config, want):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(classifier_dir, path)
    given = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**given, **config}))
    llm = make_llm(str(path), max_model_len=64)
    assert llm.engine.classifier.activation == want
    logits = hf_logits(classifier_dir, list(llm.tokenizer.encode(TEXTS[1])))
    expect = {"identity": logits, "sigmoid": torch.sigmoid(logits), "softmax": torch.softmax(logits, -1)}[want]
    assert close(llm.classify(TEXTS[1])[0].outputs.probs, expect)


def test_a_classifier_is_refused_as_a_generator_or_an_embedder(classifier_dir, tmp_path, make_llm):
    with pytest.raises(ValueError, match="is a classifier"):
        make_llm(classifier_dir, runner="generate")
    with pytest.raises(ValueError, match="task 'embed' is not this model's"):
        make_llm(classifier_dir, pooler_config='{"task": "embed"}')
    with pytest.raises(ValueError, match="only with one label"):
        make_llm(classifier_dir, max_model_len=64).score("a", "b")
