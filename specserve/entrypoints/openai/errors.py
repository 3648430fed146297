"""Every error the server sends is OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}``.

Bad input must never look like a server fault, so the handlers here map FastAPI's validation
errors (wrong types, invalid JSON, wrong content type, unknown fields) to 400 with a message
that names the field, and routing errors (404, 405) to the same format. Only a real bug gets a
500, and even that one is JSON the OpenAI client can parse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.async_engine import EngineDeadError, ServerOverloadedError
from specserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
_TYPE_BY_STATUS = {
    400: INVALID_REQUEST,
    401: "authentication_error",
    404: "not_found_error",
    405: INVALID_REQUEST,
    413: INVALID_REQUEST,
    415: INVALID_REQUEST,
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}
# Longest input echoed back in a validation message.
MAX_SHOWN_INPUT = 60
# Fields typed as unions, whose per-branch pydantic errors read poorly: say what is allowed.
UNION_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids (ints) or a list "
              "of lists of token ids",
    "stop": "stop must be a string or a list of strings",
}
MAX_LISTED_ERRORS = 3


class APIError(Exception):
    """An error answered to the client as is (status, OpenAI type, offending param)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: int | str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else status
        self.type = type or _TYPE_BY_STATUS.get(status, INVALID_REQUEST)


class BodyTooLargeError(APIError):
    """Raised while the body arrives (middleware) once it exceeds the size limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} "
                         "bytes (--max-request-body-bytes).", code="request_too_large")


def error_body(status: int, message: str, param: str | None = None,
               code: int | str | None = None, type: str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=type or _TYPE_BY_STATUS.get(status, INVALID_REQUEST),
                     param=param, code=code if code is not None else status)
    return ErrorResponse(error=info).model_dump()


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code, exc.type),
                        status_code=exc.status, headers=headers)


# ---- validation messages ---------------------------------------------------------------------
def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_INPUT else text[: MAX_SHOWN_INPUT - 3] + "..."


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic/FastAPI error -> (message, param)."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail}).", None
    if kind == "missing" and not loc:
        return "the request body is missing: send a JSON object.", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}.", loc[0]
    if not loc:
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return ("the request body must be a JSON object sent with "
                    "'Content-Type: application/json'.", None)
        return f"request body: {err.get('msg', 'invalid')}.", None
    # Drop pydantic's union branch tags ("str", "list[int]") from the shown path.
    path = ".".join(p for p in loc if not (p[:1].isalpha() and "[" in p) and p not in
                    ("str", "int", "float", "bool", "list", "dict", "function-after"))
    msg = err.get("msg", "invalid value")
    if "input" in err and kind != "missing":
        msg += f", got {_shown(err['input'])}"
    return f"{path or loc[0]}: {msg}.", loc[0]


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """Merge pydantic errors into one message (one line per field, union branches merged)."""
    seen: dict[str, str] = {}
    first_param: str | None = None
    # Of a union's branch errors, the deepest one says most ("content.0.type: should be 'text'").
    errors = sorted(errors, key=lambda e: -len(e.get("loc", ())))
    for err in errors:
        msg, param = _describe(err)
        if param in UNION_HINTS and err.get("type") != "missing" and param not in seen:
            loc = [p for p in err.get("loc", ()) if p != "body"]
            shown = _shown(err.get("input")) if len(loc) == 2 else "a list with a wrong entry"
            msg = f"{UNION_HINTS[param]}, got {shown}."  # loc 2: (field, branch) = whole value
        key = param or msg
        if key in seen:
            continue
        seen[key] = msg
        if first_param is None:
            first_param = param
    lines = list(seen.values())
    more = len(lines) - MAX_LISTED_ERRORS
    text = " ".join(lines[:MAX_LISTED_ERRORS])
    if more > 0:
        text += f" (and {more} more)"
    return text, first_param


# ---- handlers ------------------------------------------------------------------------------
async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    try:
        message, param = validation_message(exc.errors())
    except Exception:  # a message we cannot format is still the client's mistake
        logger.exception("could not format validation errors")
        message, param = "the request is invalid; see /docs for the expected body.", None
    return error_response(APIError(400, message, param=param))


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc.__cause__, APIError):  # FastAPI wraps errors raised while reading the body
        return error_response(exc.__cause__)
    status = exc.status_code
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if status == 404 and message == "Not Found":
        message = ("no such endpoint; see /docs for the API (/v1/completions, "
                   "/v1/chat/completions, /v1/models, ...).")
    return error_response(APIError(status, message), headers=getattr(exc, "headers", None))


async def _on_overloaded(_: Request, exc: ServerOverloadedError) -> JSONResponse:
    return error_response(APIError(429, str(exc), code="queue_full"),
                          headers={"Retry-After": "1"})


async def _on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(APIError(503, str(exc)))


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error while serving a request")
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ServerOverloadedError, _on_overloaded)
    app.add_exception_handler(EngineDeadError, _on_engine_dead)
    app.add_exception_handler(Exception, _on_unexpected)
