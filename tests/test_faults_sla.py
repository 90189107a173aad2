"""The SLA breaker and fault injection: the pure parts with a fake clock, then through `sits up`'s
gateway over HTTP (admin endpoint, breaker trips to the fallback or a 503 with Retry-After, recovers)."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.faults import FaultInjector, FaultsSpec
from sits.runtime.gateway import Gateway
from sits.runtime.sla import BreakerState, SlaBreaker, SlaSpec
from sits.runtime.unit_spec import UnitSpec, UnitSpecError, load_yaml_spec


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def breaker(**kw):
    clock = Clock()
    moves = []
    b = SlaBreaker(SlaSpec(**{"min_requests": 4, "open_s": 5, "half_open_probes": 2, "window_s": 30, **kw}),
                   ttft_slo_ms=100, on_transition=lambda a, b_, why: moves.append((a.value, b_.value)), clock=clock)
    return b, clock, moves


def test_breaker_opens_below_the_success_rate_and_recovers_through_half_open():
    b, clock, moves = breaker()
    for _ in range(3):
        b.record(b.classify(50, None))
    assert b.admits() and b.attainment() == 1.0
    b.record(b.classify(500, None))           # an SLO miss is a failure: 3/4 = 0.75 < 0.85
    assert b.state is BreakerState.OPEN and not b.admits() and b.trips == 1
    assert 1 <= b.retry_after_s() <= 5
    clock.t += 5
    assert b.admits() and b.state is BreakerState.HALF_OPEN
    p1 = b.probe_started()
    assert p1 and b.admits()                   # a second probe slot
    p2 = b.probe_started()
    assert not b.admits()                      # both probes out
    b.record(b.classify(20, None), probe=p1)
    b.record(b.classify(20, None), probe=p2)
    assert b.state is BreakerState.CLOSED and b.attainment() is None     # a fresh window
    assert moves == [("CLOSED", "OPEN"), ("OPEN", "HALF_OPEN"), ("HALF_OPEN", "CLOSED")]


def test_a_failed_probe_reopens_and_a_cancelled_probe_frees_its_slot():
    b, clock, moves = breaker(half_open_probes=1)
    for _ in range(4):
        b.record(b.classify(None, "engine_dead"))
    assert b.state is BreakerState.OPEN
    clock.t += 5
    assert b.admits()
    p1 = b.probe_started()
    assert not b.admits()
    b.probe_cancelled(p1)                      # the client went away: no outcome
    assert b.admits()
    p2 = b.probe_started()
    b.record(b.classify(None, "engine_dead"), probe=p2)
    assert b.state is BreakerState.OPEN and b.trips == 2
    assert b.view()["failures"] == {"engine_dead": 5}
    # a slow probe of that episode finishing in the next one counts as a plain outcome, not a probe
    clock.t += 5
    assert b.admits() and b.state is BreakerState.HALF_OPEN
    b.record(b.classify(20, None), probe=p1)
    b.probe_cancelled(p1)
    assert b.state is BreakerState.HALF_OPEN and b.admits()
    p3 = b.probe_started()
    assert not b.admits()
    b.record(b.classify(20, None), probe=p3)
    assert b.state is BreakerState.CLOSED


def test_the_window_slides_and_min_requests_holds():
    b, clock, _ = breaker()
    for _ in range(3):
        b.record(b.classify(None, "engine_dead"))
    assert b.state is BreakerState.CLOSED       # 3 < min_requests
    clock.t += 31                               # those fall out of the window
    b.record(b.classify(10, None))
    assert b.attainment() == 1.0 and b.view()["requests_in_window"] == 1


def test_injector_is_seeded_and_repeatable():
    spec = FaultsSpec.model_validate({"seed": 7, "inject": [
        {"kind": "link_jitter", "distribution": "normal", "min_ms": 10, "max_ms": 500},
        {"kind": "queue_lag", "min_ms": 100, "max_ms": 300, "routes": ["/v1/chat/completions"]},
        {"kind": "first_frame_block", "block_ms": 800, "probability": 0.5}]})
    a, b = FaultInjector(spec), FaultInjector(spec)
    seq_a = [(a.link_delay_s("/v1/completions"), a.queue_lag_s("/v1/completions"), a.first_frame_s(None))
             for _ in range(50)]
    seq_b = [(b.link_delay_s("/v1/completions"), b.queue_lag_s("/v1/completions"), b.first_frame_s(None))
             for _ in range(50)]
    assert seq_a == seq_b
    assert all(0.010 <= d <= 0.500 for d, _, _ in seq_a)
    assert all(q == 0 for _, q, _ in seq_a)                       # queue lag is scoped to the chat route
    assert 0.1 <= a.queue_lag_s("/v1/chat/completions") <= 0.3
    blocked = sum(f > 0 for *_, f in seq_a)
    assert 10 < blocked < 40                                      # probability 0.5
    other = FaultInjector(FaultsSpec.model_validate({**spec.model_dump(), "seed": 8}))
    assert [other.link_delay_s(None) for _ in range(5)] != [d for d, *_ in seq_a[:5]]


def test_instance_faults_go_to_at_most_n_instances_once():
    inj = FaultInjector(FaultsSpec.model_validate({"inject": [
        {"kind": "heartbeat_timeout", "instances": 1},
        {"kind": "step_degradation", "stages_ms": [50, 200], "stage_s": 2, "instances": 2}]}))
    d1, d2, d3 = inj.directives_for("u-1"), inj.directives_for("u-2"), inj.directives_for("u-3")
    assert d1.drop_pings and d1.step_stages_ms == (50, 200)
    assert not d2.drop_pings and d2.step_stages_ms == (50, 200)
    assert d3.empty                                               # both faults used up
    assert inj.directives_for("u-1") == d1                        # stable for its owner


def test_fault_and_sla_specs_are_validated_with_positions():
    text = ("name: u\nmodel: m\nfallback: u\nsla: {success_rate: 2}\n"
            "faults:\n  inject:\n    - {kind: link_jitter, min_ms: 50, max_ms: 10}\n    - {kind: nosuch}\n")
    with pytest.raises(UnitSpecError) as e:
        load_yaml_spec(text, "u.yaml", UnitSpec)
    msg = e.value.message
    assert "sla.success_rate" in msg and "min_ms (50.0) exceeds max_ms" in msg and "nosuch" in msg
    assert "u.yaml:4:" in msg


# -- through the gateway ------------------------------------------------------------------------
ADMIN = "admin-secret"


def unit(name, model, **extra):
    return UnitSpec.model_validate({
        "name": name, "model": model,
        "scale": {"min_instances": 1, "max_instances": 1, "downscale_delay_s": 300},
        "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False, "threads": 1},
        **extra})


def test_an_instance_runs_under_its_cpu_quota(guarded):
    srv, _ = guarded
    [inst] = httpx.get(srv.url + "/v1/units/solo").json()["instances"]
    q = inst["cpu_quota"]
    assert q["cpus"] == 0.5 and q["threads"] == 1
    assert q["mechanism"] in ("cgroup-v1", "cgroup-v2", "threads"), q
    if q["mechanism"] == "cgroup-v1":
        import os
        assert open(os.path.join(q["cgroup"], "cpu.cfs_quota_us")).read().strip() == "50000"
        assert str(inst["pid"]) in open(os.path.join(q["cgroup"], "cgroup.procs")).read().split()
    elif q["mechanism"] == "cgroup-v2":
        import os
        assert open(os.path.join(q["cgroup"], "cpu.max")).read().split()[0] == "50000"


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    units = [unit("main", tiny_model_dir, slo={"ttft_ms": 400},
                  sla={"min_requests": 3, "open_s": 1.5, "half_open_probes": 1, "window_s": 60},
                  fallback="backup"),
             unit("solo", tiny_model_dir, slo={"ttft_ms": 400},
                  sla={"min_requests": 2, "open_s": 30, "half_open_probes": 1},
                  resources={"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False,
                             "cpu_quota": 0.5}),
             unit("backup", tiny_model_dir, tools=["math.eval@^1"])]
    gw = Gateway(tmp_path_factory.mktemp("gw-sla"), tick_s=0.2)
    app = build_gateway_app(gw, units, ServerSettings(drain_grace_s=0.5, admin_keys=(ADMIN,)))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        us = httpx.get(srv.url + "/v1/units").json()["data"]
        if all([i["state"] for i in u["instances"]] == ["READY"] for u in us):
            break
        time.sleep(0.1)
    yield srv, gw
    srv.stop()


def complete(srv, model, **kw):
    return httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": 3,
                                                         "temperature": 0, **kw}, timeout=60)


def admin(srv, method, path, key=ADMIN, **kw):
    return httpx.request(method, srv.url + path, headers={"authorization": f"Bearer {key}"} if key else {},
                         timeout=30, **kw)


def test_admin_endpoint_needs_the_admin_key(guarded, serve_tiny):
    srv, _ = guarded
    assert admin(srv, "GET", "/admin/faults", key=None).json()["error"]["code"] == "invalid_admin_key"
    assert admin(srv, "GET", "/admin/faults", key="wrong").status_code == 401
    r = admin(srv, "PUT", "/admin/faults/nosuch", json={"inject": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unit_not_found"
    r = admin(srv, "PUT", "/admin/faults/main", json={"inject": [{"kind": "queue_lag", "min_ms": -1}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameter"


def test_breaker_trips_to_the_fallback_and_recovers(guarded):
    srv, gw = guarded
    assert complete(srv, "main").json()["model"] == "main"
    r = admin(srv, "PUT", "/admin/faults/main", json={"seed": 1, "inject": [{"kind": "first_frame_block",
                                                                              "block_ms": 600}]})
    assert r.status_code == 200 and r.json()["inject"][0]["kind"] == "first_frame_block"
    for _ in range(2):          # two SLO misses (600 ms > 400 ms) after one success: 1/3 < 0.85, it opens
        r = complete(srv, "main")
        assert r.status_code == 200 and r.json()["model"] == "main"
    sla = {row["unit"]: row for row in httpx.get(srv.url + "/v1/sla").json()["data"]}
    assert sla["main"]["state"] == "OPEN" and sla["main"]["trips"] == 1 and sla["main"]["failures"]["slo_miss"] == 2
    r = complete(srv, "main")                            # served by the fallback meanwhile
    assert r.status_code == 200 and r.json()["model"] == "backup"
    assert admin(srv, "DELETE", "/admin/faults/main").status_code == 200
    time.sleep(1.6)                                      # open_s: the next request is a half-open probe
    assert complete(srv, "main").json()["model"] == "main"
    sla = {row["unit"]: row for row in httpx.get(srv.url + "/v1/sla").json()["data"]}
    assert sla["main"]["state"] == "CLOSED" and sla["main"]["fallbacks"] >= 1
    events = [(e["from"], e["to"]) for e in httpx.get(srv.url + "/v1/status").json()["events"]
              if e["event"] == "breaker" and e["unit"] == "main"]
    assert events == [("CLOSED", "OPEN"), ("OPEN", "HALF_OPEN"), ("HALF_OPEN", "CLOSED")]
    m = httpx.get(srv.url + "/metrics").text
    assert 'sits:sla_breaker_transitions_total{state="OPEN",unit="main"} 1.0' in m
    assert 'sits:sla_breaker_state{state="CLOSED",unit="main"} 1.0' in m
    assert 'sits:fault_injections_total{kind="first_frame_block",unit="main"} 2.0' in m


def test_open_breaker_without_fallback_is_a_fast_503_with_retry_after(guarded):
    srv, _ = guarded
    admin(srv, "PUT", "/admin/faults/solo", json={"inject": [{"kind": "queue_lag", "min_ms": 500, "max_ms": 500}]})
    for _ in range(2):
        assert complete(srv, "solo").status_code == 200
    t0 = time.monotonic()
    r = complete(srv, "solo")
    assert r.status_code == 503 and time.monotonic() - t0 < 0.3
    assert r.json()["error"]["code"] == "sla_breaker_open" and int(r.headers["retry-after"]) >= 1
    # the SITS dialect: accepted, then REJECTED with the same code (nothing accepted is lost)
    v = httpx.post(srv.url + "/v1/requests", json={"unit": "solo", "prompt": "x", "constraints": {"max_tokens": 2}}).json()
    deadline = time.monotonic() + 10
    while v["state"] not in ("RESOLVED", "REJECTED") and time.monotonic() < deadline:
        time.sleep(0.05)
        v = httpx.get(srv.url + f"/v1/requests/{v['id']}").json()
    assert v["state"] == "REJECTED" and v["error"]["code"] == "sla_breaker_open"
    admin(srv, "DELETE", "/admin/faults/solo")


def test_step_degradation_and_link_jitter_slow_an_instance_down(guarded):
    srv, _ = guarded
    t0 = time.monotonic()
    complete(srv, "backup", max_tokens=6, ignore_eos=True)
    base = time.monotonic() - t0
    admin(srv, "PUT", "/admin/faults/backup", json={"inject": [
        {"kind": "step_degradation", "stages_ms": [150], "stage_s": 60},
        {"kind": "link_jitter", "min_ms": 20, "max_ms": 40}]})

    def directed():       # sent on the next tick, on the socket the request will take: the instance has them first
        events = httpx.get(srv.url + "/v1/status").json()["events"]
        return any(e["unit"] == "backup" and e["event"] == "fault_directives" and e.get("step_stages_ms")
                   for e in events)
    deadline = time.monotonic() + 30
    while not directed():
        assert time.monotonic() < deadline, "the fault directives never reached the instance"
        time.sleep(0.05)
    t0 = time.monotonic()
    r = complete(srv, "backup", max_tokens=6, ignore_eos=True)
    slow = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    # 6 tokens take 6 steps, each held to >= 150 ms by the fault, whatever else the host is doing
    assert slow >= 6 * 0.150 and slow > base, (base, slow)
    view = admin(srv, "GET", "/admin/faults/backup").json()
    assert view["hits"]["step_degradation"] == 1 and view["hits"]["link_jitter"] >= 7
    admin(srv, "DELETE", "/admin/faults/backup")
    time.sleep(0.5)
    t0 = time.monotonic()
    complete(srv, "backup", max_tokens=6, ignore_eos=True)
    assert time.monotonic() - t0 < slow / 2               # cleared: steps are fast again


def test_requests_may_only_ask_for_the_units_tools(guarded):
    srv, _ = guarded

    def follow(body):
        v = httpx.post(srv.url + "/v1/requests", json=body).json()
        deadline = time.monotonic() + 30
        while v["state"] not in ("RESOLVED", "REJECTED") and time.monotonic() < deadline:
            time.sleep(0.05)
            v = httpx.get(srv.url + f"/v1/requests/{v['id']}").json()
        return v

    ok = follow({"unit": "backup", "prompt": "x", "allowed_tools": ["math.eval@^1.0"], "constraints": {"max_tokens": 2}})
    assert ok["state"] == "RESOLVED"
    no = follow({"unit": "backup", "prompt": "x", "allowed_tools": ["file.read@^1.2"], "constraints": {"max_tokens": 2}})
    assert no["state"] == "REJECTED" and no["error"]["code"] == "tool_not_allowed"
    assert "math.eval@^1" in no["error"]["message"]
    bad = follow({"unit": "backup", "prompt": "x", "allowed_tools": ["math.eval@^x"], "constraints": {"max_tokens": 2}})
    assert bad["state"] == "REJECTED" and bad["error"]["code"] == "invalid_tool_ref"
    tools = {t["ref"]: t for t in httpx.get(srv.url + "/v1/tools").json()["data"]}
    assert tools["math.eval@1.0.0"]["units"] == ["backup"] and tools["file.read@1.2.0"]["units"] == []
    assert tools["file.read@1.2.0"]["side_effects"] == ["read:fs:/data/*", "net:none"]
    assert tools["math.eval@1.0.0"]["openai"]["function"]["name"] == "math_eval"
