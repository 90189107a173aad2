"""`bench/device_check.sh run` as a dry run on the CPU (tiny model, `--quick` where a benchmark has
it): the one call a GPU host gets must not fail on the script itself. Every step runs, every
benchmark leaves its JSON, and the merged device_check.json/.md hold them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1700)          # the script's own deadline and caps bound it (about 5 min alone here)
def test_the_device_check_script_runs_end_to_end_on_the_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, DEVICE_CHECK_DEVICE="cpu", DEVICE_CHECK_QUICK="1",
               DEVICE_CHECK_SECONDS="1500", DEVICE_CHECK_CAP_SCALE="5")     # caps sized for a GPU, not 2 busy cores
    proc = subprocess.run(["bash", "bench/device_check.sh", "run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1600)
    logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-2000:], logs)
    merged = json.loads((tmp_path / "device_check.json").read_text())
    assert set(merged) == {"step_base_bf16", "step_llama1b_bf16", "coldstart_llama1b_bf16", "engine_base_bf16",
                           "lora_base_bf16", "step_small_fp32", "standby_llama1b_bf16"}
    assert not (tmp_path / "skipped.txt").exists()
    assert " passed" in (tmp_path / "tests.log").read_text()
    text = (tmp_path / "device_check.md").read_text()
    assert "## Decode step" in text and "## Cold start" in text and "## LoRA" in text and "## Standby" in text
    assert "nvml (free, total) bytes:" in (tmp_path / "host.txt").read_text()
