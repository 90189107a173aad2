"""``sits serve`` never stands in front of a dead engine: extreme sampling values are answered (or
refused with a 400) and the engine lives; an engine process that dies is reaped and restarted."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(line.split()[1] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return None


def _wait(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (v := cond()):
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny()


def _complete(url: str, **kw) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4} | kw
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("params", [
    {"temperature": 5e-324}, {"temperature": 1e-300, "top_p": 1e-300}, {"temperature": 1e-45, "min_p": 1.0},
    {"temperature": 2.0, "top_k": 1_000_000}, {"presence_penalty": -2.0, "frequency_penalty": 2.0, "temperature": 1e-30},
])
def test_extreme_but_valid_sampling_values_are_served(server, params):
    r = _complete(server.url, **params)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("value", [1e-300, 5e-324, 0.001])
def test_a_repetition_penalty_that_cannot_be_computed_is_a_400(server, value):
    r = _complete(server.url, repetition_penalty=value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "repetition_penalty"
    assert _complete(server.url).status_code == 200


def test_a_dead_engine_is_reaped_and_restarted(serve_tiny):
    srv = serve_tiny()
    backend = srv.app.state.sits.registry.get("tiny")
    old_pid = backend.current.pid
    assert _complete(srv.url).status_code == 200
    os.kill(old_pid, signal.SIGKILL)
    # meanwhile: a typed 503 (engine_dead from the old process, or engine_restarting), never a hang
    r = _complete(srv.url)
    if r.status_code != 200:
        assert r.status_code == 503 and r.json()["error"]["code"] in ("engine_dead", "engine_restarting"), r.text
    _wait(lambda: backend.restarts >= 1 and backend.ready, what="the restarted engine")
    assert backend.current.pid != old_pid
    assert _proc_state(old_pid) is None, "the dead engine process was left as a zombie"
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/ready").status_code == 200
    r = _complete(srv.url)
    assert r.status_code == 200, r.text
