"""BOS per the tokenizer's own settings: a text prompt is encoded as Hugging Face and vLLM encode a
completion prompt (the tokenizer's post-processor adds its BOS), ``add_special_tokens: false`` leaves it
out, and a rendered chat template (which spells out its special tokens) gets none added."""

from __future__ import annotations

import shutil

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from conftest import start_server
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine

BOS = 0     # the tiny model's <|bos|>


@pytest.fixture(scope="module")
def bos_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a Llama-style tokenizer: its post-processor puts BOS in front."""
    path = tmp_path_factory.mktemp("bos") / "m"
    shutil.copytree(tiny_model_dir, path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                      special_tokens=[("<|bos|>", BOS)])])
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def test_a_text_prompt_gets_the_tokenizers_bos(bos_model):
    engine = LLMEngine(EngineConfig(model=bos_model, device="cpu", warmup=False, kv_cache_memory_mb=8))
    with_bos = engine.make_request("Hello world").prompt_token_ids
    without = engine.make_request("Hello world", add_special_tokens=False).prompt_token_ids
    assert with_bos[0] == BOS and with_bos[1:] == without and without[0] != BOS
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{bos_model}/tokenizer.json")
    assert hf("Hello world")["input_ids"] == with_bos           # what Hugging Face encodes


def test_over_http_completions_add_bos_and_chat_does_not(bos_model):
    from sits.api.context import ServerSettings
    from sits.api.server import DrainingServer, build_app

    app = build_app(EngineConfig(model=bos_model, device="cpu", warmup=False, kv_cache_memory_mb=32,
                                 max_model_len=256), ServerSettings(drain_grace_s=1.0), served_name="m",
                    engine_mode="thread")
    srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=1.0)
    try:
        def prompt_tokens(path: str, body: dict) -> int:
            r = httpx.post(srv.url + path, json={"model": "m", "max_tokens": 1} | body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        text = {"prompt": "Hello world"}
        assert prompt_tokens("/v1/completions", text) == prompt_tokens("/v1/completions",
                                                                        text | {"add_special_tokens": False}) + 1
        assert prompt_tokens("/v1/completions", text | {"max_tokens": None}) == prompt_tokens("/v1/completions", text)
        chat = {"messages": [{"role": "user", "content": "Hello world"}]}
        assert prompt_tokens("/v1/chat/completions", chat | {"add_special_tokens": True}) == \
            prompt_tokens("/v1/chat/completions", chat) + 1
        ids = [5, 6, 7]           # token ids are taken as they are
        assert prompt_tokens("/v1/completions", {"prompt": ids}) == 3
    finally:
        srv.stop()
