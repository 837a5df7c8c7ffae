"""Every error the server returns, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

This is the one place that turns exceptions into HTTP errors, so clients see the same shape whatever
failed: a pydantic validation error (FastAPI's bare 422 becomes a 400), malformed JSON, an engine
``ValueError`` (400, with the parameter named when the message starts with it), an unknown route, a
dead engine (503), or a bug (500, logged with its traceback; the client sees no internals).
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tideserve.engine.async_engine import EngineDeadError, QueueFullError
from tideserve.errors import EngineBusyError, EngineSleepingError

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# SamplingParams and engine messages start with the parameter they are about: "top_p must be ...",
# "logit_bias['50'] must be ...".
_LEADING_PARAM = re.compile(r"^([a-z_]+)(?:\[[^\]]*\])?(?:=\S+)? (?:must|is|has)\b")


class OpenAIError(Exception):
    """An error to return as-is: status, message, and the request field it concerns (if any)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.err_type = err_type


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message,
                      "type": err_type or ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", ""),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, err_type), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def from_exception(exc: BaseException) -> OpenAIError:
    """Map an exception raised while serving a request to the error the client gets."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError | EngineSleepingError):
        return OpenAIError(503, str(exc), headers={"Retry-After": "5"} if isinstance(exc, EngineSleepingError)
                           else None)
    if isinstance(exc, EngineBusyError):
        return OpenAIError(409, str(exc))
    if isinstance(exc, ValueError):
        message = str(exc)
        param = getattr(exc, "param", None)
        match = _LEADING_PARAM.match(message)
        return OpenAIError(400, message, param or (match.group(1) if match else None))
    logger.error("internal error while serving a request", exc_info=exc)
    return OpenAIError(500, f"Internal server error ({type(exc).__name__}); see the server log.")


_BRANCH = re.compile(r"[a-z]+\[.*\]|str|int|float|bool|list|dict|function-.*")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable one-line message and the offending field for pydantic/FastAPI validation errors."""
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON{': ' + str(detail) if detail else ''}.", None
    raw_loc = [p for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    # A union's branch names (e.g. "str", "list[int]") are noise in a field path.
    loc = [str(p) for p in raw_loc if not (isinstance(p, str) and _BRANCH.fullmatch(p))]
    param = ".".join(loc) or None
    shown = repr(first.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    if first.get("type") == "missing":
        return f"{param or 'a field'} is required.", param
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "The request body must be a JSON object.", None
    branches = []
    for err in errors:
        err_loc = [p for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        branch = err_loc[1] if len(err_loc) > 1 and err_loc[:1] == raw_loc[:1] else None
        if isinstance(branch, str) and _BRANCH.fullmatch(branch) and branch not in branches:
            branches.append(branch)
    if len(branches) > 1:
        top = str(raw_loc[0])
        expected = ", ".join(branches)
        return f"{top} has an invalid type or value: expected one of {expected}; got {shown}.", top
    msg = first.get("msg", "invalid value")
    extra = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return f"{param or 'request'}: {msg}, got {shown}{extra}.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers, exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Not found: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        return error_response(err.status, err.message, err.param, err.headers)

    for kind in (ValueError, QueueFullError, EngineDeadError):
        app.add_exception_handler(kind, _mapped)

    @app.exception_handler(Exception)
    async def _any_error(request: Request, exc: Exception) -> JSONResponse:
        err = from_exception(exc)
        return error_response(err.status, err.message, err.param, err.headers)
