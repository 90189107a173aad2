"""Standby processes: the zygote keeps children forked ahead of a unit's starts, their device set up
(a GPU's context; nothing on a CPU), and hands a start to one instead of forking."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import openai

from test_gateway import start_gateway, unit, wait_for


def zygote_children(zygote_pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == zygote_pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def test_a_start_is_handed_to_a_standby_and_another_stands_by_behind_it(tiny_model_dir, tmp_path):
    spec = unit("sb", tiny_model_dir)
    spec.resources.standby = 1
    srv, gw = start_gateway(tmp_path, [spec])
    try:
        zpid = gw.zygote.info["pid"]
        wait_for(lambda: httpx.get(f"{srv.url}/v1/status").json()["standby"]["cpu"]["ready"] == 1,
                 what="a standby process ready")
        first = zygote_children(zpid)
        assert len(first) == 1
        shown = subprocess.run([sys.executable, "-m", "sits.cli", "status", "--url", srv.url], capture_output=True,
                               text=True, timeout=60).stdout
        assert "standby processes for cpu: 1 of 1 ready" in shown
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="sb", prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        inst = httpx.get(f"{srv.url}/v1/units/sb").json()["instances"][0]
        assert inst["pid"] in first                     # the standby became the instance
        assert "standby" in inst["cold_start_ms"] and "fork" not in inst["cold_start_ms"]
        wait_for(lambda: httpx.get(f"{srv.url}/v1/status").json()["standby"]["cpu"]["ready"] == 1,
                 what="a replacement standby ready")
        behind = zygote_children(zpid) - {inst["pid"]}
        assert len(behind) == 1

        # standbys that die unused are replaced, up to a limit; then starts fork as before
        for _ in range(2):
            victim = next(iter(behind))
            os.kill(victim, signal.SIGKILL)
            behind = wait_for(lambda: (c := zygote_children(zpid) - {inst["pid"], victim}) and c,
                              what="the standby replaced")
        os.kill(next(iter(behind)), signal.SIGKILL)     # the third in a row: none forked after it
        wait_for(lambda: zygote_children(zpid) == {inst["pid"]}, what="the last standby reaped")
        assert httpx.post(f"{srv.url}/v1/units/sb/scale", json={"instances": 2}).status_code == 200
        ready = wait_for(lambda: [i for i in httpx.get(f"{srv.url}/v1/units/sb").json()["instances"]
                                  if i["state"] == "READY" and i["pid"] != inst["pid"]], what="a second instance")
        assert "fork" in ready[0]["cold_start_ms"]

        # undeployed: its instance goes, and the standbys its device no longer needs
        assert httpx.delete(f"{srv.url}/v1/units/sb").status_code in (200, 204)
        wait_for(lambda: not zygote_children(zpid), what="instances and standbys gone")
    finally:
        srv.stop()


def test_standbys_default_to_none_on_a_cpu_and_one_on_a_gpu(tiny_model_dir):
    spec = unit("cpu-unit", tiny_model_dir)
    assert spec.standby_processes() == 0
    spec.resources.device = "cuda:1"
    assert spec.standby_processes() == 1
    spec.resources.standby = 2
    assert spec.standby_processes() == 2
