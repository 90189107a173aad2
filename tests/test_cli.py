"""The `sits` command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
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
