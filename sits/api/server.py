"""``sits serve``: one model behind the HTTP surface, on uvicorn.

The HTTP server starts first and the engine loads behind it (``/health`` answers at once,
``/ready`` says 503 until the weights are loaded and warm-up is done), so an orchestrator can tell
"starting" from "dead". On SIGINT/SIGTERM the server drains before uvicorn closes connections:
in-flight streams get ``drain_grace_s`` to finish and are then ended with a ``server_shutting_down``
error chunk instead of a cut connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys

import uvicorn
from fastapi import FastAPI

from sits.api.app import create_app, drain
from sits.api.backend import BackendRegistry, EngineBackend
from sits.api.context import ServerSettings
from sits.api.http_protocol import guarded_protocol
from sits.engine.async_engine import AsyncEngine
from sits.engine.cold_start import ColdStartReport
from sits.engine.config import EngineConfig
from sits.engine.errors import SitsError
from sits.runtime.instance_supervisor import SupervisedInstance

log = logging.getLogger("sits.serve")


def serving_process_defaults() -> None:
    """Process-wide settings of a serving front end. A request's prompt is tokenized on the thread
    that handles it: the tokenizers library would hand even a batch of one to its thread pool (a
    cross-thread round trip, and threads that compete with the engine for the cores)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def event_loop_factory():
    """uvloop where it is installed (uvicorn[standard] brings it; uvicorn.run would pick it too, but
    these servers run under our own asyncio runner), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class DrainingServer(uvicorn.Server):
    """uvicorn, but a shutdown first drains the app (streams told why they end)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float):
        settings: ServerSettings = app.state.sits.settings
        if config.http == "auto":      # the request head gets a deadline and a size cap (slowloris, huge headers)
            config.http = guarded_protocol(settings.header_timeout_s, settings.max_header_bytes)
        super().__init__(config)
        self.sits_app = app
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        await drain(self.sits_app, self.grace_s)
        await super().shutdown(sockets)


ENGINE_MODES = ("process", "thread")


def build_app(engine_cfg: EngineConfig, settings: ServerSettings, served_name: str | None = None,
              on_ready=None, on_fail=None, engine_mode: str = "process") -> FastAPI:
    """``engine_mode="process"`` (default) runs the engine in an instance process: the HTTP event loop
    and the engine's step loop then never wait on each other's GIL. ``"thread"`` keeps it in-process."""
    if engine_mode not in ENGINE_MODES:
        raise ValueError(f"engine_mode must be one of {ENGINE_MODES}, got {engine_mode!r}")
    name = served_name or os.path.basename(os.path.normpath(engine_cfg.model))
    registry = BackendRegistry(loading=[name])
    stoppers: list = []

    async def load(app: FastAPI) -> None:
        try:
            if engine_mode == "process":
                backend = await SupervisedInstance.spawn(engine_cfg, name)
                stoppers.append(backend.shutdown)
                report = ColdStartReport.from_dict(backend.cold_start)
            else:
                engine = await AsyncEngine.start(engine_cfg)
                stoppers.append(engine.shutdown)
                backend = EngineBackend(engine, name=name)
                report = engine.engine.report
        except Exception as e:
            if isinstance(e, SitsError):      # expected and typed (unsupported model, bad files): no traceback
                log.error("loading %s failed: %s (%s)", engine_cfg.model, e.message, e.code)
            else:
                log.exception("loading %s failed", engine_cfg.model)
            registry.loading.discard(name)
            if on_fail is not None:
                on_fail()
            raise
        registry.add(backend)
        log.info("cold start of %s (%s):\n%s", name, engine_mode, report.format())
        if on_ready is not None:
            on_ready(name, report)

    async def stop(app: FastAPI) -> None:
        for fn in stoppers:
            await fn()

    return create_app(registry, settings, on_startup=[load], on_shutdown=[stop])


def usage_banner(name: str, host: str, port: int, api_key: str | None) -> str:
    base = f"http://{host}:{port}"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    key = api_key or "none"
    return f"""
SITS is serving {name!r} at {base}  (OpenAPI: {base}/docs, metrics: {base}/metrics)

  curl -s {base}/v1/completions{auth} -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "prompt": "The Python language", "max_tokens": 32}}'

  curl -sN {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32, "stream": true}}'

  curl -s {base}/v1/requests{auth} -H 'Content-Type: application/json' \\
       -d '{{"prompt": "Once upon a time", "constraints": {{"max_tokens": 32, "timeout_ms": 10000}}}}'
  # then: curl -sN {base}/v1/requests/<id>/events

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='{key}'); \\
print(c.chat.completions.create(model='{name}', messages=[{{'role': 'user', 'content': 'Hi'}}], max_tokens=32).choices[0].message.content)"
"""


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (as uvicorn binds it) before anything else exists: a port in use
    fails here, before an engine, a zygote or a banner, with one clear error."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)       # uvicorn's backlog; connections wait in it while the app starts
    except OSError as e:
        sock.close()
        raise SitsError(f"cannot listen on {host}:{port}: {e.strerror or e}", code="listen_failed") from None
    return sock


def serve(engine_cfg: EngineConfig, settings: ServerSettings, *, host: str = "127.0.0.1", port: int = 8000,
          served_name: str | None = None, log_level: str = "info", switch_interval_s: float = 0.0005,
          engine_mode: str = "process") -> int:
    # The engine's step thread and the event loop share the GIL. CPython makes a thread that wants
    # the GIL wait up to the switch interval (5 ms by default) while the other runs Python code, so
    # every token event would reach its client up to 5 ms late; 0.5 ms bounds that wait. Only the
    # `--engine thread` mode shares a GIL; a one-stream probe gave ≈ 4.5 -> 3.9 ms of HTTP overhead,
    # not a recorded benchmark (docs/benchmarks.md compares the engine modes, not this setting).
    sock = listen_socket(host, port)
    sys.setswitchinterval(switch_interval_s)
    serving_process_defaults()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    shown_key = settings.api_keys[0] if settings.api_keys else None

    def on_ready(name: str, report: ColdStartReport) -> None:
        print(f"{name}: {report.format()}", file=sys.stderr)
        print(usage_banner(name, host, port, shown_key), file=sys.stderr, flush=True)

    failed = False
    server: DrainingServer | None = None

    def on_fail() -> None:
        nonlocal failed
        failed = True
        if server is not None:
            server.should_exit = True

    app = build_app(engine_cfg, settings, served_name, on_ready, on_fail, engine_mode)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=30, access_log=False)
    server = DrainingServer(config, app, settings.drain_grace_s)
    with sock, asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(server.serve(sockets=[sock]))
    return 1 if failed else 0
