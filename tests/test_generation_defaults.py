"""A model's generation_config.json sampling defaults apply where a request leaves a parameter unset
(as vLLM applies them); what the request sets wins."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from conftest import start_server
from sits.engine.config import EngineConfig, generation_defaults


@pytest.fixture(scope="module")
def model_with_defaults(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-defaults") / "m"
    shutil.copytree(tiny_model_dir, path)
    raw = json.loads((path / "generation_config.json").read_text())
    raw.update(temperature=0.0, top_p=0.9, top_k=20, repetition_penalty=1.0, max_new_tokens=5, do_sample=True)
    (path / "generation_config.json").write_text(json.dumps(raw))
    return str(path)


def test_defaults_are_read_under_request_names(model_with_defaults, tiny_model_dir):
    assert generation_defaults(model_with_defaults) == {"temperature": 0.0, "top_p": 0.9, "top_k": 20,
                                                        "repetition_penalty": 1.0, "max_tokens": 5}
    assert generation_defaults(tiny_model_dir) == {}


@pytest.mark.parametrize("engine_mode", ["process", "thread"])
def test_unset_parameters_take_the_models_defaults(model_with_defaults, engine_mode):
    from sits.api.context import ServerSettings
    from sits.api.server import DrainingServer, build_app

    settings = ServerSettings(drain_grace_s=1.0)
    app = build_app(EngineConfig(model=model_with_defaults, device="cpu", warmup=False, kv_cache_memory_mb=32,
                                 max_model_len=256), settings, served_name="m", engine_mode=engine_mode)
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=1.0)
    try:
        chat = {"model": "m", "messages": [{"role": "user", "content": "Say something"}]}
        # no temperature, no max_tokens: the model's greedy default and its max_new_tokens
        a = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60).json()
        b = httpx.post(srv.url + "/v1/chat/completions", json=chat, timeout=60).json()
        assert a["usage"]["completion_tokens"] <= 5 and a["choices"][0]["message"] == b["choices"][0]["message"]
        explicit = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                              json=chat | {"temperature": 0, "max_tokens": 5}).json()
        assert explicit["choices"][0]["message"] == a["choices"][0]["message"]
        # what the request sets wins
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": "m", "prompt": "Hello", "max_tokens": 9, "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 9
    finally:
        srv.stop()
