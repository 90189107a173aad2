"""HTTP errors in the OpenAI format: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx with a stable ``code``; the handlers installed by
``install_error_handlers`` make sure no traceback and no framework-shaped body ever reaches a client.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from sits.engine.errors import SitsError

log = logging.getLogger("sits.api")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                   413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                   499: "invalid_request_error", 503: "service_unavailable_error"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body, also used by the SITS dialect."""

    error: ErrorDetail


def error_docs(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a router: each status with the OpenAI error body and what it means here."""
    return {status: {"model": ErrorResponse, "description": text} for status, text in descriptions.items()}


class ModelNotFoundError(SitsError):
    code = "model_not_found"
    http_status = 404


class AuthenticationError(SitsError):
    code = "invalid_api_key"
    http_status = 401


class PayloadTooLargeError(SitsError):
    code = "payload_too_large"
    http_status = 413


class RequestNotFoundError(SitsError):
    code = "request_not_found"
    http_status = 404


class ConflictError(SitsError):
    code = "conflict"
    http_status = 409


class ServiceUnavailableError(SitsError):
    code = "service_unavailable"
    http_status = 503


UNPARSABLE_BODY = "request body is not valid JSON (UTF-8, bounded nesting and numbers)"


def clip(text: str, limit: int = 64) -> str:
    """A client-supplied name, quoted and cut short: errors name what was wrong without echoing megabytes."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, status: int, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_response(err: SitsError, headers: dict[str, str] | None = None) -> JSONResponse:
    status = err.http_status
    return JSONResponse(error_body(err.message, status, err.code, err.param), status_code=status,
                        headers=headers)


def sits_error_as_dict(err: SitsError) -> dict[str, Any]:
    return error_body(err.message, err.http_status, err.code, err.param)["error"]


def _validation_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str, str | None]:
    """(message, code, param) for the first problem pydantic found in a request body."""
    if not errors:
        return "invalid request body", "invalid_request", None
    first = errors[0]
    kind = first.get("type", "")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return (f"request body is not valid JSON: {ctx.get('error', 'parse error')}", "invalid_json", None)
    if kind == "missing":
        if param is None:
            return "request body is missing; send a JSON object", "missing_body", None
        return f"{param} is required", "missing_parameter", param
    if kind in ("model_type", "dict_type", "model_attributes_type") and param is None:
        return "request body must be a JSON object", "invalid_json", None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), "invalid_parameter", param


def validation_error_response(errors: Sequence[dict[str, Any]]) -> JSONResponse:
    """The 400 for a body pydantic refused (FastAPI's RequestValidationError or a ValidationError)."""
    message, code, param = _validation_error(errors)
    return JSONResponse(error_body(message, 400, code, param), status_code=400)


def sits_error_response(method: str, path: str, exc: SitsError) -> JSONResponse:
    """A typed error as its HTTP answer (with ``retry-after`` where the error names one)."""
    if exc.http_status >= 500 and exc.http_status != 503:   # 503s (loading, draining) are expected
        log.warning("%s %s -> %s %s: %s", method, path, exc.http_status, exc.code, exc.message)
    headers = dict(exc.headers or {})
    if exc.retry_after_s is not None:
        headers["retry-after"] = str(exc.retry_after_s)
    return error_response(exc, headers=headers or None)


def internal_error_response(method: str, path: str) -> JSONResponse:
    """An unexpected exception: logged with its traceback here, a bare 500 for the client."""
    log.exception("unhandled error on %s %s", method, path)
    return JSONResponse(error_body("internal server error; the server logged the details", 500,
                                   "internal_error"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SitsError)
    async def _sits_error(request: Request, exc: SitsError) -> JSONResponse:
        return sits_error_response(request.method, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 400 and "error parsing the body" in message:
            # FastAPI's answer for bodies its JSON parser cannot read (invalid UTF-8, nesting too deep,
            # a number too long to convert): the same stable code as any other malformed JSON
            code, message = "invalid_json", UNPARSABLE_BODY
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(message, exc.status_code, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if _is_redis_error(exc):      # a shared store (sessions, tenants) that cannot be reached: retry later
            log.warning("%s %s: Redis unavailable (%s: %s)", request.method, request.url.path, type(exc).__name__, exc)
            body = error_body("a shared store (Redis) cannot be reached now; retry shortly", 503, "store_unavailable")
            return JSONResponse(body, status_code=503, headers={"retry-after": "1"})
        return internal_error_response(request.method, request.url.path)


def _is_redis_error(exc: BaseException) -> bool:
    try:
        from redis.exceptions import RedisError
    except ImportError:
        return False
    return isinstance(exc, RedisError)
