"""Issue 14 hardening: one request must never kill an engine, hang a client or leak a 500.

Each test closes a class of input, not one case: bad text wherever client text meets a tokenizer,
an embedder or a store; ``$ref``s inside a tool's parameters; private addresses embedded in IPv6
callback hosts; tool directories that hand a tool the whole system; session ids that cannot come
back through ``/v1/sessions/{id}``; and a SITS request that names no unit where none is implied.
"""

from __future__ import annotations

import ipaddress
import json
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, ValidationError

from conftest import start_server
from sits.api.app import create_app
from sits.api.backend import BackendRegistry
from sits.api.context import ServerSettings
from sits.api.sits.webhooks import is_private_address, public_address, validate_callback_url
from sits.engine.errors import InvalidRequestError
from sits.engine.guided import vocabulary_for
from sits.engine.tokenizer import Tokenizer
from sits.engine.tool_format import ToolSpec, tool_call_grammar
from sits.runtime.unit_spec import UnitSpec, UnitSpecError, load_unit_file, load_yaml_spec

JSON_CT = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(serve_tiny, tmp_path_factory):
    """Memory and sessions on (a data directory), a context long enough for tool schemas."""
    return serve_tiny(ServerSettings(drain_grace_s=0.5, data_dir=str(tmp_path_factory.mktemp("hardening"))),
                      engine_mode="thread", max_model_len=1024, kv_cache_memory_mb=48)


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, f"{r.status_code}: {r.text[:400]}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def _terminal(url: str, rid: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = httpx.get(f"{url}/v1/requests/{rid}", timeout=10).json()
        if v["state"] in ("RESOLVED", "REJECTED"):
            return v
        assert time.monotonic() < deadline, v
        time.sleep(0.05)


# -- 1. bad text: one check wherever client text meets a tokenizer, an embedder or a store ----------
BAD_TEXT_BODIES = [
    ("memory-text", "/v1/memory/kb", b'{"texts": ["ok", "a\\ud800b"]}', "texts"),
    ("memory-meta", "/v1/memory/kb", b'{"texts": ["ok"], "metas": [{"source": "\\udfff"}]}', "metas"),
    ("memory-meta-key", "/v1/memory/kb", b'{"texts": ["ok"], "metas": [{"\\ud800": 1}]}', "metas"),
    ("embeddings-minilm", "/v1/embeddings", b'{"model": "all-minilm-l6-v2", "input": ["ok", "\\ud800"]}', "input"),
    ("embeddings-model", "/v1/embeddings", b'{"model": "tiny", "input": "\\udc00"}', "input"),
    ("chat-memory-ref", "/v1/chat/completions",
     b'{"model": "tiny", "memory_ref": "kb", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
     None),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in BAD_TEXT_BODIES], ids=[c[0] for c in BAD_TEXT_BODIES])
def test_lone_surrogates_are_invalid_text_on_every_route(server, path, body, param):
    assert httpx.post(server.url + "/v1/memory/kb", json={"texts": ["Invoices are due on the 1st."]},
                      timeout=60).status_code == 201
    err = _error(httpx.post(server.url + path, content=body, headers=JSON_CT, timeout=60), 400, "invalid_text")
    if param is not None:
        assert err["param"] == param, err
    # nothing poisoned the set: it still lists and searches
    assert httpx.get(server.url + "/v1/memory/kb/memories", timeout=30).status_code == 200
    assert httpx.get(server.url + "/v1/memory/kb/search", params={"q": "invoice"}, timeout=30).status_code == 200


@pytest.mark.parametrize("query", ["%ff%fe", "%ed%a0%80", "a%c3", "%e2%82"])
def test_invalid_utf8_in_a_search_query_is_invalid_text(server, query):
    httpx.post(server.url + "/v1/memory/kb", json={"texts": ["Invoices are due on the 1st."]}, timeout=60)
    err = _error(httpx.get(f"{server.url}/v1/memory/kb/search?q={query}", timeout=30), 400, "invalid_text")
    assert err["param"] == "q"


def test_a_memory_ref_request_with_bad_text_is_invalid_text(server):
    httpx.post(server.url + "/v1/memory/kb", json={"texts": ["Invoices are due on the 1st."]}, timeout=60)
    r = httpx.post(server.url + "/v1/requests", content=b'{"prompt": "when \\ud800?", "memory_ref": "kb"}',
                   headers=JSON_CT, timeout=30)
    assert r.status_code == 202, r.text[:300]          # text is judged while VALIDATING, as without memory_ref
    v = _terminal(server.url, r.json()["id"])
    assert v["state"] == "REJECTED" and v["error"]["code"] == "invalid_text", v


