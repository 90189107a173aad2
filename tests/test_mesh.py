"""The mesh (issue 21): a unit that routes each request over tiers of other units (a local unit and a
remote one, a second SITS server) by its SLA and their live state, and escalates on a missed
deadline, an error, an invalid answer or low confidence; every decision an event and a span."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from conftest import free_port, start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.faults import FaultsSpec
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import unit, wait_for
from test_remote_unit import KEY_ENV, MESSAGES, UPSTREAM_KEY, remote

ALL_SPANS = {"L1": 1.0, "L2": 1.0, "L3": 1.0}


def mesh(name: str, tiers: list[str], **kw) -> UnitSpec:
    return UnitSpec.model_validate({"name": name, "mesh": {"tiers": tiers, **kw}})


@pytest.fixture(scope="module")
def upstream(serve_tiny):
    return serve_tiny(ServerSettings(drain_grace_s=1.0, api_keys=(UPSTREAM_KEY,)), max_model_len=1024)


@pytest.fixture(scope="module")
def gw(upstream, tiny_model_dir, tmp_path_factory):
    os.environ[KEY_ENV] = UPSTREAM_KEY
    dead = f"http://127.0.0.1:{free_port()}/v1"
    small = unit("small", tiny_model_dir, min_instances=1)
    units = [small, unit("cold", tiny_model_dir),
             remote("large", upstream.url + "/v1", pricing={"output_per_mtok": 100.0}),
             remote("broken", dead, backend={"connect_timeout_s": 2}),
             mesh("assist", ["small", "large"]),
             mesh("picky", ["small", "large"], escalate={"min_mean_logprob": -0.01}),
             mesh("via-cold", ["cold", "large"], ttft_budget_ms=1000),
             mesh("via-broken", ["broken", "small"]),
             mesh("held", ["small", "broken"]),
             mesh("frugal", ["large", "small"])]
    g = Gateway(tmp_path_factory.mktemp("mesh-gw"), tick_s=0.2)
    app = build_gateway_app(g, units, ServerSettings(drain_grace_s=0.5, trace_exporter="memory",
                                                     trace_level_rates=ALL_SPANS))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    wait_for(lambda: httpx.get(f"{srv.url}/v1/units/small").json()["instances"][0]["state"] == "READY",
             timeout=120, what="small READY")
    yield srv, g
    srv.stop()
    os.environ.pop(KEY_ENV, None)


def served(srv, name: str) -> dict[str, int]:
    return {t["unit"]: t["served"] for t in httpx.get(f"{srv.url}/v1/units/{name}").json()["tiers"]}


def chat(srv, model: str, headers: dict | None = None, **kw) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def direct(srv, model: str, **kw) -> str:
    r = chat(srv, model, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_first_tier_within_the_sla_serves(gw):
    srv, _ = gw
    r = chat(srv, "assist")
    assert r.status_code == 200 and r.json()["model"] == "assist"
    assert r.json()["choices"][0]["message"]["content"] == direct(srv, "small")
    assert served(srv, "assist") == {"small": 1, "large": 0}
    # streamed through the official client as well
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="assist", messages=MESSAGES, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert text == direct(srv, "small")
    spans = srv.app.state.sits.tracing.finished_spans()
    attempts = [s for s in spans if s.name == "mesh.attempt"]
    assert attempts and attempts[-1].attributes["sits.mesh.tier"] == "small"
    roots = [s for s in spans if s.attributes.get("sits.mesh") == "assist"]
    assert roots and roots[-1].attributes["sits.mesh.path"] == "small"
    assert 'sits:mesh_requests_total{mesh="assist",tier="small"} 2.0' in httpx.get(srv.url + "/metrics").text


def test_a_tier_past_the_deadline_escalates_to_the_next(gw):
    srv, g = gw
    small = g.units["small"]
    small.set_faults(FaultsSpec.model_validate({"seed": 1, "inject": [
        {"kind": "first_frame_block", "block_ms": 3000}]}))
    try:
        r = chat(srv, "assist", headers={"X-SITS-TTFT-Budget-Ms": "400"})
    finally:
        small.set_faults(None)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == direct(srv, "large")
    view = httpx.get(f"{srv.url}/v1/units/assist").json()
    assert view["escalations"]["deadline"] == 1
    events = [e for e in httpx.get(f"{srv.url}/v1/status").json()["events"] if e["unit"] == "assist"]
    assert [e["event"] for e in events][-2:] == ["mesh_escalated", "mesh_served"]
    assert events[-2]["tier"] == "small" and events[-1]["tier"] == "large"


def test_an_invalid_answer_and_low_confidence_escalate(gw):
    srv, _ = gw
    before = served(srv, "assist")["large"]
    # 4 tokens cannot hold a JSON object: the small tier's answer is cut off, the large tier answers
    r = chat(srv, "assist", max_tokens=4, response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    assert served(srv, "assist")["large"] == before + 1
    assert httpx.get(f"{srv.url}/v1/units/assist").json()["escalations"]["invalid_json"] == 1
    # a random model is never sure of itself: every answer is below -0.01 mean logprob
    r = chat(srv, "picky")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == direct(srv, "large")
    assert httpx.get(f"{srv.url}/v1/units/picky").json()["escalations"]["low_confidence"] == 1


def test_live_state_and_cost_route_around_tiers(gw):
    srv, g = gw
    # a tier with no instance is predicted to take a cold start: over a 1 s budget, so skipped (not started)
    r = chat(srv, "via-cold")
    assert r.status_code == 200 and served(srv, "via-cold") == {"cold": 0, "large": 1}
    view = httpx.get(f"{srv.url}/v1/units/via-cold").json()
    assert view["skipped"] == {"cold:predicted_ttft_over_budget": 1}
    assert g.units["cold"].pool.desired == 0
    # an unreachable tier fails over to the next one
    r = chat(srv, "via-broken")
    assert r.status_code == 200 and served(srv, "via-broken") == {"broken": 0, "small": 1}
    assert httpx.get(f"{srv.url}/v1/units/via-broken").json()["escalations"]["error"] == 1
    # a cost cap leaves out the tier that would cost more
    assert chat(srv, "frugal").status_code == 200 and served(srv, "frugal") == {"large": 1, "small": 0}
    r = chat(srv, "frugal", headers={"X-SITS-Cost-Cap": "0.0000001"})
    assert r.status_code == 200 and served(srv, "frugal") == {"large": 1, "small": 1}


def test_bad_sla_headers_and_what_a_mesh_refuses_are_typed(gw):
    srv, _ = gw
    r = chat(srv, "assist", headers={"X-SITS-TTFT-Budget-Ms": "soon"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"
    r = chat(srv, "assist", logprobs=True)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "assist", "prompt": [1, 2]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "token_prompt_unsupported"
    # completions cross as text to the chosen tier
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                   json={"model": "assist", "prompt": "The river", "max_tokens": 6, "temperature": 0})
    want = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                      json={"model": "small", "prompt": "The river", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
    with pytest.raises(ValueError, match="its own tiers"):
        mesh("loop", ["loop"])


def test_the_plan_orders_tiers_by_budget_cost_and_priority():
    """``MeshUnit.plan`` over tiers whose live state is set by hand: what fits the budget in order; an
    urgent request the fastest first; tiers predicted to miss the budget after those that fit (the
    fastest first), as fallbacks."""
    from types import SimpleNamespace

    from sits.engine.sampling_params import SamplingParams
    from sits.runtime.mesh_unit import MeshUnit
    from sits.tenancy.spec import PricingSpec

    def tier(name, ttft, open_=False, price=0.0):
        return SimpleNamespace(name=name, predicted_ttft_ms=lambda: ttft,
                               breaker=SimpleNamespace(admits=lambda: not open_),
                               features=SimpleNamespace(pricing=PricingSpec(output_per_mtok=price), shape=None))

    tiers = {"a": tier("a", 900), "b": tier("b", 300), "c": tier("c", 100, price=1e6), "d": tier("d", 50, True)}
    host = SimpleNamespace(unit=tiers.get, record=lambda *a: None)
    m = MeshUnit(mesh("m", ["a", "b", "c", "d"]), host)
    req = m.prepare("hello", SamplingParams(max_tokens=10), request_id="r-0")
    order, skipped = m.plan(req, budget_ms=1000, cap=None)
    assert [t.name for t in order] == ["a", "b", "c"] and skipped == [("d", "breaker_open")]
    order, skipped = m.plan(req, budget_ms=500, cap=1.0)          # c costs 10 units; a is too slow
    assert [t.name for t in order] == ["b", "a"] and set(skipped) == {
        ("d", "breaker_open"), ("c", "over_cost_cap"), ("a", "predicted_ttft_over_budget")}
    urgent = m.prepare("hello", SamplingParams(max_tokens=10), request_id="u-0", priority=5)
    assert [t.name for t in m.plan(urgent, budget_ms=1000, cap=None)[0]] == ["c", "a", "b"]
    assert [t.name for t in m.plan(req, budget_ms=10, cap=None)[0]] == ["c", "b", "a"]   # none fits: fastest first


def test_the_held_answer_is_served_when_every_later_tier_fails(gw):
    srv, _ = gw
    # small's answer is cut off (not JSON): held; broken, the last tier, cannot be reached: small's answer
    kw = dict(max_tokens=4, response_format={"type": "json_object"})
    r = chat(srv, "held", **kw)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == direct(srv, "small", **kw)
    view = httpx.get(f"{srv.url}/v1/units/held").json()
    assert view["escalations"] == {"invalid_json": 1, "error": 1}
    events = [e for e in httpx.get(f"{srv.url}/v1/status").json()["events"] if e["unit"] == "held"]
    assert events[-1]["event"] == "mesh_served_held" and events[-1]["tier"] == "small"


def test_a_request_without_max_tokens_and_a_mesh_cycle(gw):
    srv, _ = gw
    body = {"model": "assist", "messages": MESSAGES, "temperature": 0}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{srv.url}/v1/units", json=mesh("loop-a", ["loop-b"]).model_dump(), timeout=30)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{srv.url}/v1/units", json=mesh("loop-b", ["small", "loop-a"]).model_dump(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "mesh_cycle", r.text
    assert "loop-b -> loop-a -> loop-b" in r.json()["error"]["message"]
    assert httpx.get(f"{srv.url}/v1/status", timeout=10).status_code == 200
