"""Spans per request stage, sampled by latency sensitivity with a tail decision.

One trace per request. The edge opens the root span (W3C ``traceparent`` from the client is its
parent) and keeps it in a context variable; the stages below it (validate, route, cold start and
its phases, engine queue / prefill / decode, stream-out) are recorded with their real start and end
times, many of them after the fact from the engine's timestamps (``time.monotonic`` is one clock
for every process on the host), so no stage waits for a span and no request waits for an exporter
(export is batched). What recording costs is measured by ``sits bench tracing`` (docs/benchmarks.md:
inside this host's noise so far).

``LevelTailSampler`` is a span processor, not a head sampler: it holds a trace's spans until its
local root (and any span that crossed an async boundary below it) has ended, then keeps the trace
if any span failed or violated an SLO, and otherwise keeps a share set by the root's latency level
(defaults L1 100 %, L2 50 %, L3 10 %, L4 1 %), decided by a hash of the trace id so the decision is
repeatable. Spans that end after the decision follow it (errors are always kept).

Exporters: OTLP over HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set,
console with ``OTEL_TRACES_EXPORTER=console``, in-memory for tests and ``GET /admin/traces``.
"""

from __future__ import annotations

import collections
import contextvars
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sits import __version__
from sits.observe import genai
from sits.observe.otel_env import exporter_choice

DEFAULT_LEVEL_RATES = {"L1": 1.0, "L2": 0.5, "L3": 0.1, "L4": 0.01}
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()
_propagator = TraceContextTextMapPropagator()


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading (from any process on this host) as epoch nanoseconds, with the
    offset taken once at import: every span of SITS lies on one timeline even if the wall clock steps."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


# -- the tail sampler -----------------------------------------------------------------------------
@dataclass
class _PendingTrace:
    spans: list[ReadableSpan] = field(default_factory=list)
    open_async: int = 0
    root_ended: bool = False
    root_level: str | None = None
    keep_anyway: bool = False


class LevelTailSampler(SpanProcessor):
    """Decides per trace when its local root has ended; forwards kept spans to ``downstream``."""

    def __init__(self, downstream: SpanProcessor, rates: dict[str, float] | None = None,
                 max_pending: int = 10_000, max_decided: int = 50_000):
        self.downstream = downstream
        self.rates = {**DEFAULT_LEVEL_RATES, **(rates or {})}
        self.max_pending = max_pending
        self._pending: collections.OrderedDict[int, _PendingTrace] = collections.OrderedDict()
        self._decided: collections.OrderedDict[int, bool] = collections.OrderedDict()
        self._max_decided = max_decided
        self._lock = threading.Lock()
        self.kept = collections.Counter()        # level -> traces kept
        self.dropped = collections.Counter()

    def _rate(self, level: str | None) -> float:
        return self.rates.get(level or "L4", self.rates["L4"])

    def on_start(self, span: Span, parent_context=None) -> None:
        if span.attributes and span.attributes.get(genai.ASYNC_BOUNDARY) is True and span.end_time is None:
            with self._lock:
                tid = span.context.trace_id
                if tid not in self._decided:
                    t, evicted = self._trace(tid)
                    t.open_async += 1
                    for s in evicted:
                        self.downstream.on_end(s)

    def _trace(self, tid: int) -> tuple[_PendingTrace, list[ReadableSpan]]:
        """The pending trace; and, when the bound forced the oldest one out, its spans to forward
        (decided early: kept if it already holds an error, else dropped; later spans follow that)."""
        t = self._pending.get(tid)
        evicted: list[ReadableSpan] = []
        if t is None:
            t = self._pending[tid] = _PendingTrace()
            while len(self._pending) > self.max_pending:
                old_tid, old = self._pending.popitem(last=False)
                self._remember(old_tid, old.keep_anyway, old.root_level)
                if old.keep_anyway:
                    evicted.extend(old.spans)
        return t, evicted

    def _remember(self, tid: int, keep: bool, level: str | None) -> None:
        self._decided[tid] = keep
        while len(self._decided) > self._max_decided:
            self._decided.popitem(last=False)
        (self.kept if keep else self.dropped)[level or "L4"] += 1

    def on_end(self, span: ReadableSpan) -> None:
        tid = span.context.trace_id
        attrs = span.attributes or {}
        failed = span.status.status_code is StatusCode.ERROR or attrs.get(genai.SLO_VIOLATED) is True
        forward: list[ReadableSpan] = []
        with self._lock:
            if tid in self._decided:
                if self._decided[tid] or failed:
                    forward = [span]
            else:
                t, forward = self._trace(tid)
                t.spans.append(span)
                t.keep_anyway |= failed
                if attrs.get(genai.ASYNC_BOUNDARY) is True and t.open_async:
                    t.open_async -= 1
                is_root = span.parent is None or span.parent.is_remote
                if is_root:
                    t.root_ended = True
                    t.root_level = attrs.get(genai.LEVEL) or t.root_level
                if t.root_ended and t.open_async <= 0:
                    keep = t.keep_anyway or self._sampled(tid, t.root_level)
                    del self._pending[tid]
                    self._remember(tid, keep, t.root_level)
                    if keep:
                        forward = forward + t.spans
        for s in forward:
            self.downstream.on_end(s)

    def _sampled(self, trace_id: int, level: str | None) -> bool:
        rate = self._rate(level)
        if rate >= 1.0:
            return True
        # the low 64 bits of a W3C trace id are random: compare them with the rate (like TraceIdRatioBased)
        return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < int(rate * 2**64)

    def shutdown(self) -> None:
        self.downstream.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.downstream.force_flush(timeout_millis)


