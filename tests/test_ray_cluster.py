"""Ray as the cluster engine (issue 21), on a real multi-node Ray cluster on this host
(``ray.cluster_utils.Cluster``: a head with no CPUs for instances, two nodes of one CPU each):
instances placed by their unit's resources (one per node; a third finds no room), scale 0 → N across
nodes, streams from instances on other nodes identical to a local run, a node killed mid-stream
with the stream completing identically on the other node, and `sits status` showing nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import wait_for

ray = pytest.importorskip("ray", reason="the cluster extra (pip install -e '.[cluster]') installs Ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPT = "The river runs past the old mill and"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    yield c, nodes
    c.shutdown()


@pytest.fixture(scope="module")
def gw(cluster, tiny_model_dir, tmp_path_factory):
    c, nodes = cluster
    spec = UnitSpec.model_validate({
        "name": "chat", "model": tiny_model_dir,
        "scale": {"min_instances": 0, "max_instances": 3, "keep_alive_s": 600, "downscale_delay_s": 600},
        "resources": {"device": "cpu", "threads": 1, "kv_cache_mb": 16, "max_model_len": 512, "warmup": False},
        # every step of every instance takes 40 ms: a stream is long enough to kill its node under it
        "faults": {"seed": 1, "inject": [{"kind": "step_degradation", "stages_ms": [40], "stage_s": 3600,
                                          "instances": 8}]}})
    g = Gateway(tmp_path_factory.mktemp("ray-gw"), tick_s=0.2, ray=c.address, ray_placement_timeout_s=6)
    app = build_gateway_app(g, [spec], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5, timeout=180)
    yield srv, g, c, nodes
    srv.stop(60)


def instances(srv) -> list[dict]:
    return httpx.get(f"{srv.url}/v1/units/chat", timeout=10).json()["instances"]


def complete(srv, max_tokens: int = 24) -> str:
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
        "model": "chat", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_instances_are_placed_on_nodes_by_their_resources(gw, tiny_model_dir):
    srv, g, c, nodes = gw
    assert instances(srv) == []                       # zero instances: a request cold-starts one on a node
    text = complete(srv)
    only = instances(srv)
    assert len(only) == 1 and only[0]["node"] is not None
    assert text == _local_reference(tiny_model_dir, 24)     # the same tokens as an engine on this host
    httpx.post(f"{srv.url}/v1/units/chat/scale", json={"instances": 2}, timeout=10)
    ready = wait_for(lambda: [i for i in instances(srv) if i["state"] == "READY"] if
                     len([i for i in instances(srv) if i["state"] == "READY"]) == 2 else None, timeout=120,
                     what="two READY instances")
    worker_ids = {n.node_id[:12] for n in nodes}
    assert {i["node"] for i in ready} == worker_ids          # one CPU each: one instance per node
    # a third needs a CPU no node has: its start fails with the reason, the two keep serving
    httpx.post(f"{srv.url}/v1/units/chat/scale", json={"instances": 3}, timeout=10)
    failure = wait_for(lambda: httpx.get(f"{srv.url}/v1/units/chat").json()["start_failure"], timeout=60,
                       what="the third start to fail")
    assert "no Ray node could place" in failure["error"]
    httpx.post(f"{srv.url}/v1/units/chat/scale", json={"instances": 2}, timeout=10)
    assert complete(srv) == text
    st = subprocess.run([sys.executable, "-m", "sits.cli", "status", "--url", srv.url], capture_output=True,
                        text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    for node in worker_ids:
        assert f"node {node}" in st.stdout, st.stdout
    nodes_view = httpx.get(f"{srv.url}/v1/status").json()["nodes"]
    assert {n["node_id"] for n in nodes_view} >= worker_ids


def test_a_node_killed_mid_stream_is_a_crash_the_stream_survives(gw):
    srv, g, c, nodes = gw
    wait_for(lambda: len([i for i in instances(srv) if i["state"] == "READY"]) == 2, timeout=120, what="2 READY")
    want = complete(srv, 64)
    got: list[str] = []
    seen_first = threading.Event()
    errors: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=120, json={
                "model": "chat", "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        errors.append(chunk["error"]["code"])
                        continue
                    got.append(chunk["choices"][0]["text"])
                    if len(got) >= 8:
                        seen_first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert seen_first.wait(60)
    serving = [i for i in instances(srv) if i["inflight"] > 0]
    assert len(serving) == 1
    victim = next(n for n in nodes if n.node_id[:12] == serving[0]["node"])
    c.remove_node(victim, allow_graceful=False)
    nodes.remove(victim)
    t.join(120)
    assert not errors and "".join(got) == want               # resumed on the other node, no gap, no repeat
    events = httpx.get(f"{srv.url}/v1/status").json()["events"]
    assert any(e["event"] == "failover" for e in events)
    assert any(e["event"] == "instance_crashed" for e in events)


def _local_reference(model_dir: str, n: int) -> str:
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    from sits.engine.sampling_params import SamplingParams
    eng = LLMEngine(EngineConfig(model=model_dir, device="cpu", warmup=False, kv_cache_memory_mb=16,
                                 max_model_len=512))
    out = eng.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return out[0]["text"]
