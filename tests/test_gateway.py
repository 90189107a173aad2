"""`sits up`'s gateway end to end: units at zero instances, cold start on demand, both dialects,
the control API, scale to N and back to zero, crash replacement, persistence across restarts."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec


def unit(name: str, model: str, **scale) -> UnitSpec:
    return UnitSpec.model_validate({
        "name": name, "model": model,
        "scale": {"min_instances": 0, "max_instances": 2, "keep_alive_s": 300, "downscale_delay_s": 300, **scale},
        "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False, "threads": 1}})


def start_gateway(data_dir, units):
    gw = Gateway(data_dir, tick_s=0.2)
    settings = ServerSettings(drain_grace_s=0.5)
    app = build_gateway_app(gw, units, settings)
    return start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5), gw


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def states(srv, name):
    v = httpx.get(f"{srv.url}/v1/units/{name}").json()
    return [i["state"] for i in v["instances"]]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("gw-data")
    srv, gw = start_gateway(data, [unit("chat", tiny_model_dir)])
    yield srv, gw, data, tiny_model_dir
    srv.stop()


def test_unit_starts_at_zero_and_a_request_cold_starts_it(gateway):
    srv, gw, *_ = gateway
    assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == ["chat"]
    assert states(srv, "chat") == []
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="chat", prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert states(srv, "chat") == ["READY"]
    view = httpx.get(srv.url + "/v1/units/chat").json()
    phases = view["instances"][0]["cold_start_ms"]
    assert {"fork", "weights", "tokenizer", "kv_allocation", "first_token"} <= set(phases)
    assert phases["fork"] < 1500          # forked from the pre-imported zygote, not a fresh interpreter
    # the instance's front-end side uses the unit's tokenizer: a cold start does not load it again
    # (≈ 20 ms in the gateway's process, on the cold path)
    unit_backend = gw.units["chat"]
    assert unit_backend.pool.instances[0].backend.tokenizer is unit_backend.tokenizer
    assert view["starts"] == 1 and view["desired"] == 1
    events = [e["event"] for e in httpx.get(srv.url + "/v1/status").json()["events"] if e["unit"] == "chat"]
    assert "scale" in events and "instance_ready" in events
    client.completions.create(model="chat", prompt="Hello", max_tokens=4, temperature=0)
    assert httpx.get(srv.url + "/v1/units/chat").json()["starts"] == 1     # the warm instance served it
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'sits:unit_instances{state="READY",unit="chat"} 1.0' in metrics
    assert 'sits:cold_start_phase_milliseconds{model_name="chat",phase="fork"}' in metrics


def test_both_dialects_and_bad_input_through_the_gateway(gateway):
    srv, *_ = gateway
    r = httpx.post(srv.url + "/v1/requests", json={"unit": "chat", "prompt": "Once", "constraints": {"max_tokens": 4}})
    assert r.status_code == 202
    rid = r.json()["id"]
    v = wait_for(lambda: (x := httpx.get(f"{srv.url}/v1/requests/{rid}").json())["state"] in ("RESOLVED", "REJECTED")
                 and x, what="SITS request")
    assert v["state"] == "RESOLVED" and v["usage"]["completion_tokens"] == 4
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    bad = httpx.post(srv.url + "/v1/completions", json={"model": "chat", "prompt": [5] * 300, "max_tokens": 1})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded"
    bad = httpx.post(srv.url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert bad.status_code == 404
    r = httpx.post(srv.url + "/v1/requests", json={"unit": "nope", "prompt": "x"})
    rid = r.json()["id"]
    v = wait_for(lambda: (x := httpx.get(f"{srv.url}/v1/requests/{rid}").json())["state"] == "REJECTED" and x)
    assert v["error"]["code"] == "unit_not_found"


def test_control_api_deploy_scale_delete_and_errors(gateway):
    srv, gw, data, model = gateway
    spec = unit("second", model).model_dump()
    r = httpx.post(srv.url + "/v1/units", json=spec)
    assert r.status_code == 201, r.text
    assert sorted(m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]) == ["chat", "second"]
    r = httpx.post(srv.url + "/v1/units/second/scale", json={"instances": 2})
    assert r.status_code == 200 and r.json()["desired"] == 2
    wait_for(lambda: states(srv, "second") == ["READY", "READY"], what="two READY instances")
    r = httpx.post(srv.url + "/v1/completions", json={"model": "second", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.post(srv.url + "/v1/units/second/scale", json={"instances": 9}).json()["error"]["code"] == \
        "invalid_parameter"
    r = httpx.post(srv.url + "/v1/units", json={**spec, "name": "third", "scal": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scal"
    r = httpx.post(srv.url + "/v1/units", json={**spec, "name": "fourth", "model": "/does/not/exist"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_dir_not_found"
    r = httpx.post(srv.url + "/v1/units", json={**spec, "name": "fifth", "scale": {"trigger": "ttft_p95 > 9"}})
    assert r.status_code == 400 and "ms or s" in r.json()["error"]["message"]
    pids = [i["pid"] for i in httpx.get(srv.url + "/v1/units/second").json()["instances"]]
    assert httpx.delete(srv.url + "/v1/units/second").json()["deleted"] is True
    assert httpx.delete(srv.url + "/v1/units/second").json()["error"]["code"] == "unit_not_found"
    wait_for(lambda: all(not _alive(p) for p in pids), what="the deleted unit's processes to exit")


def test_a_units_sampling_defaults_fill_what_a_request_leaves_unset(gateway):
    """``sampling:`` in a unit (as vLLM's --override-generation-config): greedy by default here, so two
    requests that leave temperature unset answer alike whatever their seeds; a request's own value wins."""
    srv, gw, data, model = gateway
    spec = unit("greedy", model).model_dump() | {"sampling": {"temperature": 0.0, "max_tokens": 6}}
    assert httpx.post(srv.url + "/v1/units", json=spec).status_code == 201
    try:
        def complete(**kw):
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": "greedy", "prompt": "Once upon",
                                                                          **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]
        unset = [complete(max_tokens=None, seed=s) for s in (1, 2)]
        assert unset[0] == unset[1] == complete(temperature=0.0, max_tokens=6) and unset[0][1] == 6
        assert complete(max_tokens=3)[1] == 3
        bad = httpx.post(srv.url + "/v1/units", json=spec | {"name": "hot", "sampling": {"temperature": 9}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling.temperature"
    finally:
        httpx.delete(srv.url + "/v1/units/greedy")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                          # a zombie is not alive: reap it if it is our child
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def test_a_crashed_instance_is_replaced(gateway):
    srv, *_ = gateway
    httpx.post(srv.url + "/v1/completions", json={"model": "chat", "prompt": "x", "max_tokens": 2})
    inst = httpx.get(srv.url + "/v1/units/chat").json()["instances"][0]
    os.kill(inst["pid"], signal.SIGKILL)
    v = wait_for(lambda: (x := httpx.get(srv.url + "/v1/units/chat").json())["crashes"] == 1 and
                 [i["state"] for i in x["instances"]] == ["READY"] and x, what="a replacement")
    assert v["instances"][0]["pid"] != inst["pid"]
    r = httpx.post(srv.url + "/v1/completions", json={"model": "chat", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_scale_to_zero_after_keep_alive_and_persistence_across_restart(tiny_model_dir, tmp_path):
    srv, gw = start_gateway(tmp_path, [unit("brief", tiny_model_dir, keep_alive_s=1.0)])
    try:
        httpx.post(srv.url + "/v1/completions", json={"model": "brief", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert states(srv, "brief") == ["READY"]
        wait_for(lambda: states(srv, "brief") == [], timeout=30, what="scale to zero")
        reasons = [e.get("reason", "") for e in httpx.get(srv.url + "/v1/status").json()["events"]
                   if e["event"] == "scale"]
        assert any("keep_alive_s" in r for r in reasons)
        r = httpx.post(srv.url + "/v1/units", json=unit("deployed-later", tiny_model_dir).model_dump())
        assert r.status_code == 201
    finally:
        srv.stop()
    srv2, _ = start_gateway(tmp_path, [])         # no config: only what was persisted
    try:
        names = sorted(m["id"] for m in httpx.get(srv2.url + "/v1/models").json()["data"])
        assert names == ["brief", "deployed-later"]
        r = httpx.post(srv2.url + "/v1/completions", json={"model": "deployed-later", "prompt": "x", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200
    finally:
        srv2.stop()


def test_driven_load_scales_0_1_n_and_back_to_0(tiny_model_dir, tmp_path):
    """No instance -> a request starts one -> sustained load (rps trigger) adds the second ->
    idle: back down and to zero after keep-alive. Each decision carries its reason."""
    import concurrent.futures
    srv, gw = start_gateway(tmp_path, [unit("elastic", tiny_model_dir, keep_alive_s=3.0, downscale_delay_s=1.0,
                                            window_s=3.0, trigger="rps > 3")])
    try:
        assert states(srv, "elastic") == []
        c = httpx.Client(base_url=srv.url, timeout=120)

        def call(i):
            return c.post("/v1/completions", json={"model": "elastic", "prompt": f"load {i}", "max_tokens": 4}).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            deadline = time.monotonic() + 60
            codes = []
            while time.monotonic() < deadline and len([s for s in states(srv, "elastic") if s == "READY"]) < 2:
                codes += list(pool.map(call, range(8)))
            assert set(codes) == {200}
        assert states(srv, "elastic") == ["READY", "READY"]
        wait_for(lambda: states(srv, "elastic") == [], timeout=30, what="scale back to zero")
        reasons = [e["reason"] for e in c.get("/v1/status").json()["events"] if e["event"] == "scale"
                   and e["unit"] == "elastic"]
        assert any("waiting for a unit with no instance" in r for r in reasons)
        assert any("trigger holds: rps > 3" in r for r in reasons)
        assert any("keep_alive_s" in r for r in reasons)
        metrics = c.get("/metrics").text
        assert 'sits:autoscaler_decisions_total{direction="up",unit="elastic"} 2.0' in metrics
    finally:
        srv.stop()


def test_an_instance_that_stops_answering_is_replaced(tiny_model_dir, tmp_path):
    """SIGSTOP: the process is alive but silent; after health_timeout_s it is killed and replaced."""
    srv, gw = start_gateway(tmp_path, [unit("frozen", tiny_model_dir, min_instances=1, health_timeout_s=1.0)])
    try:
        inst = wait_for(lambda: (v := httpx.get(srv.url + "/v1/units/frozen").json()["instances"]) and
                        v[0]["state"] == "READY" and v[0], what="READY")
        os.kill(inst["pid"], signal.SIGSTOP)
        v = wait_for(lambda: (x := httpx.get(srv.url + "/v1/units/frozen").json())["crashes"] == 1 and
                     [i["state"] for i in x["instances"]] == ["READY"] and x, timeout=30, what="a replacement")
        assert v["instances"][0]["pid"] != inst["pid"]
        events = [e["event"] for e in httpx.get(srv.url + "/v1/status").json()["events"]]
        assert "instance_unresponsive" in events
        r = httpx.post(srv.url + "/v1/completions", json={"model": "frozen", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        srv.stop()