def test_a_session_never_stores_text_it_cannot_answer_with(server):
    """A field the chat template does not render (``name``) reaches no tokenizer, but a session would
    store it and every read of the session would then fail."""
    sid = f"bad-text-{time.monotonic_ns()}"
    body = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}'
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={**JSON_CT, "x-session-id": sid},
                   timeout=60)
    assert _error(r, 400, "invalid_text")["param"] == "messages"
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).status_code == 404


# -- 2. $defs / $ref inside a tool's parameters ----------------------------------------------------
class Address(BaseModel):
    city: Literal["Oslo", "Paris", "Lima"]
    floor: int = Field(ge=0, le=9)


class Person(BaseModel):
    name: str = Field(max_length=6)
    home: Address
    tags: list[Literal["a", "b"]] = Field(max_length=2)


class Tree(BaseModel):
    """Recursive: its ``$ref`` points back at its own definition."""
    value: int = Field(ge=0, le=9)
    children: list[Tree] = Field(max_length=2)


def test_refs_in_tool_parameters_resolve_against_the_parameters(tiny_model_dir):
    tok = Tokenizer.from_dir(tiny_model_dir)
    vocab = vocabulary_for(tok, json.loads((Path(tiny_model_dir) / "config.json").read_text())["vocab_size"])
    specs = [ToolSpec(t["function"]["name"], "", t["function"]["parameters"])
             for t in (openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Tree))]
    assert all("$defs" in s.parameters for s in specs)

    def accepts(grammar: str, text: str) -> bool:
        guide = vocab.guide(grammar)
        for t in tok.encode(text):
            if not guide.allowed()[t]:
                return False
            guide.accept(t)
        return bool(guide.allowed()[tok.eos_token_ids[0]])

    for choice in ("required", "Person", "auto"):
        g = tool_call_grammar(specs, choice)
        call = ('<tool_call>\n{"name": "Person", "arguments": {"name": "Ada", "home": {"city": "Oslo", '
                '"floor": 2}, "tags": ["a"]}}\n</tool_call>')
        assert accepts(g, call), choice
        assert not accepts(g, call.replace('"Oslo"', '"Rome"')), choice        # the $ref'd enum holds
    tree = ('<tool_call>\n{"name": "Tree", "arguments": {"value": 1, "children": [{"value": 2, "children": []}]}}'
            '\n</tool_call>')
    assert accepts(tool_call_grammar(specs, "Tree"), tree)


def test_a_pydantic_function_tool_is_called_over_http(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    tool = openai.pydantic_function_tool(Person)
    for seed in (0, 1):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Who is Ada?"}],
                                           tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=120, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        args = json.loads(ch.message.tool_calls[0].function.arguments)
        jsonschema.validate(args, tool["function"]["parameters"])
        Person.model_validate(args)
    # the same schema as response_format still works (it always did)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Who is Ada?"}],
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "person", "schema": Person.model_json_schema()}},
                                       max_tokens=120, seed=0)
    Person.model_validate_json(r.choices[0].message.content)


# -- 3a. callback hosts: IPv4 inside IPv6 ----------------------------------------------------------
EMBEDDED = [
    "::127.0.0.1", "::a9fe:a9fe", "::10.0.0.1",                          # IPv4-compatible (::/96)
    "::ffff:0:127.0.0.1",                                                # IPv4-translated (SIIT)
    "64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "64:ff9b::10.1.2.3",        # NAT64 well-known prefix
    "64:ff9b:1::a9fe:a9fe", "64:ff9b:1:7f00:1::",                        # NAT64 local-use prefix
    "2002:7f00:1::1", "2002:a9fe:a9fe::",                                # 6to4
    "2001:0:4136:e378:8000:63bf:80ff:fffe", "2001::5efe:7f00:1",         # Teredo
    "::ffff:a9fe:a9fe",                                                  # IPv4-mapped
]


@pytest.mark.parametrize("host", EMBEDDED)
def test_ipv6_forms_of_private_ipv4_are_refused(host):
    with pytest.raises(InvalidRequestError) as e:
        validate_callback_url(f"http://[{host}]:8080/hook")
    assert e.value.code == "invalid_callback_url"
    assert validate_callback_url(f"http://[{host}]/hook", allow_private=True)
    assert is_private_address(ipaddress.ip_address(host))


