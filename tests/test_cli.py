"""The `sits` command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time


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
        # the Responses API through the gateway's dispatcher (streamed events end in the final object)
        with httpx.stream("POST", url + "/v1/responses", timeout=60, json={
                "model": "main", "input": "Hi", "max_output_tokens": 4, "stream": True}) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("event: ")]
        assert resp.status_code == 200 and lines[0] == "event: response.created"
        assert lines[-1] in ("event: response.completed", "event: response.incomplete")
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
        units = json.loads(_sits("status", "--json", *cli).stdout)["units"]
        assert units[0]["name"] == "main"
        assert all(u["device_memory_mb"] is None for u in units) and "device memory" not in r.stdout   # CPU units
        r = _sits("iu", "delete", "extra", *cli)
        assert r.returncode == 0
        r = _sits("iu", "delete", "extra", *cli)
        assert r.returncode == 2 and "unit_not_found" in r.stderr
        assert "curl -s" in "".join(stderr) and "OpenAI(base_url=" in "".join(stderr)
        assert f"sits iu list --url {url}" in "".join(stderr)      # not the default port: the hint says where
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc in (0, 130) and "Traceback" not in "".join(stderr), "".join(stderr)


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    """argparse style: exit 2 and a single `sits: error: ...` line, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sits: error"), r.stderr
    return lines[0]


def test_missing_and_invalid_files_are_one_line_errors(tmp_path):
    line = _one_line_error(_sits("iu", "deploy", "--file", str(tmp_path / "missing.yaml"), timeout=60))
    assert "missing.yaml" in line and "No such file" in line
    line = _one_line_error(_sits("up", "--config", str(tmp_path / "missing.yaml"), timeout=60))
    assert "missing.yaml" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("units:\n  - name: x\n    model: /nowhere\n    scale:\n      max_instance: 2\n")
    line = _one_line_error(_sits("up", "--config", str(bad), timeout=60))
    assert f"{bad}:5:7: units.0.scale.max_instance: unknown field" in line


def _processes_with_env(marker: str) -> list[str]:
    """Command lines of live processes whose environment holds ``marker`` (what a run left behind)."""
    import os
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found.append(f.read().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def _kill_processes_with_env(marker: str) -> None:
    """Clean up after a failing run (only processes that carry this test's marker)."""
    import os
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    os.kill(int(pid), 9)
        except OSError:
            pass


def test_up_on_a_port_in_use_fails_before_starting_anything(tiny_model_dir, tmp_path):
    import os
    import socket
    import uuid

    cfg = tmp_path / "sits.yaml"
    cfg.write_text(f"units:\n  - name: main\n    model: {tiny_model_dir}\n    scale: {{min_instances: 1}}\n"
                   "    resources: {device: cpu, kv_cache_mb: 16, max_model_len: 256, warmup: false}\n")
    scratch = tmp_path / "tmp"          # the zygote's socket directory would land here
    scratch.mkdir()
    marker = f"sits-test-{uuid.uuid4().hex}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with open(tmp_path / "stderr", "w+") as err:   # a file: a leftover child would hold a pipe open
            proc = subprocess.Popen([sys.executable, "-m", "sits.cli", "up", "--config", str(cfg), "--port", str(port),
                                     "--data-dir", str(tmp_path / "data")], stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, "TMPDIR": str(scratch), "SITS_TEST_MARK": marker})
            try:
                rc = proc.wait(120)
            finally:
                proc.kill()
            err.seek(0)
            stderr = err.read()
    left = _processes_with_env(marker)
    _kill_processes_with_env(marker)
    assert rc != 0 and "Traceback" not in stderr, stderr
    assert f"127.0.0.1:{port}" in stderr and "in use" in stderr, stderr
    assert left == [], f"processes left behind: {left}"
    assert "curl -s" not in stderr, "the how-to-call-it banner was printed for a server that never listened"
    assert list(scratch.iterdir()) == [], "a zygote socket directory was left behind"


