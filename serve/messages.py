"""Anthropic's Messages API: ``POST /v1/messages`` (whole, or streamed as
Anthropic's typed events) and ``POST /v1/messages/count_tokens``, for
clients built on Anthropic's SDK pointed at this server (vLLM serves the
same routes).

Owns turning a Messages body into the chat request it stands for, validated
as a whole ``/v1/chat/completions`` body, so each field means what it means
on the chat route (template, sampling, tools, reasoning are that route's):

* ``system`` (a string or text blocks) becomes the system message;
* ``messages``: text blocks; an assistant's ``tool_use`` blocks become its
  tool calls and its ``thinking`` blocks its reasoning; a user's
  ``tool_result`` blocks become tool messages (before the user's own text);
* ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``,
  ``tool``, ``none``, ``disable_parallel_tool_use``) become the chat form;
* ``thinking`` (``enabled`` with ``budget_tokens``, or ``disabled``) becomes
  ``enable_thinking`` for the template and ``thinking_token_budget``;
* ``output_config`` (``format``: a JSON schema, ``effort``) becomes
  ``response_format`` and ``reasoning_effort``;
* ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
  and ``metadata.user_id`` keep their meaning.

The reply is read by the chat route's ``chat_choices`` and written as
content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's
``stop_reason``. ``cache_control`` marks are accepted: the prefix cache keeps
every prompt's blocks without being asked. Errors on these routes take
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``; see
``errors.py``). What the chat route cannot do is a 400 naming the field:
image and document blocks, server tools, redacted thinking.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Callable, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictStr, model_validator

from fluidserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from fluidserve.engine.outputs import CompletionOutput, RequestOutput
from fluidserve.serve.errors import APIError
from fluidserve.serve.inputs import EngineInputs, check_model, log_request
from fluidserve.serve.protocol import REQUEST_BODIES, ChatCompletionRequest, FunctionName, _off, _Request
from fluidserve.serve.reasoning import ReasoningStream
from fluidserve.serve.render import chat_choices, finish_reason, stop_reason
from fluidserve.serve.tool_parsers import CallStream, StreamPiece

MAX_BLOCKS = 4096  # content blocks in one request, as a bound on work before validation ends

# Fields passed to the chat route as they are: vLLM's sampling extensions, as
# the Responses route passes them.
_PASSED_TO_CHAT = ("top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                   "skip_special_tokens", "priority", "cache_salt")


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _check(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking: type enabled needs budget_tokens")
        return self


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: bool | None = None


class Tool(_Request):
    """A client tool. Server tools (``type`` other than ``custom``) run at
    Anthropic's; none runs here."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {"cache_control": lambda v: True}
    type: Literal["custom"] | None = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any]


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """``format``: the reply's text follows a JSON schema (the chat route's
    ``response_format``); ``effort``: the chat route's ``reasoning_effort``."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(_Request):
    user_id: str | None = None


class MessagesRequest(_Request):
    """A ``POST /v1/messages`` body."""

    _REFUSED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "service_tier": _off("auto", "standard_only"),
        "container": _off(),
        "mcp_servers": _off(),
        "context_management": _off(),
    }
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BLOCKS)]
    system: StrictStr | list[dict[str, Any]] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Any = None
    stream: bool = False
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat route, which checks them (see _PASSED_TO_CHAT).
    min_p: Any = None
    seed: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    skip_special_tokens: Any = None
    priority: Any = None
    cache_salt: Any = None


class CountTokensRequest(_Request):
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BLOCKS)]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


REQUEST_BODIES["/v1/messages"] = (MessagesRequest,)
REQUEST_BODIES["/v1/messages/count_tokens"] = (CountTokensRequest,)


# -- a Messages body as a chat body ---------------------------------------------------


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(f"{where}.content: must be a string or a list of content blocks", "messages")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs its text", "messages")
    return text


def _tool_result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    parts = _blocks(content, where)
    for j, part in enumerate(parts):
        if part.get("type") != "text":
            raise _bad(f"{where}.content[{j}]: tool results of type {part.get('type')!r} are not supported by "
                       "this server (text only)", "messages")
    return "".join(_text(p, f"{where}.content") for p in parts)


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise _bad(f"system[{i}]: blocks of type {block.get('type')!r} are not supported (text only)", "system")
    return "".join(_text(b, f"system[{i}]") for i, b in enumerate(system))


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Messages conversation."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: must be user or assistant", "messages")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise _bad(f"{where}.{extra[0]}: unrecognized field", "messages")
        blocks = _blocks(message.get("content"), where)
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        thinking: list[str] = []
        for j, block in enumerate(blocks):
            kind, at = block.get("type"), f"{where}.content[{j}]"
            if kind == "text":
                texts.append(_text(block, at))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or \
                        not isinstance(block.get("input"), dict):
                    raise _bad(f"{at}: a tool_use block needs id, name and input (an object)", "messages")
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise _bad(f"{at}: a tool_result block needs the tool_use_id it answers", "messages")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": _tool_result_text(block, at)})
            elif kind == "thinking" and role == "assistant":
                if not isinstance(block.get("thinking"), str):
                    raise _bad(f"{at}: a thinking block needs its thinking", "messages")
                thinking.append(block["thinking"])
            else:
                raise _bad(f"{at}: blocks of type {kind!r} are not supported by this server in a {role} message "
                           "(text, tool_use, tool_result and thinking)", "messages")
        if role == "user":
            out += results
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
            continue
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning"] = "".join(thinking)
        out.append(turn)
    return out


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from fluidserve.serve.api import validate_body

    out = []
    for i, raw in enumerate(tools):
        if raw.get("type") not in (None, "custom"):
            raise _bad(f"tools[{i}]: tools of type {raw.get('type')!r} run on Anthropic's servers, not on this "
                       "one (client tools with an input_schema only)", "tools")
        tool = validate_body(raw, Tool)
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out


def chat_request(req: MessagesRequest | CountTokensRequest, ignore_unknown_fields: bool) -> ChatCompletionRequest:
    """The chat body this Messages request stands for."""
    from fluidserve.serve.api import validate_body

    system = system_text(req.system)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + chat_messages(req.messages)
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs.setdefault("enable_thinking", req.thinking.type == "enabled")
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
            body["thinking_token_budget"] = req.thinking.budget_tokens
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    config = req.output_config
    if config is not None and config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        body["reasoning_effort"] = config.effort
    if req.tools:
        body["tools"] = _tools(req.tools)
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise _bad("tool_choice: type tool needs the tool's name", "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    stop=req.stop_sequences or None, user=req.metadata.user_id if req.metadata else None)
        for name in _PASSED_TO_CHAT:
            body[name] = getattr(req, name)
    else:
        body["max_tokens"] = 1
    try:
        return validate_body({k: v for k, v in body.items() if v is not None}, ChatCompletionRequest,
                             ignore_unknown_fields)
    except APIError as err:
        raise _renamed(err) from None


# The chat route's names of this API's fields.
_PARAMS = {"thinking_token_budget": "thinking", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
           "chat_template_kwargs": "thinking", "parallel_tool_calls": "tool_choice",
           "response_format": "output_config", "reasoning_effort": "output_config"}


def _renamed(err: APIError) -> APIError:
    param = _PARAMS.get(err.param or "", err.param)
    if param == err.param:
        return err
    return APIError(err.status, err.message, param=param, code=err.code, headers=err.headers)


# -- the reply as content blocks ----------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _stop_reason(co: CompletionOutput, calls: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished choice."""
    if finish_reason(co) == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    matched = stop_reason(co)
    return ("stop_sequence", matched) if isinstance(matched, str) else ("end_turn", None)


