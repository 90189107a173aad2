"""The OpenTelemetry GenAI server instruments, beside the Prometheus endpoint.

``gen_ai.server.time_to_first_token``, ``gen_ai.server.time_per_output_token`` and
``gen_ai.server.request.duration`` (seconds) with their advised bucket boundaries, plus
``gen_ai.client.token.usage``-style token counts as ``gen_ai.server.token.usage``. One MeterProvider per
app; exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._METRICS_ENDPOINT``) is set, to the
console with ``OTEL_METRICS_EXPORTER=console``, or kept in memory (tests). Off otherwise: the
instruments are then no-ops and cost nothing.
"""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (ConsoleMetricExporter, InMemoryMetricReader, MetricReader,
                                              PeriodicExportingMetricReader)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from sits import __version__
from sits.observe import genai
from sits.observe.otel_env import exporter_choice


def _reader(choice: str | None) -> tuple[str, MetricReader | None]:
    choice = exporter_choice("metrics", choice)
    if choice == "none":
        return "none", None
    if choice == "memory":
        return "memory", InMemoryMetricReader()
    if choice == "console":
        return "console", PeriodicExportingMetricReader(ConsoleMetricExporter())
    if choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        return "otlp", PeriodicExportingMetricReader(OTLPMetricExporter())
    raise AssertionError(choice)


class GenAiMetrics:
    def __init__(self, exporter: str | None = None, service_name: str = "sits"):
        self.exporter_name, self.reader = _reader(exporter)
        self.enabled = self.reader is not None
        self.provider: MeterProvider | None = None
        if not self.enabled:
            return
        views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(list(buckets)))
                 for name, buckets in (("gen_ai.server.time_to_first_token", genai.TTFT_BUCKETS),
                                       ("gen_ai.server.time_per_output_token", genai.TPOT_BUCKETS),
                                       ("gen_ai.server.request.duration", genai.DURATION_BUCKETS))]
        self.provider = MeterProvider(metric_readers=[self.reader], views=views,
                                      resource=Resource.create({"service.name": service_name,
                                                                "service.version": __version__}))
        meter = self.provider.get_meter("sits", __version__)
        self.ttft = meter.create_histogram("gen_ai.server.time_to_first_token", unit="s",
                                           description="Time to generate the first token for successful responses")
        self.tpot = meter.create_histogram("gen_ai.server.time_per_output_token", unit="s",
                                           description="Time per output token generated after the first token")
        self.duration = meter.create_histogram("gen_ai.server.request.duration", unit="s",
                                               description="Generative AI server request duration")
        self.tokens = meter.create_counter("gen_ai.server.token.usage", unit="{token}",
                                           description="Tokens processed, by type (input / output)")

    @staticmethod
    def _attrs(model: str) -> dict:
        return {genai.REQUEST_MODEL: model, genai.PROVIDER_NAME: genai.PROVIDER}

    def first_token(self, model: str, seconds: float) -> None:
        if self.enabled:
            self.ttft.record(seconds, self._attrs(model))

    def finished(self, model: str, duration_s: float, tpot_s: float | None, input_tokens: int,
                 output_tokens: int, error: str | None = None) -> None:
        if not self.enabled:
            return
        attrs = self._attrs(model)
        self.duration.record(duration_s, attrs | ({genai.ERROR_TYPE: error} if error else {}))
        if tpot_s is not None:
            self.tpot.record(tpot_s, attrs)
        self.tokens.add(input_tokens, attrs | {"gen_ai.token.type": "input"})
        self.tokens.add(output_tokens, attrs | {"gen_ai.token.type": "output"})

    def snapshot(self) -> dict[str, dict]:
        """In-memory reader only: instrument name -> {"count", "sum", "bucket_counts", "explicit_bounds"}
        summed over attribute sets (tests and ``GET /admin/otel-metrics``)."""
        if not isinstance(self.reader, InMemoryMetricReader):
            return {}
        out: dict[str, dict] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for p in m.data.data_points:
                        cur = out.setdefault(m.name, {"count": 0, "sum": 0.0})
                        if hasattr(p, "bucket_counts"):
                            cur["count"] += p.count
                            cur["sum"] += p.sum
                            cur["explicit_bounds"] = list(p.explicit_bounds)
                            prev = cur.get("bucket_counts") or [0] * len(p.bucket_counts)
                            cur["bucket_counts"] = [a + b for a, b in zip(prev, p.bucket_counts)]
                        else:
                            cur["count"] += 1
                            cur["sum"] += p.value
        return out

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
