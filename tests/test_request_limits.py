"""Requests are validated once, in the front end, against the serving engine's real limits.

A gateway plans a unit's limits from its config before any instance runs (the same function the
engine sizes its KV pool with), so a unit at zero instances refuses what no instance could take;
an instance reporting other limits than those the gateway validates against is not used.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sits.engine.config import ModelConfig
from sits.engine.messages import EngineLimits
from sits.engine.request_validator import plan_limits
from sits.runtime.unit_pool import UnitPool
from test_gateway import start_gateway, unit


@pytest.mark.parametrize("kw", [{"kv_cache_memory_mb": 1}, {"kv_cache_memory_mb": 3, "max_model_len": 64},
                                {"num_kv_blocks": 7, "block_size": 8}])
def test_planned_limits_are_the_engines(make_engine, tiny_model_dir, kw):
    engine = make_engine(**kw)
    planned = plan_limits(engine.cfg, ModelConfig.from_dir(tiny_model_dir))
    assert planned == engine.limits
    assert engine.pool.num_blocks == planned.num_kv_blocks and engine.max_model_len == planned.max_model_len


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    srv, gw = start_gateway(tmp_path_factory.mktemp("gw-limits"), [])
    yield srv, gw
    srv.stop()


def test_a_cold_unit_refuses_what_its_kv_pool_cannot_hold(gateway, tiny_model_dir):
    srv, gw = gateway
    spec = unit("small-pool", tiny_model_dir).model_dump()
    spec["resources"]["kv_cache_mb"] = 1
    assert httpx.post(srv.url + "/v1/units", json=spec, timeout=60).status_code == 201
    limits = gw.units["small-pool"].limits
    capacity = limits.kv_capacity_tokens
    assert capacity < limits.max_model_len       # the pool, not the context, is the binding limit
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"model": "small-pool", "prompt": [1] * 8, "max_tokens": capacity})
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_capacity_exceeded", r.text
    assert gw.units["small-pool"].pool.instances == []       # refused in the gateway: nothing started
    # max_tokens left out: the rest of what the pool can hold (not of the context), and it runs
    r = httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"model": "small-pool", "prompt": [1] * 8, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= capacity - 8
    assert httpx.delete(srv.url + "/v1/units/small-pool", timeout=60).status_code == 200


def test_an_instance_reporting_other_limits_is_not_used(tiny_model_dir):
    spec = unit("mismatch", tiny_model_dir, start_backoff_s=60)
    mc = ModelConfig.from_dir(tiny_model_dir)
    planned = plan_limits(spec.engine_config(), mc)
    wrong = EngineLimits(planned.vocab_size, planned.max_model_len, planned.block_size, planned.num_kv_blocks + 1)
    events: list[tuple[str, dict]] = []

    async def main():
        failed = asyncio.Event()

        def on_event(kind: str, data: dict) -> None:
            events.append((kind, data))
            if kind == "instance_failed":
                failed.set()

        pool = UnitPool(spec, on_event=on_event, limits=wrong)
        pool.scale_to(1, "test")
        await asyncio.wait_for(failed.wait(), 120)
        await pool.shutdown()
        return pool

    pool = asyncio.run(main())
    failed = [data for kind, data in events if kind == "instance_failed"]
    assert "limits" in failed[0]["error"] and pool.ready() == []
    assert "instance_ready" not in [kind for kind, _ in events]
