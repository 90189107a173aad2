"""Tracing and OTel metrics: the tail sampler on its own, then real spans from a served request
(W3C traceparent in and out, one span per stage, GenAI attributes), the async dialect, cold starts."""

from __future__ import annotations

import time

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sits.api.context import ServerSettings
from sits.observe import genai
from sits.observe.tracing import LevelTailSampler, Scope, close, open_child, stage


def sampler_setup(rates=None):
    mem = InMemorySpanExporter()
    sampler = LevelTailSampler(SimpleSpanProcessor(mem), rates)
    provider = TracerProvider()
    provider.add_span_processor(sampler)
    return provider.get_tracer("t"), mem, sampler


def root(tracer, level, **attrs):
    return Scope(tracer, tracer.start_span("root", attributes={genai.LEVEL: level, **attrs}))


def test_levels_keep_their_share_and_errors_and_slo_violations_are_always_kept():
    tracer, mem, sampler = sampler_setup({"L4": 0.0, "L2": 0.5})
    for level in ("L1", "L4"):
        r = root(tracer, level)
        stage("child", time.monotonic(), time.monotonic(), parent=r)
        r.span.end()
    names = [(s.name, s.attributes.get(genai.LEVEL)) for s in mem.get_finished_spans()]
    assert names == [("child", None), ("root", "L1")]           # L4 at rate 0: the whole trace dropped
    mem.clear()
    r = root(tracer, "L4")
    stage("child", time.monotonic(), time.monotonic(), parent=r, error="engine_dead")
    r.span.end()
    r2 = root(tracer, "L4", **{genai.SLO_VIOLATED: True})
    r2.span.end()
    assert len(mem.get_finished_spans()) == 3                   # error and SLO violation kept at L4
    mem.clear()
    kept = 0
    for _ in range(400):
        r = root(tracer, "L2")
        r.span.end()
        kept += len(mem.get_finished_spans())
        mem.clear()
    assert 140 < kept < 260                                     # about half, by trace id
    assert sampler.kept["L2"] == kept and sampler.dropped["L2"] == 400 - kept


def test_a_trace_waits_for_spans_that_crossed_an_async_boundary():
    tracer, mem, _ = sampler_setup({"L3": 0.0})
    r = root(tracer, "L3")
    work = open_child("request.execute", time.monotonic(), parent=r, async_mechanism="queue")
    r.span.end()                                                # the 202 went out; the work goes on
    assert mem.get_finished_spans() == ()
    stage("engine.prefill", time.monotonic(), time.monotonic(), parent=work)
    close(work, error="timeout")                                # it failed after the root ended
    names = sorted(s.name for s in mem.get_finished_spans())
    assert names == ["engine.prefill", "request.execute", "root"]
    late = stage("webhook.deliver", time.monotonic(), time.monotonic(), parent=work, async_mechanism="callback")
    assert late is not None and "webhook.deliver" in [s.name for s in mem.get_finished_spans()]   # follows "keep"


# -- served --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(serve_tiny):
    # every level kept here: the sampler's shares are tested above, these tests read whole traces
    return serve_tiny(ServerSettings(drain_grace_s=0.5, trace_exporter="memory", otel_metrics="memory",
                                     trace_level_rates={"L2": 1.0, "L3": 1.0, "L4": 1.0}), engine_mode="thread")