def _input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _usage(inputs: EngineInputs, final: RequestOutput) -> dict[str, int]:
    usage = {"input_tokens": len(inputs.prompts[0].token_ids), "output_tokens": final.num_generated_tokens}
    usage["cache_read_input_tokens"] = final.num_cached_tokens or 0
    return usage


def message_body(server: Any, msg_id: str, inputs: EngineInputs, final: RequestOutput) -> dict[str, Any]:
    (choice,) = chat_choices(final, top_n=None, decode=server.decode, tool_mode=inputs.tool_mode,
                             reasoning=inputs.reasoning)
    content: list[dict[str, Any]] = []
    if choice.message.reasoning:
        content.append({"type": "thinking", "thinking": choice.message.reasoning, "signature": ""})
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls:
        args = _input(call.function.arguments)
        if args is None:  # cut short by max_tokens: what was written, as text
            content.append({"type": "text", "text": call.function.arguments})
            continue
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": args})
    reason, sequence = _stop_reason(final.outputs[0], bool(choice.message.tool_calls))
    model = server.model.reply_name(inputs.params.lora)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(inputs, final)}


# -- routes ----------------------------------------------------------------------------------


def messages_routes(server: Any) -> dict[str, Callable]:
    """Route handlers over ``server`` (api.py's ``_Server``): {method and path: handler}."""

    async def parsed(request: Request, model_cls: type) -> tuple[Any, EngineInputs]:
        """The body and the engine inputs of the chat request it stands for."""
        req = await server.parse(request, model_cls)
        check_model(req.model, server.model)
        chat = chat_request(req, server.settings.ignore_unknown_fields)
        try:
            return req, server.processor.chat(chat)
        except APIError as err:
            raise _renamed(err) from None

    async def create_message(request: Request) -> Response:
        received = time.monotonic()
        req, inputs = await parsed(request, MessagesRequest)
        server.admit_capacity(1)
        msg_id = _new_id("msg")
        if server.settings.log_requests:
            log_request(msg_id, inputs, server.settings.max_log_len)
        timers = [server.timer(inputs, received)]
        streams = await server.submit(msg_id, inputs, received)
        if req.stream:
            return server.sse(_events(server, msg_id, inputs, streams[0], timers[0]))
        (final,) = await server.until_disconnect(request, server.collect(streams, timers), streams)
        return JSONResponse(message_body(server, msg_id, inputs, final))

    async def count_tokens(request: Request) -> JSONResponse:
        _, inputs = await parsed(request, CountTokensRequest)
        return JSONResponse({"input_tokens": len(inputs.prompts[0].token_ids)})

    return {"POST /v1/messages": create_message, "POST /v1/messages/count_tokens": count_tokens}


