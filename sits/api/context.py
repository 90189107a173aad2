"""What every route of one app shares: the served backends, metrics, in-flight work and settings.

One ``ServerContext`` per app (kept on ``app.state.sits``), never module globals, so tests can run
several servers in one process and the gateway can mount the same routes over its own backends.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from sits.api.backend import BackendRegistry
from sits.api.generation import InflightRegistry
from sits.api.metrics import ServerMetrics


@dataclass
class ServerSettings:
    api_keys: tuple[str, ...] = ()          # empty: no auth
    max_body_bytes: int = 1 << 20           # 413 above this
    body_timeout_s: float = 30.0            # 408 when a request body takes longer to arrive
    header_timeout_s: float = 10.0          # 408 and close when a request head takes longer (slowloris)
    max_header_bytes: int = 64 * 1024       # 431 above this (request line + headers)
    webhook_secret: str | None = None       # HMAC-SHA256 signature on webhook POSTs when set
    request_retention_s: float = 600.0      # finished SITS requests stay readable this long
    max_retained_requests: int = 10_000     # ... and at most this many are kept
    max_pending_requests: int = 4096        # unfinished SITS requests at once (429 above)
    webhook_max_attempts: int = 5
    webhook_backoff_s: float = 0.25         # first retry delay, doubled each attempt
    webhook_timeout_s: float = 5.0
    allow_private_callbacks: bool = False   # callback_url may point at loopback / private hosts
    admin_keys: tuple[str, ...] = ()        # empty: the /admin endpoints are off (403)
    trace_exporter: str | None = None       # none | console | otlp | memory; None: from the OTEL_* env
    trace_level_rates: dict[str, float] | None = None   # tail-sampling share per level (default L1 1 .. L4 0.01)
    otel_metrics: str | None = None         # none | otlp | console | memory; None: from the OTEL_* env
    data_dir: str | None = None             # where embedded state lives (sessions.db); None: no sessions by default
    session_store: str | None = None        # redis://..., sqlite:///path, none; None: SQLite in data_dir
    tenant_store: str | None = None         # redis://... (gateways sharing tenants); None: SQLite in data_dir
    tool_dirs: tuple[str, ...] = ()         # directories of extra tool contracts (*.yaml) beside the built-ins
    drain_grace_s: float = 10.0             # on shutdown, in-flight streams get this long to finish
    hot_path: bool = True                   # generation endpoints skip FastAPI's router (sits.api.hot_path)


@dataclass
class ServerContext:
    registry: BackendRegistry
    metrics: ServerMetrics
    settings: ServerSettings = field(default_factory=ServerSettings)
    inflight: InflightRegistry = field(default_factory=InflightRegistry)
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    store: object | None = None             # sits.api.sits.request_store.RequestStore, set by create_app
    tracing: object | None = None           # sits.observe.tracing.Tracing, set by create_app
    sessions: object | None = None          # sits.memory.sessions.SessionStore, set by create_app
    tools: object | None = None             # sits.tools.ToolRegistry, set by create_app
    tool_runner: object | None = None       # sits.tools.ToolRunner (worker processes), set by create_app
    memory: object | None = None            # sits.memory.vectors.MemoryStore (with a data_dir), set by create_app
    tenancy: object | None = None           # sits.tenancy.service.Tenancy (with a data_dir), set by create_app
    responses: object | None = None         # sits.api.openai.response_store.ResponseStore, made on first use


def context_of(request: Request) -> ServerContext:
    return request.app.state.sits


def new_request_id() -> str:
    return uuid.uuid4().hex


def accepted_at(request: Request) -> float:
    """When the edge middleware accepted this request (time.monotonic), or now."""
    return request.scope.get("state", {}).get("sits_accepted_at") or time.monotonic()
