"""vLLM's score and rerank endpoints on an embedding model (``--runner
pooling``): ``POST /score`` (and ``/v1/score``) scores text pairs,
``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``: Jina's and Cohere's
shape) orders documents by their relevance to a query.

Owns the two request bodies, which texts become engine requests, and the
replies. The sides pair 1:1, 1:N or N:N. On an embedding model each text is
embedded once, as ``/v1/embeddings`` would embed it (a query scored against
N documents is N + 1 engine requests, not 2N), and a pair's score is the
cosine of the two vectors (``engine/pooling.py``): vLLM's bi-encoder
scoring. On a classifier of one label (a cross-encoder: a reward model, a
decoder reranker) each pair is one prompt, tokenized as a pair, and its
score is the classifier's output for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Annotated, Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictStr, model_validator

from fluidserve.engine.outputs import RequestOutput
from fluidserve.engine.pooling import cosine, pair_ids, score_pairs
from fluidserve.engine.sampling_params import PoolingParams
from fluidserve.serve.embeddings import PoolingFields, PoolingUsage, pooled_route
from fluidserve.serve.errors import bad_request
from fluidserve.serve.inputs import EngineInputs
from fluidserve.serve.protocol import _off, _Wire

# A text, or vLLM's multimodal ``{"content": [...]}`` (refused by name: the
# served models read text only).
ScoreInput = StrictStr | dict[str, Any]

# vLLM's scoring fields we do not implement -> which values mean "off". The
# instruction and template kwargs reach a cross-encoder's template only.
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "padding": _off("do_not_pad"),
    "mm_processor_kwargs": _off(),
    "instruction": _off(),
    "chat_template_kwargs": _off(),
}

# The field pairs a score body may name, in vLLM's order of preference.
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def _texts(given: ScoreInput | list[ScoreInput], name: str) -> list[str]:
    texts = given if isinstance(given, list) else [given]
    for t in texts:
        if not isinstance(t, str):
            raise ValueError(f"{name}: multimodal content is not supported: the served model reads text only")
    return texts


class _ScoringFields(PoolingFields):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED
    # Each side cut to its first N tokens before embedding (0: not cut).
    max_tokens_per_query: Annotated[int, Field(ge=0)] = 0
    max_tokens_per_doc: Annotated[int, Field(ge=0)] = 0


class ScoreRequest(_ScoringFields):
    """A score body names one pair of sides: ``queries`` with ``documents``
    (or ``items``), ``data_1`` with ``data_2``, or ``text_1`` with ``text_2``."""

    queries: ScoreInput | list[ScoreInput] | None = None
    documents: ScoreInput | list[ScoreInput] | None = None
    items: ScoreInput | list[ScoreInput] | None = None
    data_1: ScoreInput | list[ScoreInput] | None = None
    data_2: ScoreInput | list[ScoreInput] | None = None
    text_1: ScoreInput | list[ScoreInput] | None = None
    text_2: ScoreInput | list[ScoreInput] | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> "ScoreRequest":
        given = [n for pair in _SCORE_SIDES for n in pair if getattr(self, n) is not None]
        pair = next((p for p in _SCORE_SIDES if set(given) == set(p)), None)
        if pair is None:
            first = next((p for p in _SCORE_SIDES if p[0] in given), _SCORE_SIDES[-1])
            missing = next((n for n in first if n not in given), None)
            if missing is not None:
                raise ValueError(f"{missing}: is required with {first[1 - first.index(missing)]}")
            extra = next(n for n in given if n not in first)
            raise ValueError(f"{extra}: give one pair of sides (queries and documents, queries and items, "
                             "data_1 and data_2, or text_1 and text_2), not more")
        one, two = (_texts(getattr(self, n), n) for n in pair)
        for name, side in zip(pair, (one, two)):
            if not side:
                raise ValueError(f"{name}: must not be empty")
        if len(one) > 1 and len(one) != len(two):
            raise ValueError(f"{pair[1]}: the two sides must be 1:1, 1:N or N:N, got {len(one)}:{len(two)}")
        return self

    def sides(self) -> tuple[tuple[str, str], list[str], list[str]]:
        """The pair of fields given, and the texts of each side."""
        pair = next(p for p in _SCORE_SIDES if getattr(self, p[0]) is not None and getattr(self, p[1]) is not None)
        return pair, _texts(getattr(self, pair[0]), pair[0]), _texts(getattr(self, pair[1]), pair[1])


class RerankRequest(_ScoringFields):
    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: Annotated[int, Field(ge=0)] = 0  # 0: every document

    @model_validator(mode="after")
    def _check_texts(self) -> "RerankRequest":
        _texts(self.query, "query")
        if not _texts(self.documents, "documents"):
            raise ValueError("documents: must not be empty")
        return self

    def sides(self) -> tuple[tuple[str, str], list[str], list[str]]:
        return ("query", "documents"), _texts(self.query, "query"), _texts(self.documents, "documents")


class ScoreData(_Wire):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_Wire):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(_Wire):
    text: str


class RerankResult(_Wire):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(_Wire):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Wire):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def scoring_inputs(server: Any, req: ScoreRequest | RerankRequest) -> tuple[EngineInputs, int]:
    """The engine inputs of a scoring body and how many of them are side
    1's texts, which come first (0: each prompt is a pair, a cross-encoder's)."""
    model = server.model
    limit = model.max_model_len
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        if getattr(req, name) >= limit:
            raise bad_request(f"{name} ({getattr(req, name)}) must be less than max_model_len ({limit})", name)
    (name_1, name_2), one, two = req.sides()
    processor = server.processor
    one = [processor.cut_text(t, req.max_tokens_per_query) if req.max_tokens_per_query else t for t in one]
    two = [processor.cut_text(t, req.max_tokens_per_doc) if req.max_tokens_per_doc else t for t in two]
    pooling = PoolingParams(normalize=req.use_activation)
    if model.labels:
        if len(model.labels) != 1:
            raise bad_request(f"model: {model.name} is a classifier of {len(model.labels)} labels; a score needs "
                              "one (a cross-encoder): use /classify", "model")
        tok = processor.tokenizer
        prompts = [processor.pooled_prompt(pair_ids(tok, one[i], two[j], model.use_sep_token, model.score_template),
                                           True, req.truncate_prompt_tokens, req.truncation_side, name_2)
                   for i, j in score_pairs(len(one), len(two))]
        return processor.pooling_inputs(prompts, req, pooling), 0
    prompts = [processor.pooled_prompt(text, True, req.truncate_prompt_tokens, req.truncation_side, name)
               for name, texts in ((name_1, one), (name_2, two)) for text in texts]
    return processor.pooling_inputs(prompts, req, pooling), len(one)


def pair_scores(finals: list[RequestOutput], num_1: int) -> list[float]:
    """Each pair's score, in side 2's order: the cosine of its two vectors,
    or (``num_1`` 0) the cross-encoder's output for the pair."""
    if num_1 == 0:
        return [out.embedding[0] for out in finals]
    vectors = [out.embedding for out in finals]
    return [cosine(vectors[i], vectors[num_1 + j]) for i, j in score_pairs(num_1, len(vectors) - num_1)]


