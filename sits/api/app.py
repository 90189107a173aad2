"""The ASGI app: both dialects, health and readiness, metrics, the edge, and draining.

``create_app`` takes the backends to serve (``sits serve``: one in-process engine; the runtime's
gateway: its units) and returns a FastAPI app. Its OpenAPI schema documents what is actually
answered (400 with the OpenAI error body where FastAPI would say 422; SSE where a route streams),
which is what the schemathesis test holds it to.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sits import __version__
from sits.api.auth import Authenticator
from sits.api.backend import BackendRegistry
from sits.api.context import ServerContext, ServerSettings
from sits.api.edge import EdgeMiddleware
from sits.api.errors import install_error_handlers
from sits.api.hot_path import HotRoutes
from sits.api.metrics import CONTENT_TYPE, ServerMetrics
from sits.api import adapter_routes, tenant_routes
from sits.api.openai import embedding_routes
from sits.api.openai import routes as openai_routes
from sits.api.openai import responses as responses_routes
from sits.api.sits import memory_routes, session_routes, tool_routes
from sits.api.sits import routes as sits_routes
from sits.api.sits.request_store import RequestStore
from sits.api.sits.webhooks import WebhookDispatcher
from sits.observe.otel_metrics import GenAiMetrics
from sits.observe.tracing import Tracing
from sits.engine.errors import SitsError
from sits.memory.sessions import open_session_store
from sits.memory.vectors import open_memory_store
from sits.tenancy.metrics import TenantCollector
from sits.tenancy.service import Tenancy
from sits.tools import ToolRegistry, ToolRunner

log = logging.getLogger("sits.api")


class ServerShuttingDownError(SitsError):
    code = "server_shutting_down"
    http_status = 503


class SitsApp(FastAPI):
    """FastAPI entered through the edge: every HTTP request meets ``entry`` (the edge, then the
    generation endpoints' hot path) first, and reaches FastAPI's own stack only when it needs it."""

    entry: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.entry is None:
            return await super().__call__(scope, receive, send)
        scope["app"] = self            # as Starlette does: routes find app.state through the request
        await self.entry(scope, receive, send)


def create_app(registry: BackendRegistry, settings: ServerSettings | None = None, *,
               on_startup: list[Callable[[FastAPI], Awaitable[None]]] | None = None,
               on_shutdown: list[Callable[[FastAPI], Awaitable[None]]] | None = None,
               memory=None, tenancy: Tenancy | None = None) -> FastAPI:
    """``on_startup`` hooks run as background tasks (e.g. loading a model while /ready says 503);
    ``on_shutdown`` hooks run after the drain (e.g. stopping engines); ``memory``: a MemoryStore
    someone else owns (the gateway's), else one in ``settings.data_dir``; ``tenancy`` likewise."""
    settings = settings or ServerSettings()
    tracing = Tracing(settings.trace_exporter, rates=settings.trace_level_rates)
    metrics = ServerMetrics(lambda: [(b.name, b.stats()) for b in registry.all()],
                            otel=GenAiMetrics(settings.otel_metrics))
    ctx = ServerContext(registry=registry, metrics=metrics, settings=settings, tracing=tracing,
                        sessions=open_session_store(settings.session_store, settings.data_dir),
                        tools=ToolRegistry(list(settings.tool_dirs)), tool_runner=ToolRunner(),
                        memory=memory if memory is not None or settings.data_dir is None
                        else open_memory_store(settings.data_dir))
    ctx.tenancy = tenancy if tenancy is not None or (settings.data_dir is None and settings.tenant_store is None) \
        else Tenancy.open(settings.data_dir, settings.tenant_store)
    if ctx.tenancy is not None:
        metrics.registry.register(TenantCollector(ctx.tenancy))
    ctx.store = RequestStore(retention_s=settings.request_retention_s, max_finished=settings.max_retained_requests,
                             max_pending=settings.max_pending_requests)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.webhooks = WebhookDispatcher(metrics, secret=settings.webhook_secret,
                                               max_attempts=settings.webhook_max_attempts,
                                               backoff_s=settings.webhook_backoff_s,
                                               timeout_s=settings.webhook_timeout_s,
                                               allow_private=settings.allow_private_callbacks)
        if ctx.tenancy is not None:     # before the first request: keys must be known before any call is let in
            await ctx.tenancy.start()
        tasks = [asyncio.create_task(hook(app)) for hook in on_startup or []]
        try:
            yield
        finally:
            await drain(app, grace_s=settings.drain_grace_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await app.state.webhooks.aclose()
            await ctx.tool_runner.close()
            for hook in on_shutdown or []:
                await hook(app)
            tracing.shutdown()
            metrics.otel.shutdown()
            if ctx.sessions is not None:
                await ctx.sessions.close()
            if ctx.memory is not None and memory is None:
                ctx.memory.close()
            if ctx.tenancy is not None and tenancy is None:
                await ctx.tenancy.aclose()

    app = SitsApp(title="SITS", version=__version__, lifespan=lifespan,
                  description="A serverless runtime for LLM inference: the OpenAI dialect and the SITS "
                              "request dialect (PENDING -> VALIDATING -> EXECUTING -> RESOLVED | REJECTED).")
    app.state.sits = ctx
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(sits_routes.router)
    app.include_router(session_routes.router)
    app.include_router(tool_routes.router)
    app.include_router(memory_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(tenant_routes.admin)
    app.include_router(tenant_routes.usage_router)
    app.include_router(adapter_routes.router)

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, Any]:
        """The process is up and its engines' loops are alive (not the same as ready)."""
        dead = [b.name for b in registry.all() if not b.ready]
        if dead:
            return JSONResponse({"status": "unhealthy", "dead": dead}, status_code=503)
        return {"status": "ok", "uptime_s": round(time.time() - ctx.started_at, 3)}

    @app.get("/ready", tags=["ops"], responses={503: {"description": "loading, warming up, or draining"}})
    async def ready() -> dict[str, Any]:
        """Ready for traffic: every model loaded and warmed up, and not draining."""
        models = {b.name: b.stats().cold_start.get("phases_ms", {}) for b in registry.all()}
        if ctx.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not registry.ready:
            return JSONResponse({"status": "loading", "loading": sorted(registry.loading),
                                 "models": sorted(models)}, status_code=503)
        return {"status": "ready", "models": models}

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    hot = HotRoutes(functools.partial(FastAPI.__call__, app), enabled=lambda: settings.hot_path)
    app.entry = EdgeMiddleware(hot, auth=Authenticator(lambda: settings.api_keys, ctx.tenancy),
                               max_body_bytes=lambda: settings.max_body_bytes, draining=lambda: ctx.draining,
                               body_timeout_s=lambda: settings.body_timeout_s, tracing=lambda: ctx.tracing)
    app.openapi = lambda: _openapi(app)
    return app


async def drain(app: FastAPI, grace_s: float) -> int:
    """Stop taking work, give in-flight requests ``grace_s`` to finish, then end them with a reason.

    Streams get an error chunk (``server_shutting_down``) and ``[DONE]``; SITS requests become
    REJECTED ``server_shutting_down``. Returns how many were cut short.
    """
    ctx: ServerContext = app.state.sits
    ctx.draining = True
    deadline = time.monotonic() + grace_s
    store: RequestStore = ctx.store  # type: ignore[assignment]
    while (len(ctx.inflight) or store.live()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cut = ctx.inflight.abort_all(ServerShuttingDownError("the server is shutting down; this request was cut short"))
    tasks = [tr.task for tr in store.live() if tr.task is not None and not tr.task.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=2.0)
    if cut or tasks:
        log.warning("drain: %d engine request(s) and %d tracked request(s) cut short", cut, len(tasks))
    return cut + len(tasks)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with 422 replaced by the 400 this app really answers."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.setdefault("responses", {})
            # the edge answers these for any route (request head too slow / too large)
            responses.setdefault("408", {"description": "the request head or body arrived too slowly"})
            responses.setdefault("431", {"description": "the request head (line + headers) is too large"})
            if "422" in responses:
                del responses["422"]
                responses.setdefault("400", {"description": "invalid request (OpenAI error body)",
                                             "content": {"application/json": {"schema": {
                                                 "$ref": "#/components/schemas/ErrorResponse"}}}})
    comps = schema.get("components", {}).get("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    app.openapi_schema = schema
    return schema


__all__ = ["create_app", "drain", "Request"]
