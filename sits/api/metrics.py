"""Prometheus metrics for ``GET /metrics``, named parallel to vLLM's so dashboards port over.

Latency histograms use the OpenTelemetry GenAI server buckets. Engine state (running / waiting
requests, KV use, prefix-cache and preemption counts, cold-start phases) is read from the engine
at scrape time by a custom collector, so the serving path never updates those itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.api.sits.lifecycle import LifecycleEvent
from sits.engine.messages import EngineStats, TokenEvent
from sits.observe.genai import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
from sits.observe.otel_metrics import GenAiMetrics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[tuple[str, EngineStats]]]):
        self._sources = sources

    def collect(self):
        running = GaugeMetricFamily("sits:num_requests_running", "requests in the running batch", labels=["model_name"])
        waiting = GaugeMetricFamily("sits:num_requests_waiting", "requests waiting for admission", labels=["model_name"])
        kv = GaugeMetricFamily("sits:kv_cache_usage_perc", "KV-cache blocks in use (1 = full)", labels=["model_name"])
        kv_blocks = GaugeMetricFamily("sits:kv_cache_blocks", "KV-cache blocks preallocated", labels=["model_name"])
        queries = CounterMetricFamily("sits:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      labels=["model_name"])
        hits = CounterMetricFamily("sits:prefix_cache_hits", "prompt tokens served from the prefix cache",
                                   labels=["model_name"])
        preempt = CounterMetricFamily("sits:num_preemptions", "running requests preempted for KV space",
                                      labels=["model_name"])
        steps = CounterMetricFamily("sits:engine_steps", "engine steps executed", labels=["model_name"])
        cold = GaugeMetricFamily("sits:cold_start_phase_milliseconds", "engine start-up, by phase",
                                 labels=["model_name", "phase"])
        for name, s in self._sources():
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            kv.add_metric([name], s.kv_usage)
            kv_blocks.add_metric([name], s.num_kv_blocks)
            queries.add_metric([name], s.prefix_queries)
            hits.add_metric([name], s.prefix_hits)
            preempt.add_metric([name], s.num_preemptions)
            steps.add_metric([name], s.num_steps)
            for phase, ms in (s.cold_start.get("phases_ms") or {}).items():
                cold.add_metric([name, phase], ms)
        yield from (running, waiting, kv, kv_blocks, queries, hits, preempt, steps, cold)


class ServerMetrics:
    """One registry per app (tests run several apps in one process)."""

    def __init__(self, engine_stats: Callable[[], Iterable[tuple[str, EngineStats]]] | None = None,
                 otel: GenAiMetrics | None = None):
        self.otel = otel or GenAiMetrics("none")
        self.registry = CollectorRegistry()
        r = self.registry
        m = ["model_name"]
        self.ttft = Histogram("sits:time_to_first_token_seconds", "time to first token (engine arrival -> first token)",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("sits:inter_token_latency_seconds", "time between consecutive output tokens",
                             m, buckets=TPOT_BUCKETS, registry=r)
        self.tpot = Histogram("sits:request_time_per_output_token_seconds", "mean decode time per output token",
                              m, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("sits:e2e_request_latency_seconds", "engine arrival -> last token",
                             m, buckets=DURATION_BUCKETS, registry=r)
        self.queue = Histogram("sits:request_queue_time_seconds", "engine arrival -> first scheduled",
                               m, buckets=DURATION_BUCKETS, registry=r)
        self.prefill = Histogram("sits:request_prefill_time_seconds", "first scheduled -> first token",
                                 m, buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("sits:prompt_tokens", "prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("sits:generation_tokens", "tokens generated", m, registry=r)
        self.request_success = Counter("sits:request_success", "finished generations by finish reason",
                                       m + ["finished_reason"], registry=r)
        self.requests_finished = Counter("sits:requests_finished", "requests by final state and error code",
                                         ["state", "code"], registry=r)
        self.transitions = Counter("sits:request_state_transitions", "request lifecycle transitions",
                                   ["state"], registry=r)
        self.webhook_deliveries = Counter("sits:webhook_deliveries", "webhook POSTs by outcome", ["outcome"],
                                          registry=r)
        if engine_stats is not None:
            r.register(_EngineCollector(engine_stats))

    # -- per token events -------------------------------------------------------------------------
    def observe_token(self, model: str, ev: TokenEvent, prev_time: float | None) -> None:
        """Record one engine event; ``prev_time`` is the previous token's time (None for the first)."""
        if prev_time is None:
            if ev.first_token_time is not None:
                self.ttft.labels(model).observe(ev.first_token_time - ev.arrival_time)
                self.otel.first_token(model, ev.first_token_time - ev.arrival_time)
                if ev.first_scheduled_time is not None:
                    self.queue.labels(model).observe(ev.first_scheduled_time - ev.arrival_time)
                    self.prefill.labels(model).observe(ev.first_token_time - ev.first_scheduled_time)
        elif ev.token_id is not None:
            self.itl.labels(model).observe(ev.time - prev_time)
        if ev.finished:
            self.prompt_tokens.labels(model).inc(ev.num_prompt_tokens)
            self.generation_tokens.labels(model).inc(ev.num_output_tokens)
            self.request_success.labels(model, ev.finish_reason or "unknown").inc()
            self.e2e.labels(model).observe(ev.time - ev.arrival_time)
            tpot = None
            if ev.num_output_tokens > 1 and ev.first_token_time is not None:
                tpot = (ev.time - ev.first_token_time) / (ev.num_output_tokens - 1)
                self.tpot.labels(model).observe(tpot)
            self.otel.finished(model, ev.time - ev.arrival_time, tpot, ev.num_prompt_tokens, ev.num_output_tokens)

    def observe_abort(self, model: str) -> None:
        self.request_success.labels(model, "abort").inc()

    # -- lifecycle ------------------------------------------------------------------------------
    def on_transition(self, ev: LifecycleEvent) -> None:
        self.transitions.labels(ev.state.value).inc()
        if ev.state.terminal:
            code = ""
            if ev.payload and isinstance(ev.payload.get("error"), dict):
                code = str(ev.payload["error"].get("code", ""))
            self.requests_finished.labels(ev.state.value, code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
