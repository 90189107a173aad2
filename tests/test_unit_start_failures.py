"""A unit that cannot start: refused at deploy when it cannot fit the host; when its instances fail
to start anyway, requests get a typed 503 naming the cause at once, starts back off exponentially,
and the unit's status shows why. Once the cause is gone the unit serves again."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from sits import cli
from sits.runtime.host_fit import available_memory_bytes
from test_gateway import start_gateway, unit, wait_for


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    srv, gw = start_gateway(tmp_path_factory.mktemp("gw-fail"), [])
    yield srv, gw
    srv.stop()


def test_a_unit_whose_kv_pool_cannot_fit_the_host_is_refused_at_deploy(gateway, tiny_model_dir):
    srv, gw = gateway
    huge_mb = available_memory_bytes() // 2**20 * 4
    spec = unit("huge", tiny_model_dir).model_dump()
    spec["resources"]["kv_cache_mb"] = huge_mb
    r = httpx.post(srv.url + "/v1/units", json=spec, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory" and "MiB available" in err["message"]
    assert "huge" not in gw.units
    # the same unit with a pool that fits is accepted
    spec["resources"]["kv_cache_mb"] = 16
    assert httpx.post(srv.url + "/v1/units", json=spec, timeout=60).status_code == 201
    assert httpx.delete(srv.url + "/v1/units/huge", timeout=60).status_code == 200


def test_requests_to_a_unit_that_cannot_start_fail_fast_and_starts_back_off(gateway, tiny_model_dir, tmp_path, capsys):
    srv, gw = gateway
    model = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"\0" * 64)              # config and tokenizer load; the weights do not
    spec = unit("broken", str(model), start_backoff_s=0.4, start_backoff_max_s=0.8).model_dump()
    assert httpx.post(srv.url + "/v1/units", json=spec, timeout=60).status_code == 201

    body = {"model": "broken", "prompt": "hi", "max_tokens": 2}
    t0 = time.monotonic()
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "unit_unavailable" and "failed start" in err["message"], err
    assert "Retry-After" in r.headers
    assert time.monotonic() - t0 < 30
    # a request during the backoff is answered at once (no start is under way)
    r = httpx.post(srv.url + "/v1/completions", json=body | {"stream": True}, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "unit_unavailable"

    view = httpx.get(srv.url + "/v1/units/broken").json()
    assert view["start_failure"]["failures_in_a_row"] >= 1 and view["start_failure"]["error"]
    assert cli.main(["status", "--url", srv.url]) == 0
    assert "FAILING TO START" in capsys.readouterr().out

    # starts are retried, each after a longer wait (0.4 s, then 0.8 s: the cap), never once per tick
    def failures():
        return [e["time"] for e in httpx.get(srv.url + "/v1/status").json()["events"]
                if e["unit"] == "broken" and e["event"] == "instance_failed"]
    def three_failures():
        f = failures()
        return f if len(f) >= 3 else None
    times = wait_for(three_failures, timeout=60, what="three failed starts")
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert gaps[0] >= 0.4 and gaps[1] >= 0.8, gaps

    weights.write_bytes(good)                    # the cause is fixed: the next start succeeds
    r = wait_for(lambda: (x := httpx.post(srv.url + "/v1/completions", json=body, timeout=60)).status_code == 200
                 and x, timeout=60, what="the unit to serve again")
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(srv.url + "/v1/units/broken").json()["start_failure"] is None
    httpx.delete(srv.url + "/v1/units/broken", timeout=60)
