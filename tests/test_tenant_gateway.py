"""Tenants through `sits up`'s gateway: the control API closed to user keys, a unit's price table,
the cold start a tenant's request caused, and instance memory-time apportioned by busy time."""

from __future__ import annotations

import httpx
import pytest

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
    ra = httpx.post(f"{url}/v1/completions", headers=_h(a), timeout=120,
                    json={"model": "priced", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True})
    assert ra.status_code == 200, ra.text
    usage = ra.json()["usage"]
    assert usage["sits"]["cost"] == pytest.approx((4 * 1.0 + 8 * 4.0) / 1e6)
    for _ in range(3):      # b uses the warm instance three times as long
        rb = httpx.post(f"{url}/v1/completions", headers=_h(b), timeout=120,
                        json={"model": "priced", "prompt": [5, 6, 7, 8], "max_tokens": 8, "ignore_eos": True})
        assert rb.status_code == 200
    rows = httpx.get(f"{url}/v1/usage", params={"group_by": "tenant"}, headers=_h(admin)).json()["data"]
    by = {r["tenant"]: r for r in rows}
    assert by["ta"]["cold_starts"] == 1 and by["tb"]["cold_starts"] == 0
    assert by["ta"]["requests"] == 1 and by["tb"]["requests"] == 3
    # scaled to zero: the instance's weights + KV pool x its lifetime, split by busy time
    assert httpx.post(f"{url}/v1/units/priced/scale", json={"instances": 0}, headers=_h(admin)).status_code == 200
    wait_for(lambda: httpx.get(f"{url}/v1/units/priced", headers=_h(admin)).json()["instances"] == [],
             what="the instance to stop")
    rows = gw.tenancy.store.usage(unit="priced")
    inst = [r for r in rows if r.outcome == "instance"]
    assert {r.tenant for r in inst} == {"ta", "tb"}
    gb = {r.tenant: r.gb_hours for r in inst}
    assert gb["tb"] > gb["ta"] > 0
    unit_be = gw.units["priced"]
    assert unit_be.footprint_bytes > 0
    assert all(r.cost == pytest.approx(r.gb_hours * 360.0) for r in inst)
    # a user key sees its own tenant's usage, its memory-time included
    mine = httpx.get(f"{url}/v1/usage", params={"group_by": "tenant"}, headers=_h(b)).json()["data"]
    assert [r["tenant"] for r in mine] == ["tb"] and mine[0]["gb_hours"] > 0

