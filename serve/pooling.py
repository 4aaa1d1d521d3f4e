"""vLLM's generic pooling endpoint, ``POST /pooling``, on a pooling server:
the model's pooled output for each input (or conversation), whatever the
model pools.

Owns the request's ``task`` and the reply. An embedding model pools
``embed`` (each input's vector, as ``/v1/embeddings`` gives it, ``dimensions``
and ``use_activation`` included), a sequence classifier ``classify`` (each
input's label probabilities, as ``/classify`` gives them); a ``task`` the
model does not run (per-token pooling among them) is a 400 naming it. The
body is an embeddings body's (serve/embeddings.py); the vectors go as JSON
floats or as base64 of their bytes in ``embed_dtype``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.embeddings import EmbeddingRequest, PoolingUsage, pooled_route
from fluidserve.serve.errors import APIError
from fluidserve.serve.inputs import EngineInputs
from fluidserve.serve.protocol import _Wire

# vLLM's pooling tasks; a model here runs one of the first two.
Task = Literal["embed", "classify", "token_embed", "token_classify", "score", "plugin"]


class PoolingRequest(EmbeddingRequest):
    task: Task | None = None  # None: the model's own (embed, or classify for a classifier)


class PoolingData(_Wire):
    index: int
    object: str = "pooling"
    data: list[float] | str


class PoolingResponse(_Wire):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


def model_task(server: Any) -> str:
    """What the served model pools: ``classify`` for a classifier, else ``embed``."""
    return "classify" if server.model.labels else "embed"


def pooling_inputs(server: Any, req: PoolingRequest) -> EngineInputs:
    """The request's prompts, pooled as the model pools them; a 400 naming
    ``task`` (or ``dimensions``, for a classifier) otherwise."""
    task = model_task(server)
    if req.task is not None and req.task != task:
        raise APIError(400, f"task {req.task!r} is not served: this model pools {task!r}", param="task")
    if task == "embed":
        return server.processor.embedding(req)
    if req.dimensions is not None:
        raise APIError(400, "dimensions: a classifier's outputs are its labels; only an embedding model takes "
                       "dimensions", param="dimensions")
    return server.processor.classification(req)


def pooling_body(server: Any, rid: str, req: PoolingRequest, inputs: EngineInputs,
                 finals: list[RequestOutput]) -> PoolingResponse:
    data = [PoolingData(index=i, data=req.wire(out.embedding)) for i, out in enumerate(finals)]
    return PoolingResponse(id=rid, model=server.model.reply_name(req.model), data=data,
                           usage=PoolingUsage.of(inputs))


async def pooling(server: Any, request: Request) -> JSONResponse:
    """``POST /pooling``: every input's pooled output, in input order."""
    return await pooled_route(server, request, PoolingRequest, "pool",
                              lambda req: (pooling_inputs(server, req), partial(pooling_body, server)))


def pooling_routes(server: Any) -> dict[str, Callable]:
    """``"METHOD /path" -> handler`` for the server's route table."""

    async def route(request: Request) -> JSONResponse:
        return await pooling(server, request)

    return {"POST /pooling": route}
