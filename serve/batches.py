"""The OpenAI Batch API: ``/v1/files`` and ``/v1/batches`` routes, input
validation, and the runner that feeds batch lines to the engine as offline
requests.

Owns a batch's life: ``validating`` (the input file is parsed once into
stored lines, or the batch fails with per-line ``errors``), ``in_progress``
(lines run through the same request -> engine -> response path as the online
endpoints, each result committed by ``store.py`` as it finishes),
``finalizing`` -> ``completed`` (output and error files written), and the
side exits ``cancelling`` -> ``cancelled`` and ``expired``.

Flooding is prevented here: at most ``max_in_flight`` lines of all batches
are in the engine at once, and ``_Server.admit_capacity`` leaves them out of
the online queue limit, so a million-line batch never takes an online
request's place. After a crash the runner re-runs exactly the lines with no
committed result.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from math import inf
from typing import TYPE_CHECKING, Any, AsyncIterator, BinaryIO, Callable, Iterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from python_multipart.exceptions import FormParserError
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from fluidserve.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from fluidserve.engine.outputs import RequestOutput
from fluidserve.serve.embeddings import EmbeddingRequest, embedding_body
from fluidserve.serve.scores import RerankRequest, ScoreRequest, scoring_body, scoring_inputs
from fluidserve.serve.errors import APIError, bad_request, error_body, int_param, order_param, query_params
from fluidserve.serve.inputs import check_model
from fluidserve.serve import responses
from fluidserve.serve.protocol import (
    BATCH_ENDPOINTS,
    POOLING_ENDPOINTS,
    BatchCreateRequest,
    ChatCompletionRequest,
    CompletionRequest,
)
from fluidserve.serve.store import (COPY_CHUNK, BatchLine, BatchRecord, FileRecord, LineResult, MissingContent, Store,
                                    StoreError, new_id)

if TYPE_CHECKING:
    from fluidserve.serve.api import _Server

logger = logging.getLogger("fluidserve.batches")

COMPLETION_WINDOW_S = 24 * 3600
MAX_REPORTED_ERRORS = 1000  # errors.data entries kept for a failed validation
EXPIRED_ERROR = {"code": "batch_expired",
                 "message": "This request could not be executed before the completion window expired."}


@dataclass(frozen=True)
class BatchConfig:
    data_dir: str
    max_in_flight: int = 64  # batch lines in the engine at once, all batches together
    max_file_bytes: int = 200 * 1024 * 1024  # OpenAI's upload limit
    max_lines: int = 50_000  # OpenAI's requests-per-batch limit
    retry_s: float = 2.0  # wait before retrying after the engine or the store failed
    store_max_pages: int | None = None  # cap the database size (tests fill the "disk" with it)


# -- input validation ---------------------------------------------------------


def _line_error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def parse_batch_input(content: bytes | BinaryIO, endpoint: str | None,
                      max_lines: int) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The request lines of a batch input file (its bytes, or a binary file
    read one line at a time), or the errors OpenAI reports in
    ``errors.data`` (line numbers 1-based, blank lines skipped). With no
    ``endpoint`` (``run-batch``) each line may use either endpoint."""
    source = io.BytesIO(content) if isinstance(content, (bytes, bytearray, memoryview)) else content
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    num_errors = 0
    seen: set[str] = set()
    no = 0
    # Lines are numbered as str.splitlines numbers the whole text: a UTF-8
    # sequence never contains b"\n", and every splitlines break (b"\r\n"
    # included) ends within the b"\n"-terminated piece it starts in.
    for piece in source:
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError as exc:
            return [], [_line_error("invalid_file_encoding", f"The input file is not UTF-8 ({exc.reason}).", None)]
        for raw in text.splitlines():
            no += 1
            if not raw.strip():
                continue
            obj, err = _check_line(raw, no, endpoint, seen)
            if err is not None:
                num_errors += 1
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(err)
            else:
                lines.append(obj)
    if not lines and not num_errors:
        errors.append(_line_error("empty_file", "The input file contains no requests.", None))
    if len(lines) + num_errors > max_lines:
        errors.insert(0, _line_error("too_many_requests", f"A batch may contain at most {max_lines} requests; "
                                     f"this file has {len(lines) + num_errors}.", None))
    return lines, errors[:MAX_REPORTED_ERRORS]