def scoring_body(server: Any, num_1: int, rid: str, req: ScoreRequest | RerankRequest, inputs: EngineInputs,
                 finals: list[RequestOutput]) -> ScoreResponse | RerankResponse:
    """The reply to ``req`` from its requests' finished outputs, side 1's
    ``num_1`` first (the online routes', and a Batch API line's)."""
    scores = pair_scores(finals, num_1)
    model = server.model.reply_name(req.model)
    if isinstance(req, ScoreRequest):
        return ScoreResponse(id=rid, model=model, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=PoolingUsage.of(inputs))
    documents = req.sides()[2]
    results = sorted((RerankResult(index=i, document=RerankDocument(text=documents[i]), relevance_score=s)
                      for i, s in enumerate(scores)), key=lambda r: -r.relevance_score)
    return RerankResponse(id=rid, model=model, results=results[:req.top_n or len(results)],
                          usage=RerankUsage(**PoolingUsage.of(inputs).model_dump(exclude={"completion_tokens"})))


async def scoring(server: Any, request: Request, kind: type[ScoreRequest] | type[RerankRequest]) -> JSONResponse:
    """``POST /score`` or ``/rerank``: run each text (or pair) once, then score."""

    def plan(req: ScoreRequest | RerankRequest) -> tuple[EngineInputs, Callable[..., _Wire]]:
        inputs, num_1 = scoring_inputs(server, req)
        return inputs, partial(scoring_body, server, num_1)

    return await pooled_route(server, request, kind, "score", plan)


def scoring_routes(server: Any) -> dict[str, Callable]:
    """``"METHOD /path" -> handler`` for the server's route table: vLLM's
    paths, the ``/v1`` ones kept as aliases as vLLM keeps them."""

    async def score(request: Request) -> JSONResponse:
        return await scoring(server, request, ScoreRequest)

    async def rerank(request: Request) -> JSONResponse:
        return await scoring(server, request, RerankRequest)

    return {"POST /score": score, "POST /v1/score": score,
            **{f"POST {path}": rerank for path in ("/rerank", "/v1/rerank", "/v2/rerank")}}
