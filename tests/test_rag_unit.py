"""The RAG unit of examples/: deployed with `sits iu deploy --file`, it ingests its folder and every
request comes back with the right document cited (the tiny model's words mean nothing; the
retrieval and the citations must be right). Re-deploying re-indexes only what changed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from sits.memory.ingest import chunks
from test_gateway import start_gateway, wait_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_rag_unit_from_the_example(tiny_model_dir, tmp_path):
    docs = tmp_path / "rag-docs"
    shutil.copytree(EXAMPLES / "rag-docs", docs)
    text = (EXAMPLES / "rag-iu.yaml").read_text()
    assert "ingest: ./rag-docs" in text
    unit_file = tmp_path / "rag-iu.yaml"        # the example, with the test's model and a small KV pool
    unit_file.write_text(text.replace("model: ../models/default", f"model: {tiny_model_dir}")
                         .replace("resources: {device: auto, kv_cache_mb: 64}",
                                  "resources: {device: cpu, kv_cache_mb: 16, max_model_len: 512, warmup: false}"))
    srv, gw = start_gateway(tmp_path / "data", [])
    try:
        r = subprocess.run([sys.executable, "-m", "sits.cli", "iu", "deploy", "--file", str(unit_file),
                            "--url", srv.url], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        view = httpx.get(srv.url + "/v1/units/handbook").json()
        ing = view["memory"]["ingested"]
        expected = sum(len(chunks(p.read_text(), 300)) for p in docs.glob("*.md"))
        assert ing["files"] == 4 and ing["added"] == ing["chunks"] == expected > 4 and ing["forgotten"] == 0
        questions = {"When is an invoice due?": "billing.md", "What time does the backup job run?": "backups.md",
                     "How fast must the on-call engineer acknowledge a page?": "oncall.md",
                     "Who is a new engineer paired with?": "onboarding.md"}
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for q, source in questions.items():
            raw = client.chat.completions.with_raw_response.create(
                model="handbook", messages=[{"role": "user", "content": q}], max_tokens=4, temperature=0)
            body = raw.http_response.json()
            assert body["citations"][0]["meta"]["source"] == source, (q, body["citations"])
            assert len(body["citations"]) == 3
            assert raw.parse().choices[0].finish_reason in ("length", "stop")
        # the SITS dialect cites too, with no memory_ref: the unit's own set
        v = httpx.post(srv.url + "/v1/requests", json={"unit": "handbook", "prompt": "How do I restore a database?",
                                                       "constraints": {"max_tokens": 3}}).json()
        wait_for(lambda: httpx.get(f"{srv.url}/v1/requests/{v['id']}").json()["state"] in ("RESOLVED", "REJECTED"))
        v = httpx.get(f"{srv.url}/v1/requests/{v['id']}").json()
        assert v["state"] == "RESOLVED" and v["citations"][0]["meta"]["source"] == "backups.md"
        assert httpx.get(f"{srv.url}/v1/memory/{v['id']}/chain").json()["retrieved"][0]["memory"] == v["citations"][0]["id"]
        # a streamed answer carries them in its first chunk
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={
                "model": "handbook", "stream": True, "max_tokens": 2,
                "messages": [{"role": "user", "content": "Is there a fee for card payments?"}]}) as s:
            first = next(ln for ln in s.iter_lines() if ln.startswith("data: {"))
        assert '"source": "billing.md"' in first.replace('":"', '": "') or '"source":"billing.md"' in first
        # edit one document, re-deploy: only its chunks change
        (docs / "oncall.md").write_text((docs / "oncall.md").read_text().replace("five minutes", "ten minutes"))
        r = subprocess.run([sys.executable, "-m", "sits.cli", "iu", "deploy", "--file", str(unit_file),
                            "--url", srv.url], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        again = httpx.get(srv.url + "/v1/units/handbook").json()["memory"]["ingested"]
        assert again["added"] == again["forgotten"] == 1 and again["unchanged"] == ing["chunks"] - 1
    finally:
        srv.stop()


def test_a_rag_unit_with_an_empty_set_still_answers(tiny_model_dir, tmp_path):
    from sits.runtime.unit_spec import UnitSpec
    (tmp_path / "empty").mkdir()
    spec = UnitSpec.model_validate({"name": "bare", "model": tiny_model_dir,
                                    "memory": {"set": "bare", "ingest": str(tmp_path / "empty")},
                                    "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256,
                                                  "warmup": False}})
    srv, _ = start_gateway(tmp_path / "data", [spec])
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": "bare", "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]},
                       timeout=120)
        assert r.status_code == 200 and "citations" not in r.json()
    finally:
        srv.stop()