def _check_line(raw: str, no: int, endpoint: str | None, seen: set[str]) -> tuple[Any, dict[str, Any] | None]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None, _line_error("invalid_json_line", "This line is not parseable as valid JSON.", no)
    if not isinstance(obj, dict):
        return None, _line_error("invalid_json_line", "Each line must be a JSON object.", no)
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return None, _line_error("unsupported_parameter", f"Unknown field '{unknown[0]}' in the request line.",
                                 no, unknown[0])
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, _line_error("missing_required_parameter", "custom_id must be a non-empty string.", no,
                                 "custom_id")
    if obj.get("method") != "POST":
        return None, _line_error("invalid_method", "The method of every request in a batch must be POST.", no,
                                 "method")
    if endpoint is None and obj.get("url") not in BATCH_ENDPOINTS:
        return None, _line_error("invalid_url", f"The url must be one of {', '.join(BATCH_ENDPOINTS)}.", no, "url")
    if endpoint is not None and obj.get("url") != endpoint:
        return None, _line_error("invalid_url", f"The url of this request does not match the batch's endpoint "
                                 f"{endpoint}.", no, "url")
    if not isinstance(obj.get("body"), dict):
        return None, _line_error("missing_required_parameter", "body must be a JSON object.", no, "body")
    if custom_id in seen:
        return None, _line_error("duplicate_custom_id", "The custom_id of this request duplicates an earlier "
                                 "one; custom_id must be unique within a batch.", no, "custom_id")
    seen.add(custom_id)
    return BatchLine(no, custom_id, obj["body"], obj["url"]), None


# -- one line through the online path ----------------------------------------


class _Transient(Exception):
    """The line could not run now (engine down, draining): retry it later,
    record nothing."""


@dataclass(frozen=True)
class LineOutcome:
    status_code: int
    body: dict[str, Any]
    input_tokens: int = 0
    output_tokens: int = 0


class LineExecutor:
    """Runs one batch line exactly as the online endpoint would run its body,
    but as an offline request, and counts what it generates."""

    def __init__(self, server: "_Server", on_tokens: Callable[[int], None] = lambda n: None) -> None:
        self.server = server
        self.on_tokens = on_tokens
        # Engine requests of batch lines that have no output yet: the part of
        # the engine's queue that online admission must not count.
        self.num_queued = 0

    async def run(self, endpoint: str, body: dict[str, Any], request_id: str) -> LineOutcome:
        from fluidserve.serve.api import validate_body

        s = self.server
        try:
            if body.get("stream"):
                raise bad_request("stream: is not supported in a batch", "stream")
            if body.get("background"):  # a line runs in the batch, whose output file is its answer
                raise bad_request("background: is not supported in a batch (every line runs in the background)",
                                  "background")
            if endpoint not in s.model.batch_endpoints:
                raise bad_request(f"url: {s.model.name} does not serve {endpoint} (it serves "
                                  f"{', '.join(s.model.batch_endpoints)})", "url")
            call, num_1 = None, 0
            if endpoint == "/v1/completions":
                req: Any = validate_body(body, CompletionRequest, s.settings.ignore_unknown_fields)
                check_model(req.model, s.model)
                inputs = s.processor.completion(req)
            elif endpoint == "/v1/responses":
                req = validate_body(body, responses.ResponsesRequest, s.settings.ignore_unknown_fields)
                call = await responses.begin(s, req, lambda chat: request_id)
                inputs = call.inputs
            elif endpoint == "/v1/embeddings":
                req = validate_body(body, EmbeddingRequest, s.settings.ignore_unknown_fields)
                check_model(req.model, s.model)
                inputs = s.processor.embedding(req)
            elif endpoint in ("/v1/score", "/v1/rerank"):
                kind = ScoreRequest if endpoint == "/v1/score" else RerankRequest
                req = validate_body(body, kind, s.settings.ignore_unknown_fields)
                check_model(req.model, s.model)
                inputs, num_1 = scoring_inputs(s, req)
            else:
                req = validate_body(body, ChatCompletionRequest, s.settings.ignore_unknown_fields)
                check_model(req.model, s.model)
                inputs = s.processor.chat(req)
            inputs = dataclasses.replace(inputs, klass="offline", final_only=True)
            if s.state.draining:
                raise _Transient("server is draining")
            waiting = [len(inputs.prompts)]
            self.num_queued += waiting[0]
            try:
                streams = await s.submit(request_id, inputs)
                finals = await self._collect(streams, waiting)
            finally:
                self.num_queued -= waiting[0]
            if call is not None:
                reply = await responses.finish(s, call, finals[0])
            else:
                scored = partial(scoring_body, s, num_1)
                render = {"/v1/completions": s.completion_body, "/v1/embeddings": partial(embedding_body, s),
                          "/v1/score": scored, "/v1/rerank": scored}.get(endpoint, s.chat_body)
                response = render(request_id, req, inputs, finals)
        except APIError as err:
            if err.code in ("engine_unavailable", "shutting_down"):
                raise _Transient(err.message) from None
            return LineOutcome(err.status, error_body(err.status, err.message, err.param, err.code))
        if call is not None:
            return LineOutcome(200, reply, reply["usage"]["input_tokens"], reply["usage"]["output_tokens"])
        usage = response.usage
        return LineOutcome(200, response.model_dump(mode="json"), usage.prompt_tokens if usage else 0,
                           getattr(usage, "completion_tokens", 0))

    async def _collect(self, streams: list[RequestStream], waiting: list[int]) -> list[RequestOutput]:
        from fluidserve.serve.api import _as_api_error

        async def one(stream: RequestStream) -> RequestOutput:
            last, counted = None, 0
            async for out in stream:  # the finished output alone (final_only)
                if last is None:
                    waiting[0] -= 1
                    self.num_queued -= 1
                total = sum(len(co.token_ids) for co in out.outputs)
                self.on_tokens(total - counted)
                last, counted = out, total
            assert last is not None
            return last

        try:
            return list(await asyncio.gather(*(one(st) for st in streams)))
        except EngineDeadError as exc:
            raise _Transient(str(exc)) from None
        except RequestFailedError as exc:
            raise _as_api_error(exc) from None
        finally:
            for st in streams:
                st.abort()


