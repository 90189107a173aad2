"""Requests cannot kill or hang what serves them, against `sits up` (the real CLI, its own process).

A burst of requests with random sampling values at the edges of float range (subnormal
temperatures, tiny top-p, huge penalties, NaN spelled as numbers clients can send), mixed with
normal ones: each is answered 200 or 400 with a code, and the instance that served them is the
same process at the end (no crash, no restart). A unit whose instances cannot start answers 503
``unit_unavailable`` at once, with the cause, and its starts back off.
"""

from __future__ import annotations

import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sits.bench.common import start_sits, stop_sits, wait_until

pytestmark = pytest.mark.reliability

# at the edges of each parameter's valid range, and (sometimes) anything a JSON number can be
VALID_EDGES = {
    "temperature": [0.0, 5e-324, 1e-300, 1e-45, 1e-38, 0.0099, 0.01, 2.0],
    "top_p": [5e-324, 1e-300, 1e-45, 1e-8, 1.0],
    "min_p": [0.0, 5e-324, 1e-300, 0.999999, 1.0],
    "presence_penalty": [-2.0, -5e-324, 0.0, 1e-300, 2.0],
    "frequency_penalty": [-2.0, -5e-324, 0.0, 1e-300, 2.0],
    "repetition_penalty": [0.01, 0.0100001, 1.0, 10.0],
    "top_k": [-1, 0, 1, 2, 1_000_000],
}
ANY_EDGES = [5e-324, 1e-300, -1e-300, 0.0099, 2.0000001, 10.0000001, -2.0000001, 1e38, 1.7976931348623157e308,
             -1.7976931348623157e308, -2**63, 2**31, 2**63 - 1]


def random_body(rng: random.Random, i: int) -> dict:
    body = {"model": "edge", "prompt": "the cat sat on the mat", "max_tokens": rng.randint(1, 8),
            "seed": rng.randint(0, 2**32)}
    if i % 4 == 0:
        return body                           # a normal request among the hostile ones
    for name, edges in VALID_EDGES.items():
        if rng.random() < 0.6:
            body[name] = rng.choice(ANY_EDGES if rng.random() < 0.08 else edges)
    return body


def test_random_extreme_sampling_values_never_crash_an_instance(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "sits.yaml").write_text(
        "units:\n"
        f"  - name: edge\n    model: {tiny_model_dir}\n"
        "    scale: {min_instances: 1, max_instances: 1}\n"
        "    resources: {device: cpu, kv_cache_mb: 32, max_model_len: 256, threads: 1}\n"
        f"  - name: broken\n    model: {broken}\n"
        "    scale: {min_instances: 0, max_instances: 1, start_backoff_s: 0.5, start_backoff_max_s: 2}\n"
        "    resources: {device: cpu, kv_cache_mb: 16, max_model_len: 256, threads: 1}\n")
    proc, url = start_sits(["up", "--config", str(tmp_path / "sits.yaml"), "--data-dir", str(tmp_path / "data")])
    try:
        wait_until(lambda: [i["state"] for i in httpx.get(url + "/v1/units/edge").json()["instances"]] == ["READY"],
                   120, "the instance")
        pid = httpx.get(url + "/v1/units/edge").json()["instances"][0]["pid"]
        rng = random.Random(14)
        bodies = [random_body(rng, i) for i in range(200)]

        def send(body: dict) -> tuple[int, str | None]:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            return r.status_code, (r.json().get("error") or {}).get("code") if r.status_code != 200 else None

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(send, bodies))
        statuses = sorted({s for s, _ in results})
        assert set(statuses) <= {200, 400}, [(b, r) for b, r in zip(bodies, results) if r[0] not in (200, 400)][:5]
        assert all(code for s, code in results if s == 400)
        served = sum(1 for s, _ in results if s == 200)
        view = httpx.get(url + "/v1/units/edge").json()
        assert view["crashes"] == 0 and view["starts"] == 1
        assert [i["pid"] for i in view["instances"]] == [pid]
        print(f"\n  {len(bodies)} requests with edge values: {served} served, {len(bodies) - served} refused (400); "
              f"instance pid {pid} throughout, 0 crashes")

        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2}, timeout=60)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "unit_unavailable", r.text
        assert "safetensors" in r.json()["error"]["message"]
        status = httpx.get(url + "/v1/units/broken").json()["start_failure"]
        assert status and status["failures_in_a_row"] >= 1
        print(f"  a unit that cannot start: 503 unit_unavailable in {took:.2f} s, cause named: "
              f"{r.json()['error']['message'][-80:]!r}")
    finally:
        stop_sits(proc)
