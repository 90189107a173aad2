"""The SITS dialect over HTTP: 202 PENDING, followable events, timeout, cancel, webhooks, retention."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.sits.webhooks import verify

SECRET = "s3cret"


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(ServerSettings(webhook_secret=SECRET, webhook_backoff_s=0.05, request_retention_s=600,
                                     allow_private_callbacks=True,   # the webhook receiver runs on loopback
                                     drain_grace_s=1.0))


class Receiver:
    """A real local webhook receiver: records every POST; /flaky fails its first two attempts."""

    def __init__(self):
        self.got: list[dict] = []
        self.lock = threading.Lock()
        self.flaky_calls = 0

        async def hook(request: Request):
            body = await request.body()
            with self.lock:
                self.got.append({"path": request.url.path, "headers": dict(request.headers), "body": body,
                                 "json": json.loads(body)})
            return JSONResponse({"ok": True})

        async def flaky(request: Request):
            self.flaky_calls += 1
            if self.flaky_calls <= 2:
                return JSONResponse({"busy": True}, status_code=503)
            return await hook(request)

        async def ready(request: Request):
            return JSONResponse({"ok": True})

        self.app = Starlette(routes=[Route("/hook", hook, methods=["POST"]), Route("/flaky", flaky, methods=["POST"]),
                                     Route("/ready", ready)])
        self.srv = start_server(self.app)

    def events_for(self, rid: str) -> list[dict]:
        with self.lock:
            return [g for g in self.got if g["json"]["request_id"] == rid]


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.srv.stop()


def submit(server, **body) -> dict:
    body.setdefault("constraints", {"max_tokens": 6})
    r = httpx.post(server.url + "/v1/requests", json=body)
    assert r.status_code == 202, r.text
    view = r.json()
    assert view["state"] == "PENDING" and view["id"].startswith("req_")
    assert r.headers["location"] == f"/v1/requests/{view['id']}"
    return view


def wait_terminal(server, rid: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = httpx.get(f"{server.url}/v1/requests/{rid}").json()
        if v["state"] in ("RESOLVED", "REJECTED"):
            return v
        time.sleep(0.02)
    raise AssertionError(f"{rid} not terminal after {timeout} s")


def read_events(server, rid: str, last_event_id: int | None = None) -> list[tuple[int, str, dict]]:
    headers = {} if last_event_id is None else {"last-event-id": str(last_event_id)}
    out, cur = [], {}
    with httpx.stream("GET", f"{server.url}/v1/requests/{rid}/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("id: "):
                cur["id"] = int(line[4:])
            elif line.startswith("event: "):
                cur["event"] = line[7:]
            elif line.startswith("data: "):
                out.append((cur["id"], cur["event"], json.loads(line[6:])))
                cur = {}
    return out


def test_resolved_path_with_events_and_output(server):
    v = submit(server, prompt="Once upon a time", temperature=0, constraints={"max_tokens": 8})
    events = read_events(server, v["id"])         # follows live until the terminal event
    states = [d["state"] for _, kind, d in events if kind == "state"]
    assert states == ["PENDING", "VALIDATING", "EXECUTING", "RESOLVED"]
    assert [i for i, *_ in events] == list(range(1, len(events) + 1))
    deltas = "".join(d["text"] for _, kind, d in events if kind == "delta")
    final = wait_terminal(server, v["id"])
    assert final["output"] == deltas and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 8
    assert set(final["timings"]) >= {"validate", "queue", "prefill", "decode", "total"}
    terminal = events[-1][2]
    assert terminal["payload"]["output"] == deltas
    assert all("payload" not in d for _, kind, d in events[:-1] if kind == "state")
    # the same greedy request through the OpenAI dialect gives the same text
    c = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Once upon a time",
                                                         "max_tokens": 8, "temperature": 0}).json()
    assert c["choices"][0]["text"] == deltas


def test_messages_and_priority_are_accepted(server):
    v = submit(server, messages=[{"role": "user", "content": "hi"}], interactive=True,
               constraints={"max_tokens": 4, "priority": 5})
    assert wait_terminal(server, v["id"])["state"] == "RESOLVED"


@pytest.mark.parametrize("body,code,failed_in", [
    ({"unit": "nope", "prompt": "x"}, "unit_not_found", "VALIDATING"),
    ({"prompt": "x", "allowed_tools": ["file.read@^1.2"]}, "tool_not_allowed", "VALIDATING"),
    ({"prompt": "x", "memory_ref": "mem-1"}, "memory_not_found", "VALIDATING"),
    ({"prompt": "x", "constraints": {"max_tokens": 10_000}}, "context_length_exceeded", "VALIDATING"),
])
def test_rejected_during_validation(server, body, code, failed_in):
    v = submit(server, **body)
    final = wait_terminal(server, v["id"])
    assert final["state"] == "REJECTED" and final["error"]["code"] == code
    assert [t["state"] for t in final["transitions"]] == ["PENDING", failed_in, "REJECTED"]
    assert final["output"] == ""


def test_timeout_is_enforced(server):
    v = submit(server, prompt="Tell a long story", constraints={"max_tokens": 200, "timeout_ms": 60})
    final = wait_terminal(server, v["id"])
    assert final["state"] == "REJECTED" and final["error"]["code"] == "timeout"
    assert final["transitions"][-2]["state"] in ("VALIDATING", "EXECUTING")
    took_ms = (final["updated_ns"] - final["created_ns"]) / 1e6
    assert took_ms < 60 + 1500


def test_cancel_then_cancel_again_conflicts(server):
    v = submit(server, prompt="Tell a long story", constraints={"max_tokens": 200})
    r = httpx.delete(f"{server.url}/v1/requests/{v['id']}")
    assert r.status_code == 200
    assert r.json()["state"] == "REJECTED" and r.json()["error"]["code"] == "cancelled"
    r = httpx.delete(f"{server.url}/v1/requests/{v['id']}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "request_terminal"
    assert httpx.get(f"{server.url}/v1/requests/x-unknown").status_code == 404
    assert httpx.delete(f"{server.url}/v1/requests/x-unknown").json()["error"]["code"] == "request_not_found"


def test_cancel_frees_the_engine(server):
    v = submit(server, prompt="Tell a long story", constraints={"max_tokens": 200})
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/v1/requests/{v['id']}").json()["state"] != "EXECUTING":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    httpx.delete(f"{server.url}/v1/requests/{v['id']}")
    backend = server.app.state.sits.registry.get("tiny")
    deadline = time.monotonic() + 5
    while backend.stats().num_running or backend.stats().num_waiting:
        assert time.monotonic() < deadline, backend.stats()
        time.sleep(0.01)


def test_last_event_id_resumes_after_that_event(server):
    v = submit(server, prompt="Resume me", temperature=0, constraints={"max_tokens": 6})
    wait_terminal(server, v["id"])
    full = read_events(server, v["id"])
    resumed = read_events(server, v["id"], last_event_id=3)
    assert resumed == full[3:]
    assert read_events(server, v["id"], last_event_id=len(full)) == []
    r = httpx.get(f"{server.url}/v1/requests/{v['id']}/events", headers={"last-event-id": "abc"})
    assert r.status_code == 400


def test_webhook_receives_every_transition_in_order_signed(server, receiver):
    url = receiver.srv.url + "/hook"
    v = submit(server, prompt="hook me", callback_url=url)
    wait_terminal(server, v["id"])
    deadline = time.monotonic() + 10
    while len(receiver.events_for(v["id"])) < 4:
        assert time.monotonic() < deadline, receiver.events_for(v["id"])
        time.sleep(0.02)
    got = receiver.events_for(v["id"])
    assert [g["json"]["state"] for g in got] == ["PENDING", "VALIDATING", "EXECUTING", "RESOLVED"]
    for g in got:
        h = g["headers"]
        assert verify(SECRET, h["x-sits-timestamp"], g["body"], h["x-sits-signature"])
        assert not verify("wrong", h["x-sits-timestamp"], g["body"], h["x-sits-signature"])
        assert h["x-sits-event"] == g["json"]["state"]
    assert got[-1]["json"]["payload"]["finish_reason"] in ("length", "stop")


def test_webhooks_carry_the_clients_trace(server, receiver):
    trace = "0af7651916cd43dd8448eb211c80319c"
    r = httpx.post(server.url + "/v1/requests", json={"prompt": "trace me", "constraints": {"max_tokens": 2},
                                                      "callback_url": receiver.srv.url + "/hook"},
                   headers={"traceparent": f"00-{trace}-b7ad6b7169203331-01"})
    assert r.headers["traceparent"].split("-")[1] == trace
    rid = r.json()["id"]
    wait_terminal(server, rid)
    deadline = time.monotonic() + 10
    while len(receiver.events_for(rid)) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert {g["headers"]["traceparent"].split("-")[1] for g in receiver.events_for(rid)} == {trace}


def test_webhook_retries_with_backoff(server, receiver):
    v = submit(server, prompt="retry me", callback_url=receiver.srv.url + "/flaky")
    wait_terminal(server, v["id"])
    deadline = time.monotonic() + 10
    while len(receiver.events_for(v["id"])) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    got = receiver.events_for(v["id"])
    assert [g["json"]["state"] for g in got] == ["PENDING", "VALIDATING", "EXECUTING", "RESOLVED"]
    assert got[0]["headers"]["x-sits-delivery-attempt"] == "3"     # two 503s, then delivered
    metrics = httpx.get(server.url + "/metrics").text
    assert 'sits:webhook_deliveries_total{outcome="retried"}' in metrics


def test_metrics_count_final_states_and_codes(server):
    text = httpx.get(server.url + "/metrics").text
    assert 'sits:requests_finished_total{code="",state="RESOLVED"}' in text
    assert 'sits:requests_finished_total{code="cancelled",state="REJECTED"}' in text
    assert 'sits:request_state_transitions_total{state="VALIDATING"}' in text


def test_finished_requests_are_dropped_after_retention(serve_tiny):
    """Kept while retained (long enough for a poll on a busy host to see it), then a 404."""
    srv = serve_tiny(ServerSettings(request_retention_s=2.0, drain_grace_s=0.5))
    v = submit(srv, prompt="forget me", constraints={"max_tokens": 2})
    wait_terminal(srv, v["id"])
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{srv.url}/v1/requests/{v['id']}")).status_code == 200:
        assert time.monotonic() < deadline, "a finished request outlived its retention"
        time.sleep(0.1)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"


@pytest.mark.parametrize("address,private", [
    ("127.0.0.1", True), ("10.1.2.3", True), ("100.100.100.200", True), ("169.254.169.254", True),
    ("0.0.0.0", True), ("::1", True), ("::ffff:10.0.0.1", True), ("2002:a9fe:a9fe::1", True), ("fec0::1", True),
    ("fd00:ec2::254", True), ("224.0.0.1", True), ("8.8.8.8", False), ("2606:4700::1111", False)])
def test_callback_addresses_that_are_not_public(address, private):
    import ipaddress

    from sits.api.sits.webhooks import is_private_address
    assert is_private_address(ipaddress.ip_address(address)) is private


def test_deliveries_connect_to_the_checked_address():
    from sits.api.sits.webhooks import _pinned
    assert _pinned("https://hooks.example.com:8443/x?y=1", "93.184.216.34") == (
        "https://93.184.216.34:8443/x?y=1", {"host": "hooks.example.com:8443"}, {"sni_hostname": "hooks.example.com"})
    assert _pinned("http://h.example/x", "2606:4700::1111")[0] == "http://[2606:4700::1111]/x"