def spans_of(srv, trace_id: str):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        spans = [s for s in srv.app.state.sits.tracing.finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
        if spans and any(s.parent is None or s.parent.is_remote for s in spans):
            return spans
        time.sleep(0.02)
    raise AssertionError(f"no finished trace {trace_id}")


def test_a_streamed_chat_is_one_trace_with_a_span_per_stage(traced):
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", traced.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"traceparent": f"00-{client_trace}-{client_span}-01"}) as r:
        assert r.status_code == 200
        tp = r.headers["traceparent"]
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    version, trace_id, span_id, flags = tp.split("-")
    assert trace_id == client_trace and span_id != client_span and flags == "01"
    spans = {s.name: s for s in spans_of(traced, trace_id)}
    rootspan = spans["POST /v1/chat/completions"]
    assert f"{rootspan.parent.span_id:016x}" == client_span and rootspan.parent.is_remote
    assert {"gateway.accept", "validate", "engine.queue", "engine.prefill", "engine.decode", "stream_out"} <= set(spans)
    for name in ("gateway.accept", "validate", "engine.queue", "engine.prefill", "engine.decode", "stream_out"):
        s = spans[name]
        assert s.parent.span_id == rootspan.context.span_id, name
        assert rootspan.start_time <= s.start_time <= s.end_time <= rootspan.end_time, name
    a = rootspan.attributes
    assert a[genai.OPERATION] == "chat" and a[genai.REQUEST_MODEL] == "tiny" and a[genai.REQUEST_MAX_TOKENS] == 5
    assert a[genai.USAGE_OUTPUT] == 5 and a[genai.USAGE_INPUT] > 0 and tuple(a[genai.RESPONSE_FINISH_REASONS]) == ("length",)
    assert a[genai.LEVEL] == "L1" and a["http.response.status_code"] == 200
    assert spans["stream_out"].attributes[genai.ASYNC_BOUNDARY] is True
    assert spans["stream_out"].attributes[genai.ASYNC_MECHANISM] == "stream"
    assert spans["engine.prefill"].attributes[genai.LEVEL] == "L1"
    # the stages tile the request: queue ends where prefill starts, prefill where decode starts
    assert spans["engine.queue"].end_time == spans["engine.prefill"].start_time
    assert spans["engine.prefill"].end_time == spans["engine.decode"].start_time


def test_without_a_client_traceparent_a_new_trace_is_returned_and_errors_are_traced(traced):
    r = httpx.post(traced.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    trace_id = r.headers["traceparent"].split("-")[1]
    spans = spans_of(traced, trace_id)
    assert spans[-1].attributes[genai.LEVEL] == "L2"            # not streamed
    r = httpx.post(traced.url + "/v1/completions", json={"model": "nosuch", "prompt": "x"})
    assert r.status_code == 404
    spans = {s.name: s for s in spans_of(traced, r.headers["traceparent"].split("-")[1])}
    assert spans["POST /v1/completions"].attributes["http.response.status_code"] == 404
    assert set(spans) == {"POST /v1/completions", "gateway.accept"}      # it never reached validation


def test_async_request_execution_is_a_span_with_every_transition(traced):
    r = httpx.post(traced.url + "/v1/requests", json={"prompt": "Hello", "constraints": {"max_tokens": 3}})
    assert r.status_code == 202
    rid, trace_id = r.json()["id"], r.headers["traceparent"].split("-")[1]
    deadline = time.monotonic() + 30
    while httpx.get(f"{traced.url}/v1/requests/{rid}").json()["state"] != "RESOLVED" and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    spans = {s.name: s for s in spans_of(traced, trace_id)}
    ex = spans["request.execute"]
    assert ex.attributes[genai.ASYNC_MECHANISM] == "queue" and ex.attributes[genai.LEVEL] == "L3"
    assert [e.name for e in ex.events] == ["PENDING", "VALIDATING", "EXECUTING", "RESOLVED"]
    assert ex.end_time > spans["POST /v1/requests"].end_time                 # it outlived the 202
    assert spans["engine.decode"].parent.span_id == ex.context.span_id
    assert ex.attributes[genai.USAGE_OUTPUT] == 3


def test_otel_genai_metrics_use_the_advised_buckets(traced):
    httpx.post(traced.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                     "ignore_eos": True})
    snap = traced.app.state.sits.metrics.otel.snapshot()
    ttft = snap["gen_ai.server.time_to_first_token"]
    assert ttft["count"] >= 1 and tuple(ttft["explicit_bounds"]) == genai.TTFT_BUCKETS
    assert tuple(snap["gen_ai.server.request.duration"]["explicit_bounds"]) == genai.DURATION_BUCKETS
    assert tuple(snap["gen_ai.server.time_per_output_token"]["explicit_bounds"]) == genai.TPOT_BUCKETS
    assert snap["gen_ai.server.token.usage"]["sum"] > 0


def test_a_cold_start_is_part_of_the_trace_of_the_request_that_waited(tiny_model_dir, tmp_path):
    from conftest import start_server
    from sits.api.gateway_server import build_gateway_app
    from sits.api.server import DrainingServer
    from sits.runtime.gateway import Gateway
    from sits.runtime.unit_spec import UnitSpec

    spec = UnitSpec.model_validate({"name": "cold", "model": tiny_model_dir, "slo": {"ttft_ms": 1},
                                    "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256,
                                                  "threads": 1}})
    gw = Gateway(tmp_path, tick_s=0.2)
    app = build_gateway_app(gw, [spec], ServerSettings(drain_grace_s=0.5, trace_exporter="memory",
                                                       trace_level_rates={"L2": 0.0}, admin_keys=("adm",)))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"model": "cold", "prompt": "Hi", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200
        trace_id = r.headers["traceparent"].split("-")[1]
        spans = {s.name: s for s in spans_of(srv, trace_id)}      # L2 at rate 0, but it missed its SLO: kept
        assert spans["POST /v1/completions"].attributes[genai.SLO_VIOLATED] is True
        route, cold = spans["route"], spans["cold_start"]
        assert route.attributes["sits.unit"] == "cold" and cold.parent.span_id == route.context.span_id
        assert cold.attributes[genai.ASYNC_MECHANISM] == "fork"
        phases = [n for n in spans if n.startswith("cold_start.")]
        assert {"cold_start.fork", "cold_start.weights", "cold_start.kv_allocation"} <= set(phases)
        assert all(spans[p].parent.span_id == cold.context.span_id for p in phases)
        # a warm request has no cold start in its trace
        r = httpx.post(srv.url + "/v1/completions", json={"model": "cold", "prompt": "Hi", "max_tokens": 2})
        names = {s.name for s in spans_of(srv, r.headers["traceparent"].split("-")[1])}
        assert "route" in names and "cold_start" not in names
        # and a person can read it back
        view = httpx.get(srv.url + "/admin/traces", params={"trace_id": trace_id},
                         headers={"authorization": "Bearer adm"}).json()["data"][0]
        assert view["spans"][0]["name"] == "POST /v1/completions" and view["spans"][0]["start_ms"] == 0
        phases = [s for s in view["spans"] if s["name"].startswith("cold_start.")]
        assert {"cold_start.weights", "cold_start.kv_allocation"} <= {s["name"] for s in phases}
        assert sum(s["duration_ms"] for s in phases) > 0     # (inherited weights may take microseconds)
    finally:
        srv.stop()


