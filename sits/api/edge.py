"""The edge: what every HTTP request goes through before any route (a pure ASGI middleware).

It stamps the acceptance time (the zero of every server-side latency), assigns ``x-request-id``
(the client's own when it sends a sane one), hands ``X-Session-ID`` and the W3C trace id to the
runtime as routing hints, checks API keys in constant time, bounds the body
(413 over the limit, 408 for a client that trickles it too slowly), reads every ``/v1`` body as
JSON (``curl -d`` labels it form-urlencoded), refuses new work while the
server drains, and adds ``x-request-id`` / ``server-timing`` to every response.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sits.api.auth import Authenticator
from sits.api.errors import error_body, internal_error_response
from sits.api.metering import RequestAccount, current_account
from sits.memory.sessions import INVALID_SESSION_ID, valid_session_id
from sits.observe import genai
from sits.observe.tracing import Scope as TraceScope
from sits.observe.tracing import close, current_scope, mark_failed, stage
from sits.runtime.hints import RequestHints, current_hints
from sits.tenancy.principal import OPERATOR, current_charges, current_principal

_SANE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_BODY_METHODS = {"POST", "PUT", "PATCH"}
# a request's latency level until its route knows better (a stream is L1)
_LEVEL_BY_PATH = {"/v1/chat/completions": "L2", "/v1/completions": "L2", "/v1/responses": "L2", "/v1/requests": "L3"}
OPEN_PATHS = ("/health", "/ready", "/metrics", "/docs", "/openapi.json", "/redoc")


def _json(status: int, message: str, code: str,
          extra_headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error_body(message, status, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, headers + (extra_headers or []), body


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, *, auth: Authenticator, max_body_bytes: Callable[[], int],
                 draining: Callable[[], bool], body_timeout_s: Callable[[], float] = lambda: 30.0,
                 tracing: Callable[[], object | None] = lambda: None):
        self.app = app
        self.tracing = tracing
        self.auth = auth
        self.max_body_bytes = max_body_bytes
        self.draining = draining
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not _SANE_ID.match(rid):
            rid = uuid.uuid4().hex
        session = headers.get(b"x-session-id", b"").decode("latin-1")
        trace = _TRACEPARENT.match(headers.get(b"traceparent", b"").decode("latin-1"))
        budget, cap = headers.get(b"x-sits-ttft-budget-ms"), headers.get(b"x-sits-cost-cap")
        current_hints.set(RequestHints(session_id=session if valid_session_id(session) else None,
                                       trace_id=trace.group(1) if trace else None,
                                       path=scope.get("path"),
                                       ttft_budget_ms=budget.decode("latin-1") if budget is not None else None,
                                       cost_cap=cap.decode("latin-1") if cap is not None else None))
        state = scope.setdefault("state", {})
        state["sits_accepted_at"] = t0
        state["request_id"] = rid
        rid_header = (b"x-request-id", rid.encode())
        path: str = scope.get("path", "")
        method: str = scope.get("method", "GET")
        tracing = self.tracing()
        root = None
        if tracing is not None and tracing.enabled and not path.startswith(OPEN_PATHS):
            root = tracing.start_request(f"{method} {path}", t0, trace.group(0) if trace else None,
                                         {"http.request.method": method, "url.path": path, "sits.request_id": rid,
                                          genai.LEVEL: _LEVEL_BY_PATH.get(path, "L4")})
            current_scope.set(root)
        if root is not None:
            tp = root.traceparent
        elif trace:      # not traced here: the client's trace id, our own (unsampled) span id
            tp = f"00-{trace.group(1)}-{uuid.uuid4().hex[:16]}-00"
        else:
            tp = None
        tp_header = [(b"traceparent", tp.encode())] if tp else []
        state["sits_traceparent"] = tp
        status_seen: list[int] = []
        try:
            await self._handle(scope, receive, send, headers, t0, [rid_header] + tp_header, path, method, status_seen,
                               root)
        except asyncio.CancelledError:
            raise
        except Exception:
            if status_seen:            # FastAPI's catch-all answered 500 already (and re-raised for the log)
                raise
            status_seen.append(500)    # nothing was answered: a typed 500, never a bare one
            internal = internal_error_response(method, path)
            await send({"type": "http.response.start", "status": 500,
                        "headers": internal.raw_headers + [rid_header] + tp_header})
            await send({"type": "http.response.body", "body": internal.body})
        finally:
            if root is not None:
                status = status_seen[0] if status_seen else 499
                root.span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    mark_failed(str(status), root)
                close(root)       # on the same monotonic timeline as every stage (the wall clock may step)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, headers: dict[bytes, bytes], t0: float,
                      extra_headers: list[tuple[bytes, bytes]], path: str, method: str, status_seen: list[int],
                      root: TraceScope | None) -> None:
        rid_headers = list(extra_headers)

        async def reply(status: int, message: str, code: str,
                        extra: list[tuple[bytes, bytes]] | None = None) -> None:
            st, hs, body = _json(status, message, code, extra)
            status_seen.append(st)
            await send({"type": "http.response.start", "status": st, "headers": hs + rid_headers})
            await send({"type": "http.response.body", "body": body})

        account = None
        if path.startswith("/v1/"):
            principal = OPERATOR
            if self.auth.required():
                scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
                found = self.auth.resolve(token.strip()) if scheme.lower() == "bearer" else None
                if found is None:
                    return await reply(401, "invalid or missing API key: send Authorization: Bearer <key>",
                                       "invalid_api_key", [(b"www-authenticate", b"Bearer")])
                principal = found
                current_principal.set(principal)
            if self.auth.tenancy is not None:       # usage is recorded; a tenant's limits apply
                account = RequestAccount(self.auth.tenancy, principal)
                current_account.set(account)
                current_charges.set(account.charges)
        if self.draining() and method in _BODY_METHODS and path.startswith("/v1/"):
            return await reply(503, "the server is shutting down and takes no new work", "server_shutting_down",
                               [(b"retry-after", b"1"), (b"connection", b"close")])
        session = headers.get(b"x-session-id")
        if session and path.startswith("/v1/") and not valid_session_id(session.decode("latin-1")):
            return await reply(400, INVALID_SESSION_ID, "invalid_session_id")   # it could never be read back

        if method in _BODY_METHODS:
            limit = self.max_body_bytes()
            declared = headers.get(b"content-length")
            if declared is not None:
                try:
                    if int(declared) > limit:
                        return await reply(413, f"request body is {int(declared)} bytes; the limit is {limit}",
                                           "payload_too_large", [(b"connection", b"close")])
                except ValueError:
                    return await reply(400, "Content-Length is not a number", "invalid_request")
            try:
                async with asyncio.timeout(self.body_timeout_s()):     # no extra task, unlike wait_for
                    body = await self._read_body(receive, limit)
            except _TooLarge:
                return await reply(413, f"request body exceeds the limit of {limit} bytes", "payload_too_large",
                                   [(b"connection", b"close")])
            except TimeoutError:
                return await reply(408, f"the request body did not arrive within {self.body_timeout_s():g} s",
                                   "request_timeout", [(b"connection", b"close")])
            except _Disconnected:
                return
            scope["state"]["sits_body"] = body      # the hot path validates it from here
            receive = _replay(body, receive)
            if path.startswith("/v1/") or path.startswith("/admin/"):
                try:
                    body.decode("utf-8")     # JSON is UTF-8 (RFC 8259): refuse anything else here, typed
                except UnicodeDecodeError as e:
                    return await reply(400, f"request body is not valid UTF-8 (byte {e.start})", "invalid_json")
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if path.startswith("/v1/") and ctype in (b"", b"application/x-www-form-urlencoded"):
                # `curl -d` sends form-urlencoded by default; every /v1 body is JSON, so read it as such
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                         + [(b"content-type", b"application/json")]}

        if root is not None:
            root.marks["accepted"] = now = time.monotonic()
            stage("gateway.accept", t0, now, level="L1")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message.get("status", 200))
                hs = list(message.get("headers", []))
                names = {k.lower() for k, _ in hs}
                hs.extend(rid_headers)
                if account is not None and account.headers and b"x-ratelimit-limit-requests" not in names \
                        and b"x-ratelimit-limit-tokens" not in names:
                    hs.extend((k.encode(), v.encode()) for k, v in account.headers.items())
                if b"server-timing" not in names:
                    hs.append((b"server-timing", f"edge;dur={(time.monotonic() - t0) * 1e3:.3f}".encode()))
                message = {**message, "headers": hs}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    @staticmethod
    async def _read_body(receive: Receive, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
