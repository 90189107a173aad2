"""Embeddings from a unit's own model: ``POST /v1/embeddings`` (OpenAI client, both engine modes),
the engine's mean pooling against a dense reference, and vector memory's fallback embedder (a set
embedded by its unit's model, kept with the set, refused when mixed or when the unit is gone)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from conftest import start_server
from sits.api.context import ServerSettings
from sits.api.gateway_server import build_gateway_app
from sits.api.server import DrainingServer
from sits.memory.vectors import EmbedderUnavailableError, MemoryStore
from sits.engine.errors import InvalidRequestError
from sits.runtime.gateway import Gateway
from sits.runtime.unit_spec import UnitSpec
from test_gateway import wait_for

TEXTS = ["The backup job runs at 2 am.", "Invoices are due on the first of the month.", "x"]


def test_engine_embeddings_are_mean_pooled_unit_vectors(make_engine):
    eng = make_engine()
    ids = [eng.tokenizer.encode(t) for t in TEXTS]
    got = eng.embed(ids)
    assert got.shape == (3, eng.model_config.hidden_size)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    with torch.inference_mode():            # one at a time, no padding: the batch changes nothing
        for row, toks in zip(got, ids):
            h = eng.model.hidden_dense(torch.tensor([toks]))[0].mean(0)
            assert np.abs(torch.nn.functional.normalize(h, dim=0).numpy() - row).max() < 1e-5
    with pytest.raises(InvalidRequestError):
        eng.embed([[]])


@pytest.fixture(scope="module", params=["thread", "process"])
def client(serve_tiny, request):
    srv = serve_tiny(engine_mode=request.param)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_embeddings(client, make_engine):
    r = client.embeddings.create(model="tiny", input=TEXTS)          # the client asks for base64
    vecs = np.array([d.embedding for d in r.data])
    ref = make_engine().embed([make_engine().tokenizer.encode(t) for t in TEXTS])
    assert np.abs(vecs - ref).max() < 1e-5 and [d.index for d in r.data] == [0, 1, 2]
    assert r.usage.prompt_tokens == r.usage.total_tokens > 3
    f = client.embeddings.create(model="tiny", input="hello", encoding_format="float")
    assert len(f.data[0].embedding) == vecs.shape[1]
    minilm = client.embeddings.create(model="all-minilm-l6-v2", input=["a cat on a sofa", "a kitten on a couch"])
    a, b = (np.array(d.embedding) for d in minilm.data)
    assert len(a) == 384 and a @ b > 0.5


@pytest.mark.parametrize("body,status,code", [
    ({"input": ""}, 400, "invalid_input"),
    ({"input": []}, 400, "invalid_input"),
    ({"input": ["x"] * 257}, 400, "invalid_input"),
    ({"input": [[1, 2], [10**9]]}, 400, "invalid_token_id"),
    ({"input": "x", "dimensions": 7}, 400, "invalid_parameter"),
    ({"input": "word " * 2000}, 400, "context_length_exceeded"),
    ({"input": [1, 2], "model": "all-minilm-l6-v2"}, 400, "invalid_input"),
    ({"input": "x", "model": "nope"}, 404, "model_not_found"),
    ({"input": 5}, 400, None),
])
def test_bad_embedding_requests(client, body, status, code):
    r = httpx.post(str(client.base_url) + "embeddings", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code


def test_a_set_keeps_its_embedder(tmp_path):
    store = MemoryStore(tmp_path / "m.db", lambda texts: np.eye(4, dtype=np.float32)[[0] * len(texts)])
    store.register_embedder("fake", lambda texts: np.array([[0, 1.0]] * len(texts), dtype=np.float32))
    store.add("mine", ["a", "b"], embedder="fake")
    store.add("mine", ["c"])                                   # the set's own embedder, implied
    assert [h.score for h in store.search("mine", "q", k=3)] == [1.0, 1.0, 1.0]
    with pytest.raises(InvalidRequestError) as e:
        store.add("mine", ["d"], embedder="minilm")
    assert e.value.code == "embedder_mismatch"
    store.add("old", ["written with the default"])             # a default set cannot take another embedder
    with pytest.raises(InvalidRequestError):
        store.add("old", ["x"], embedder="fake")
    assert {s["set"]: s["embedder"] for s in store.sets()} == {"mine": "fake", "old": "minilm"}
    store.register_embedder("fake", None)
    with pytest.raises(EmbedderUnavailableError):
        store.search("mine", "q")


def test_a_rag_unit_embedded_by_its_own_model(tiny_model_dir, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = {"billing.md": "Invoices are due on the first day of each month.",
             "backups.md": "The backup job runs at 2 am and keeps seven days."}
    for name, text in texts.items():
        (docs / name).write_text(text)
    spec = UnitSpec.model_validate({
        "name": "own", "model": tiny_model_dir,
        "memory": {"set": "own-docs", "ingest": str(docs), "embedder": "unit", "top_k": 1},
        "scale": {"min_instances": 0, "max_instances": 1, "keep_alive_s": 300},
        "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False, "threads": 1}})
    gw = Gateway(tmp_path / "data", tick_s=0.2)
    app = build_gateway_app(gw, [spec], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        unit = httpx.get(srv.url + "/v1/units/own").json()
        assert unit["memory"]["ingested"]["added"] == 2 and unit["memory"]["embedder"] == "unit"
        sets = {s["set"]: s for s in httpx.get(srv.url + "/v1/memory").json()["data"]}
        assert sets["own-docs"]["embedder"] == "unit:own"
        # the tiny model's vectors mean nothing semantically, but a chunk's own text is its nearest
        for source, text in texts.items():
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "model": "own", "messages": [{"role": "user", "content": text}], "max_tokens": 2}).json()
            assert r["citations"][0]["meta"]["source"] == source and r["citations"][0]["score"] > 0.999, r
        hits = httpx.get(srv.url + "/v1/memory/own-docs/search", params={"q": texts["billing.md"], "k": 2},
                         timeout=60).json()["data"]
        assert [h["meta"]["source"] for h in hits] == ["billing.md", "backups.md"]
        # the same vectors through the OpenAI endpoint (the unit is warm now)
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "own", "input": "x"}, timeout=60).json()
        hidden = json.loads((Path(tiny_model_dir) / "config.json").read_text())["hidden_size"]
        assert len(r["data"][0]["embedding"]) == hidden
    finally:
        srv.stop()


def test_a_cold_unit_embedding_its_own_set_serves_a_burst(tiny_model_dir, tmp_path):
    """Ten requests at once to a unit at zero whose set it embeds itself: each search waits for the
    unit's cold start, which must not need the threads those waits hold (it used to hang)."""
    import concurrent.futures
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Invoices are due on the first day of each month.")
    spec = UnitSpec.model_validate({
        "name": "cold", "model": tiny_model_dir,
        "memory": {"set": "cold-docs", "ingest": str(docs), "embedder": "unit", "top_k": 1},
        "scale": {"min_instances": 0, "max_instances": 1, "keep_alive_s": 1, "downscale_delay_s": 1},
        "resources": {"device": "cpu", "kv_cache_mb": 16, "max_model_len": 256, "warmup": False, "threads": 1}})
    gw = Gateway(tmp_path / "data", tick_s=0.2)
    app = build_gateway_app(gw, [spec], ServerSettings(drain_grace_s=0.5))
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=0.5)
    try:
        wait_for(lambda: not httpx.get(srv.url + "/v1/units/cold").json()["instances"], timeout=60,
                 what="scale to zero")

        def ask(i):
            return httpx.post(srv.url + "/v1/chat/completions", timeout=90, json={
                "model": "cold", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(ask, range(10)))
        assert [r.status_code for r in answers] == [200] * 10
        assert all(r.json()["citations"][0]["meta"]["source"] == "a.md" for r in answers)
    finally:
        srv.stop()
