"""Memory as a resource units share (issue 18, the part a CPU host can test): with a budget that
holds one instance of either unit but not both, a start evicts the other unit's idle instance, waits
while that unit is busy (its stream is never cut), and a unit that can never fit is refused at deploy."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import httpx

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import unit, wait_for

MIB = 2**20


def _events(srv, unit_name: str) -> list[dict]:
    return [e for e in httpx.get(f"{srv.url}/v1/status").json()["events"] if e["unit"] == unit_name]


def _complete(srv, model: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})


def test_units_share_a_memory_budget(tiny_model_dir, tmp_path):
    weights = sum(p.stat().st_size for p in Path(tiny_model_dir).glob("*.safetensors"))
    one = weights + 16 * MIB                          # an instance: the weights and its 16 MiB KV pool
    alpha = unit("alpha", tiny_model_dir)
    beta = UnitSpec.model_validate(unit("beta", tiny_model_dir).model_dump() | {"faults": {
        "seed": 1, "inject": [{"kind": "step_degradation", "stages_ms": [15], "stage_s": 3600, "instances": 4}]}})
    huge = UnitSpec.model_validate(unit("huge", tiny_model_dir).model_dump()
                                   | {"resources": alpha.resources.model_dump() | {"kv_cache_mb": 256}})
    gw = Gateway(tmp_path, tick_s=0.2, memory_budget_mb=one * 1.3 / MIB)
    app = build_gateway_app(gw, [alpha, beta], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        assert _complete(srv, "alpha").status_code == 200
        mem = httpx.get(f"{srv.url}/v1/status").json()["memory"]
        # the zygote holds the model's weights once for both units; alpha's instance its KV pool
        assert set(mem["by_unit_mb"]) == {"(zygote)", "alpha"} and mem["reserved_mb"] <= mem["capacity_mb"]
        assert abs(mem["by_unit_mb"]["(zygote)"] - weights / MIB) < 1.0
        # beta does not fit beside alpha: alpha is idle, so it is evicted for beta
        assert _complete(srv, "beta").status_code == 200
        assert any(e["event"] == "evicted" and e["for"] == "beta" for e in _events(srv, "alpha"))
        wait_for(lambda: httpx.get(f"{srv.url}/v1/units/alpha").json()["instances"] == [], what="alpha at zero")
        assert set(httpx.get(f"{srv.url}/v1/status").json()["memory"]["by_unit_mb"]) == {"(zygote)", "beta"}
        # beta busy with a long stream: alpha's start waits for it (the stream is never cut), then evicts it
        beta_text: list[str] = []
        beta_done = threading.Event()

        def stream_beta() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120, json={
                    "model": "beta", "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True,
                    "stream": True}) as r:
                beta_text.extend(line for line in r.iter_lines() if line.startswith("data: {"))
            beta_done.set()

        t = threading.Thread(target=stream_beta)
        t.start()
        wait_for(lambda: len(beta_text) > 0 or httpx.get(f"{srv.url}/v1/units/beta").json()["inflight"] > 0,
                 what="beta streaming")
        r = _complete(srv, "alpha")
        assert r.status_code == 200, r.text
        t.join(60)
        assert beta_done.is_set() and '"finish_reason":"length"' in beta_text[-1].replace(" ", "")   # never cut
        assert any(e["event"] == "instance_waiting_for_memory" for e in _events(srv, "alpha"))
        cold = httpx.get(f"{srv.url}/v1/units/alpha").json()["cold_start"]["phases_ms"]
        assert cold.get("memory_wait", 0) > 0
        # a unit whose weights and one KV pool cannot fit the budget: refused at deploy, with the numbers
        r = httpx.post(f"{srv.url}/v1/units", json=huge.model_dump(), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "insufficient_memory", r.text
        assert "memory budget" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_each_gpu_is_budgeted_apart_from_the_host(tiny_model_dir, tmp_path):
    """A unit on a GPU reserves from that GPU's ledger: its weights, KV pool, activation reserve and a
    CUDA context, beside the contexts of the processes standing by there. One that can never fit is
    refused at deploy with the GPU named; a start that fails (no CUDA on this host) gives its
    reservation back. Budgeting works without NVML when the operator gives it (``--gpu-memory-mb``)."""
    from sits.runtime.device_memory import CUDA_CONTEXT_BYTES

    def gpu_unit(name: str, kv_mb: int) -> UnitSpec:
        spec = unit(name, tiny_model_dir)
        return UnitSpec.model_validate(spec.model_dump() | {"resources": spec.resources.model_dump() | {
            "device": "cuda:0", "kv_cache_mb": kv_mb}})

    gw = Gateway(tmp_path, tick_s=0.2, gpu_memory_mb=3000)
    app = build_gateway_app(gw, [gpu_unit("small-gpu", 16)], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        status = httpx.get(f"{srv.url}/v1/status").json()
        ledger = status["device_memory"]["cuda:0"]
        assert ledger["capacity_mb"] == 3000
        assert ledger["by_unit_mb"] == {"(standby)": CUDA_CONTEXT_BYTES / MIB}     # one standby's context
        host_before = status["memory"]["by_unit_mb"]
        # its weights, kept in host memory for its starts, are built by the zygote's loader process
        copy = wait_for(lambda: (h := httpx.get(f"{srv.url}/v1/units/small-gpu").json()["host_copy"])["state"] != "loading"
                        and h, what="the unit's host copy built")
        assert copy["state"] == "ready" and copy["ms"] > 0, copy
        r = httpx.post(f"{srv.url}/v1/units", json=gpu_unit("big-gpu", 4000).model_dump())
        assert r.status_code == 400 and r.json()["error"]["code"] == "insufficient_memory"
        assert "GPU cuda:0" in r.json()["error"]["message"] and "--gpu-memory-mb" in r.json()["error"]["message"]
        # a start: reserved on the GPU (not the host), given back when it fails here (no CUDA)
        r = _complete(srv, "small-gpu")
        assert r.status_code >= 500
        events = _events(srv, "small-gpu")
        assert any(e["event"] == "instance_failed" for e in events), [e["event"] for e in events]
        # no more retries (each would reserve again while it runs), then nothing is left reserved
        assert httpx.post(f"{srv.url}/v1/units/small-gpu/scale", json={"instances": 0}).status_code == 200
        wait_for(lambda: httpx.get(f"{srv.url}/v1/units/small-gpu").json()["instances"] == [], what="no instance")
        status = httpx.get(f"{srv.url}/v1/status").json()
        assert status["device_memory"]["cuda:0"]["by_unit_mb"] == {"(standby)": CUDA_CONTEXT_BYTES / MIB}
        assert status["memory"]["by_unit_mb"] == host_before
        shown = subprocess.run([sys.executable, "-m", "sits.cli", "status", "--url", srv.url], capture_output=True,
                               text=True, timeout=60)
        assert f"cuda:0 memory: {CUDA_CONTEXT_BYTES // MIB} of 3000 MiB reserved ((standby) 512)" in shown.stdout, \
            shown.stdout + shown.stderr
    finally:
        srv.stop()


def test_gpu_memory_is_read_without_a_cuda_context():
    from sits.runtime.device_memory import device_key, gpu_memory, visible_indices
    assert visible_indices(None, 2) == [0, 1]
    assert visible_indices("1", 2) == [1]
    assert visible_indices("1,0,5,0", 2) == [1, 0]          # CUDA stops at the first invalid entry
    assert visible_indices("GPU-8f3a", 2) is None            # UUIDs are not mapped
    assert visible_indices("", 2) == []
    gpus = gpu_memory()                                      # {} on a host without the NVIDIA driver
    assert all(k.startswith("cuda:") and 0 <= free <= total for k, (free, total) in gpus.items())
    assert device_key("cuda") == "cuda:0" and device_key("cuda:1") == "cuda:1"


def test_a_gpu_units_host_copy_must_fit_the_hosts_budget(tiny_model_dir, tmp_path):
    """The zygote keeps a GPU unit's weights in host memory between starts: a unit whose copy cannot
    fit the host's budget is refused at deploy, like a CPU unit's weights."""
    spec = unit("gpu", tiny_model_dir)
    spec = UnitSpec.model_validate(spec.model_dump() | {"resources": spec.resources.model_dump() | {"device": "cuda:0"}})
    weights = sum(p.stat().st_size for p in Path(tiny_model_dir).glob("*.safetensors"))
    gw = Gateway(tmp_path, tick_s=0.2, memory_budget_mb=weights / 8 / MIB, gpu_memory_mb=3000)
    app = build_gateway_app(gw, [], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        r = httpx.post(f"{srv.url}/v1/units", json=spec.model_dump())
        assert r.status_code == 400 and r.json()["error"]["code"] == "insufficient_memory"
        assert "kept in host memory" in r.json()["error"]["message"]
    finally:
        srv.stop()
