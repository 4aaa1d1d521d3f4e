"""OpenAI's embeddings endpoint, ``POST /v1/embeddings``, on a server whose
model runs as an embedding model (``--runner pooling``, engine/pooling.py).

Owns the request body (OpenAI's fields and vLLM's extras), the input's
prompts (one engine request each, admitted all or none), and the reply:
each vector as JSON floats or as base64 of its little-endian bytes in
``embed_dtype`` (the OpenAI SDK's default asks for base64 float32).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictStr, model_validator

from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.inputs import EngineInputs, check_model
from fluidserve.serve.protocol import INT64_MAX, INT64_MIN, TokenIds, _off, _Request, _Wire, prompt_list

# vLLM's embedding fields we do not implement -> which values mean "off".
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "messages": _off(),  # the chat form of the request
    "padding": _off("do_not_pad"),
    "mm_processor_kwargs": _off(),
    "chat_template": _off(),
    "chat_template_kwargs": _off(),
    "add_generation_prompt": _off(),
    "continue_final_message": _off(False),
}


class EmbeddingRequest(_Request):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED
    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of those.
    input: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "right"
    add_special_tokens: bool = True
    use_activation: bool | None = None  # false: the vector as pooled, not scaled to unit length
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"
    request_id: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _check_input(self) -> "EmbeddingRequest":
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: must not be empty")
        return self

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of prompts, each a string or token ids."""
        return prompt_list(self.input)


class EmbeddingData(_Wire):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(_Wire):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0  # vLLM's usage carries it


class EmbeddingResponse(_Wire):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


def encode(vector: list[float], dtype: str, endianness: str) -> str:
    """Base64 of the vector's bytes in ``dtype`` (bfloat16: the top half of
    each float32), in the byte order asked for."""
    import numpy as np

    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    if dtype == "bfloat16":
        # Round to nearest even, as torch's float32 -> bfloat16 cast does.
        bits = np.asarray(vector, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        raw = bits.astype(np.dtype(np.uint16).newbyteorder(order)).tobytes()
    else:
        raw = np.asarray(vector, dtype=np.dtype(dtype).newbyteorder(order)).tobytes()
    return base64.b64encode(raw).decode("ascii")


def embeddings_routes(server: Any) -> dict[str, Callable]:
    """``"METHOD /path" -> handler`` for the server's route table."""

    async def route(request: Request) -> JSONResponse:
        return await embeddings(server, request)

    return {"POST /v1/embeddings": route}


async def embeddings(server: Any, request: Request) -> JSONResponse:
    """``POST /v1/embeddings``: every input's vector, in input order."""
    received = time.monotonic()
    req = await server.parse(request, EmbeddingRequest)
    check_model(req.model, server.model)
    inputs = server.processor.embedding(req)
    server.admit_capacity(len(inputs.prompts))
    rid = f"embd-{server.base_request_id(request, req.request_id)}"
    timers = [server.timer(inputs, received) for _ in inputs.prompts]
    streams = await server.submit(rid, inputs, received)
    finals = await server.until_disconnect(request, server.collect(streams, timers), streams)
    return JSONResponse(embedding_body(server, rid, req, inputs, finals).model_dump(mode="json"))


def embedding_body(server: Any, rid: str, req: EmbeddingRequest, inputs: EngineInputs,
                   finals: list[RequestOutput]) -> EmbeddingResponse:
    """The reply to ``req`` from its requests' finished outputs (the online
    route's, and a Batch API line's)."""
    data = [EmbeddingData(index=i, embedding=out.embedding if req.encoding_format == "float"
                          else encode(out.embedding, req.embed_dtype, req.endianness))
            for i, out in enumerate(finals)]
    tokens = sum(len(p.token_ids) for p in inputs.prompts)
    return EmbeddingResponse(id=rid, model=server.model.reply_name(req.model), data=data,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
