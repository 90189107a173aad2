"""``sits up``: the gateway with its units, on uvicorn.

The same app as ``sits serve`` (both dialects, metrics, the edge, draining) over the gateway's
units instead of one engine, plus the control API. Units come from the persisted set in the data
directory and from ``--config`` (which wins on a name clash).
"""

from __future__ import annotations

import asyncio
import logging
import sys

import uvicorn
from fastapi import FastAPI
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.api import admin_routes, control_routes, finetune_routes
from sits.api.app import create_app
from sits.api.backend import BackendRegistry
from sits.api.context import ServerSettings
from sits.api.server import DrainingServer, event_loop_factory, listen_socket, serving_process_defaults, usage_banner
from sits.runtime.gateway import Gateway
from sits.runtime.mesh_unit import MeshUnit
from sits.runtime.unit import UnitBackend
from sits.runtime.unit_spec import UnitSpec

log = logging.getLogger("sits.up")


class _GatewayCollector(Collector):
    def __init__(self, gw: Gateway):
        self.gw = gw

    def collect(self):
        inst = GaugeMetricFamily("sits:unit_instances", "instances per unit and state", labels=["unit", "state"])
        desired = GaugeMetricFamily("sits:unit_desired_instances", "the autoscaler's target", labels=["unit"])
        health = GaugeMetricFamily("sits:unit_slo_health", "SLO health score (1 = SLO met)", labels=["unit"])
        starts = CounterMetricFamily("sits:instance_starts", "instances started", labels=["unit"])
        crashes = CounterMetricFamily("sits:instance_crashes", "instances that died", labels=["unit"])
        decisions = CounterMetricFamily("sits:autoscaler_decisions", "scaling changes", labels=["unit", "direction"])
        breaker = GaugeMetricFamily("sits:sla_breaker_state", "SLA breaker state (1 for the current one)",
                                    labels=["unit", "state"])
        attain = GaugeMetricFamily("sits:sla_attainment", "share of responses that met the SLO over the window",
                                   labels=["unit"])
        moves = CounterMetricFamily("sits:sla_breaker_transitions", "SLA breaker transitions by target state",
                                    labels=["unit", "state"])
        shed = CounterMetricFamily("sits:sla_rejected_requests", "requests the open breaker turned away "
                                   "(to the fallback or a 503)", labels=["unit"])
        faults = CounterMetricFamily("sits:fault_injections", "times an injected fault acted", labels=["unit", "kind"])
        mesh_served = CounterMetricFamily("sits:mesh_requests", "requests a mesh's tier answered",
                                          labels=["mesh", "tier"])
        mesh_escalated = CounterMetricFamily("sits:mesh_escalations", "tiers a mesh gave up on, by rule",
                                             labels=["mesh", "reason"])
        for name, b in self.gw.units.items():
            if isinstance(b, UnitBackend):      # a remote unit has no instances of its own
                counts: dict[str, int] = {}
                for i in b.pool.instances:
                    counts[i.state.value] = counts.get(i.state.value, 0) + 1
                for state in ("STARTING", "WARMING", "READY", "DRAINING"):
                    inst.add_metric([name, state], counts.get(state, 0))
                desired.add_metric([name], b.pool.desired)
                if b.last_decision is not None and b.last_decision.health is not None:
                    health.add_metric([name], b.last_decision.health)
                starts.add_metric([name], b.pool.starts)
                crashes.add_metric([name], b.pool.crashes)
            for state in ("CLOSED", "HALF_OPEN", "OPEN"):
                breaker.add_metric([name, state], 1.0 if b.breaker.state.value == state else 0.0)
            if (rate := b.breaker.attainment()) is not None:
                attain.add_metric([name], rate)
            shed.add_metric([name], b.breaker.rejected)
            for kind, n in b.fault_hits.items():
                faults.add_metric([name, kind], n)
            if isinstance(b, MeshUnit):
                for tier in b.spec.mesh.tiers:
                    mesh_served.add_metric([name, tier], b.served_by.get(tier, 0))
                for reason, n in b.escalations.items():
                    mesh_escalated.add_metric([name, reason], n)
        for (unit, direction), n in self.gw.decisions.items():
            decisions.add_metric([unit, direction], n)
        for (unit, state), n in self.gw.breaker_transitions.items():
            moves.add_metric([unit, state], n)
        yield from (inst, desired, health, starts, crashes, decisions, breaker, attain, moves, shed, faults,
                    mesh_served, mesh_escalated)


def build_gateway_app(gateway: Gateway, config_units: list[UnitSpec], settings: ServerSettings) -> FastAPI:
    registry = BackendRegistry(mapping=gateway.units, loading=["(gateway starting)"])

    async def start(app: FastAPI) -> None:
        try:
            await gateway.start(config_units)
        finally:
            registry.loading.clear()

    async def stop(app: FastAPI) -> None:
        await gateway.shutdown()

    app = create_app(registry, settings, on_startup=[start], on_shutdown=[stop], memory=gateway.memory,
                     tenancy=gateway.tenancy)
    app.state.gateway = gateway
    app.include_router(control_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(finetune_routes.router)
    app.state.sits.metrics.registry.register(_GatewayCollector(gateway))
    app.openapi_schema = None
    return app


def up(config_units: list[UnitSpec], settings: ServerSettings, *, data_dir: str, host: str = "127.0.0.1",
       port: int = 8000, log_level: str = "info", tick_s: float = 1.0, prefetch: bool = True,
       ray: str | None = None, memory_budget_mb: float | None = None,
       gpu_memory_mb: float | None = None) -> int:
    sock = listen_socket(host, port)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serving_process_defaults()
    base = f"http://{host}:{port}"
    url_opt = "" if (host, port) == ("127.0.0.1", 8000) else f" --url {base}"    # the CLI's default

    async def main() -> None:
        gateway = Gateway(data_dir, tick_s=tick_s, prefetch=prefetch, tenant_store=settings.tenant_store, ray=ray,
                          memory_budget_mb=memory_budget_mb, gpu_memory_mb=gpu_memory_mb)
        app = build_gateway_app(gateway, config_units, settings)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                access_log=False)
        server = DrainingServer(config, app, settings.drain_grace_s)
        names = ", ".join(u.name for u in config_units) or "the persisted units"
        print(f"SITS gateway at {base} (units: {names}; data: {data_dir})", file=sys.stderr)
        if config_units:
            key = settings.api_keys[0] if settings.api_keys else None
            print(usage_banner(config_units[0].name, host, port, key).replace("SITS is serving", "Unit"),
                  file=sys.stderr)
        print(f"  sits status{url_opt}\n  sits iu list{url_opt}\n"
              f"  sits iu deploy --file examples/chat-unit.yaml{url_opt}\n", file=sys.stderr, flush=True)
        await server.serve(sockets=[sock])

    with sock, asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main())
    return 0
