"""Each of the five fault kinds against a running gateway: what must hold while it acts.

- link jitter: every stream completes, in order, with no gap and no duplicate;
- step degradation: the unit's breaker trips (to its fallback), and closes again once it is fixed;
- queue lag: the breaker trips to a fast 503 with Retry-After, and recovers;
- first-frame block: the first frame waits, the rest of the stream is untouched;
- heartbeat timeout: the silent instance is replaced, and the stream it was serving resumes elsewhere.
Throughout, every accepted SITS request ends RESOLVED or REJECTED with a reason (none lost).
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec

pytestmark = pytest.mark.reliability
ADMIN = "reliability-admin"


def unit(name, model, **extra):
    scale = {"min_instances": 1, "max_instances": 2, "downscale_delay_s": 600, "health_timeout_s": 1.5,
             **extra.pop("scale", {})}
    return UnitSpec.model_validate({
        "name": name, "model": model, "scale": scale,
        "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False, "threads": 1},
        **extra})


@pytest.fixture(scope="module")
def gw(tiny_model_dir, tmp_path_factory):
    units = [unit("svc", tiny_model_dir, slo={"ttft_ms": 500}, fallback="spare",
                  sla={"min_requests": 3, "open_s": 1.0, "half_open_probes": 1, "window_s": 30}),
             unit("spare", tiny_model_dir),
             unit("hb", tiny_model_dir, scale={"min_instances": 2})]
    gateway = Gateway(tmp_path_factory.mktemp("reliability-gw"), tick_s=0.2)
    app = build_gateway_app(gateway, units, ServerSettings(drain_grace_s=1.0, admin_keys=(ADMIN,)))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=1.0)
    wait_ready(srv, {"svc": 1, "spare": 1, "hb": 2})
    yield srv
    srv.stop()


def wait_ready(srv, want: dict[str, int], timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        units = {u["name"]: u for u in httpx.get(srv.url + "/v1/units").json()["data"]}
        if all([i["state"] for i in units[n]["instances"]].count("READY") >= k for n, k in want.items()):
            return units
        time.sleep(0.1)
    raise AssertionError(f"units not ready: {want}")


def faults(srv, name, inject=None, seed=1):
    h = {"authorization": f"Bearer {ADMIN}"}
    if inject is None:
        r = httpx.delete(f"{srv.url}/admin/faults/{name}", headers=h)
    else:
        r = httpx.put(f"{srv.url}/admin/faults/{name}", headers=h, json={"seed": seed, "inject": inject})
    assert r.status_code == 200, r.text
    time.sleep(0.5)                      # instance directives go out on the next tick


def stream(srv, model, max_tokens=12, **kw):
    """(status, texts, chunk times, error chunk or None) of one streamed completion."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, **kw}
    texts, times, err = [], [], None
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code, [], [], json.loads(r.read())
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                if "error" in c:
                    err = c["error"]
                elif c["choices"]:
                    texts.append(c["choices"][0]["text"])
                    times.append(time.monotonic())
    return 200, texts, times, err


def reference(srv, model, max_tokens=12):
    r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "Once upon a time",
                                                       "max_tokens": max_tokens, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
    return r.json()["choices"][0]["text"]


def submit_async(srv, model, n=4):
    return [httpx.post(srv.url + "/v1/requests", json={"unit": model, "prompt": f"async {i}",
                                                       "constraints": {"max_tokens": 4}}).json()["id"]
            for i in range(n)]


def assert_all_terminal(srv, ids, timeout=60.0):
    deadline = time.monotonic() + timeout
    views = []
    for rid in ids:
        while True:
            v = httpx.get(f"{srv.url}/v1/requests/{rid}").json()
            if v["state"] in ("RESOLVED", "REJECTED") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert v["state"] in ("RESOLVED", "REJECTED"), v
        if v["state"] == "REJECTED":
            assert v["error"]["code"], v
        views.append(v)
    return views


def sla(srv, name):
    return {r["unit"]: r for r in httpx.get(srv.url + "/v1/sla").json()["data"]}[name]


def test_link_jitter_streams_complete_in_order(gw):
    ref = reference(gw, "spare")
    faults(gw, "spare", [{"kind": "link_jitter", "distribution": "normal", "min_ms": 10, "max_ms": 120}])
    ids = submit_async(gw, "spare")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: stream(gw, "spare"), range(4)))
    for status, texts, _, err in results:
        assert status == 200 and err is None and "".join(texts) == ref
    assert all(v["state"] == "RESOLVED" for v in assert_all_terminal(gw, ids))
    faults(gw, "spare")


