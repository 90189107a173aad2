"""Vector memory: the MiniLM embedder against transformers, time slices, snapshots, causal chains,
and memory_ref through the SITS dialect (retrieval and citations must be right even though the
tiny model's text is not)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from sits.api.context import ServerSettings
from sits.memory.embedder import default_model_dir, shared_embedder
from sits.memory.vectors import MemoryNotFoundError, MemoryStore

DOCS = ["The cat sleeps on the red sofa every afternoon.",
        "Invoices are due on the first day of each month.",
        "Paris is the capital and largest city of France.",
        "The backup job runs at 2 am and keeps seven days of history."]


def embed(texts):
    return shared_embedder().embed(texts).numpy()


def test_embedder_matches_transformers_bert():
    from transformers import AutoTokenizer, BertModel
    texts = ["A kitten naps on a couch.", "quarterly revenue", "x"]
    ours = shared_embedder().embed(texts)
    model = BertModel.from_pretrained(str(default_model_dir())).eval()
    enc = AutoTokenizer.from_pretrained(str(default_model_dir()))(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert (ours - ref).abs().max().item() < 1e-5
    assert float(ours[0].numpy() @ embed(["The cat sleeps on the sofa."])[0]) > 0.5     # it is a real sentence model


def test_time_slices_snapshots_and_chains(tmp_path):
    m = MemoryStore(tmp_path / "memory.db", embed)
    ids = m.add("kb", DOCS, [{"source": f"doc{i}.txt"} for i in range(4)], at=100.0)
    assert m.search("kb", "where does the kitten nap?", k=1)[0].id == ids[0]
    m.snapshot("kb", "v1", at=150.0)
    assert m.forget("kb", ids[0], at=200.0) and not m.forget("kb", ids[0], at=201.0)
    m.add("kb", ["The dog barks at the mail carrier."], at=210.0)
    now = {h.text for h in m.list("kb")}
    assert DOCS[0] not in now and "The dog barks at the mail carrier." in now
    assert {h.text for h in m.list("kb", as_of=160.0)} == set(DOCS)               # as it was then
    assert m.search("kb", "kitten", k=1, as_of=160.0)[0].id == ids[0]
    assert m.list("kb", as_of=50.0) == []
    changed = m.restore("kb", "v1", at=300.0)
    assert len(changed["forgotten"]) == 1 and len(changed["restored"]) == 1
    assert {h.text for h in m.list("kb")} == set(DOCS)
    assert {h.text for h in m.list("kb", as_of=250.0)} == (set(DOCS) - {DOCS[0]}) | {"The dog barks at the mail carrier."}
    with pytest.raises(MemoryNotFoundError):
        m.restore("kb", "nope")
    # chains: req_a reads the capital fact and writes an answer; req_b reads that answer
    m.search("kb", "capital of France", k=1, response_id="req_a")
    [answer] = m.add("kb", ["Q: capital? A: Paris"], response_id="req_a")
    m.search("kb", "Q: capital? A: Paris", k=1, response_id="req_b")
    b = m.chain("req_b")
    assert b["retrieved"][0]["memory"] == f"m_{answer}" and b["influenced_by"] == ["req_a"]
    a = m.chain(f"m_{ids[2]}")
    assert [r["response"] for r in a["retrieved_by"]] == ["req_a"] and a["meta"] == {"source": "doc2.txt"}
    assert m.chain(f"m_{answer}")["written_by"] == ["req_a"]


@pytest.fixture(scope="module")
def mem_server(serve_tiny, tmp_path_factory):
    return serve_tiny(ServerSettings(drain_grace_s=0.5, data_dir=str(tmp_path_factory.mktemp("mem"))),
                      engine_mode="thread")


def finished(url, rid):
    deadline = time.monotonic() + 30
    while True:
        v = httpx.get(f"{url}/v1/requests/{rid}").json()
        if v["state"] in ("RESOLVED", "REJECTED") or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def test_memory_over_http_and_memory_ref(mem_server):
    url = mem_server.url
    r = httpx.post(url + "/v1/memory/kb", json={"texts": DOCS, "metas": [{"source": f"doc{i}.txt"} for i in range(4)]})
    assert r.status_code == 201
    ids = r.json()["ids"]
    hits = httpx.get(url + "/v1/memory/kb/search", params={"q": "When do I have to pay the bill?", "k": 2}).json()
    assert hits["data"][0]["id"] == ids[1]
    v = httpx.post(url + "/v1/requests", json={"prompt": "When does the backup run?", "memory_ref": "kb",
                                              "remember": True, "constraints": {"max_tokens": 4}}).json()
    v = finished(url, v["id"])
    assert v["state"] == "RESOLVED", v
    assert v["citations"][0]["id"] == ids[3] and v["citations"][0]["meta"] == {"source": "doc3.txt"}
    assert len(v["citations"]) == 4 and v["memories_written"]
    chain = httpx.get(f"{url}/v1/memory/{v['id']}/chain").json()
    assert chain["retrieved"][0]["memory"] == ids[3] and chain["wrote"] == v["memories_written"]
    back = httpx.get(f"{url}/v1/memory/{ids[3]}/chain").json()
    assert v["id"] in [x["response"] for x in back["retrieved_by"]]
    # time slices over HTTP
    t = time.time()
    assert httpx.post(url + "/v1/memory/kb/snapshots", json={"name": "before"}).status_code == 201
    assert httpx.delete(f"{url}/v1/memory/kb/memories/{ids[0]}").json()["forgotten"] is True
    now = [h["id"] for h in httpx.get(url + "/v1/memory/kb/memories").json()["data"]]
    then = [h["id"] for h in httpx.get(url + "/v1/memory/kb/memories", params={"as_of": t}).json()["data"]]
    assert ids[0] not in now and ids[0] in then
    restored = httpx.post(url + "/v1/memory/kb/snapshots/before/restore").json()
    assert restored["restored"] and len(httpx.get(url + "/v1/memory/kb/memories").json()["data"]) == len(then)
    # a set that does not exist is a REJECTED memory_not_found, as before
    v = finished(url, httpx.post(url + "/v1/requests", json={"prompt": "x", "memory_ref": "nothing-here"}).json()["id"])
    assert v["state"] == "REJECTED" and v["error"]["code"] == "memory_not_found"
    assert httpx.get(url + "/v1/memory").json()["data"][0]["set"] == "kb"
    # the OpenAI dialect takes memory_ref too (an extension field): citations at the top level
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "When does the backup run?"}], max_tokens=2,
        extra_body={"memory_ref": "kb"})
    body = raw.http_response.json()
    # (the remembered Q/A about the backup is as close as the document now)
    assert {"source": "doc3.txt"} in [c["meta"] for c in body["citations"][:2]] and "warning" not in raw.headers
    assert any(r["response"] == body["id"] for r in httpx.get(f"{url}/v1/memory/{ids[3]}/chain").json()["retrieved_by"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"memory_ref": "nothing-here"})
    assert e.value.body["code"] == "memory_not_found"


def test_memory_needs_a_data_dir(serve_tiny):
    srv = serve_tiny(ServerSettings(drain_grace_s=0.5), engine_mode="thread")
    r = httpx.get(srv.url + "/v1/memory/kb/search", params={"q": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "memory_disabled"
    r = httpx.post(srv.url + "/v1/memory/Bad Name", json={"texts": ["x"]})
    assert r.status_code in (400, 404)


def test_restore_is_idempotent_and_ingest_stays_in_its_folder(tmp_path):
    import os

    from sits.memory.ingest import ingest_dir
    m = MemoryStore(tmp_path / "memory.db", embed)
    [keep] = m.add("s", ["kept"], at=10.0)
    m.snapshot("s", "v", at=20.0)
    m.forget("s", keep, at=30.0)
    first = m.restore("s", "v", at=40.0)
    again = m.restore("s", "v", at=50.0)
    assert len(first["restored"]) == 1 and again == {**again, "forgotten": [], "restored": []}
    docs, other = tmp_path / "docs", tmp_path / "other"
    docs.mkdir()
    other.mkdir()
    (docs / "a.md").write_text("alpha paragraph")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", docs / "link.txt")
    (other / "b.md").write_text("beta paragraph")
    assert ingest_dir(m, "kb", docs)["added"] == 1                       # the symlink out is skipped
    assert ingest_dir(m, "kb", other)["forgotten"] == 0                  # another folder, same set
    assert {h.text for h in m.list("kb")} == {"alpha paragraph", "beta paragraph"}


@pytest.mark.parametrize("path", ["/v1/memory/m_%C2%B2/chain", "/v1/memory/m_99999999999999999999999/chain"])
def test_odd_memory_ids_are_400(mem_server, path):
    r = httpx.get(mem_server.url + path)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_memory_id"


def test_non_finite_input_is_refused(mem_server):
    r = httpx.post(mem_server.url + "/v1/memory/kb", content=b'{"texts": ["x"], "metas": [{"v": NaN}]}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.get(mem_server.url + "/v1/memory/kb/memories", params={"as_of": "nan"})
    assert r.status_code == 400
