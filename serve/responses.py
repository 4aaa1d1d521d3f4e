"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed as typed
events), ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items``, and conversations continued with
``previous_response_id``.

Owns turning a Responses body into a chat request, validated as a whole
``/v1/chat/completions`` body, so that every field means what it means on
the chat route (template, sampling, structured output and tools are that
route's); rendering the reply as a Response object and as the event stream
OpenAI's SDK reads; and the responses kept for ``previous_response_id``.

Kept responses are the last ``max_stored_responses`` used
(``--max-stored-responses``): in this process's memory, and with
``--data-dir`` in the Batch API's SQLite store too, written before the reply
goes out, so they outlive a restart. Each keeps only its own turn (its input
items and its reply) and the id of the one before: a conversation is read
back by walking that chain, so a long one costs memory once, not once per
turn.

With ``--reasoning-parser`` a thinking reply's reasoning is a ``reasoning``
output item (its text as ``reasoning_text`` content) before the message,
streamed with ``response.reasoning_text.delta`` events; reasoning input items
go back to the template with the assistant turn they led to.

``background: true`` is answered at once as ``queued`` and run here
(``BackgroundRuns``), read back with ``GET`` and stopped with ``POST
/v1/responses/{id}/cancel``; with ``--data-dir`` an accepted one survives a
restart.

What the chat route cannot do is refused with a 400 naming the field:
built-in tools (web search, file search, ...), image, file and audio
inputs, reasoning summaries and encrypted reasoning, streamed background
responses.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, AsyncIterator, Callable, ClassVar, Literal, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictStr, model_validator

from fluidserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from fluidserve.engine.outputs import CompletionOutput, RequestOutput
from fluidserve.serve.errors import CONTEXT_LENGTH_EXCEEDED, APIError, int_param, order_param, query_params
from fluidserve.serve.inputs import EngineInputs, check_model, log_request
from fluidserve.serve.protocol import REQUEST_BODIES, ChatCompletionRequest, FunctionName, Prob, _off, _Request
from fluidserve.serve.reasoning import ReasoningStream
from fluidserve.serve.render import chat_choices, chat_logprobs, finish_reason, reasoning_tokens
from fluidserve.serve.store import Store, StoreError
from fluidserve.serve.tool_parsers import CallStream, StreamPiece

logger = logging.getLogger(__name__)

MAX_METADATA_PAIRS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_REASONING = -2  # the reasoning item's key in a reply's order (-1: the message, i: calls[i])
_UNFINISHED = ("queued", "in_progress")  # a background response's statuses before its reply

# Fields of the chat route a Responses body may carry too (vLLM's sampling
# extensions, OpenAI's end-user identifiers): passed through as they are.
_PASSED_TO_CHAT = ("user", "safety_identifier", "prompt_cache_key", "seed", "top_k", "min_p",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "logit_bias", "priority", "chat_template_kwargs",
                   "skip_special_tokens", "bad_words", "allowed_token_ids", "request_id", "cache_salt")


class ReasoningOptions(_Request):
    """``reasoning``: ``effort`` is the chat route's ``reasoning_effort``;
    no summaries are written."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {"summary": _off(), "generate_summary": _off()}
    effort: Any = None  # checked by the chat route


class ResponseFormatText(_Request):
    """``text.format``: OpenAI's flat form of the chat route's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> "ResponseFormatText":
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("text.format: type json_schema needs a name and a schema")
        return self

    def as_chat(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class ResponseText(_Request):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {"verbosity": _off("medium")}
    format: ResponseFormatText | None = None


class FunctionTool(_Request):
    """A function tool, flat as the Responses API writes it."""

    type: StrictStr
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> "FunctionTool":
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported by this server "
                             "(function tools only)")
        if self.name is None:
            raise ValueError("a function tool needs a name")
        return self

    def as_chat(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters,
              "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class NamedFunction(_Request):
    type: Literal["function"]
    name: FunctionName


class ResponsesStreamOptions(_Request):
    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {"include_obfuscation": _off(False)}


class ResponsesRequest(_Request):
    """A ``POST /v1/responses`` body."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "max_tool_calls": _off(),
        "conversation": _off(),
        "prompt": _off(),  # stored prompt templates
        "service_tier": _off("auto", "default"),
        "context_management": _off(),
    }
    model: str | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Prob | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: list[StrictStr] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    text: ResponseText | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    reasoning: ReasoningOptions | None = None
    # Answered at once as "queued"; the reply is read with GET (BackgroundRuns).
    background: bool = False
    # "auto": the oldest turns of the conversation are dropped until the prompt fits.
    truncation: Literal["auto", "disabled"] | None = None
    # Passed to the chat route, which checks them (see _PASSED_TO_CHAT).
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    logit_bias: Any = None
    priority: Any = None
    chat_template_kwargs: Any = None
    skip_special_tokens: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    request_id: Any = None
    cache_salt: Any = None

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        for entry in self.include or []:
            if entry != LOGPROBS_INCLUDE:
                raise ValueError(f"include: {entry!r} is not supported by this server (only {LOGPROBS_INCLUDE!r})")
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_PAIRS:
            raise ValueError(f"metadata: at most {MAX_METADATA_PAIRS} pairs")
        if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in meta.items()):
            raise ValueError(f"metadata: keys of at most {MAX_METADATA_KEY} characters, values of at most "
                             f"{MAX_METADATA_VALUE}")
        if self.previous_response_id is not None and not self.previous_response_id:
            raise ValueError("previous_response_id: must not be empty")
        if self.background and not self.store:
            raise ValueError("store: a background response is read back with GET, so it must be stored")
        if self.background and self.stream:
            raise ValueError("stream: background responses are not streamed by this server (poll GET "
                             "/v1/responses/{id} until its status is final)")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None


REQUEST_BODIES["/v1/responses"] = (ResponsesRequest,)  # described in /openapi.json like the chat route's


# -- input items as chat messages ---------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"{where}.content[{j}]: parts of type {kind!r} are not supported by this server "
                             "(text parts only)")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}.content[{j}]: a text part needs its text")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input``: messages, and function calls
    with their outputs (consecutive calls are one assistant turn, as the
    model made them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    thought: tuple[str, str] | None = None  # a reasoning item's text, for the assistant turn it led to

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal thought
        if thought is not None:
            message["reasoning"], thought = thought[1], None
        return message

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if thought is not None and not (kind == "function_call" or (kind == "message"
                                                                     and item.get("role") == "assistant")):
            raise ValueError(f"{thought[0]}: a reasoning item must come just before the assistant message or "
                             "function call it led to")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: must be user, assistant, system or developer")
            message = {"role": role, "content": _text_of(item.get("content"), where)}
            messages.append(assistant(message) if role == "assistant" else message)
        elif kind == "reasoning":
            thought = (where, _reasoning_text(item, where))
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, arguments)):
                raise ValueError(f"{where}: a function_call needs call_id, name and arguments (strings)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if thought is None and last is not None and last["role"] == "assistant" and last.get("tool_calls") \
                    and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ValueError(f"{where}: a function_call_output needs the call_id it answers")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})
        else:
            raise ValueError(f"{where}.type: input items of type {kind!r} are not supported by this server "
                             "(message, reasoning, function_call and function_call_output)")
    if thought is not None:
        raise ValueError(f"{thought[0]}: a reasoning item must come just before the assistant message or "
                         "function call it led to")
    return messages


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its
    summary's text. Encrypted reasoning is another server's to read."""
    if item.get("encrypted_content") is not None:
        raise ValueError(f"{where}.encrypted_content: encrypted reasoning is not supported by this server")
    content, summary = item.get("content"), item.get("summary")
    parts, kind = (content, "reasoning_text") if content else (summary or [], "summary_text")
    if not isinstance(parts, list):
        raise ValueError(f"{where}: content and summary must be lists of parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: parts must be {kind} parts with their text")
        texts.append(part["text"])
    return "\n".join(texts)


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as OpenAI lists it back: each item whole, with an id."""
    if isinstance(items, str):
        items = [{"role": "user", "content": [{"type": "input_text", "text": items}]}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}.get(kind, "item")
        entry = {"id": _new_id(prefix), "type": kind, "status": "completed", **item}
        if kind == "message" and isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        listed.append(entry)
    return listed


# -- kept responses --------------------------------------------------------------------


@dataclass
class Stored:
    body: dict[str, Any]  # the Response object as returned
    turn: list[dict[str, Any]]  # this turn's chat messages: its input, then its reply
    previous: str | None
    items: list[dict[str, Any]] = field(default_factory=list)  # its input items, as GET .../input_items lists them


class ResponseStore:
    """The last ``capacity`` kept responses used, in memory: a response is
    used when it is made and when a new one continues its conversation, so
    a live conversation is kept whole (reading one back is not a use). With
    ``durable`` (the SQLite store of ``--data-dir``) each is written there
    before its reply goes out and outlives the process; memory is then a
    cache of it, never holding one the store has dropped."""

    def __init__(self, capacity: int, durable: Store | None = None) -> None:
        self.capacity = capacity
        self.durable = durable
        self._kept: OrderedDict[str, Stored] = OrderedDict()

    async def put(self, response_id: str, stored: Stored, continued: Sequence[str] = (),
                  request: dict[str, Any] | None = None) -> None:
        """Keep ``stored``; ``continued``: the kept turns it follows, which
        count as used with it; ``request``: a background response's body,
        kept (durably) until it is put again finished."""
        if self.capacity <= 0:
            return
        for rid in reversed(continued):  # the conversation's oldest turn first, as the store orders them
            if rid in self._kept:
                self._kept.move_to_end(rid)
        self._cache(response_id, stored)
        if self.durable is None:
            return
        record = {"body": stored.body, "turn": stored.turn, "items": stored.items}
        try:
            dropped = await asyncio.to_thread(self.durable.put_response, response_id, stored.previous, record,
                                              self.capacity, continued, request)
        except StoreError as exc:
            # The reply is made: it still goes out, and stays kept in memory.
            logger.warning("response %s is kept in memory only: %s", response_id, exc)
            return
        for rid in dropped:
            self._kept.pop(rid, None)

    def mark(self, response_id: str, status: str) -> None:
        """A kept response's status, in memory only: a background response
        found unfinished after a restart is queued again, as it reads."""
        stored = self._kept.get(response_id)
        if stored is not None:
            stored.body["status"] = status

    def _cache(self, response_id: str, stored: Stored) -> None:
        self._kept[response_id] = stored
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    async def get(self, response_id: str) -> Stored | None:
        stored = self._kept.get(response_id)
        if stored is None and self.durable is not None and self.capacity > 0:
            row = await asyncio.to_thread(self.durable.get_response, response_id)
            if row is not None:
                previous, record = row
                stored = Stored(record["body"], record["turn"], previous, record["items"])
                self._cache(response_id, stored)
        return stored

    async def delete(self, response_id: str) -> bool:
        deleted = self._kept.pop(response_id, None) is not None
        if self.durable is not None:
            deleted = await asyncio.to_thread(self.durable.delete_response, response_id) or deleted
        return deleted

    async def conversation(self, response_id: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The chat messages of every turn up to and including
        ``response_id``'s, and the ids of those turns (latest first); a 400
        where one is not kept."""
        turns, ids = [], []
        seen: set[str] = set()
        rid: str | None = response_id
        while rid is not None and rid not in seen:
            seen.add(rid)
            stored = await self.get(rid)
            if stored is None:
                which = "" if rid == response_id else f" (it continues {rid!r}, which is no longer kept)"
                raise _not_found(response_id, which)
            if stored.body.get("status") in _UNFINISHED:
                raise APIError(400, f"Previous response with id {rid!r} is still {stored.body['status']}: "
                               "continue it once it has finished.", param="previous_response_id")
            turns.append(stored.turn)
            ids.append(rid)
            rid = stored.previous
        return [m for turn in reversed(turns) for m in turn], ids


def _not_found(response_id: str, why: str = "") -> APIError:
    return APIError(400, f"Previous response with id {response_id!r} not found{why}.",
                    param="previous_response_id", code="previous_response_not_found")


# -- the request -------------------------------------------------------------------


@dataclass
class _Call:
    """One Responses request on its way: what rendering and keeping need."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    inputs: EngineInputs
    turn: list[dict[str, Any]]  # this turn's input messages
    response_id: str
    continued: list[str]  # the kept turns it follows (previous_response_id's chain), latest first
    created_at: int = field(default_factory=lambda: int(time.time()))


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]], turn: list[dict[str, Any]],
                 ignore_unknown_fields: bool) -> ChatCompletionRequest:
    """The chat body this Responses request stands for."""
    from fluidserve.serve.api import validate_body

    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    body: dict[str, Any] = {"model": req.model, "messages": messages + history + turn,
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls}
    if req.wants_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.as_chat()
    if req.tools:
        body["tools"] = [t.as_chat() for t in req.tools]
    if req.reasoning is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    else:
        body["tool_choice"] = req.tool_choice
    for name in _PASSED_TO_CHAT:
        body[name] = getattr(req, name)
    return validate_body({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest,
                         ignore_unknown_fields)


def responses_routes(server: Any) -> dict[str, Callable]:
    """Route handlers over ``server`` (api.py's ``_Server``, whose
    ``responses`` store keeps them): {method and path: handler}."""
    store: ResponseStore = server.responses

    async def create_response(request: Request) -> Response:
        return await _create(server, request)

    async def kept(response_id: str) -> Stored:
        stored = await store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id",
                           code="not_found")
        return stored

    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse((await kept(response_id)).body)

    async def list_input_items(request: Request, response_id: str) -> JSONResponse:
        q = query_params(request, ("after", "limit", "order"))
        limit = int_param(q, "limit", 20, 1, 100)
        order, after = order_param(q), q.get("after")
        stored = await kept(response_id)
        items = stored.items if order == "asc" else stored.items[::-1]
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else 0
        page = items[start:start + limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None,
                             "has_more": start + limit < len(items)})

    async def delete_response(response_id: str) -> JSONResponse:
        await kept(response_id)
        await server.background.cancel(response_id)  # a running one stops first
        await store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(response_id: str) -> JSONResponse:
        stored = await kept(response_id)
        if not stored.body.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled.",
                           param="response_id")
        body = await server.background.cancel(response_id)
        return JSONResponse(body if body is not None else (await kept(response_id)).body)

    return {"POST /v1/responses": create_response, "GET /v1/responses/{response_id}": get_response,
            "GET /v1/responses/{response_id}/input_items": list_input_items,
            "DELETE /v1/responses/{response_id}": delete_response,
            "POST /v1/responses/{response_id}/cancel": cancel_response}


async def begin(server: Any, req: ResponsesRequest, response_id: Callable[[ChatCompletionRequest], str]) -> _Call:
    """The request as the chat request it stands for and its engine inputs;
    ``response_id`` names it from that chat request."""
    check_model(req.model, server.model)
    store: ResponseStore = server.responses
    history, continued = await store.conversation(req.previous_response_id) if req.previous_response_id else ([], [])
    try:
        turn = input_messages(req.input)
    except ValueError as exc:
        raise APIError(400, str(exc), param="input") from None
    if not history and not turn:
        raise APIError(400, "input: must not be empty", param="input")
    if req.wants_logprobs and req.tools:
        param = "top_logprobs" if req.top_logprobs is not None else "include"
        raise APIError(400, f"{param}: logprobs with tools are not supported by this server", param=param)
    chat, inputs = _fitted(server, req, history, turn)
    if req.wants_logprobs and inputs.reasoning is not None:
        param = "top_logprobs" if req.top_logprobs is not None else "include"
        raise APIError(400, f"{param}: logprobs of a thinking reply are not supported on this route (the chat "
                       "route gives them, or turn thinking off)", param=param)
    return _Call(req, chat, inputs, turn, response_id(chat), continued)


def _fitted(server: Any, req: ResponsesRequest, history: list[dict[str, Any]],
            turn: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, EngineInputs]:
    """The chat request and its engine inputs. Where the prompt does not fit
    the context and ``truncation`` is "auto", the fewest of the
    conversation's oldest turns are dropped (whole turns: a user message and
    what answered it, tool calls with their outputs) for it to fit, as
    OpenAI drops input items from the conversation's middle: leading system
    messages and this request's own input stay. A 400 naming ``input`` (or
    ``max_output_tokens``) where even that does not fit."""
    lead = next((i for i, m in enumerate(history) if m.get("role") not in ("system", "developer")), len(history))
    starts = [i for i in range(lead, len(history)) if i == lead or history[i].get("role") == "user"]

    def without(dropped: int) -> tuple[ChatCompletionRequest, EngineInputs] | APIError:
        """The request with its ``dropped`` oldest turns left out, or the
        context error it meets."""
        kept = history[:lead] + (history[starts[dropped]:] if dropped < len(starts) else [])
        chat = chat_request(req, kept, turn, server.settings.ignore_unknown_fields)
        try:
            return chat, server.processor.chat(chat)
        except APIError as err:
            if err.code != CONTEXT_LENGTH_EXCEEDED:
                raise
            return err

    try:
        fitted = without(0)
    except APIError as err:
        if err.param != "reasoning_effort":
            raise
        raise APIError(err.status, err.message.replace("reasoning_effort", "reasoning.effort", 1), param="reasoning",
                       code=err.code) from None
    if isinstance(fitted, APIError) and req.truncation == "auto" and starts:
        # Every turn dropped makes the prompt shorter: search for the fewest
        # drops that fit, in a logarithmic number of renders.
        fitted = without(len(starts))
        if not isinstance(fitted, APIError):
            low, high = 1, len(starts)  # dropping ``high`` fits (``fitted``); dropping ``low - 1`` does not
            while low < high:
                mid = (low + high) // 2
                attempt = without(mid)
                if isinstance(attempt, APIError):
                    low = mid + 1
                else:
                    high, fitted = mid, attempt
    if isinstance(fitted, APIError):
        hint = "" if req.truncation == "auto" else ' (truncation: "auto" drops the oldest turns to fit)'
        raise APIError(400, fitted.message + hint, param="max_output_tokens" if fitted.param == "max_tokens"
                       else "input", code=CONTEXT_LENGTH_EXCEEDED)
    return fitted


async def _create(server: Any, request: Request) -> Response:
    received = time.monotonic()
    req = await server.parse(request, ResponsesRequest)
    call = await begin(server, req, lambda chat: f"resp_{server.base_request_id(request, chat.request_id)}")
    inputs = call.inputs
    server.admit_capacity(1)
    if req.background:
        return JSONResponse(await server.background.start(call))
    if server.settings.log_requests:
        log_request(call.response_id, inputs, server.settings.max_log_len)
    timers = [server.timer(inputs, received)]
    streams = await server.submit(call.response_id, inputs, received)
    for timer, stream in zip(timers, streams):
        timer.routed_to(getattr(stream, "engine", "0"))
    if req.stream:
        return server.sse(_events(server, call, streams[0], timers[0]))
    (final,) = await server.until_disconnect(request, server.collect(streams, timers), streams)
    return JSONResponse(await finish(server, call, final))


async def finish(server: Any, call: _Call, final: RequestOutput, reply: _Reply | None = None) -> dict[str, Any]:
    """The Response object of ``call``'s finished output (its items as
    ``reply`` has them, else read off the output), kept if asked."""
    reply = reply or _reply_of(server, call, final)
    body = _envelope(server, call, "incomplete" if reply.cut else "completed")
    body.update(output=reply.items(), usage=_usage(call, final),
                incomplete_details={"reason": "max_output_tokens"} if reply.cut else None)
    if call.req.store:
        stored = Stored(body, call.turn + [reply.message()], call.req.previous_response_id,
                        input_items(call.req.input))
        await server.responses.put(call.response_id, stored, call.continued)
    return body


# -- rendering -------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _envelope(server: Any, call: _Call, status: str) -> dict[str, Any]:
    """The Response object's fields that do not depend on the reply."""
    req = call.req
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict} for t in req.tools or []]
    tool_choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction) else req.tool_choice
    return {
        "id": call.response_id, "object": "response", "created_at": call.created_at, "status": status,
        "background": req.background, "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": server.model.reply_name(req.model), "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": tool_choice or "auto", "tools": tools, "top_logprobs": req.top_logprobs or 0,
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled", "usage": None,
        "user": req.user, "metadata": req.metadata or {},
    }