def output_line(custom_id: str, request_id: str, outcome: LineOutcome) -> dict[str, Any]:
    """One line of a batch's output or error file, in OpenAI's format."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": outcome.status_code, "request_id": request_id, "body": outcome.body},
            "error": None}


# -- the runner ---------------------------------------------------------------


class BatchRunner:
    """One background task working through active batches, oldest first."""

    def __init__(self, server: "_Server", store: Store, config: BatchConfig) -> None:
        self.server = server
        self.store = store
        self.config = config
        metrics = server.metrics
        self.executor = LineExecutor(server, on_tokens=metrics.offline_tokens.inc)
        server.offline_queued = lambda: self.executor.num_queued
        self._wake = asyncio.Event()
        self._cancels: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task | None = None
        self.current: str | None = None  # the batch whose lines are running
        self.in_flight = 0
        metrics.offline_in_flight.set_function(lambda: self.in_flight)
        self.refresh_status_metrics()

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        """Abandon in-flight lines (they re-run after a restart) and stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.store.close()

    def wake(self) -> None:
        self._wake.set()

    def cancel(self, batch_id: str) -> None:
        self._cancels.setdefault(batch_id, asyncio.Event()).set()
        self.wake()

    def refresh_status_metrics(self) -> None:
        try:
            counts = self.store.count_batches_by_status()
        except StoreError:
            return
        for status in ("validating", "in_progress", "finalizing", "completed", "failed", "expired",
                       "cancelling", "cancelled"):
            self.server.metrics.batches.labels(status).set(counts.get(status, 0))

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if self.server.state.draining:  # lines left now simply run after the restart
                await _wait(self._wake, 1.0)
                continue
            try:
                active = await asyncio.to_thread(self.store.active_batches)
                for batch in active:
                    await self._advance(batch)
                self.refresh_status_metrics()
                if not active:
                    await _wait(self._wake, None)
            except asyncio.CancelledError:
                raise
            except (StoreError, _Transient) as exc:
                logger.error("batch runner paused for %.0f s: %s", self.config.retry_s, exc)
                await _wait(self._wake, self.config.retry_s)
            except Exception:  # noqa: BLE001 - the runner must outlive one bad batch
                logger.exception("batch runner error")
                await _wait(self._wake, self.config.retry_s)

    async def _advance(self, batch: BatchRecord) -> None:
        """Move one batch as far as it can go now."""
        store, bid = self.store, batch.id
        if batch.status == "validating":
            await self._validate(batch)
        elif batch.status == "in_progress":
            if time.time() >= (batch.expires_at or inf):
                await asyncio.to_thread(store.finish_batch, bid, "expired", ("in_progress",), EXPIRED_ERROR)
                return
            self.current = bid
            try:
                done = await self._run_lines(batch)
            finally:
                self.current = None
            if done:
                await asyncio.to_thread(store.set_status, bid, "finalizing", only_from=("in_progress",))
                await asyncio.to_thread(store.finish_batch, bid, "completed", ("finalizing",))
        elif batch.status == "finalizing":
            await asyncio.to_thread(store.finish_batch, bid, "completed", ("finalizing",))
        if (await asyncio.to_thread(store.get_batch, bid)).status == "cancelling":
            await asyncio.to_thread(store.finish_batch, bid, "cancelled", ("cancelling",))
            self._cancels.pop(bid, None)

    async def _validate(self, batch: BatchRecord) -> None:
        try:
            source = await asyncio.to_thread(self.store.open_file, batch.input_file_id)
        except MissingContent:
            source = None
        if source is None:
            errors = [_line_error("file_not_found", f"The input file {batch.input_file_id} no longer exists.",
                                  None, "input_file_id")]
            lines: list[BatchLine] = []
        else:
            # A 200 MB file takes seconds to parse: off the event loop.
            try:
                lines, errors = await asyncio.to_thread(parse_batch_input, source, batch.endpoint,
                                                        self.config.max_lines)
            finally:
                source.close()
        if errors:
            await asyncio.to_thread(self.store.fail_batch, batch.id, errors)
        else:
            await asyncio.to_thread(self.store.start_batch, batch.id, lines)

    async def _run_lines(self, batch: BatchRecord) -> bool:
        """Run the batch's unfinished lines, ``max_in_flight`` at a time.
        True when every line has a result; False when cancelled or stopped
        early (the unfinished lines stay unfinished)."""
        cancel = self._cancels.setdefault(batch.id, asyncio.Event())
        tasks: set[asyncio.Task] = set()
        after, exhausted = -1, False
        try:
            while True:
                if cancel.is_set() or self.server.state.draining or time.time() >= (batch.expires_at or inf):
                    return False  # _advance finishes a cancelled or expired batch
                room = self.config.max_in_flight - len(tasks)
                if room > 0 and not exhausted:
                    fresh = await asyncio.to_thread(self.store.pending_lines, batch.id, room, after)
                    exhausted = len(fresh) < room
                    for line in fresh:
                        tasks.add(asyncio.ensure_future(self._run_line(batch, line)))
                        after = line.line_no
                if not tasks:
                    return exhausted
                waiter = asyncio.ensure_future(cancel.wait())
                finished, _ = await asyncio.wait(tasks | {waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                for task in finished - {waiter}:
                    tasks.discard(task)
                    task.result()  # a transient failure stops this pass; the runner retries later
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_line(self, batch: BatchRecord, line: BatchLine) -> None:
        request_id = f"{batch.id}-{line.line_no}"
        self.in_flight += 1
        try:
            outcome = await self.executor.run(batch.endpoint, line.body, request_id)
        finally:
            self.in_flight -= 1
        result = LineResult(line.line_no, outcome.status_code == 200,
                            output_line(line.custom_id, request_id, outcome),
                            outcome.input_tokens, outcome.output_tokens)
        await asyncio.to_thread(self.store.record_result, batch.id, result)


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        pass


# -- HTTP routes --------------------------------------------------------------


def file_json(rec: FileRecord) -> dict[str, Any]:
    return {"id": rec.id, "object": "file", "bytes": rec.bytes, "created_at": rec.created_at,
            "filename": rec.filename, "purpose": rec.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def batch_json(b: BatchRecord) -> dict[str, Any]:
    errors = {"object": "list", "data": b.errors} if b.errors else None
    usage = {"input_tokens": b.input_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": b.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": b.input_tokens + b.output_tokens}
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id, "created_at": b.created_at,
        "in_progress_at": b.in_progress_at, "expires_at": b.expires_at, "finalizing_at": b.finalizing_at,
        "completed_at": b.completed_at, "failed_at": b.failed_at, "expired_at": b.expired_at,
        "cancelling_at": b.cancelling_at, "cancelled_at": b.cancelled_at,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata, "model": b.model, "usage": usage,
    }


def _page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


class BatchAPI:
    """The route handlers; with no config every route says how to enable it."""

    def __init__(self, server: "_Server", config: BatchConfig | None) -> None:
        self.server = server
        self.config = config
        self.store = Store(config.data_dir, max_pages=config.store_max_pages) if config else None
        self.runner = BatchRunner(server, self.store, config) if config and self.store else None

    def start(self) -> None:
        if self.runner is not None:
            self.runner.start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.stop()

    def _store(self) -> Store:
        if self.store is None:
            raise APIError(404, "The Batch API is disabled: start the server with --data-dir", code="not_enabled")
        return self.store

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except StoreError as exc:
            full = "is full" in str(exc)
            raise APIError(507 if full else 500, str(exc), code="storage_full" if full else "storage_error") from None

    # -- files --------------------------------------------------------------
    async def create_file(self, request: Request) -> JSONResponse:
        store = self._store()
        assert self.config is not None
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise bad_request("files must be uploaded as multipart/form-data", "file")
        form = await _read_form(request, self.config.max_file_bytes + 64 * 1024)
        try:
            unknown = sorted(set(form) - {"file", "purpose"})
            if unknown:
                raise bad_request(f"{unknown[0]}: is not supported", unknown[0])
            if "purpose" not in form:
                raise bad_request("purpose: is required", "purpose")
            purpose = await _field_text(form["purpose"])
            if purpose != "batch":
                raise bad_request(f"purpose: only 'batch' is supported, got '{purpose[:64]}'", "purpose")
            if "file" not in form:
                raise bad_request("file: is required", "file")
            upload = form["file"]
            if isinstance(upload, UploadFile):
                filename, source = upload.filename, upload.file
            else:  # a plain field, which Starlette keeps in memory up to its 1 MB part limit
                filename, source = None, io.BytesIO(upload.encode("utf-8"))
            size = source.seek(0, io.SEEK_END)
            source.seek(0)
            if size > self.config.max_file_bytes:
                raise APIError(413, f"file: exceeds the limit of {self.config.max_file_bytes} bytes", param="file",
                               code="file_too_large")
            rec = await self._call(store.add_file, filename or "upload.jsonl", purpose, source)
        finally:
            await form.close()
        return JSONResponse(file_json(rec))

    async def list_files(self, request: Request) -> JSONResponse:
        store = self._store()
        q = query_params(request, ("after", "limit", "order", "purpose"))
        limit = int_param(q, "limit", 10_000, 1, 10_000)
        order = order_param(q)
        page = await self._call(store.list_files, after=q.get("after"), limit=limit, order=order,
                                purpose=q.get("purpose"))
        return JSONResponse(_page([file_json(f) for f in page.items], page.has_more))

    async def _file(self, file_id: str) -> FileRecord:
        rec = await self._call(self._store().get_file, file_id)
        if rec is None:
            raise APIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        return rec

    async def get_file(self, file_id: str) -> JSONResponse:
        return JSONResponse(file_json(await self._file(file_id)))

    async def file_content(self, file_id: str) -> Response:
        source = await self._call(self._store().open_file, file_id)
        if source is None:
            raise APIError(404, f"No such File object: {file_id}", param="id", code="not_found")
        size = source.seek(0, io.SEEK_END)
        source.seek(0)
        return StreamingResponse(_read_chunks(source), media_type="application/octet-stream",
                                 headers={"Content-Length": str(size)})

    async def delete_file(self, file_id: str) -> JSONResponse:
        await self._file(file_id)
        deleted = await self._call(self._store().delete_file, file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": bool(deleted)})

    # -- batches ------------------------------------------------------------
    async def create_batch(self, request: Request) -> JSONResponse:
        store = self._store()
        req = await self.server.parse(request, BatchCreateRequest)
        rec = await self._call(store.get_file, req.input_file_id)
        if rec is None:
            raise APIError(404, f"No such File object: {req.input_file_id}", param="input_file_id",
                           code="not_found")
        if rec.purpose != "batch":
            raise bad_request(f"input_file_id: file {rec.id} has purpose '{rec.purpose}', not 'batch'",
                              "input_file_id")
        served = self.server.model.batch_endpoints
        if req.endpoint not in served:
            raise bad_request(f"endpoint: {self.server.model.name} serves {', '.join(served)} in a batch"
                              + (" (with --runner pooling)" if req.endpoint in POOLING_ENDPOINTS else ""),
                              "endpoint")
        now = int(time.time())
        batch = BatchRecord(id=new_id("batch_"), input_file_id=req.input_file_id, endpoint=req.endpoint,
                            completion_window=req.completion_window, status="validating", created_at=now,
                            metadata=req.metadata, model=self.server.model.name,
                            expires_at=now + COMPLETION_WINDOW_S)
        await self._call(store.create_batch, batch)
        if self.runner is not None:
            self.runner.wake()
            self.runner.refresh_status_metrics()
        return JSONResponse(batch_json(batch))

    async def _batch(self, batch_id: str) -> BatchRecord:
        rec = await self._call(self._store().get_batch, batch_id)
        if rec is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="not_found")
        return rec

    async def get_batch(self, batch_id: str) -> JSONResponse:
        return JSONResponse(batch_json(await self._batch(batch_id)))

    async def list_batches(self, request: Request) -> JSONResponse:
        store = self._store()
        q = query_params(request, ("after", "limit"))
        limit = int_param(q, "limit", 20, 1, 100)
        page = await self._call(store.list_batches, after=q.get("after"), limit=limit)
        return JSONResponse(_page([batch_json(b) for b in page.items], page.has_more))

    async def cancel_batch(self, batch_id: str) -> JSONResponse:
        store = self._store()
        batch = await self._batch(batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return JSONResponse(batch_json(batch))
        moved = await self._call(store.set_status, batch_id, "cancelling", only_from=("validating", "in_progress"))
        if not moved:
            batch = await self._batch(batch_id)
            if batch.status not in ("cancelling", "cancelled"):
                raise APIError(409, f"Cannot cancel a batch with status '{batch.status}'", param="batch_id",
                               code="invalid_state")
        if self.runner is not None:
            self.runner.cancel(batch_id)
            if self.runner.current != batch_id:
                # Queued behind another batch: nothing of it runs, finish now
                # (the runner's own finish then finds it final and does nothing).
                await self._call(store.finish_batch, batch_id, "cancelled", ("cancelling",))
            self.runner.refresh_status_metrics()
        return JSONResponse(batch_json(await self._batch(batch_id)))


def install_batch_api(app: FastAPI, server: "_Server", config: BatchConfig | None, auth: list) -> BatchAPI:
    """Add the /v1/files and /v1/batches routes; the returned object's
    ``start``/``stop`` belong in the app's lifespan."""
    api = BatchAPI(server, config)
    routes = (
        ("/v1/files", api.create_file, "POST"),
        ("/v1/files", api.list_files, "GET"),
        ("/v1/files/{file_id}", api.get_file, "GET"),
        ("/v1/files/{file_id}", api.delete_file, "DELETE"),
        ("/v1/files/{file_id}/content", api.file_content, "GET"),
        ("/v1/batches", api.create_batch, "POST"),
        ("/v1/batches", api.list_batches, "GET"),
        ("/v1/batches/{batch_id}", api.get_batch, "GET"),
        ("/v1/batches/{batch_id}/cancel", api.cancel_batch, "POST"),
    )
    for path, handler, method in routes:
        app.add_api_route(path, handler, methods=[method], dependencies=auth)
    return api


# -- multipart ----------------------------------------------------------------


class _UploadParser(MultiPartParser):
    """Starlette's multipart parser (python-multipart underneath; file parts
    spooled to temporary files past 1 MB), told whether the closing
    boundary came: python-multipart takes a body cut short as complete."""

    complete = False

    def on_end(self) -> None:
        self.complete = True


async def _read_form(request: Request, limit: int) -> FormData:
    """The multipart form of ``request``, refused with 413 as soon as the
    body passes ``limit`` bytes, so an oversize upload is never spooled
    whole. The caller closes the form."""

    def too_large() -> APIError:
        return APIError(413, f"file: upload exceeds the limit of {limit} bytes", param="file", code="file_too_large",
                        headers={"Connection": "close"})

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large()

    async def body() -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > limit:
                raise too_large()
            yield chunk

    async with contextlib.aclosing(body()) as stream:
        parser = _UploadParser(request.headers, stream)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise bad_request(f"malformed multipart/form-data body: {exc.message}", "file") from None
        except FormParserError as exc:  # older Starlette lets python-multipart's own errors through
            raise bad_request(f"malformed multipart/form-data body: {exc}", "file") from None
    if not parser.complete:
        await form.close()
        raise bad_request("malformed multipart/form-data body: no closing boundary", "file")
    return form


async def _field_text(value: str | UploadFile) -> str:
    if isinstance(value, str):
        return value
    return (await value.read(1024)).decode("utf-8", "replace")


def _read_chunks(source: BinaryIO) -> Iterator[bytes]:
    try:
        while chunk := source.read(COPY_CHUNK):
            yield chunk
    finally:
        source.close()


# -- fluidserve run-batch -----------------------------------------------------


async def run_batch_file(server: "_Server", lines: list[BatchLine], out: Any, max_in_flight: int,
                         progress: Callable[[int, int, int], None]) -> tuple[int, int]:
    """Run ``lines`` through ``server``'s request path without HTTP, writing
    each output line to ``out`` as it finishes. Returns (succeeded, failed)."""
    tokens = [0]
    executor = LineExecutor(server, on_tokens=lambda n: tokens.__setitem__(0, tokens[0] + n))
    slots = asyncio.Semaphore(max_in_flight)
    counts = [0, 0]

    async def one(line: BatchLine) -> None:
        async with slots:
            request_id = f"run-batch-{line.line_no}-{uuid.uuid4().hex[:8]}"
            outcome = await executor.run(line.url, line.body, request_id)
        out.write(json.dumps(output_line(line.custom_id, request_id, outcome)) + "\n")
        counts[outcome.status_code != 200] += 1
        progress(counts[0] + counts[1], counts[1], tokens[0])

    await asyncio.gather(*(one(line) for line in lines))
    return counts[0], counts[1]


def run_batch_main(argv: Sequence[str]) -> int:
    """``fluidserve run-batch -i in.jsonl -o out.jsonl [engine flags]``: a
    batch file run offline, no server; one output line per request line
    (errors included, with their status code), in finishing order."""
    import argparse
    import sys

    from fluidserve.engine.async_engine import AsyncEngine
    from fluidserve.engine.heap import frozen_heap
    from fluidserve.serve.api import build_app
    from fluidserve.serve.cli import (add_serve_args, build_engine, engine_config_from_args, frontend_tokenizer,
                                      load_chat_template, model_info, server_settings)

    parser = argparse.ArgumentParser(prog="fluidserve run-batch",
                                     description="run an OpenAI batch input file offline, without a server")
    parser.add_argument("-i", "--input-file", required=True, help="batch input JSONL (OpenAI's format)")
    parser.add_argument("-o", "--output-file", required=True, help="where to write the output JSONL")
    add_serve_args(parser)
    args = parser.parse_args(list(argv))
    try:
        with open(args.input_file, "rb") as f:
            lines, errors = parse_batch_input(f, None, max_lines=sys.maxsize)
    except OSError as exc:
        print(f"fluidserve run-batch: {exc}", file=sys.stderr)
        return 2
    if errors:
        for e in errors[:20]:
            where = f"line {e['line']}: " if e["line"] else ""
            print(f"fluidserve run-batch: {where}{e['message']} ({e['code']})", file=sys.stderr)
        return 2
    try:
        # The server's own frontend flags: the same template, sampling
        # defaults, names and tool parsing as the same lines served online.
        settings = server_settings(args)
        chat_template = load_chat_template(args.chat_template)
        engine, thread = build_engine(engine_config_from_args(args))
        info = model_info(engine, args.served_model_name, args.generation_config, args.max_logprobs, chat_template)
        app = build_app(AsyncEngine(engine, thread=thread), frontend_tokenizer(engine, chat_template), info,
                        settings)
    except (ValueError, OSError) as exc:
        print(f"fluidserve run-batch: {exc}", file=sys.stderr)
        return 2
    server = app.state.server
    start = time.monotonic()

    def progress(done: int, failed: int, tokens: int) -> None:
        rate = tokens / max(time.monotonic() - start, 1e-6)
        print(f"\rrun-batch: {done}/{len(lines)} requests, {failed} failed, {rate:.0f} tok/s",
              end="", file=sys.stderr, flush=True)

    async def run() -> tuple[int, int]:
        server.engine.start()
        try:
            with open(args.output_file, "w", encoding="utf-8") as out:
                return await run_batch_file(server, lines, out, args.batch_max_in_flight, progress)
        finally:
            await server.engine.shutdown()

    try:
        with frozen_heap(collect_first=True):
            ok, failed = asyncio.run(run())
    except _Transient as exc:
        print(f"\nfluidserve run-batch: {exc}", file=sys.stderr)
        return 1
    print(f"\nrun-batch: wrote {ok + failed} lines to {args.output_file} ({failed} failed) in "
          f"{time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0
