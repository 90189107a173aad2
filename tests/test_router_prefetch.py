"""Routing (session affinity, prefix affinity × KV room − load) and trace-driven pre-warming."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from sits.engine.llm_engine import EngineStats
from sits.runtime.prefetch import Prefetcher
from sits.runtime.router import Router, prefix_hashes
from test_gateway import start_gateway, unit, wait_for


@dataclass
class FakeBackend:
    free_blocks: int = 1000
    max_num_seqs: int = 64

    def stats(self):
        return EngineStats(0, 0, 0.0, 1000, self.free_blocks, 0, 0, 0.0, 0, 0, "pfsd")


@dataclass
class Inst:
    id: str
    backend: FakeBackend
    inflight: int = 0


def test_prefix_hashes_chain():
    a = prefix_hashes(list(range(40)))
    b = prefix_hashes(list(range(32)) + [0] * 8)
    assert len(a) == 2 and a == b                      # only full blocks count
    assert prefix_hashes([9] + list(range(1, 40)))[0] != a[0]


def test_router_prefers_cached_prefix_then_room_then_load():
    r = Router()
    x, y = Inst("x", FakeBackend()), Inst("y", FakeBackend())
    shared = list(range(64))
    h = prefix_hashes
    r.record("y", h(shared + [1, 2, 3]))
    assert r.choose([x, y], h(shared + [7, 8]), 100)[0] is y        # prefix affinity
    y.backend.free_blocks = 1                                         # ... unless it has no room
    assert r.choose([x, y], h(shared), 2000)[0] is x
    y.backend.free_blocks = 1000
    y.inflight = 60                                                   # ... or it is far busier
    assert r.choose([x, y], h(shared), 100)[0] is x
    fresh = r.choose([x, Inst("z", FakeBackend(), inflight=5)], h([1] * 10), 20)[0]
    assert fresh is x                                                 # no affinity: the least loaded


def test_router_session_affinity():
    r = Router()
    x, y = Inst("x", FakeBackend()), Inst("y", FakeBackend())
    r.record("y", prefix_hashes([5] * 20), session_id="s1")
    inst, why = r.choose([x, y], prefix_hashes([1] * 40), 60, session_id="s1")
    assert inst is y and why == "session"
    assert r.choose([x], prefix_hashes([1] * 40), 60, session_id="s1")[0] is x       # its instance is gone


def test_prefetcher_learns_p_b_given_a():
    t = [0.0]
    p = Prefetcher(window_s=10, threshold=0.85, min_observations=3, clock=lambda: t[0])
    for i in range(4):
        t[0] += 1
        assert p.observe("a", f"s{i}") == []          # P(b|a) = 0/1, 1/2, 2/3, 3/4: below 0.85
        t[0] += 1
        p.observe("b", f"s{i}")
    assert p.probability("a", "b") == 1.0
    t[0] += 1
    assert p.observe("a", "s9") == [] and p.probability("a", "b") == 0.8   # this "a" is not followed yet
    for i in range(10, 30):
        t[0] += 1
        p.observe("a", f"s{i}")
        t[0] += 1
        p.observe("b", f"s{i}")
    t[0] += 1
    assert p.observe("a", "new") == [("b", p.probability("a", "b"))]
    assert p.probability("a", "b") >= 0.85
    t[0] += 100                                       # outside the window: not a chain
    p.observe("c", "new")
    assert p.probability("a", "c") == 0.0
    assert p.observe("a", None) == []


def test_session_affinity_and_prefetch_through_the_gateway(tiny_model_dir, tmp_path):
    srv, gw = start_gateway(tmp_path, [unit("first", tiny_model_dir, min_instances=2),
                                       unit("second", tiny_model_dir, keep_alive_s=3600)])
    try:
        wait_for(lambda: len([i for i in httpx.get(srv.url + "/v1/units/first").json()["instances"]
                              if i["state"] == "READY"]) == 2, what="two READY instances")
        c = httpx.Client(base_url=srv.url, timeout=120)
        for i in range(4):
            r = c.post("/v1/completions", json={"model": "first", "prompt": f"turn {i} of a chat", "max_tokens": 2},
                       headers={"x-session-id": "conv-1"})
            assert r.status_code == 200
        routed = c.get("/v1/units/first").json()["routed"]
        assert routed.get("session") == 3                        # the first call placed it; 3 followed it
        # a workflow: first -> second, in the same session each time
        for i in range(12):      # P(second | first) = 12 / 14 (the chat above and the last call count too)
            sid = f"flow-{i}"
            c.post("/v1/completions", json={"model": "first", "prompt": "step one", "max_tokens": 2},
                   headers={"x-session-id": sid})
            c.post("/v1/completions", json={"model": "second", "prompt": "step two", "max_tokens": 2},
                   headers={"x-session-id": sid})
            c.post("/v1/units/second/scale", json={"instances": 0})
            wait_for(lambda: c.get("/v1/units/second").json()["instances"] == [], what="second at zero")
        c.post("/v1/completions", json={"model": "first", "prompt": "step one", "max_tokens": 2},
               headers={"x-session-id": "flow-next"})
        v = c.get("/v1/units/second").json()
        assert v["desired"] == 1 and v["instances"], v            # started before anyone asked for it
        events = [e for e in c.get("/v1/status").json()["events"] if e["event"] == "prefetch"]
        assert events and events[-1]["after"] == "first" and events[-1]["p"] >= 0.85
    finally:
        srv.stop()
