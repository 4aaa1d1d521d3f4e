"""vLLM's classify endpoint, ``POST /classify``, on a sequence classifier
(a ``...ForSequenceClassification`` checkpoint: a reward model, a sentiment
or topic classifier, a decoder reranker).

Owns the reply: for each input (or conversation, the chat form; the body is
an embeddings body's prompts, ``serve/embeddings.py``), the probabilities
of every label, the most likely label's name and the label count. The
probabilities are the classifier's head over the pooled last hidden state,
through the model's activation (``engine/pooling.py``); ``use_activation:
false`` gives the logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.embeddings import PooledRequest, PoolingUsage, pooled_route
from fluidserve.serve.inputs import EngineInputs
from fluidserve.serve.protocol import _Wire


class ClassificationRequest(PooledRequest):
    pass


class ClassificationData(_Wire):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Wire):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


def classification_body(server: Any, rid: str, req: ClassificationRequest, inputs: EngineInputs,
                        finals: list[RequestOutput]) -> ClassificationResponse:
    labels = server.model.labels
    data = []
    for i, out in enumerate(finals):
        probs = out.embedding
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(index=i, label=labels[best], probs=probs, num_classes=len(probs)))
    return ClassificationResponse(id=rid, model=server.model.reply_name(req.model), data=data,
                                  usage=PoolingUsage.of(inputs))


async def classify(server: Any, request: Request) -> JSONResponse:
    """``POST /classify``: every input's label probabilities, in input order."""
    return await pooled_route(server, request, ClassificationRequest, "classify",
                              lambda req: (server.processor.classification(req), partial(classification_body, server)))


def classify_routes(server: Any) -> dict[str, Callable]:
    """``"METHOD /path" -> handler`` for the server's route table."""

    async def route(request: Request) -> JSONResponse:
        return await classify(server, request)

    return {"POST /classify": route}