def test_ctrl_c_while_the_gateway_starts_leaves_no_process(tiny_model_dir, tmp_path):
    """SIGINT while the zygote is still starting: it is stopped too, not orphaned."""
    import os
    import signal
    import time
    import uuid

    from conftest import free_port

    cfg = tmp_path / "sits.yaml"
    cfg.write_text(f"units:\n  - name: main\n    model: {tiny_model_dir}\n"
                   "    resources: {device: cpu, kv_cache_mb: 16, max_model_len: 256, warmup: false}\n")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marker = f"sits-test-{uuid.uuid4().hex}"
    with open(tmp_path / "stderr", "w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "sits.cli", "up", "--config", str(cfg), "--port",
                                 str(free_port()), "--data-dir", str(tmp_path / "data")], stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, "TMPDIR": str(scratch), "SITS_TEST_MARK": marker})
        try:
            deadline = time.monotonic() + 60
            while not any("sits.runtime.zygote" in c for c in _processes_with_env(marker)):
                assert time.monotonic() < deadline and proc.poll() is None, "no zygote started"
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        finally:
            proc.kill()
        time.sleep(0.5)
        left = _processes_with_env(marker)
        _kill_processes_with_env(marker)
        err.seek(0)
        assert left == [], f"processes left behind: {left}\n{err.read()}"
    assert list(scratch.iterdir()) == [], "a zygote socket directory was left behind"


def test_client_commands_name_the_gateway_they_cannot_reach():
    import os

    from conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "SITS_URL": url}
    for args in (("iu", "list"), ("status",)):
        r = subprocess.run([sys.executable, "-m", "sits.cli", *args], capture_output=True, text=True, timeout=60,
                           env=env)
        line = _one_line_error(r)
        assert f"cannot reach the SITS gateway at {url}" in line and "--url" in line and "SITS_URL" in line


def test_sits_url_is_read_when_the_command_runs(monkeypatch):
    from sits import cli

    monkeypatch.setenv("SITS_URL", "http://gateway.test:9999")
    assert cli._gateway_url(cli.build_parser().parse_args(["iu", "list"])) == "http://gateway.test:9999"
    args = cli.build_parser().parse_args(["status"])
    monkeypatch.delenv("SITS_URL")
    assert cli._gateway_url(args) == cli.DEFAULT_URL
    assert cli._gateway_url(cli.build_parser().parse_args(["status", "--url", "http://x:1"])) == "http://x:1"


def _all_parsers(parser, path=("sits",)):
    import argparse
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, path + (name,))


def test_every_option_has_help_with_its_default():
    import argparse

    from sits.cli import build_parser

    missing, no_default = [], []
    for path, p in _all_parsers(build_parser()):
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = " ".join(path) + " " + (a.option_strings[-1] if a.option_strings else a.dest)
            if not (a.help or "").strip():
                missing.append(name)
            elif a.option_strings and not any(a.default is v for v in (None, False, argparse.SUPPRESS)) \
                    and a.default != [] and "default" not in p.formatter_class("x")._get_help_string(a):
                no_default.append(name)
    assert missing == [], f"options without help: {missing}"
    assert no_default == [], f"help that does not state the default: {no_default}"


def test_serve_on_a_port_in_use_fails_before_loading_the_model(tiny_model_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "sits.cli", "serve", "--model", tiny_model_dir, "--port", str(port),
                            "--device", "cpu", "--no-warmup"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    assert "curl -s" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_serve_with_an_unsupported_model_says_why_without_a_traceback(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from conftest import free_port
    r = subprocess.run([sys.executable, "-m", "sits.cli", "serve", "--model", str(model), "--port", str(free_port()),
                        "--device", "cpu", "--no-warmup"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert "unsupported_model" in r.stderr and "GPT2LMHeadModel" in r.stderr, r.stderr


def test_control_commands_start_without_importing_torch():
    """`sits status`, `sits iu ...`: a client of the gateway, quick to start (the benchmarks' modules,
    which import torch, are loaded for `sits bench` only)."""
    code = ("import sys\nfrom sits.cli import main\n"
            "rc = main(['status', '--url', 'http://127.0.0.1:9'])\n"
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr
    assert "gateway_unreachable" in r.stderr
