"""What a real OpenAI client expects of the surface: a model card by id, best_of checked, logprob bytes
that are the token's own, tools without a description rendered as the model's template renders them."""

from __future__ import annotations

import httpx
import openai
import pytest

from sits.engine.tokenizer import Tokenizer
from sits.engine.tool_format import ToolSpec


@pytest.fixture(scope="module")
def server(serve_tiny):
    return serve_tiny(engine_mode="thread")


def test_a_model_card_by_id(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    r = httpx.get(server.url + "/v1/models/nope", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("best_of, n, code", [(1, 2, "invalid_parameter"), (3, 1, "unsupported_parameter")])
def test_best_of_other_than_n_is_refused(server, best_of, n, code):
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": n, "best_of": best_of})
    assert r.status_code == 400 and r.json()["error"]["code"] == code and r.json()["error"]["param"] == "best_of"
    ok = httpx.post(server.url + "/v1/completions", timeout=30,
                    json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 2, "best_of": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_token_bytes_are_the_tokens_own(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    text = "héllo wörld ✓ 12"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == text
    assert any(p and p[0] >= 0x80 and len(p) == 1 for p in pieces)      # half a character, not U+FFFD's bytes
    assert tok.token_bytes(tok.eos_token_ids[0]) == tok.decode([tok.eos_token_ids[0]], False).encode()


def test_chat_logprob_bytes_over_http(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 12
    whole = [c for c in content if "\ufffd" not in c["token"]]
    assert whole and all(bytes(c["bytes"]).decode() == c["token"] for c in whole)
    assert all(bytes(t["bytes"]).decode(errors="replace") == t["token"] or "\ufffd" in t["token"]
               for c in content for t in c["top_logprobs"])


def test_a_tool_without_description_renders_none():
    bare = ToolSpec("get_time", None, {"type": "object", "properties": {}})
    assert "description" not in bare.openai()["function"]
    assert ToolSpec("f", "Does f").openai()["function"]["description"] == "Does f"


def test_text_parts_are_joined_the_same_way_over_http_and_in_python(server, tiny_model_dir):
    from sits.engine.tokenizer import Tokenizer as T
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second line"}]
    tok = T.from_dir(tiny_model_dir)
    python_prompt = tok.apply_chat_template([{"role": "user", "content": parts}])
    expected = len(tok.encode(python_prompt))
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == expected
    assert "first line\nsecond line" in python_prompt


def test_echo_puts_the_prompt_in_front(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 1, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
