"""Errors a client can cause, as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}.

Every path out of the app that reports a failure goes through `error_response`, so clients (and the
official `openai` package, which raises by status) always see the same shape."""
from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvserve.server")

# Sent with every 503 that shutdown answers: the client may retry in a few seconds, at another replica or at
# this one restarted.
SHUTDOWN_RETRY_AFTER = {"Retry-After": "5"}

# vLLM's names for the error types, keyed by status.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

# "n must be an integer >= 1, got 0": SamplingParams and the engine name the field first.
_FIELD_FIRST = re.compile(r"^([a-z_]+) ")
_PATH_FIRST = re.compile(r"^([a-z_][a-z_0-9.]*) ")
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|bytes|none|.*[\[\]\-].*)$")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    if param is None:
        m = _FIELD_FIRST.match(message)
        param = m.group(1) if m else None
    return OpenAIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if loc[:1] in (["body"], ["query"]):    # where the field was, not which field
        loc = loc[1:]
    # A union's branch that pydantic tried ("prompt.str", "stop.list[str].1") is no field of the request.
    loc = [part for part in loc if not _UNION_BRANCH.match(part)]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # pydantic's prefix for our checks
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {msg}", None
    if param is None and (m := _PATH_FIRST.match(msg)):  # a check of the whole body names the field first
        return msg, m.group(1)
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI raises 400 "There was an error parsing the body" for undecodable bodies
        # (non-UTF-8, nesting too deep for the JSON parser); 404/405 for unknown routes.
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault; logged with its traceback, reported without internals.
        logger.exception("unhandled error: %s", exc)
        return error_response(500, "internal server error")
