"""The FastAPI app: OpenAI-compatible routes over an ``AsyncEngine``.

Owns the HTTP edge: authentication, body limits and parsing, admission
(queue limit, draining), streaming as Server-Sent Events, and aborting a
request the moment its client disconnects, streaming or not. Translation in
and out of the engine lives in ``inputs.py`` and ``render.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from fluidserve.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.beam_search import BeamSearchStream
from fluidserve.serve.errors import APIError, error_body, from_validation_error, from_value_error, install_handlers
from fluidserve.serve.inputs import EngineInputs, InputProcessor, ModelInfo, check_model, log_request
from fluidserve.serve.metrics import RequestTimer, ServerMetrics
from fluidserve.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    IGNORE_UNKNOWN_FIELDS,
    DetokenizeRequest,
    LoadResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    add_request_schemas,
)
from fluidserve.serve.lora import lora_routes
from fluidserve.serve.classify import classify, classify_routes
from fluidserve.serve.pooling import pooling_routes
from fluidserve.serve.embeddings import embeddings, embeddings_routes
from fluidserve.serve.scores import scoring_routes
from fluidserve.serve.messages import messages_routes
from fluidserve.serve.reasoning import ReasoningParser
from fluidserve.serve.render import (ChatStreamer, CompletionStreamer, chat_choices, completion_choices, keep_best,
                                     make_usage, prediction_tokens, prompt_logprobs, reasoning_tokens)
from fluidserve.serve.responses import BackgroundRuns, ResponseStore, responses_routes

VERSION = "0.1.0"
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int = 1024
    retry_after_s: int = 1
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers
    log_requests: bool = False  # log each request's parameters and prompt
    max_log_len: int | None = None  # prompt characters / token ids logged
    # --enable-auto-tool-choice with --tool-call-parser: the parser that finds
    # tool calls in replies under tool_choice "auto"; None: "auto" is refused.
    tool_call_parser: str | None = None
    # vLLM's server options of the same names.
    return_tokens_as_token_ids: bool = False  # default of the request field: logprob tokens as "token_id:N"
    enable_force_include_usage: bool = False  # a usage chunk ends every stream, asked for or not
    enable_request_id_headers: bool = False  # answer with X-Request-Id
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template)
    trust_request_chat_template: bool = False  # a request may bring its own Jinja chat template
    ignore_unknown_fields: bool = False  # drop request keys no API defines (vLLM's way) instead of a 400
    max_stored_responses: int = 10_000  # Responses API: replies kept for previous_response_id and GET
    disable_any_whitespace: bool = False  # JSON constraints compact unless a request says otherwise
    reasoning_parser: str | None = None  # --reasoning-parser: replies split into reasoning and content
    enable_in_reasoning: bool = False  # a grammar constrains the reasoning too (else it starts after it)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (serve/lora.py): vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, read by the CLI.
    runtime_lora_updating: bool = False


@dataclass
class ServerState:
    """Mutable state of a running server, beside the frozen settings."""

    draining: bool = False
    started: float = field(default_factory=time.time)


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def build_app(engine: AsyncEngine, tokenizer: Any, model: ModelInfo,
              settings: ServerSettings | None = None, batch_config: Any = None) -> FastAPI:
    """``batch_config`` (a ``batches.BatchConfig``) enables the durable Batch API."""
    from fluidserve.serve.batches import install_batch_api
    from fluidserve.serve.chat_batch import batch_chat_route

    settings = settings or ServerSettings()
    reasoning = ReasoningParser.load(settings.reasoning_parser, tokenizer) if settings.reasoning_parser else None
    processor = InputProcessor(tokenizer, model, settings.tool_call_parser,
                               disable_any_whitespace=settings.disable_any_whitespace, reasoning_parser=reasoning,
                               enable_in_reasoning=settings.enable_in_reasoning,
                               trust_request_chat_template=settings.trust_request_chat_template)
    server = _Server(engine, processor, model, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        batch_runner.start()
        await server.background.resume()
        yield
        await server.background.stop()
        await batch_runner.stop()
        await engine.shutdown()

    app = FastAPI(title="fluidserve", version=VERSION, lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.openapi = _openapi_with_bodies(app)
    app.state.server = server
    router = getattr(engine, "router", None)  # data-parallel replicas: the router's counters
    if router is not None:
        server.metrics.set_router_source(router.counters)
    install_handlers(app)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    if settings.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(ClientDisconnect, _client_gone)  # left while sending the body
    auth = [Depends(server.authenticate)]

    # An embedding model serves /v1/embeddings, /score and /rerank and no generation route (vLLM's
    # --runner pooling too).
    generates = not model.pooling
    if generates:
        app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth)
        app.add_api_route("/v1/chat/completions", server.chat, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model_id:path}", server.model_card, methods=["GET"], dependencies=auth)
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/ping", server.health, methods=["GET"])  # SageMaker's health check
    app.add_api_route("/ping", server.health, methods=["POST"], name="ping_post")
    app.add_api_route("/load", server.load, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"], dependencies=auth)
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"], dependencies=auth)
    app.add_api_route("/invocations", server.invocations, methods=["POST"], dependencies=auth)
    if generates:
        app.add_api_route("/v1/chat/completions/batch", batch_chat_route(server), methods=["POST"],
                          dependencies=auth)
    generation = {**responses_routes(server), **messages_routes(server)}
    pooled = classify_routes(server) if model.labels else embeddings_routes(server)
    pooling = {**pooled, **pooling_routes(server), **scoring_routes(server)}
    routes = generation if generates else pooling
    # A route another kind of model serves is a 404 that says so.
    other_pooled = embeddings_routes(server) if model.labels else classify_routes(server)
    app.state.unserved = _unserved(model, [*_GENERATION_PATHS, *generation, *other_pooled] if not generates else
                                   [*embeddings_routes(server), *classify_routes(server), *pooling])
    if settings.runtime_lora_updating:
        routes |= lora_routes(server)
    for route, handler in routes.items():
        method, path = route.split(" ", 1)
        app.add_api_route(path, handler, methods=[method], dependencies=auth)
    if settings.enable_tokenizer_info_endpoint:
        app.add_api_route("/tokenizer_info", server.tokenizer_info, methods=["GET"], dependencies=auth)
    batch_runner = install_batch_api(app, server, batch_config, auth)
    server.responses.durable = batch_runner.store  # with --data-dir, kept responses outlive the process
    return app


# The routes of a kind of model this server's model is not, and what serves them.
_SERVED_BY = {"/v1/embeddings": "an embedding model (--runner pooling)", "/classify": "a sequence classifier",
              "/pooling": "a pooling model (--runner pooling)"}


_GENERATION_PATHS = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/chat/completions/batch")


def _unserved(model: ModelInfo, routes: list[str]) -> dict[str, str]:
    """Each path another kind of model serves -> why this server answers it
    with a 404: what this model is and what kind serves the path (the
    generation routes, for a pooling model; the pooling routes, for a
    generative one)."""
    kind = ("a sequence classifier" if model.labels else "an embedding model") if model.pooling else "generative"
    out = {}
    for route in routes:
        path = route.split(" ", 1)[1].split("/{", 1)[0]
        if model.pooling and path in ("/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
            continue  # served by every pooling model
        served_by = _SERVED_BY.get(path, "a pooling model (--runner pooling)" if not model.pooling
                                   else "a generative model (--runner generate)")
        out[path] = f"{path} is served for {served_by}; this server's model ({model.name}) is {kind}"
    return out


class _Server:
    """Route handlers sharing one engine, input processor and metrics."""

    def __init__(self, engine: AsyncEngine, processor: InputProcessor, model: ModelInfo,
                 settings: ServerSettings) -> None:
        self.engine = engine
        self.processor = processor
        self.model = model
        self.settings = settings
        self.state = ServerState()
        self.metrics = ServerMetrics(model.name, model.max_model_len)
        self.offline_queued: Callable[[], int] = lambda: 0  # set by the batch runner
        self.responses = ResponseStore(settings.max_stored_responses)  # Responses API: the replies kept
        self.background = BackgroundRuns(self)  # Responses API: background: true
        self.decode = lambda token_id: processor.tokenizer.decode([token_id])
        self.decode_ids = lambda ids, skip: processor.tokenizer.decode(ids, skip_special_tokens=skip)

    # -- edge checks --------------------------------------------------------
    async def authenticate(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
        anthropic = request.headers.get("x-api-key")  # how Anthropic's SDK sends the key
        ok = ok or (anthropic is not None and hmac.compare_digest(anthropic.strip().encode(), key.encode()))
        if not ok:
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    async def parse(self, request: Request, model_cls: type[M]) -> M:
        body = await self._read_body(request)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        return validate_body(data, model_cls, self.settings.ignore_unknown_fields)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
        body = bytearray()
        if not too_big:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    too_big = True
                    break
        if too_big:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large",
                           headers={"Connection": "close"})
        return bytes(body)

    def admit_capacity(self, num_requests: int) -> None:
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        if self.state.draining:
            raise APIError(503, "server is shutting down", code="shutting_down", headers=retry)
        health = self.engine.health()
        if not health.ok:
            raise APIError(503, f"engine unavailable: {health.reason}", code="engine_unavailable", headers=retry)
        # Batch lines are bounded by the batch runner: they never take online places.
        online_queued = self.engine.num_queued - self.offline_queued()
        if online_queued + num_requests > self.settings.max_queued_requests:
            raise APIError(429, "too many queued requests; retry later", code="queue_full", headers=retry)

    # -- generation routes --------------------------------------------------
    async def completions(self, request: Request) -> Response:
        received = time.monotonic()  # the engine's TTFT budgets count the parsing and tokenizing too
        req = await self.parse(request, CompletionRequest)
        check_model(req.model, self.model)
        inputs = self.processor.completion(req)
        self.admit_capacity(len(inputs.prompts))
        rid = f"cmpl-{self.base_request_id(request, req.request_id)}"
        if self.settings.log_requests:
            log_request(rid, inputs, self.settings.max_log_len)
        timers = [self.timer(inputs, received) for _ in inputs.prompts]
        streams = await self.submit(rid, inputs, received)
        _routed(timers, streams)
        top_n = req.top_n
        if req.stream:
            include_usage, continuous = self.usage_options(req)
            streamer = CompletionStreamer(rid, self.model.reply_name(req.model), inputs.prompts, n=req.n, echo=req.echo,
                                          top_n=top_n, decode=self.decode, continuous_usage=continuous,
                                          as_ids=self.as_ids(req), token_ids=bool(req.return_token_ids))
            return self.sse(self._completion_events(streams, timers, streamer, inputs, include_usage))
        finals = await self.until_disconnect(request, self.collect(streams, timers), streams)
        return JSONResponse(self.completion_body(rid, req, inputs, finals).model_dump(mode="json"))

    def completion_body(self, rid: str, req: CompletionRequest, inputs: EngineInputs,
                        finals: list[RequestOutput]) -> CompletionResponse:
        # Usage counts every candidate best_of made, as OpenAI bills them.
        usage = make_usage(inputs.prompts, sum(o.num_generated_tokens for o in finals), self.cached_tokens(finals))
        if req.ranked:
            finals = keep_best(finals, req.n)
        choices = completion_choices(inputs.prompts, finals, n=req.n, echo=req.echo, top_n=req.top_n,
                                     decode=self.decode, as_ids=self.as_ids(req),
                                     token_ids=bool(req.return_token_ids))
        return CompletionResponse(id=rid, model=self.model.reply_name(req.model), choices=choices, usage=usage)

    async def chat(self, request: Request) -> Response:
        received = time.monotonic()  # the engine's TTFT budgets count the template and tokenizing too
        req = await self.parse(request, ChatCompletionRequest)
        check_model(req.model, self.model)
        inputs = self.processor.chat(req)
        self.admit_capacity(1)
        rid = f"chatcmpl-{self.base_request_id(request, req.request_id)}"
        if self.settings.log_requests:
            log_request(rid, inputs, self.settings.max_log_len)
        timers = [self.timer(inputs, received)]
        streams = await self.submit(rid, inputs, received)
        _routed(timers, streams)
        top_n = req.top_n
        if req.stream:
            include_usage, continuous = self.usage_options(req)
            streamer = ChatStreamer(rid, self.model.reply_name(req.model), top_n=top_n, decode=self.decode,
                                    prompt=inputs.prompts[0] if continuous else None,
                                    tool_mode=inputs.tool_mode, role=req.reply_role, echo_text=_echo_text(req),
                                    as_ids=self.as_ids(req), token_ids=bool(req.return_token_ids),
                                    reasoning=inputs.reasoning)
            return self.sse(self._chat_events(streams, timers, streamer, inputs, include_usage))
        finals = await self.until_disconnect(request, self.collect(streams, timers), streams)
        return JSONResponse(self.chat_body(rid, req, inputs, finals).model_dump(mode="json"))

    def chat_body(self, rid: str, req: ChatCompletionRequest, inputs: EngineInputs,
                  finals: list[RequestOutput]) -> ChatCompletionResponse:
        top_n = req.top_n
        usage = make_usage(inputs.prompts, finals[0].num_generated_tokens, self.cached_tokens(finals),
                           self.reasoning_tokens(inputs, finals[0]), prediction_tokens(finals[0].outputs))
        if req.ranked:
            finals = keep_best(finals, req.n)
        choices = chat_choices(finals[0], top_n=top_n, decode=self.decode, tool_mode=inputs.tool_mode,
                               role=req.reply_role, echo_text=_echo_text(req), as_ids=self.as_ids(req),
                               token_ids=bool(req.return_token_ids), reasoning=inputs.reasoning)
        return ChatCompletionResponse(id=rid, model=self.model.reply_name(req.model), choices=choices, usage=usage,
                                      prompt_logprobs=prompt_logprobs(finals[0].prompt_logprobs),
                                      prompt_token_ids=list(inputs.prompts[0].token_ids) if req.return_token_ids
                                      else None)

    # -- vLLM's per-request options ----------------------------------------
    def base_request_id(self, request: Request, body_id: str | None) -> str:
        """vLLM's order: the X-Request-Id header, the body's request_id, a
        fresh id. The header is checked as request_id is."""
        header = request.headers.get("x-request-id")
        if header is not None and not _REQUEST_ID.fullmatch(header):
            raise APIError(400, "X-Request-Id: must be 1 to 128 of A-Z a-z 0-9 . _ : -", param="X-Request-Id",
                           code="invalid_value")
        base = header or body_id or uuid.uuid4().hex
        request.scope.setdefault("state", {})[_ID_STATE] = base
        return base

    def usage_options(self, req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage on every chunk) of a stream."""
        opts = req.stream_options
        include = bool(opts and opts.include_usage) or self.settings.enable_force_include_usage
        return include, include and bool(opts and opts.continuous_usage_stats)

    def as_ids(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.settings.return_tokens_as_token_ids

    def reasoning_tokens(self, inputs: EngineInputs, final: RequestOutput | None) -> int | None:
        """usage's ``reasoning_tokens``: reported (zero too) once the server
        has a reasoning parser, as vLLM reports them."""
        if self.processor.reasoning_parser is None:
            return None
        return reasoning_tokens(inputs.reasoning, final.outputs if final is not None else [])

    def cached_tokens(self, finals: list[RequestOutput]) -> int | None:
        if not self.settings.enable_prompt_tokens_details:
            return None
        return sum(o.num_cached_tokens or 0 for o in finals)

    # -- engine plumbing ----------------------------------------------------
    def timer(self, inputs: EngineInputs, start: float | None = None) -> RequestTimer:
        return RequestTimer(self.metrics, start, n=inputs.params.n, max_tokens=inputs.params.max_tokens)

    async def submit(self, rid: str, inputs: EngineInputs, received: float | None = None) -> list[RequestStream]:
        """Admit one engine request per prompt; all or none. ``received``:
        when the HTTP request arrived (the engine's arrival time; now if None)."""
        streams: list[RequestStream] = []
        multi = len(inputs.prompts) > 1
        try:
            for i, prompt in enumerate(inputs.prompts):
                sub_id = f"{rid}-{i}" if multi else rid
                if inputs.beam is not None:  # searched above the engine, read as one final output
                    streams.append(BeamSearchStream(self.engine, sub_id, prompt.token_ids, inputs.beam,
                                                    self.decode_ids, inputs.klass))
                    continue
                arrival = time.monotonic() if received is None else received
                streams.append(await self.engine.add_request(sub_id, prompt.token_ids, inputs.params,
                                                             inputs.klass, arrival, final_only=inputs.final_only))
        except BaseException as exc:
            for s in streams:
                s.abort()
            raise _as_api_error(exc) from None
        return streams

    async def collect(self, streams: list[RequestStream], timers: list[RequestTimer]) -> list[RequestOutput]:
        async def one(stream: RequestStream, timer: RequestTimer) -> RequestOutput:
            last = None
            async for out in stream:
                timer.on_output(out)
                last = out
            assert last is not None
            return last

        try:
            return list(await asyncio.gather(*(one(s, t) for s, t in zip(streams, timers))))
        except (EngineDeadError, RequestFailedError) as exc:
            raise _as_api_error(exc) from None
        finally:
            for s in streams:
                s.abort()

    async def until_disconnect(self, request: Request, work: Awaitable[T], streams: list[RequestStream]) -> T:
        """Await ``work``; if the client disconnects first, abort its
        requests (freeing their KV) and give up."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        self.metrics.in_flight.inc()
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.metrics.in_flight.dec()
            watcher.cancel()
        if not task.done():
            task.cancel()
            for s in streams:
                s.abort()
            raise ClientGone()
        return task.result()

    def sse(self, events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(self._counted(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _counted(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        self.metrics.in_flight.inc()
        try:
            async for event in events:
                yield event
        finally:
            self.metrics.in_flight.dec()

    async def _completion_events(self, streams: list[RequestStream], timers: list[RequestTimer],
                                 streamer: CompletionStreamer, inputs: EngineInputs,
                                 include_usage: bool) -> AsyncIterator[str]:
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in _merge(streams):
                timers[i].on_output(out)
                last[i] = out
                for chunk in streamer.chunks(i, out):
                    yield _event(chunk)
            if include_usage:
                used = sum(o.num_generated_tokens for o in last.values())
                yield _event(streamer.usage_chunk(make_usage(inputs.prompts, used,
                                                             self.cached_tokens(list(last.values())))))
        except (EngineDeadError, RequestFailedError) as exc:
            yield _error_event(_as_api_error(exc))
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

    async def _chat_events(self, streams: list[RequestStream], timers: list[RequestTimer],
                           streamer: ChatStreamer, inputs: EngineInputs, include_usage: bool) -> AsyncIterator[str]:
        last: RequestOutput | None = None
        try:
            async for out in streams[0]:
                timers[0].on_output(out)
                last = out
                for chunk in streamer.chunk(out):
                    yield _event(chunk)
            if include_usage:
                used = last.num_generated_tokens if last is not None else 0
                cached = self.cached_tokens([last] if last is not None else [])
                predicted = prediction_tokens(last.outputs) if last is not None else None
                yield _event(streamer.usage_chunk(make_usage(inputs.prompts, used, cached,
                                                             self.reasoning_tokens(inputs, last), predicted)))
        except (EngineDeadError, RequestFailedError) as exc:
            yield _error_event(_as_api_error(exc))
        finally:
            streams[0].abort()
        yield "data: [DONE]\n\n"

    # -- other routes -------------------------------------------------------
    def _card(self, name: str) -> ModelCard:
        model = self.model
        if name in model.lora_modules:  # vLLM's card of an adapter: its folder, under the base model
            return ModelCard(id=name, root=model.lora_modules[name], parent=model.name,
                             max_model_len=model.max_model_len)
        return ModelCard(id=name, root=model.root or model.name, max_model_len=model.max_model_len)

    async def models(self) -> JSONResponse:
        cards = [self._card(name) for name in self.model.names]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    async def model_card(self, model_id: str) -> JSONResponse:
        check_model(model_id, self.model)
        return JSONResponse(self._card(model_id).model_dump(mode="json"))

    async def health(self) -> Response:
        health = self._health()
        if not health.ok:
            return JSONResponse(error_body(503, health.reason, code="engine_unhealthy"), 503)
        if self.state.draining:
            return JSONResponse(error_body(503, "server is shutting down", code="shutting_down"), 503)
        if health.detail is not None:  # data-parallel replicas: how many serve
            return JSONResponse({"status": "ok", **health.detail})
        return PlainTextResponse("ok")

    def _health(self):
        health = self.engine.health()
        self.metrics.healthy.set(1.0 if health.ok else 0.0)
        if health.detail is not None:
            self.metrics.set_replicas(health.detail["replicas_healthy"], health.detail["replicas_total"])
        return health

    async def metrics_endpoint(self) -> Response:
        self._health()
        self.metrics.engine.update(await self.engine.get_stats())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": VERSION})

    async def load(self) -> JSONResponse:
        """Requests in the engine now, for load-aware routers."""
        return JSONResponse(LoadResponse(server_load=self.engine.num_in_flight).model_dump(mode="json"))

    async def tokenize(self, request: Request) -> JSONResponse:
        req = await self.parse(request, TokenizeRequest)
        check_model(req.model, self.model)
        return JSONResponse(self.processor.tokenize(req).model_dump(mode="json"))

    async def detokenize(self, request: Request) -> JSONResponse:
        req = await self.parse(request, DetokenizeRequest)
        check_model(req.model, self.model)
        return JSONResponse(self.processor.detokenize(req).model_dump(mode="json"))

    async def tokenizer_info(self) -> JSONResponse:
        return JSONResponse(self.processor.tokenizer_info())

    async def invocations(self, request: Request) -> Response:
        """SageMaker's single route: a chat body (``messages``) or a completion
        body; on an embedding model, an embeddings body."""
        body = await self._read_body(request)
        if self.model.pooling:
            handler = classify if self.model.labels else embeddings
            return await handler(self, _replayed(request, body))
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        handler = self.chat if isinstance(data, dict) and "messages" in data else self.completions
        return await handler(_replayed(request, body))


# -- helpers ------------------------------------------------------------------

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ID_STATE = "fluidserve_request_id"


def _routed(timers: list[RequestTimer], streams: list[Any]) -> None:
    """Per-request series go under the replica (vLLM's ``engine``) serving it."""
    for timer, stream in zip(timers, streams):
        timer.routed_to(getattr(stream, "engine", "0"))


def _echo_text(req: ChatCompletionRequest) -> str:
    """Chat ``echo``: the last message's content, when it has the reply's role."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == req.reply_role else ""


class RequestIdHeader:
    """``--enable-request-id-headers``: every response carries X-Request-Id,
    the id its generation ran under, else the one the client sent, else a
    fresh one. Plain ASGI, so streaming and disconnects pass untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Request(scope).headers.get("x-request-id")

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                rid = scope.get("state", {}).get(_ID_STATE) or sent or uuid.uuid4().hex
                message = {**message, "headers": [*message.get("headers", []),
                                                   (b"x-request-id", rid.encode("latin-1", "replace"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)



def validate_body(data: Any, model_cls: type[M], ignore_unknown_fields: bool = False) -> M:
    """A decoded JSON body as ``model_cls``; a 400 naming the bad field (an
    unknown one too, unless ``ignore_unknown_fields``)."""
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data, context={IGNORE_UNKNOWN_FIELDS: ignore_unknown_fields})
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None


async def _client_gone(_: Request, __: Exception) -> Response:
    # Nobody is listening; 499 (nginx's "client closed request") for the log.
    return Response(status_code=499)


def _as_api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"engine unavailable: {exc}", code="engine_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"generation failed: {exc}", code="generation_failed")
    return exc


def _event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


def _error_event(err: BaseException) -> str:
    if not isinstance(err, APIError):
        err = APIError(500, "internal server error")
    return f"data: {json.dumps(error_body(err.status, err.message, err.param, err.code))}\n\n"


def _openapi_with_bodies(app: FastAPI) -> Callable[[], dict[str, Any]]:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_request_schemas(generate())
        return app.openapi_schema

    return openapi


def _replayed(request: Request, body: bytes) -> Request:
    """``request`` with its already-read body delivered again; later
    receives (the disconnect) still come from the client."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait(exc)
            return
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