# -- streaming ---------------------------------------------------------------------------------


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Streamer:
    """One reply's events: content blocks opened one at a time as the reply
    reaches them (its thinking, its text, each tool call), each closed
    before the next opens, as Anthropic streams them."""

    def __init__(self, inputs: EngineInputs) -> None:
        self.thinking = ReasoningStream(inputs.reasoning.parser) if inputs.reasoning is not None else None
        self.tools = CallStream(inputs.tool_mode) if inputs.tool_mode is not None else None
        self.index = -1
        self.open: str | None = None  # the open block's kind
        self.calls = 0

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", index=self.index, content_block=block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(_event("content_block_delta", index=self.index, delta={"type": "signature_delta",
                                                                              "signature": ""}))
        self.open = None
        return out + [_event("content_block_stop", index=self.index)]

    def _delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        out = self._start(kind, block) if self.open != kind else []
        return out + [_event("content_block_delta", index=self.index, delta=delta)]

    def feed(self, co: CompletionOutput) -> list[str]:
        out: list[str] = []
        text = co.text_delta
        if self.thinking is not None:
            thought, text = self.thinking.step(text, last=bool(co.finish_reason))
            if thought:
                out += self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                   {"type": "thinking_delta", "thinking": thought})
            if self.thinking.in_reasoning and not text:
                return out  # no content yet
        if self.tools is None:
            pieces = [StreamPiece(text)]
        else:
            pieces = self.tools.step(text, last=bool(co.finish_reason))
        for piece in pieces:
            if piece.content:
                out += self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": piece.content})
            for d in piece.calls:
                if d.id is not None:
                    out += self._start("tool_use", {"type": "tool_use", "id": d.id, "name": d.name or "",
                                                    "input": {}})
                    self.calls += 1
                if d.arguments:
                    out.append(_event("content_block_delta", index=self.index,
                                      delta={"type": "input_json_delta", "partial_json": d.arguments}))
        return out


async def _events(server: Any, msg_id: str, inputs: EngineInputs, stream: RequestStream,
                  timer: Any) -> AsyncIterator[str]:
    """message_start, each block's start, deltas and stop, message_delta with
    the stop reason and usage, message_stop; an ``error`` event where
    generation fails."""
    from fluidserve.serve.api import _as_api_error

    streamer = _Streamer(inputs)
    model = server.model.reply_name(inputs.params.lora)
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": len(inputs.prompts[0].token_ids), "output_tokens": 0}}
    yield _event("message_start", message=start)
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
        reason, sequence = _stop_reason(final.outputs[0], streamer.calls > 0)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": final.num_generated_tokens})
        yield _event("message_stop")
    except (EngineDeadError, RequestFailedError) as exc:
        err = _as_api_error(exc)
        yield _event("error", error={"type": "api_error", "message": getattr(err, "message", str(err))})
    finally:
        stream.abort()
