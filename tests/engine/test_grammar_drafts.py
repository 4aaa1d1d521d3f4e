"""The engine's grammar-shaped drafts (engine/grammar_drafts.py) on the
byte tokenizer: n-gram drafts cut at the first token the grammar refuses,
the grammar's forced text as the draft where none is left, the matcher fed
the engine's outputs as they grow, a grammar that waits for a reasoning's
end, and outputs the grammar refused (no grammar drafts then)."""

from __future__ import annotations

import pytest

from fluidserve.engine.sampling_params import SamplingParams, StructuredOutputs

pytest.importorskip("xgrammar")

EOS = 257  # the byte tokenizer's end of sequence
END = 300  # a reasoning's end marker in these tests (any id the grammar never reads)


def ids(text: str) -> list[int]:
    return list(text.encode())


@pytest.fixture
def drafts():
    from fluidserve.engine.grammar_drafts import GrammarDrafts
    from fluidserve.engine.loader import load_tokenizer
    from fluidserve.engine.structured import GrammarCompiler
    from fluidserve.engine.tiny_model import default_tiny_model_dir

    tokenizer = load_tokenizer(default_tiny_model_dir())
    compiler = GrammarCompiler(tokenizer, 261, [EOS])
    return GrammarDrafts(tokenizer, lambda: compiler)


def params(regex: str, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex=regex), **kw)


def test_ngram_drafts_are_cut_where_the_grammar_refuses(drafts):
    p = params("(abc)+x")
    assert drafts.propose("s", p, ids("ab"), ids("cabd"), 4) == ids("cab")
    assert drafts.propose("s", p, ids("abca"), ids("bcx") + [EOS], 4) == ids("bcx") + [EOS]  # through the end
    assert drafts.cut == 1
    assert drafts.propose("s", p, ids("abcab"), ids("cab"), 4) == ids("cab")  # the matcher took the new outputs


def test_where_no_ngram_draft_stands_the_grammar_forces_the_draft(drafts):
    p = params('\\{"key": "[a-z]+", "n": [0-9]\\}')
    assert drafts.propose("s", p, [], [], 4) == ids('{"ke')  # at most the step's limit
    assert drafts.propose("s", p, ids('{"ke'), ids("zz"), 8) == ids('y": "')  # "zz" refused, then forced
    assert drafts.propose("s", p, ids('{"key": "ab'), [], 8) == []  # a free choice: nothing forced
    assert drafts.propose("s", p, ids('{"key": "ab"'), [], 8) == ids(', "n": ')
    assert drafts.forced == 4 + 5 + 7


def test_a_grammar_after_a_reasoning_shapes_drafts_once_it_starts(drafts):
    p = params("(ab)+x", structured_after_token_id=END)
    assert drafts.propose("s", p, ids("zz"), ids("zzq"), 4) == ids("zzq")  # thinking: the n-gram drafts go
    assert drafts.propose("s", p, ids("zz") + [END] + ids("a"), ids("bq"), 4) == ids("b")


def test_outputs_the_grammar_refused_leave_the_drafts_alone(drafts):
    p = params("(ab)+x")
    assert drafts.propose("s", p, ids("aq"), ids("zz"), 4) == ids("zz")
    drafts.release("s")
    assert drafts.propose("s", p, ids("a"), ids("bz"), 4) == ids("b")  # released: a new matcher
