"""Failover: an instance SIGKILLed mid-stream; the stream resumes on another instance with no
duplicate and no missing token, and the greedy text equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal

import httpx

from test_gateway import start_gateway, unit, wait_for


def test_a_stream_survives_its_instance_dying(tiny_model_dir, tmp_path):
    srv, gw = start_gateway(tmp_path, [unit("fo", tiny_model_dir, min_instances=1)])
    try:
        wait_for(lambda: [i["state"] for i in httpx.get(srv.url + "/v1/units/fo").json()["instances"]] == ["READY"])
        body = {"model": "fo", "prompt": "Once upon a time there was", "max_tokens": 80, "temperature": 0,
                "ignore_eos": True}
        reference = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        pid = httpx.get(srv.url + "/v1/units/fo").json()["instances"][0]["pid"]
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}},
                          timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 10:
                    os.kill(pid, signal.SIGKILL)
        assert not any("error" in c for c in chunks), chunks[-3:]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == reference
        assert chunks[-1]["usage"]["completion_tokens"] == 80
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        events = httpx.get(srv.url + "/v1/status").json()["events"]
        fo = [e for e in events if e["event"] == "failover"]
        assert len(fo) == 1 and fo[0]["tokens_sent"] >= 9
        v = httpx.get(srv.url + "/v1/units/fo").json()
        assert v["crashes"] == 1 and [i["state"] for i in v["instances"]] == ["READY"]
        assert v["instances"][0]["pid"] != pid
    finally:
        srv.stop()


def test_a_guided_stream_resumes_inside_its_grammar(tiny_model_dir, tmp_path):
    """The resumed instance replays the sent tokens into the grammar: the JSON still parses and
    equals the uninterrupted answer."""
    srv, gw = start_gateway(tmp_path, [unit("fo", tiny_model_dir, min_instances=1, max_instances=1)])
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                         "minItems": 12, "maxItems": 12}}, "required": ["items"]}
    try:
        wait_for(lambda: [i["state"] for i in httpx.get(srv.url + "/v1/units/fo").json()["instances"]] == ["READY"])
        body = {"model": "fo", "messages": [{"role": "user", "content": "List twelve."}], "max_tokens": 120,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "l", "schema": schema}}}
        reference = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json()
        reference = reference["choices"][0]["message"]["content"]
        pid = httpx.get(srv.url + "/v1/units/fo").json()["instances"][0]["pid"]
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 8:
                        os.kill(pid, signal.SIGKILL)
        assert not any("error" in c for c in chunks), chunks[-3:]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == reference and len(json.loads(text)["items"]) == 12
        fo = [e for e in httpx.get(srv.url + "/v1/status").json()["events"] if e["event"] == "failover"]
        assert len(fo) == 1 and fo[0]["tokens_sent"] >= 6
    finally:
        srv.stop()