# -- set-up ---------------------------------------------------------------------------------------
class RingSpanExporter(SpanExporter):
    """In memory, bounded: the latest ``max_spans`` kept spans (tests, ``GET /admin/traces``)."""

    def __init__(self, max_spans: int = 20_000):
        self._spans: collections.deque[ReadableSpan] = collections.deque(maxlen=max_spans)
        self._lock = threading.Lock()

    def export(self, spans) -> SpanExportResult:
        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        with self._lock:
            return tuple(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def shutdown(self) -> None:
        pass


def exporter_from_env(choice: str | None = None) -> tuple[str, SpanExporter | None]:
    """``choice``: none | console | otlp | memory; default from the standard OTEL_* variables."""
    choice = exporter_choice("traces", choice)
    if choice == "none":
        return "none", None
    if choice == "console":
        return "console", ConsoleSpanExporter()
    if choice == "memory":
        return "memory", RingSpanExporter()
    if choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return "otlp", OTLPSpanExporter()      # endpoint, headers, timeout: the standard OTEL_* variables
    raise AssertionError(choice)


class Tracing:
    """One app's tracer provider (not the global one: tests run several apps in one process)."""

    def __init__(self, exporter: str | None = None, *, service_name: str = "sits",
                 rates: dict[str, float] | None = None):
        self.exporter_name, exporter_obj = exporter_from_env(exporter)
        self.enabled = exporter_obj is not None
        self.memory = exporter_obj if isinstance(exporter_obj, RingSpanExporter) else None
        # every span is recorded (the decision is the tail sampler's, at the end); without this the SDK
        # would head-sample by the client's flags or OTEL_TRACES_SAMPLER and lose errors
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create({
            "service.name": service_name, "service.version": __version__}))
        self.sampler: LevelTailSampler | None = None
        if exporter_obj is not None:
            batch = SimpleSpanProcessor(exporter_obj) if self.memory is not None else BatchSpanProcessor(exporter_obj)
            self.sampler = LevelTailSampler(batch, rates)
            self.provider.add_span_processor(self.sampler)
        self.tracer = self.provider.get_tracer("sits", __version__)

    def start_request(self, name: str, accepted_at: float, traceparent: str | None,
                      attributes: dict | None = None) -> "Scope | None":
        """The root span of one request (a child of the client's ``traceparent`` when it sent one)."""
        if not self.enabled:
            return None
        parent = _propagator.extract({"traceparent": traceparent}) if traceparent else None
        span = self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=wall_ns(accepted_at),
                                      attributes=attributes)
        return Scope(self.tracer, span)

    def finished_spans(self) -> list[ReadableSpan]:
        return list(self.memory.get_finished_spans()) if self.memory is not None else []

    def shutdown(self) -> None:
        self.provider.shutdown()