def _usage(call: _Call, final: RequestOutput) -> dict[str, Any]:
    prompt = len(call.inputs.prompts[0].token_ids)
    out = final.num_generated_tokens
    thought = reasoning_tokens(call.inputs.reasoning, final.outputs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": thought}, "total_tokens": prompt + out}


def _logprobs(entries: Any) -> list[dict[str, Any]]:
    """Chat logprob entries as output_text's."""
    if entries is None or entries.content is None:
        return []
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes or [],
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes or []}
                              for t in e.top_logprobs]} for e in entries.content]


@dataclass
class _Reply:
    """A reply as output items: its reasoning, a message (its text and
    logprobs) and function calls, in the order they were opened."""

    reasoning: str = ""
    reasoning_id: str | None = None  # once there is a reasoning item
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, str]] = field(default_factory=list)  # id, call_id, name, arguments
    message_id: str | None = None  # once there is a message item
    order: list[int] = field(default_factory=list)  # the items: -2 the reasoning, -1 the message, i calls[i]
    cut: bool = False  # max_output_tokens reached

    def open_reasoning(self) -> None:
        self.reasoning_id = _new_id("rs")
        self.order.append(_REASONING)

    def open_message(self) -> None:
        self.message_id = _new_id("msg")
        self.order.append(-1)

    def open_call(self, call_id: str, name: str) -> dict[str, str]:
        self.calls.append({"id": _new_id("fc"), "call_id": call_id, "name": name, "arguments": ""})
        self.order.append(len(self.calls) - 1)
        return self.calls[-1]

    def item(self, key: int) -> dict[str, Any]:
        # max_output_tokens cut the last item short: a message's text, or a call's arguments.
        status = "incomplete" if self.cut and key == self.order[-1] else "completed"
        if key == _REASONING:
            return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": self.reasoning}], "encrypted_content": None,
                    "status": status}
        if key < 0:
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                    "content": [part]}
        return {"type": "function_call", **self.calls[key], "status": status}

    def items(self) -> list[dict[str, Any]]:
        return [self.item(key) for key in self.order]

    def message(self) -> dict[str, Any]:
        """The reply as a chat message: the kept conversation's next turn."""
        out: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.reasoning:
            out["reasoning"] = self.reasoning  # the template decides whether a later turn sees it
        if self.calls:
            out["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self.calls]
        return out


def _reply_of(server: Any, call: _Call, final: RequestOutput) -> _Reply:
    """A finished output's reply, read as the chat route reads it."""
    (choice,) = chat_choices(final, top_n=call.chat.top_n, decode=server.decode, tool_mode=call.inputs.tool_mode,
                             reasoning=call.inputs.reasoning)
    reply = _Reply(cut=choice.finish_reason == "length")
    if choice.message.reasoning:
        reply.open_reasoning()
        reply.reasoning = choice.message.reasoning
    calls = choice.message.tool_calls
    if choice.message.content or not (calls or reply.reasoning_id):  # a reply of nothing: an empty message
        reply.open_message()
        reply.text, reply.logprobs = choice.message.content or "", _logprobs(choice.logprobs)
    for c in calls:
        reply.open_call(c.id, c.function.name)["arguments"] = c.function.arguments
    return reply


# -- streaming -------------------------------------------------------------------------


class _Events:
    """Numbered server-sent events of one response."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Streamer:
    """One reply's events as its output grows: a message item opened at its
    first text, a function call item at the call's first piece (as the
    chat route's tool-call stream finds them), and each closed at the end."""

    def __init__(self, server: Any, call: _Call) -> None:
        self.event = _Events()
        self.reply = _Reply()
        self.decode, self.top_n = server.decode, call.chat.top_n
        mode = call.inputs.tool_mode
        self.tools = CallStream(mode) if mode is not None else None
        reasoning = call.inputs.reasoning
        self.thinking = ReasoningStream(reasoning.parser) if reasoning is not None else None

    def _at(self, key: int) -> dict[str, Any]:
        return {"output_index": self.reply.order.index(key)}

    def _open_message(self) -> list[str]:
        self.reply.open_message()
        item = {**self.reply.item(-1), "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", **self._at(-1), item=item),
                self.event("response.content_part.added", item_id=item["id"], **self._at(-1), content_index=0,
                           part=part)]

    def _think(self, text: str) -> list[str]:
        reply = self.reply
        out = []
        if reply.reasoning_id is None:
            reply.open_reasoning()
            item = {**reply.item(_REASONING), "status": "in_progress", "content": []}
            out += [self.event("response.output_item.added", **self._at(_REASONING), item=item),
                    self.event("response.content_part.added", item_id=reply.reasoning_id, **self._at(_REASONING),
                               content_index=0, part={"type": "reasoning_text", "text": ""})]
        reply.reasoning += text
        out.append(self.event("response.reasoning_text.delta", item_id=reply.reasoning_id, **self._at(_REASONING),
                              content_index=0, delta=text))
        return out

    def feed(self, co: CompletionOutput) -> list[str]:
        out: list[str] = []
        text = co.text_delta
        if self.thinking is not None:
            thought, text = self.thinking.step(text, last=bool(co.finish_reason))
            if thought:
                out += self._think(thought)
        if self.tools is None:
            pieces = [StreamPiece(text)]
        elif self.thinking is not None and self.thinking.in_reasoning and not text:
            pieces = []  # no content yet: nothing for a tool-call parser
        else:
            pieces = self.tools.step(text, last=bool(co.finish_reason))
        entries = (_logprobs(chat_logprobs(co.new_token_ids, co.new_logprobs, self.top_n, self.decode))
                   if self.top_n is not None else [])
        reply = self.reply
        for piece in pieces:
            if piece.content or entries:  # logprobs come without tools only (begin refuses both)
                if reply.message_id is None:
                    out += self._open_message()
                reply.text += piece.content
                reply.logprobs += entries
                out.append(self.event("response.output_text.delta", item_id=reply.message_id, **self._at(-1),
                                      content_index=0, delta=piece.content, logprobs=entries))
                entries = []
            for d in piece.calls:
                if d.id is not None:
                    reply.open_call(d.id, d.name or "")
                    item = {**reply.item(len(reply.calls) - 1), "status": "in_progress"}
                    out.append(self.event("response.output_item.added", **self._at(d.index), item=item))
                c = reply.calls[d.index]
                if d.arguments:
                    c["arguments"] += d.arguments
                    out.append(self.event("response.function_call_arguments.delta", item_id=c["id"],
                                          **self._at(d.index), delta=d.arguments))
        if co.finish_reason is not None:
            reply.cut = finish_reason(co) == "length"
        return out

    def close(self) -> list[str]:
        """Every item's closing events; a reply of nothing is an empty message."""
        out = [] if self.reply.order else self._open_message()
        for key in self.reply.order:
            item, at = self.reply.item(key), self._at(key)
            if key == _REASONING:
                part = item["content"][0]
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], **at, content_index=0,
                                      text=part["text"]))
                out.append(self.event("response.content_part.done", item_id=item["id"], **at, content_index=0,
                                      part=part))
            elif key < 0:
                part = item["content"][0]
                out.append(self.event("response.output_text.done", item_id=item["id"], **at, content_index=0,
                                      text=part["text"], logprobs=part["logprobs"]))
                out.append(self.event("response.content_part.done", item_id=item["id"], **at, content_index=0,
                                      part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], **at,
                                      arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", **at, item=item))
        return out


async def _events(server: Any, call: _Call, stream: RequestStream, timer: Any) -> AsyncIterator[str]:
    """The stream: created, in progress, the reply's items as they are
    made, then completed (or incomplete at max_output_tokens) with usage,
    or failed."""
    from fluidserve.serve.api import _as_api_error

    streamer = _Streamer(server, call)
    event = streamer.event
    envelope = _envelope(server, call, "in_progress")
    yield event("response.created", response=envelope)
    yield event("response.in_progress", response=envelope)
    final: RequestOutput | None = None
    try:
        async for out in stream:
            timer.on_output(out)
            final = out
            for line in streamer.feed(out.outputs[0]):
                yield line
        assert final is not None
        for line in streamer.close():
            yield line
        body = await finish(server, call, final, streamer.reply)
        yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed",
                    response=body)
    except (EngineDeadError, RequestFailedError) as exc:
        err = _as_api_error(exc)
        failed = _envelope(server, call, "failed")
        failed["error"] = {"code": "server_error", "message": getattr(err, "message", str(err))}
        yield event("response.failed", response=failed)
    finally:
        stream.abort()