def test_otlp_export_is_switched_on_by_the_standard_endpoint_variable(serve_tiny, monkeypatch):
    """A real OTLP/HTTP receiver: spans and GenAI metrics arrive as protobuf at /v1/traces, /v1/metrics."""
    import threading

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from conftest import start_server

    got: dict[str, list[bytes]] = {"/v1/traces": [], "/v1/metrics": []}
    lock = threading.Lock()

    async def collect(request):
        body = await request.body()
        assert request.headers["content-type"] == "application/x-protobuf"
        with lock:
            got[request.url.path].append(body)
        return Response(b"", media_type="application/x-protobuf")

    async def ready(request):
        return Response(b"ok")

    collector = start_server(Starlette(routes=[Route("/v1/traces", collect, methods=["POST"]),
                                               Route("/v1/metrics", collect, methods=["POST"]),
                                               Route("/ready", ready)]))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
    try:
        srv = serve_tiny(ServerSettings(drain_grace_s=0.5), engine_mode="thread")
        assert srv.app.state.sits.tracing.exporter_name == "otlp"
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        trace_id = bytes.fromhex(r.headers["traceparent"].split("-")[1])
        names: set[str] = set()
        metrics: set[str] = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not ({"engine.prefill", "stream_out"} <= names and
                                                   {"gen_ai.server.time_to_first_token",
                                                    "gen_ai.server.request.duration"} <= metrics):
            time.sleep(0.1)
            with lock:
                traces, mets = list(got["/v1/traces"]), list(got["/v1/metrics"])
            for body in traces:
                for rs in ExportTraceServiceRequest.FromString(body).resource_spans:
                    names |= {s.name for ss in rs.scope_spans for s in ss.spans if s.trace_id == trace_id}
            for body in mets:
                for rm in ExportMetricsServiceRequest.FromString(body).resource_metrics:
                    metrics |= {m.name for sm in rm.scope_metrics for m in sm.metrics}
        assert {"POST /v1/chat/completions", "engine.prefill", "engine.decode", "stream_out"} <= names
        assert "gen_ai.server.time_to_first_token" in metrics and "gen_ai.server.request.duration" in metrics
        srv.stop()                # flushes to the collector while it still listens
    finally:
        collector.stop()


def test_a_client_marking_its_trace_unsampled_does_not_hide_ours(traced):
    r = httpx.post(traced.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                         "stream": True},
                   headers={"traceparent": "00-11111111111111111111111111111111-2222222222222222-00"})
    assert r.status_code == 200
    names = {s.name for s in spans_of(traced, "11111111111111111111111111111111")}
    assert {"POST /v1/completions", "engine.prefill", "stream_out"} <= names     # recorded; the tail decides


def test_traces_pushed_out_by_the_bound_keep_their_errors():
    tracer, mem, sampler = sampler_setup({"L3": 0.0})
    sampler.max_pending = 2
    failing = root(tracer, "L3")
    open_child("request.execute", time.monotonic(), parent=failing, async_mechanism="queue")   # never ends
    stage("engine.prefill", time.monotonic(), time.monotonic(), parent=failing, error="engine_dead")
    failing.span.end()
    quiet = root(tracer, "L3")
    open_child("request.execute", time.monotonic(), parent=quiet, async_mechanism="queue")
    quiet.span.end()
    third = root(tracer, "L3")
    open_child("request.execute", time.monotonic(), parent=third, async_mechanism="queue")     # evicts `failing`
    kept = {f"{s.context.trace_id:032x}" for s in mem.get_finished_spans()}
    assert kept == {f"{failing.span.get_span_context().trace_id:032x}"}
