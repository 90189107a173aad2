"""The generation endpoints on a short path: plain ASGI from the edge to the route function.

Before a FastAPI route's own code runs, the router matches the path, the dependency solver builds
the arguments, the body is decoded to Python objects and validated from them, and the request
passes an exception middleware and an exit stack. That is ≈ 0.3 ms of Python per request warm,
and about three times more on a busy 2-core host, where an engine step leaves the caches cold:
the largest share of the server's time to first token. ``HotRoutes`` serves ``POST
/v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses`` with the same request models (validated
straight from the bytes with ``model_validate_json``), the same route functions and the same error
bodies; everything else, and these three with ``ServerSettings.hot_path`` off, goes through FastAPI
unchanged. The OpenAPI schema still comes from the FastAPI routes, which stay registered.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sits.api.errors import (UNPARSABLE_BODY, error_body, internal_error_response, sits_error_response,
                             validation_error_response)
from sits.api.openai import responses as responses_routes
from sits.api.openai import routes as openai_routes
from sits.api.openai.responses_protocol import ResponsesRequest
from sits.api.protocol import ChatCompletionRequest, CompletionRequest
from sits.engine.errors import SitsError

Endpoint = Callable[[BaseModel, Request], Awaitable[Response]]

ROUTES: dict[tuple[str, str], tuple[type[BaseModel], Endpoint]] = {
    ("POST", "/v1/chat/completions"): (ChatCompletionRequest, openai_routes.create_chat_completion),
    ("POST", "/v1/completions"): (CompletionRequest, openai_routes.create_completion),
    ("POST", "/v1/responses"): (ResponsesRequest, responses_routes.create_response),
}

# what FastAPI answers for an empty body: the required body is missing
_MISSING = [{"type": "missing", "loc": ("body",), "msg": "Field required"}]


class HotRoutes:
    """ASGI: the routes in ``ROUTES`` served directly, the rest handed to ``fallback`` (FastAPI).

    It runs inside the edge, which has read the body (``scope["state"]["sits_body"]``), checked
    keys and limits, and adds ``x-request-id`` / ``server-timing`` to whatever is answered here.
    """

    def __init__(self, fallback: ASGIApp, enabled: Callable[[], bool] = lambda: True):
        self.fallback = fallback
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = ROUTES.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        body = scope.get("state", {}).get("sits_body")
        if route is None or body is None or not self.enabled():
            return await self.fallback(scope, receive, send)
        model, endpoint = route
        try:
            response = await endpoint(parse_body(model, body), Request(scope, receive))
        except ValidationError as e:
            response = validation_error_response(e.errors(include_url=False))
        except _Unparsable as e:
            response = e.response
        except SitsError as e:
            response = sits_error_response(scope["method"], scope["path"], e)
        except Exception:  # noqa: BLE001 - logged with its traceback; the client gets a typed 500
            response = internal_error_response(scope["method"], scope["path"])
        await response(scope, receive, send)


class _Unparsable(Exception):
    def __init__(self, response: Response):
        self.response = response


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """``model`` from the raw body, deciding every input as FastAPI's route would.

    pydantic's JSON parser is stricter than Python's ``json`` (lone surrogate escapes, ``NaN``), and
    FastAPI reads bodies with ``json``: a body pydantic cannot parse is read the FastAPI way, so
    both paths give the same answer (the common case never gets here).
    """
    if not body:
        raise _Unparsable(validation_error_response(_MISSING))
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        if e.errors(include_url=False)[0]["type"] != "json_invalid":
            raise
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise _Unparsable(validation_error_response(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
              "ctx": {"error": e.msg}}])) from None
    except (RecursionError, ValueError):
        raise _Unparsable(JSONResponse(error_body(UNPARSABLE_BODY, 400, "invalid_json"), status_code=400)) from None
    return model.model_validate(data)
