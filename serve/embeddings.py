"""OpenAI's embeddings endpoint, ``POST /v1/embeddings``, on a server whose
model runs as an embedding model (``--runner pooling``, engine/pooling.py).

Owns the request body (OpenAI's fields and vLLM's extras, among them the
chat form: ``messages``, one conversation or a list, each rendered through
the chat template), the input's prompts (one engine request each, admitted
all or none), and the reply:
each vector as JSON floats or as base64 of its little-endian bytes in
``embed_dtype`` (the OpenAI SDK's default asks for base64 float32).
"""

from __future__ import annotations

import base64
import time
from functools import partial
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictStr, model_validator

from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.inputs import EngineInputs, check_model
from fluidserve.serve.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatMessage,
    TokenIds,
    _check_template_flags,
    _off,
    _Request,
    _Wire,
    prompt_list,
)

# vLLM's embedding fields we do not implement -> which values mean "off".
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "padding": _off("do_not_pad"),
    "mm_processor_kwargs": _off(),
    "media_io_kwargs": _off(),
}


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


class PoolingFields(_Request):
    """What every pooling body (embeddings, classify, score, rerank) takes
    beside its texts: how they are cut, scheduled and cached (vLLM's)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] = "right"
    # false: an embedding as pooled, not scaled to unit length; a classifier's logits.
    use_activation: bool | None = None
    request_id: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    cache_salt: Annotated[str, Field(min_length=1)] | None = None


class PooledRequest(PoolingFields):
    """What an embeddings and a classify body share: the prompts (``input``,
    or the chat form)."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = _REFUSED
    # A string, a list of strings, a list of token ids, or a list of those.
    input: StrictStr | TokenIds | list[StrictStr] | list[TokenIds] | None = None
    # vLLM's chat form: one conversation, or a list of them, each rendered
    # through the chat template and embedded as one prompt.
    messages: (Annotated[list[ChatMessage], Field(min_length=1)]
               | Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]], Field(min_length=1)]
               | None) = None
    # None: true for ``input``, false for ``messages`` (the template writes its own).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The conversation's own Jinja template, with --trust-request-chat-template (as on the chat route).
    chat_template: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _chat_input(cls, data: Any) -> Any:
        # vLLM also takes a conversation (or a list of them) in ``input``.
        if isinstance(data, dict) and "messages" not in data:
            given = data.get("input")
            if _is_conversation(given) or (isinstance(given, list) and given
                                           and all(_is_conversation(c) for c in given)):
                data = {k: v for k, v in data.items() if k != "input"} | {"messages": given}
        return data

    @model_validator(mode="after")
    def _check_input(self) -> "PooledRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError("messages: give input or messages, not both" if self.messages is not None
                             else "input: is required (or messages, the chat form)")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input: must not be empty")
        if self.messages is None:
            for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template"):
                if getattr(self, name):
                    raise ValueError(f"{name}: applies to the chat form (messages) only")
        _check_template_flags(self)
        return self

    def inputs(self) -> list[str | list[int]]:
        """The input as a list of prompts, each a string or token ids."""
        return prompt_list(self.input)

    def conversations(self) -> list[list[ChatMessage]]:
        """``messages`` as a list of conversations, each one prompt."""
        given = self.messages or []
        return [given] if isinstance(given[0], ChatMessage) else list(given)


class EmbeddingRequest(PooledRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"

    def wire(self, vector: list[float]) -> list[float] | str:
        """A pooled vector as this request asks for it: floats, or base64."""
        return vector if self.encoding_format == "float" else encode(vector, self.embed_dtype, self.endianness)


class EmbeddingData(_Wire):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class PoolingUsage(_Wire):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0  # vLLM's usage carries it

    @classmethod
    def of(cls, inputs: EngineInputs) -> "PoolingUsage":
        """Every prompt's tokens: a pooling request generates none."""
        tokens = sum(len(p.token_ids) for p in inputs.prompts)
        return cls(prompt_tokens=tokens, total_tokens=tokens)


class EmbeddingResponse(_Wire):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


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
    return await pooled_route(server, request, EmbeddingRequest, "embd",
                              lambda req: (server.processor.embedding(req), partial(embedding_body, server)))


async def pooled_route(server: Any, request: Request, kind: type[_Request], prefix: str,
                       plan: Callable[[Any], tuple[EngineInputs, Callable[..., _Wire]]]) -> JSONResponse:
    """A pooling route (embeddings, classify, score, rerank): the body of
    ``kind``, its engine inputs and renderer from ``plan``, every prompt
    admitted (all or none) and run, and the reply rendered from their
    finished outputs, in prompt order."""
    received = time.monotonic()
    req = await server.parse(request, kind)
    check_model(req.model, server.model)
    inputs, render = plan(req)
    server.admit_capacity(len(inputs.prompts))
    rid = f"{prefix}-{server.base_request_id(request, req.request_id)}"
    timers = [server.timer(inputs, received) for _ in inputs.prompts]
    streams = await server.submit(rid, inputs, received)
    finals = await server.until_disconnect(request, server.collect(streams, timers), streams)
    return JSONResponse(render(rid, req, inputs, finals).model_dump(mode="json"))


def embedding_body(server: Any, rid: str, req: EmbeddingRequest, inputs: EngineInputs,
                   finals: list[RequestOutput]) -> EmbeddingResponse:
    """The reply to ``req`` from its requests' finished outputs (the online
    route's, and a Batch API line's)."""
    data = [EmbeddingData(index=i, embedding=req.wire(out.embedding)) for i, out in enumerate(finals)]
    return EmbeddingResponse(id=rid, model=server.model.reply_name(req.model), data=data,
                             usage=PoolingUsage.of(inputs))
