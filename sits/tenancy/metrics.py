"""Per-tenant Prometheus series, read from ``Tenancy`` at scrape time (nothing is counted twice).
Usage totals are this gateway's; budgets and requests in flight are the ledger's (a shared ledger's
as of its last refresh). The unlabelled tenant ``""`` is the operator's and an open server's own
traffic."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class TenantCollector(Collector):
    def __init__(self, tenancy):
        self.tenancy = tenancy

    def collect(self):
        t = self.tenancy
        labels = ["tenant", "unit", "outcome"]
        requests = CounterMetricFamily("sits:tenant_requests", "requests settled, per tenant, unit and outcome", labels=labels)
        tokens = CounterMetricFamily("sits:tenant_tokens", "tokens used (kind: prompt, cached, completion)",
                                     labels=["tenant", "unit", "kind"])
        flops = CounterMetricFamily("sits:tenant_flops", "floating-point operations computed", labels=["tenant", "unit"])
        kv = CounterMetricFamily("sits:tenant_kv_block_seconds", "KV-cache blocks held x seconds", labels=["tenant", "unit"])
        gbh = CounterMetricFamily("sits:tenant_instance_gb_hours", "instance memory-time (weights + KV) apportioned "
                                  "by busy time", labels=["tenant", "unit"])
        colds = CounterMetricFamily("sits:tenant_cold_starts", "instance starts a tenant's requests caused",
                                    labels=["tenant", "unit"])
        cost = CounterMetricFamily("sits:tenant_cost", "cost units charged (the units' price tables)", labels=["tenant", "unit"])
        refused = CounterMetricFamily("sits:tenant_rejections", "requests refused by a limit or budget (429)",
                                      labels=["tenant", "code"])
        remaining = GaugeMetricFamily("sits:tenant_budget_remaining", "what a budget has left this period "
                                      "(settled and reserved taken off)", labels=["tenant", "period", "measure"])
        active = GaugeMetricFamily("sits:tenant_requests_in_flight", "admitted requests not yet finished", labels=["tenant"])
        per_unit: dict[tuple[str, str], list[float]] = {}
        for (tenant, unit, outcome), u in list(t.totals.items()):
            if outcome != "instance":
                requests.add_metric([tenant, unit, outcome], u.requests)
            agg = per_unit.setdefault((tenant, unit), [0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0])
            for i, v in enumerate((u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.flops, u.kv_block_seconds,
                                   u.cost, u.gb_hours, u.cold_starts)):
                agg[i] += v
        for (tenant, unit), (p, c, o, f, k, money, gb, cs) in per_unit.items():
            gbh.add_metric([tenant, unit], gb)
            colds.add_metric([tenant, unit], cs)
            for kind, n in (("prompt", p), ("cached", c), ("completion", o)):
                tokens.add_metric([tenant, unit, kind], n)
            flops.add_metric([tenant, unit], f)
            kv.add_metric([tenant, unit], k)
            cost.add_metric([tenant, unit], money)
        for (tenant, code), n in list(t.rejections.items()):
            refused.add_metric([tenant, code], n)
        for (kind, ident), in_flight, budgets in t.ledger.snapshot():
            if kind != "tenant":
                continue
            active.add_metric([ident], in_flight)
            for v in budgets:
                for measure in ("tokens", "cost"):
                    if f"{measure}_remaining" in v:
                        remaining.add_metric([ident, v["period"], measure], v[f"{measure}_remaining"])
        yield from (requests, tokens, flops, kv, gbh, colds, cost, refused, remaining, active)