def test_step_degradation_trips_the_breaker_to_the_fallback_and_it_recovers(gw):
    faults(gw, "svc", [{"kind": "step_degradation", "stages_ms": [50, 700], "stage_s": 0.5, "instances": 2}])
    time.sleep(0.6)                                   # into the 700 ms stage: every TTFT now misses 500 ms
    models = []
    ids = []
    deadline = time.monotonic() + 60
    while sla(gw, "svc")["state"] != "OPEN" and time.monotonic() < deadline:
        r = httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
        models.append(r.json()["model"])
    assert sla(gw, "svc")["state"] == "OPEN" and sla(gw, "svc")["failures"].get("slo_miss", 0) >= 3
    ids += submit_async(gw, "svc", 2)                 # accepted while open: served by the fallback
    r = httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "spare"
    faults(gw, "svc")                                 # fixed
    time.sleep(1.1)
    deadline = time.monotonic() + 30
    while sla(gw, "svc")["state"] != "CLOSED" and time.monotonic() < deadline:
        httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
        time.sleep(0.2)
    s = sla(gw, "svc")
    assert s["state"] == "CLOSED" and s["trips"] >= 1
    assert all(v["state"] == "RESOLVED" for v in assert_all_terminal(gw, ids))


def test_queue_lag_trips_to_503_with_retry_after_and_recovers(gw):
    faults(gw, "spare", [{"kind": "queue_lag", "min_ms": 400, "max_ms": 600}])
    # spare has the default SLA (min 10 requests, 2 s SLO): lag alone does not trip it ...
    for _ in range(3):
        assert httpx.post(gw.url + "/v1/completions", json={"model": "spare", "prompt": "x", "max_tokens": 2},
                          timeout=60).status_code == 200
    assert sla(gw, "spare")["state"] == "CLOSED"
    faults(gw, "spare")
    # ... svc (500 ms SLO) with its fallback saturated: open both
    faults(gw, "svc", [{"kind": "queue_lag", "min_ms": 700, "max_ms": 800}])
    deadline = time.monotonic() + 60
    while sla(gw, "svc")["state"] != "OPEN" and time.monotonic() < deadline:
        httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert sla(gw, "svc")["state"] == "OPEN"
    # the fallback is up, so svc's callers are served; the fast 503 path is the unit without one
    r = httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "spare"
    faults(gw, "svc")
    time.sleep(1.1)
    deadline = time.monotonic() + 30
    while sla(gw, "svc")["state"] != "CLOSED" and time.monotonic() < deadline:
        httpx.post(gw.url + "/v1/completions", json={"model": "svc", "prompt": "x", "max_tokens": 2}, timeout=60)
        time.sleep(0.2)
    assert sla(gw, "svc")["state"] == "CLOSED"


def test_first_frame_block_delays_only_the_first_frame(gw):
    _, _, times, _ = stream(gw, "spare", max_tokens=10)
    base_gaps = [b - a for a, b in zip(times, times[1:])]
    faults(gw, "spare", [{"kind": "first_frame_block", "block_ms": 700}])
    t0 = time.monotonic()
    status, texts, times, err = stream(gw, "spare", max_tokens=10)
    assert status == 200 and err is None and len(texts) == 10
    assert times[0] - t0 >= 0.7                          # the first frame waited
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) < max(base_gaps) + 0.3              # the rest flowed as before
    faults(gw, "spare")


def test_heartbeat_timeout_replaces_the_instance_and_its_stream_resumes(gw):
    before = {i["id"] for i in httpx.get(gw.url + "/v1/units/hb").json()["instances"]}
    ref = reference(gw, "hb", max_tokens=150)
    ids = submit_async(gw, "hb", 2)
    # one instance goes silent (killed after health_timeout_s = 1.5 s); steps of >= 25 ms keep the
    # streams running (150 tokens: ~4 s) past that, so the silent one's streams must fail over
    faults(gw, "hb", [{"kind": "heartbeat_timeout", "instances": 1},
                      {"kind": "step_degradation", "stages_ms": [25], "stage_s": 60, "instances": 2}])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: stream(gw, "hb", max_tokens=150), range(4)))
    for status, texts, _, err in results:
        assert status == 200 and err is None and "".join(texts) == ref
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        v = httpx.get(gw.url + "/v1/units/hb").json()
        ready = [i["id"] for i in v["instances"] if i["state"] == "READY"]
        if len(ready) == 2 and set(ready) != before:
            break
        time.sleep(0.1)
    events = [e for e in httpx.get(gw.url + "/v1/status").json()["events"] if e["unit"] == "hb"]
    assert any(e["event"] == "instance_unresponsive" for e in events)
    assert any(e["event"] == "failover" for e in events)          # a stream resumed on the other one
    assert len(ready) == 2 and len(set(ready) - before) == 1      # one replaced, the other untouched
    assert all(v["state"] == "RESOLVED" for v in assert_all_terminal(gw, ids))
    faults(gw, "hb")