def test_delivery_refuses_names_that_resolve_to_embedded_private_addresses(monkeypatch):
    import asyncio

    async def fake_getaddrinfo(host, port, **kw):
        return [(10, 1, 6, "", (addr, 0, 0, 0)) for addr in {"nat64.test": ["64:ff9b::7f00:1"],
                                                            "compat.test": ["::169.254.169.254"],
                                                            "public.test": ["64:ff9b::808:808"]}[host]]

    async def go():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
        return [await public_address(h) for h in ("nat64.test", "compat.test", "public.test", "::127.0.0.1")]

    assert asyncio.run(go()) == [None, None, "64:ff9b::808:808", None]


# -- 3b. tool_dirs that hand a tool the whole system ----------------------------------------------
@pytest.mark.parametrize("host", ["/", "/etc", "/proc/self", "/sys", "/dev", "/boot", "//", "/etc/../", "/root"])
def test_tool_dirs_refuse_system_directories(host):
    with pytest.raises(UnitSpecError) as e:
        load_yaml_spec(f"name: c\nmodel: m\ntool_dirs:\n  /data: {host}\n", "u.yaml", UnitSpec)
    p = e.value.problems[0]
    assert p.field == "tool_dirs./data" and p.line == 4 and repr(host) in p.message, p
    assert str(p).startswith("u.yaml:4:10: tool_dirs./data: ")


def test_tool_dirs_refuse_a_relative_path_or_a_link_that_reaches_the_root(tmp_path):
    depth = len(tmp_path.parts)
    unit = tmp_path / "unit.yaml"
    unit.write_text(f"name: c\nmodel: m\ntool_dirs: {{/data: {'../' * depth}}}\n")
    with pytest.raises(UnitSpecError):
        load_unit_file(unit)
    (tmp_path / "root-link").symlink_to("/")
    unit.write_text("name: c\nmodel: m\ntool_dirs: {/data: ./root-link}\n")
    with pytest.raises(UnitSpecError):
        load_unit_file(unit)
    with pytest.raises(ValidationError):          # a unit deployed over HTTP is the same model
        UnitSpec.model_validate({"name": "c", "model": "m", "tool_dirs": {"/data": "/"}})
    (tmp_path / "docs").mkdir()
    unit.write_text("name: c\nmodel: m\ntool_dirs: {/data: ./docs}\n")
    assert load_unit_file(unit).tool_dirs == {"/data": str(tmp_path / "docs")}


# -- 3c. session ids that could not come back through /v1/sessions/{id} -------------------------------
@pytest.mark.parametrize("sid", ["a/b", "..", ".", "a b", "a?b", "a#b", "a%2fb", "x" * 129, "é"])
def test_session_ids_that_cannot_round_trip_are_400(server, sid):
    headers = {"x-session-id": sid.encode()}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    err = _error(httpx.post(server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30),
                 400, "invalid_session_id")
    assert "A-Za-z0-9" in err["message"]
    _error(httpx.post(server.url + "/v1/requests", json={"prompt": "hi"}, headers=headers, timeout=30),
           400, "invalid_session_id")


def test_an_accepted_session_id_can_be_read_and_deleted(server):
    sid = f"conv:{time.monotonic_ns()}.a_b-c"
    r = httpx.post(server.url + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-session-id"] == sid
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).json()["turns"] == 1
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", timeout=10).json()["deleted"] is True


# -- 4. a SITS request that names no unit where several are served ------------------------------------
class _Named:
    """Enough of a backend for a registry that serves several names."""

    ready = True

    def __init__(self, name: str):
        self.name = name


def test_a_request_without_a_unit_is_400_when_the_unit_is_ambiguous():
    app = create_app(BackendRegistry([_Named("chat"), _Named("handbook")]), ServerSettings(drain_grace_s=0.1))
    srv = start_server(app, ready_path="/health")
    try:
        for body in ({"prompt": "When do I pay?", "memory_ref": "kb"}, {"prompt": "hi"}):
            err = _error(httpx.post(srv.url + "/v1/requests", json=body, timeout=10), 400, "unit_required")
            assert err["param"] == "unit" and "(chat, handbook)" in err["message"], err
    finally:
        srv.stop()


def test_a_request_without_a_unit_goes_to_the_only_one(server):
    r = httpx.post(server.url + "/v1/requests", json={"prompt": "hi", "constraints": {"max_tokens": 2}}, timeout=30)
    assert r.status_code == 202 and r.json()["unit"] == "tiny"
    assert _terminal(server.url, r.json()["id"])["state"] == "RESOLVED"