# -- recording stages under the current request ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class Scope:
    """A span and the tracer that makes its children (``marks``: times stages share, e.g. body read)."""

    tracer: otel_trace.Tracer
    span: Span
    marks: dict = field(default_factory=dict)

    @property
    def traceparent(self) -> str | None:
        ctx = self.span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}" if ctx.is_valid else None


current_scope: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("sits_trace_scope", default=None)


def _attrs(attributes: dict | None, level: str | None, async_mechanism: str | None) -> dict:
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    if level is not None:
        attrs[genai.LEVEL] = level
    if async_mechanism is not None:
        attrs[genai.ASYNC_BOUNDARY] = True
        attrs[genai.ASYNC_MECHANISM] = async_mechanism
    return attrs


def open_child(name: str, start: float, *, parent: Scope | None = None, level: str | None = None,
               async_mechanism: str | None = None, attributes: dict | None = None) -> Scope | None:
    """A live child span (``start``: time.monotonic), ended by the caller with ``close``.
    No-op (None) when the request is not traced."""
    parent = parent if parent is not None else current_scope.get()
    if parent is None or not parent.span.get_span_context().is_valid:   # an ended parent still takes children
        return None
    span = parent.tracer.start_span(name, context=otel_trace.set_span_in_context(parent.span),
                                    start_time=wall_ns(start), attributes=_attrs(attributes, level, async_mechanism))
    return Scope(parent.tracer, span)


def close(scope: Scope | None, end: float | None = None, *, error: str | None = None) -> None:
    if scope is None:
        return
    if error is not None:
        mark_failed(error, scope)
    scope.span.end(end_time=wall_ns(end if end is not None else time.monotonic()))


def stage(name: str, start: float, end: float, *, parent: Scope | None = None, level: str | None = None,
          attributes: dict | None = None, error: str | None = None,
          async_mechanism: str | None = None) -> Scope | None:
    """Record a finished stage (``start``/``end``: time.monotonic) under ``parent`` (default: the
    current request's span); returns its scope so sub-stages can nest under it."""
    scope = open_child(name, start, parent=parent, level=level, async_mechanism=async_mechanism,
                       attributes=attributes)
    close(scope, max(end, start), error=error)
    return scope


def annotate(attributes: dict, scope: Scope | None = None) -> None:
    """Set attributes on the current request's span (values None are skipped)."""
    scope = scope if scope is not None else current_scope.get()
    if scope is not None and scope.span.is_recording():
        scope.span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def mark_failed(error: str, scope: Scope | None = None) -> None:
    scope = scope if scope is not None else current_scope.get()
    if scope is not None and scope.span.is_recording():
        scope.span.set_status(Status(StatusCode.ERROR, error))
        scope.span.set_attribute(genai.ERROR_TYPE, error)


def spans_as_dicts(spans: list[ReadableSpan]) -> Iterator[dict]:
    """For ``GET /admin/traces``: the fields a person reads, times in ms from the trace's start."""
    if not spans:
        return iter(())
    t0 = min(s.start_time for s in spans)
    return ({"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
             "parent_id": f"{s.parent.span_id:016x}" if s.parent else None,
             "start_ms": round((s.start_time - t0) / 1e6, 3), "duration_ms": round((s.end_time - s.start_time) / 1e6, 3),
             "status": s.status.status_code.name, "attributes": dict(s.attributes or {})}
            for s in sorted(spans, key=lambda s: (s.start_time, not (s.parent is None or s.parent.is_remote))))
