"""The `sits` command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def _sits(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "sits.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_build_tiny_then_generate(tmp_path):
    d = tmp_path / "m"
    r = _sits("model", "build-tiny", str(d), "--preset", "tiny")
    assert r.returncode == 0, r.stderr
    assert json.loads((d / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    again = _sits("model", "build-tiny", str(d))
    assert again.returncode == 2 and "overwrite" in again.stderr

    r = _sits("generate", "--model", str(d), "--max-tokens", "8", "--device", "cpu", "Hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello")
    assert "cold start:" in r.stderr and "weights" in r.stderr and "8 tokens" in r.stderr


def test_generate_reports_typed_errors(tmp_path):
    r = _sits("generate", "--model", str(tmp_path), "hi")
    assert r.returncode == 2
    assert "error [model_load_failed]" in r.stderr and "config.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_starts_answers_and_stops_cleanly(tiny_model_dir):
    """`sits serve` as `make run` starts it: live at once, ready after warm-up, prints how to call it,
    answers the openai client, and shuts down cleanly on Ctrl-C (SIGINT)."""
    import signal
    import threading
    import time

    import httpx
    import openai

    from conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sits.cli", "serve", "--model", tiny_model_dir, "--port",
                             str(port), "--served-model-name", "default", "--kv-cache-mb", "32",
                             "--max-model-len", "256", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        saw_loading = False
        while True:
            assert time.monotonic() < deadline, "".join(stderr)
            assert proc.poll() is None, "".join(stderr)
            try:
                r = httpx.get(url + "/ready", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if r.status_code == 503:
                saw_loading = True
                assert r.json()["status"] == "loading"
                c = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x"})
                assert c.status_code in (503, 200)
                if c.status_code == 503:
                    assert c.json()["error"]["code"] == "model_loading"
            elif r.status_code == 200:
                break
            time.sleep(0.05)
        assert saw_loading          # the engine loads behind a live server
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=5)
        assert out.usage.completion_tokens >= 1
        time.sleep(0.2)
        banner = "".join(stderr)
        assert f"http://127.0.0.1:{port}/v1/chat/completions" in banner and "OpenAI(base_url=" in banner
        assert "cold start" in banner and "weights" in banner
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc in (0, 130), "".join(stderr)     # 130: uvicorn re-raises SIGINT after its graceful shutdown
    assert "Traceback" not in "".join(stderr)


def test_up_iu_and_status_drive_a_running_gateway(tiny_model_dir, tmp_path):
    """`sits up` with a config, then `sits iu deploy/list/scale/delete` and `sits status` against it."""
    import signal
    import threading
    import time

    import httpx

    from conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    res = '{device: cpu, kv_cache_mb: 16, max_model_len: 256, warmup: false, threads: 1, cpu_quota: 1.5}'
    (tmp_path / "sits.yaml").write_text(
        f"units:\n  - name: main\n    model: {tiny_model_dir}\n    scale: {{min_instances: 1}}\n    resources: {res}\n")
    (tmp_path / "extra.yaml").write_text(f"name: extra\nmodel: {tiny_model_dir}\nresources: {res}\n")
    (tmp_path / "broken.yaml").write_text(f"name: broken\nmodel: {tiny_model_dir}\nscale:\n  max_instance: 2\n")
    proc = subprocess.Popen([sys.executable, "-m", "sits.cli", "up", "--config", str(tmp_path / "sits.yaml"),
                             "--port", str(port), "--data-dir", str(tmp_path / "data"), "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while True:                      # min_instances: 1 -> a READY instance without any request
            assert time.monotonic() < deadline and proc.poll() is None, "".join(stderr)
            try:
                u = httpx.get(url + "/v1/units/main", timeout=2).json()
                if [i["state"] for i in u.get("instances", [])] == ["READY"]:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        cli = ("--url", url)
        r = _sits("iu", "deploy", "--file", str(tmp_path / "extra.yaml"), *cli)
        assert r.returncode == 0 and "deployed extra" in r.stdout, r.stderr
        r = _sits("iu", "deploy", "--file", str(tmp_path / "broken.yaml"), *cli)
        assert r.returncode == 2 and "broken.yaml:4:3: scale.max_instance: unknown field" in r.stderr
        r = _sits("iu", "scale", "extra", "1", *cli)
        assert r.returncode == 0 and "desired 1" in r.stdout
        r = _sits("iu", "list", *cli)
        assert "main" in r.stdout and "extra" in r.stdout
        c = httpx.post(url + "/v1/completions", json={"model": "extra", "prompt": "x", "max_tokens": 2}, timeout=120)
        assert c.status_code == 200
        r = _sits("status", *cli)
        assert r.returncode == 0 and "last cold start: fork" in r.stdout and "main" in r.stdout
        assert re.search(r"cpu quota: (cgroup-v1|cgroup-v2|threads) 1\.5 cpu", r.stdout), r.stdout
        sla_rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith(("SLA", "main", "extra"))][-3:]
        assert sla_rows[0][:3] == ["SLA", "ttft", "slo"] and sla_rows[1][0] == "main" and "CLOSED" in sla_rows[1]
        assert json.loads(_sits("status", "--json", *cli).stdout)["units"][0]["name"] == "main"
        r = _sits("iu", "delete", "extra", *cli)
        assert r.returncode == 0
        r = _sits("iu", "delete", "extra", *cli)
        assert r.returncode == 2 and "unit_not_found" in r.stderr
        assert "curl -s" in "".join(stderr) and "OpenAI(base_url=" in "".join(stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc in (0, 130) and "Traceback" not in "".join(stderr), "".join(stderr)
