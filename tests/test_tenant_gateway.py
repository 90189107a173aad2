"""Tenants through `sits up`'s gateway: the control API closed to user keys, a unit's price table,
the cold start a tenant's request caused, and instance memory-time apportioned by busy time."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from test_gateway import start_gateway, unit, wait_for


@pytest.fixture(scope="module")
def priced(tiny_model_dir, tmp_path_factory):
    spec = unit("priced", tiny_model_dir)
    spec = spec.model_copy(update={"pricing": spec.pricing.model_copy(update={
        "input_per_mtok": 1.0, "output_per_mtok": 4.0, "per_gb_hour": 360.0})})
    srv, gw = start_gateway(tmp_path_factory.mktemp("tenant-gw"), [spec])
    admin = httpx.post(f"{srv.url}/v1/tenants", json={"name": "ops"}).json()
    key = httpx.post(f"{srv.url}/v1/tenants/ops/keys", json={"role": "admin"}).json()["key"]
    yield srv, gw, key
    srv.stop()
    assert admin["name"] == "ops"


def _h(key):
    return {"authorization": f"Bearer {key}"}


def _user(url, admin, name):
    assert httpx.post(f"{url}/v1/tenants", json={"name": name}, headers=_h(admin)).status_code == 201
    return httpx.post(f"{url}/v1/tenants/{name}/keys", json={}, headers=_h(admin)).json()["key"]


def test_cold_start_cost_and_memory_time_per_tenant(priced):
    srv, gw, admin = priced
    url = srv.url
    a, b = _user(url, admin, "ta"), _user(url, admin, "tb")
    # the control API needs the admin key now
    r = httpx.post(f"{url}/v1/units/priced/scale", json={"instances": 0}, headers=_h(a))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    assert httpx.get(f"{url}/v1/status", headers=_h(admin)).status_code == 200
    # zero instances: a's request starts one, and is charged the cold start
    t_before_start = time.monotonic()
    ra = httpx.post(f"{url}/v1/completions", headers=_h(a), timeout=120,
                    json={"model": "priced", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True})
    assert ra.status_code == 200, ra.text
    usage = ra.json()["usage"]
    assert usage["sits"]["cost"] == pytest.approx((4 * 1.0 + 8 * 4.0) / 1e6)
    for _ in range(3):      # b uses the warm instance three times as long
        rb = httpx.post(f"{url}/v1/completions", headers=_h(b), timeout=120,
                        json={"model": "priced", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True})
        assert rb.status_code == 200
    t_served = time.monotonic()
    rows = httpx.get(f"{url}/v1/usage", params={"group_by": "tenant"}, headers=_h(admin)).json()["data"]
    by = {r["tenant"]: r for r in rows}
    assert by["ta"]["cold_starts"] == 1 and by["tb"]["cold_starts"] == 0
    assert by["ta"]["requests"] == 1 and by["tb"]["requests"] == 3
    # scaled to zero: the instance's weights + KV pool x its lifetime, split by busy time
    t_scaled = time.monotonic()
    assert httpx.post(f"{url}/v1/units/priced/scale", json={"instances": 0}, headers=_h(admin)).status_code == 200
    wait_for(lambda: httpx.get(f"{url}/v1/units/priced", headers=_h(admin)).json()["instances"] == [],
             what="the instance to stop")
    t_stopped = time.monotonic()
    rows = asyncio.run(gw.tenancy.store.usage(unit="priced"))
    inst = [r for r in rows if r.outcome == "instance"]
    assert {r.tenant for r in inst} == {"ta", "tb"}
    gb = {r.tenant: r.gb_hours for r in inst}
    assert gb["tb"] > gb["ta"] > 0
    unit_be = gw.units["priced"]
    # by hand: the checkpoint's matmul and embedding parameters (norms are noise) and the KV pool the
    # instance reported, in the engine's element size
    elem = unit_be.features.shape.kv_bytes_per_elem
    cfg = json.loads((Path(unit_be.spec.model) / "config.json").read_text())
    params = 0
    for f in Path(unit_be.spec.model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys() if "norm" not in k)
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * elem
    assert unit_be.footprint_bytes == params * elem + unit_be.limits.kv_capacity_tokens * per_token
    # the rows add up to footprint x lifetime: it lived at least from the last answer to the scale-down
    gb_hours = sum(r.gb_hours for r in inst)
    assert unit_be.footprint_bytes / 1e9 * (t_stopped - t_before_start) / 3600 >= gb_hours
    assert gb_hours >= unit_be.footprint_bytes / 1e9 * (t_scaled - t_served) / 3600
    assert all(r.cost == pytest.approx(r.gb_hours * 360.0) for r in inst)
    # a user key sees its own tenant's usage, its memory-time included
    mine = httpx.get(f"{url}/v1/usage", params={"group_by": "tenant"}, headers=_h(b)).json()["data"]
    assert [r["tenant"] for r in mine] == ["tb"] and mine[0]["gb_hours"] > 0



def test_instance_memory_time_is_apportioned_by_busy_time_by_hand():
    from sits.tenancy.instance_meter import InstanceMeter
    meter = InstanceMeter(footprint_bytes=2_000_000_000, started_at=0.0)
    meter.served("ta", 30.0)
    meter.served("tb", 10.0)
    # 2 GB for half an hour is 1 GB-hour, split 30 : 10 by request-seconds
    assert dict(meter.close(1800.0)) == pytest.approx({"ta": 0.75, "tb": 0.25})
    assert meter.close(3600.0) == []                  # nobody served: carried into the next interval
    meter.served("tb", 5.0)
    assert dict(meter.close(5400.0)) == pytest.approx({"tb": 2.0})    # 2 GB x 1 h
    assert meter.close(7200.0, final=True) == [(None, pytest.approx(1.0))]   # the operator's keep-alive