# -- background responses ----------------------------------------------------------------


def _unanswered(call: _Call, body: dict[str, Any]) -> Stored:
    """A background response kept without a reply (queued, failed or
    cancelled): its turn is its input alone."""
    return Stored(body, call.turn, call.req.previous_response_id, input_items(call.req.input))


@dataclass
class _Job:
    call: _Call
    task: asyncio.Task | None = None
    cancelled: bool = False  # by the client (not by shutdown, which leaves the job to the next start)


class BackgroundRuns:
    """``background: true``: the response is kept as ``queued`` and answered
    at once; its generation runs here, and the kept response becomes
    ``in_progress``, then ``completed``, ``incomplete``, ``failed`` or
    ``cancelled`` (``POST .../cancel``). Nobody waits on its tokens, so it
    runs as offline work (behind every online request, inside the
    co-serving budget) unless its ``priority`` says otherwise, and only its
    final output comes back from the engine.

    With ``--data-dir`` the request is kept beside the queued response in
    the same transaction, so nothing accepted is lost: a server stopped or
    killed before the reply was kept runs the request again when it starts
    (``resume``), under the same id. Without it, as every kept response,
    they live in memory only."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._jobs: dict[str, _Job] = {}

    @property
    def running(self) -> int:
        return len(self._jobs)

    async def start(self, call: _Call) -> dict[str, Any]:
        """Keep ``call``'s response as queued, start it, and return the body."""
        body = _envelope(self.server, call, "queued")
        request = call.req.model_dump(mode="json", by_alias=True, exclude_unset=True)
        await self.server.responses.put(call.response_id, _unanswered(call, body), call.continued, request=request)
        self._launch(call)
        return body

    def _launch(self, call: _Call) -> None:
        klass = "offline" if call.req.priority is None else call.inputs.klass
        call.inputs = dataclasses.replace(call.inputs, klass=klass, final_only=True)
        job = self._jobs[call.response_id] = _Job(call)
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"background {call.response_id}")

    async def _run(self, job: _Job) -> None:
        server, call = self.server, job.call
        streams: list[RequestStream] = []
        try:
            timers = [server.timer(call.inputs)]
            streams = await server.submit(call.response_id, call.inputs)
            server.responses.mark(call.response_id, "in_progress")
            (final,) = await server.collect(streams, timers)
            await finish(server, call, final)
        except asyncio.CancelledError:
            if job.cancelled:
                await self._end(call, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - the response fails, and says why
            from fluidserve.serve.api import _as_api_error

            err = _as_api_error(exc)
            logger.warning("background response %s failed: %s", call.response_id, exc)
            await self._end(call, "failed", {"code": "server_error", "message": getattr(err, "message", str(err))})
        finally:
            for stream in streams:
                stream.abort()
            self._jobs.pop(call.response_id, None)

    async def _end(self, call: _Call, status: str, error: dict[str, str] | None = None) -> None:
        body = _envelope(self.server, call, status)
        body["error"] = error
        await self.server.responses.put(call.response_id, _unanswered(call, body))

    async def cancel(self, response_id: str) -> dict[str, Any] | None:
        """Stop a running background response; its kept body (cancelled), or
        None where it was not running (already finished: left as it is)."""
        job = self._jobs.get(response_id)
        if job is None or job.task is None:
            return None
        job.cancelled = True
        job.task.cancel()
        await asyncio.gather(job.task, return_exceptions=True)
        stored = await self.server.responses.get(response_id)
        return stored.body if stored is not None else None

    async def resume(self) -> None:
        """At start: run again every background response a stopped server
        accepted and did not finish (``--data-dir``)."""
        from fluidserve.serve.api import validate_body

        store = self.server.responses
        if store.durable is None:
            return
        for rid, previous, record, request in await asyncio.to_thread(store.durable.pending_responses):
            try:
                req = validate_body(request, ResponsesRequest, self.server.settings.ignore_unknown_fields)
                call = await begin(self.server, req, lambda chat, rid=rid: rid)
            except APIError as err:
                body = {**record["body"], "status": "failed",
                        "error": {"code": "server_error", "message": f"not resumed after a restart: {err.message}"}}
                await store.put(rid, Stored(body, record["turn"], previous, record["items"]))
                continue
            call.created_at = record["body"]["created_at"]
            logger.info("resuming background response %s", rid)
            self._launch(call)

    async def stop(self) -> None:
        """At shutdown: stop the running jobs, leaving them kept as queued
        for the next start to run (with ``--data-dir``)."""
        jobs = [job.task for job in self._jobs.values() if job.task is not None]
        for task in jobs:
            task.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
