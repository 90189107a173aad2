"""Load held against `sits up` (the real CLI, in its own process): N concurrent streams for M seconds.

Zero errors; p50/p99 TTFT reported; afterwards every KV block is free again (no leak across
thousands of requests, aborted ones included) and neither the gateway's nor the instances'
resident memory grew beyond a bound. Sized for 2 cores; SITS_RELIABILITY_STREAMS /
SITS_RELIABILITY_SECONDS scale it up on a bigger host.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time

import httpx
import pytest

from sits.bench.common import pct, start_sits, stop_sits, wait_until

pytestmark = pytest.mark.reliability

STREAMS = int(os.environ.get("SITS_RELIABILITY_STREAMS", "8"))
SECONDS = float(os.environ.get("SITS_RELIABILITY_SECONDS", "30"))
RSS_GROWTH_MB = 96          # per process, between the end of warm-up and the end of the load


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def kv_usage(url: str, unit: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf'^sits:kv_cache_usage_perc{{model_name="{unit}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else -1.0


def one_stream(url: str, rng: random.Random, ttfts: list, errors: list, abort: bool) -> None:
    words = rng.randint(3, 60)
    body = {"model": "load", "prompt": " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "slept"])
                                                for _ in range(words)),
            "max_tokens": rng.randint(4, 32), "temperature": 0.8, "seed": rng.randint(0, 1 << 30),
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                return
            first = True
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])
                    if "error" in c:
                        errors.append(c["error"]["code"])
                        return
                    if first and c["choices"] and c["choices"][0]["text"]:
                        ttfts.append((time.monotonic() - t0) * 1e3)
                        first = False
                        if abort:
                            return         # the client walks away mid-stream: its blocks must be freed
    except httpx.HTTPError as e:
        errors.append(f"{type(e).__name__}: {e}")


def test_streams_held_for_a_while_leave_nothing_behind(tiny_model_dir, tmp_path):
    (tmp_path / "sits.yaml").write_text(
        "units:\n  - name: load\n    model: " + tiny_model_dir + "\n"
        "    scale: {min_instances: 1, max_instances: 1}\n"
        "    resources: {device: cpu, kv_cache_mb: 32, max_model_len: 256, threads: 1}\n")
    proc, url = start_sits(["up", "--config", str(tmp_path / "sits.yaml"), "--data-dir", str(tmp_path / "data")])
    try:
        wait_until(lambda: [i["state"] for i in httpx.get(url + "/v1/units/load").json()["instances"]] == ["READY"],
                   120, "the instance")
        inst_pid = httpx.get(url + "/v1/units/load").json()["instances"][0]["pid"]
        ttfts: list[float] = []
        errors: list[str] = []
        count = [0]

        def worker(i: int, until: float) -> None:
            rng = random.Random(i)
            while time.monotonic() < until:
                one_stream(url, rng, ttfts, errors, abort=rng.random() < 0.1)
                count[0] += 1

        def run(seconds: float) -> None:
            until = time.monotonic() + seconds
            threads = [threading.Thread(target=worker, args=(i, until)) for i in range(STREAMS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        run(min(5.0, SECONDS / 4))                    # warm-up: allocator pools, caches, JIT paths
        rss0 = {"gateway": rss_mb(proc.pid), "instance": rss_mb(inst_pid)}
        ttfts.clear()
        count[0] = 0
        t0 = time.monotonic()
        run(SECONDS)
        elapsed = time.monotonic() - t0
        rss1 = {"gateway": rss_mb(proc.pid), "instance": rss_mb(inst_pid)}
        print(f"\nload held: {STREAMS} streams x {elapsed:.0f}s, {count[0]} requests ({count[0] / elapsed:.1f}/s), "
              f"TTFT p50 {pct(ttfts, 0.5):.1f} ms p99 {pct(ttfts, 0.99):.1f} ms, errors {len(errors)}; "
              f"RSS gateway {rss0['gateway']:.0f}->{rss1['gateway']:.0f} MB, "
              f"instance {rss0['instance']:.0f}->{rss1['instance']:.0f} MB")
        assert not errors, errors[:5]
        assert count[0] >= STREAMS * 5
        # every block comes back once the last stream (and every abort) is done
        wait_until(lambda: kv_usage(url, "load") == 0.0, 10, "all KV blocks free")
        for k in rss0:
            assert rss1[k] - rss0[k] < RSS_GROWTH_MB, (k, rss0[k], rss1[k])
        v = httpx.get(url + "/v1/units/load").json()
        assert v["crashes"] == 0 and v["instances"][0]["pid"] == inst_pid
    finally:
        stop_sits(proc)
