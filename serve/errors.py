"""Every error the server returns, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``, or on Anthropic's
routes (``/v1/messages``) in Anthropic's: ``{"type": "error", "error":
{"type", "message"}}``.

Owns the mapping from failures to status codes, and the reading of query
parameters (an unknown one, or a bad value, is a 400 naming it). A client
mistake is always a 4xx — the official client retries every 5xx, so a 5xx for
bad input would be repeated. Messages are capped so a huge body can never echo
back megabytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fluidserve.serve.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("fluidserve.serve")

MAX_MESSAGE_CHARS = 1024

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in a request handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def cap(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "...(truncated)"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    info = ErrorInfo(message=cap(message), type=kind, param=param, code=code)
    return ErrorResponse(error=info).model_dump(mode="json")


ANTHROPIC_ROUTES = "/v1/messages"  # their errors take Anthropic's shape


def error_response(err: APIError, path: str = "") -> JSONResponse:
    if path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(anthropic_error_body(err.status, err.message), err.status, headers=err.headers)
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, headers=err.headers)


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": cap(message)}}


# OpenAI's code for a prompt (and completion) longer than the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_value_error(exc: ValueError) -> APIError:
    """A ``ValueError`` whose message starts with the parameter it names
    (SamplingParams' and the engine's convention) as a 400."""
    message = str(exc) or "invalid request"
    first = message.split(" ", 1)[0].rstrip(":")
    param = first if first.isidentifier() and first.islower() and len(message.split(" ", 1)) > 1 else None
    return bad_request(message, param)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Pydantic's error list, without the offending input, as one 400."""
    parts: list[str] = []
    param: str | None = None
    # FastAPI's own error (a bad query or path parameter) takes no options;
    # only "loc" and "msg" are read, never the input.
    errors = (exc.errors(include_url=False, include_input=False, include_context=False)
              if isinstance(exc, ValidationError) else exc.errors())
    for e in errors[:8]:
        loc = [str(x) for x in e.get("loc", ())]
        # FastAPI's locations start with where the value was (a body field may be named "query").
        if not isinstance(exc, ValidationError) and loc and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if loc:
            param = param or loc[0]
            parts.append(f"{'.'.join(loc)}: {msg}")
        else:
            param = param or (msg.split(":", 1)[0] if ":" in msg else None)
            parts.append(msg)
    return bad_request("; ".join(parts) or "invalid request body", param)


def install_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can raise through OpenAI's error shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message, path = str(exc.detail), request.url.path
        if exc.status_code == 404 and message == "Not Found":  # no route: say which, as OpenAI does
            message = unserved_message(getattr(app.state, "unserved", {}), path) or \
                f"Invalid URL ({request.method} {path})"
        elif exc.status_code == 405 and message == "Method Not Allowed":
            allowed = {k.lower(): v for k, v in (exc.headers or {}).items()}.get("allow")
            message = f"{request.method} is not allowed on {path}" + (f" (only {allowed})" if allowed else "")
        err = APIError(exc.status_code, message, headers=dict(exc.headers or {}))
        return error_response(err, path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in request handler")
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"), request.url.path)


def unserved_message(unserved: dict[str, str], path: str) -> str | None:
    """Why ``path`` has no route here, where another kind of model serves it
    (``unserved``: such paths, without their path parameters -> why)."""
    path = path.rstrip("/")
    under = [prefix for prefix in unserved if path == prefix or path.startswith(prefix + "/")]
    return unserved[max(under, key=len)] if under else None


def query_params(request: Request, allowed: Sequence[str]) -> dict[str, str]:
    """The query string's parameters; an unknown one is a 400 naming it."""
    unknown = sorted(set(request.query_params) - set(allowed))
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown query parameter", unknown[0])
    return dict(request.query_params)


def int_param(query: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name}: must be an integer", name) from None
    if not lo <= value <= hi:
        raise bad_request(f"{name}: must be between {lo} and {hi}", name)
    return value


def order_param(query: dict[str, str]) -> str:
    """A list's ``order``: "asc" or "desc" (the default, newest first)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order: must be 'asc' or 'desc'", "order")
    return order
